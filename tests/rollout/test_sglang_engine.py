"""rollout.engine=sglang: the launch argv of each config, the config-time refusals, launch failures that leave
nothing running, attaching to servers the manager must not kill, and the handoff plans' engine steps as the
HTTP calls they make. Real SGLang needs a CUDA build, so the servers here are the stand-in launcher
(`miles serve` taking SGLang's argv); the loop itself is in test_sglang_engine_loop.py."""

from __future__ import annotations

import os
import sys

import pytest

from miles.handoff.plan import HandoffPlan
from miles.rollout.launch import (
    free_port,
    sglang_available,
    sglang_engine_argv,
    spawn_miles_servers,
    spawn_sglang_servers,
)
from miles.rollout.manager import sglang_engines
from miles.sources import make_sources
from tests.conftest import tiny_run_cfg

pytestmark = [pytest.mark.procs, pytest.mark.timeout(120)]  # procs: it starts processes or servers
SG = ("rollout.engine=sglang", "model.checkpoint=/ckpt/qwen3-8b")


def _cfg(tmp_path, *overrides):
    return tiny_run_cfg(tmp_path, *SG, *overrides)


def _standin(tmp_path, *overrides):
    """rollout.engine=sglang served by `miles serve` (which builds the tiny model from the run config)."""
    return tiny_run_cfg(tmp_path, "rollout.engine=sglang", "rollout.sglang_launcher=miles-serve", *overrides)


def test_the_default_argv_launches_sglang_with_the_checkpoint_memory_saver_and_half_the_memory(tmp_path):
    argv = sglang_engine_argv(_cfg(tmp_path), 0, 30000)
    assert argv == [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/ckpt/qwen3-8b",
        "--host",
        "127.0.0.1",
        "--port",
        "30000",
        "--mem-fraction-static",
        "0.5",
        "--enable-memory-saver",
        "--skip-server-warmup",
    ]


def test_a_host_mirror_adds_weights_cpu_backup_and_extra_flags_follow_with_their_memory_fraction_winning(tmp_path):
    cfg = _cfg(
        tmp_path,
        "handoff.engine_host_mirror=true",
        "rollout.sglang_args=--tp-size,4,--mem-fraction-static=0.7,--disable-cuda-graph",
    )
    argv = sglang_engine_argv(cfg, 1, 30001)
    assert argv[argv.index("--mem-fraction-static") + 1] == "0.7" and argv.count("--mem-fraction-static") == 1
    assert argv[-4:] == ["--enable-weights-cpu-backup", "--tp-size", "4", "--disable-cuda-graph"]


def test_the_stand_in_launcher_is_miles_serve_with_the_same_sglang_flags_and_the_run_config(tmp_path):
    real = sglang_engine_argv(_cfg(tmp_path, "rollout.sglang_args=--tp-size,2"), 3, 30003)
    standin = sglang_engine_argv(
        _cfg(tmp_path, "rollout.sglang_args=--tp-size,2", "rollout.sglang_launcher=miles-serve"), 3, 30003, "/c.json"
    )
    assert standin[:3] == [sys.executable, "-m", "miles.cli.serve"]
    assert standin[3 : len(real)] == real[3:]  # the SGLang flags, unchanged
    assert standin[len(real) :] == ["--config", "/c.json", "--owner", "engine/3", "--parent-pid", str(os.getpid())]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.sglang_args=--tp-size,2,--tpsize,2"], r"does not know: \['--tpsize'\]"),
        (["rollout.sglang_args=--port,31000"], r"--port \(set from rollout.sglang_ports\)"),
        (["rollout.sglang_args=--tp-size"], r"--tp-size needs a value"),
        (["sync.transport=rdt"], r"Ray Direct Transport .* use sync.transport=tensor"),
        (["sync.transport=disk-delta", "handoff.engine_host_mirror=true"], r"whole HF checkpoint"),
        (["sync.check_weights=true"], r"set sync.check_weights=false"),
        (["rollout.engine_urls=http://10.0.0.7:30000"], r"CUDA IPC .* use sync.transport=broadcast"),
        (["rollout.engine_urls=http://a:1,http://b:2"], r"set rollout.num_engines=2"),
        (["rollout.engine_urls=localhost:30000"], r"should look like http://host:30000"),
        (["rollout.num_engines=3", "rollout.sglang_ports=30000-30001"], r"has 2 port\(s\) for .* = 3"),
        (["model.checkpoint="], r"set model.checkpoint to a HF checkpoint directory"),
    ],
)
def test_combinations_sglang_cannot_run_are_refused_at_config_time_with_the_fix(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        _cfg(tmp_path, *overrides)


def test_sglang_fields_with_another_engine_are_refused(tmp_path):
    with pytest.raises(ValueError, match="apply to rollout.engine = 'sglang', not 'http'"):
        tiny_run_cfg(tmp_path, "rollout.engine=http", "rollout.engine_urls=http://127.0.0.1:30000")


@pytest.mark.skipif(sglang_available(), reason="sglang is installed")
def test_launching_sglang_engines_without_sglang_says_how_to_install_it(tmp_path):
    with pytest.raises(ImportError, match=r"pip install 'miles\[sglang\]'.*sglang_launcher=miles-serve"):
        spawn_sglang_servers(_cfg(tmp_path))


def test_servers_that_never_answer_health_fail_with_their_log_tail_and_none_is_left_running(tmp_path, monkeypatch):
    monkeypatch.setenv("MILES_TEST_PID_DIR", str(tmp_path))
    cfg = _cfg(
        tmp_path,
        "rollout.sglang_launcher=tests.rollout.never_healthy",
        "rollout.num_engines=2",
        "rollout.engine_ready_timeout_s=4",
    )
    with pytest.raises(
        RuntimeError, match=r"(?s)did not answer /health within 4 s.*ends:\nloading the model: stuck on purpose"
    ):
        spawn_sglang_servers(cfg, log_dir=str(tmp_path))
    pids = [int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()]
    assert len(pids) == 2  # both were launched (in parallel) ...
    for pid in pids:  # ... and both are gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_an_engine_url_that_does_not_answer_is_a_clear_error(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    cfg = _standin(tmp_path, f"rollout.engine_urls={url}")
    with pytest.raises(RuntimeError, match=rf"rollout.engine_urls \['{url}'\] did not answer GET /health"):
        sglang_engines(cfg, "cpu")


def test_attached_servers_are_driven_but_never_stopped_by_the_manager(tmp_path):
    base = tiny_run_cfg(tmp_path, "rollout.max_batch_size=8", "rollout.max_seq_len=32")
    (proc,) = spawn_miles_servers(base, 1, device="cpu")
    try:
        cfg = _standin(tmp_path, f"rollout.engine_urls={proc.url}")
        (client,) = sglang_engines(cfg, "cpu")
        client.set_weight_version(5)
        assert client.weight_version == 5 and client.process is None
        client.close()
        assert proc.alive and client.url == proc.url
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def recorded_manager(tmp_path_factory):
    """A RolloutManager over one stand-in SGLang server, every HTTP request it sends recorded."""
    from miles.rollout.manager import RolloutManager

    tmp = tmp_path_factory.mktemp("plan")
    cfg = _standin(tmp, "rollout.max_batch_size=8", "rollout.max_seq_len=32")
    manager = RolloutManager(cfg, device="cpu", sources=make_sources)
    calls = []
    (client,) = manager.engines
    client.http.event_hooks["request"].append(lambda req: calls.append(req))
    yield manager, calls
    manager.close()
    assert not client.process.alive  # the manager stops the server it launched


class _TrainerSide:
    """The trainer's side of a plan, which makes no engine HTTP call (the sync step's calls are the sync's tests)."""

    def build(self): ...

    def clear_memory(self): ...

    def offload(self, tags):
        return [0]

    def onload(self, tags):
        return [0]

    def update_weights(self, version):
        return [{}]


@pytest.mark.parametrize("mode", ["cpu", "gpu"])
@pytest.mark.parametrize("level", ["kv_cache,weight", "kv_cache"])
def test_each_handoff_plan_phase_sends_exactly_its_engine_steps_release_and_resume_calls_in_order(
    recorded_manager, tmp_path, mode, level
):
    import json

    from miles.handoff.executor import PlanExecutor

    manager, calls = recorded_manager
    cfg = _standin(tmp_path, f"handoff.colocate_memory_peak_device={mode}", f"handoff.offload_rollout_level={level}")
    plan = HandoffPlan.from_config(cfg.handoff)
    executor = PlanExecutor()
    executor.rollout, executor.trainer = manager, _TrainerSide()  # the executor a run uses, over this manager
    everything = []
    for phase, steps in plan.phases().items():
        calls.clear()
        executor.execute(steps, version=1, phase=phase)
        sent = [(c.url.path, json.loads(c.content)["tags"]) for c in calls if not c.url.path.startswith("/miles/")]
        expected = [
            (
                "/release_memory_occupation" if s.verb.startswith("offload") else "/resume_memory_occupation",
                list(s.tags),
            )
            for s in steps
            if s.owner == "engine" and s.tags
        ]
        assert sent == expected and expected, (phase, plan.describe())
        assert {t for _, tags in sent for t in tags} <= {"weights", "kv_cache", "cuda_graph"}
        everything += sent
    assert any("weights" in tags for _, tags in everything) == ("weight" in level), everything


def test_the_readme_gb300_command_validates_plans_and_launches_one_sglang_engine_of_tp_4_per_tray(tmp_path):
    """The README's worked GB300 example (a dense Qwen3-8B on two trays): its --set values validate, the plan
    resolves before Ray starts, and each engine is launched as SGLang with tp 4 (the checkpoint path is swapped for
    the shipped qwen3-8b config.json, which is all the planner reads)."""
    import shutil

    from miles.config import apply_overrides
    from miles.handoff.planner import resolve_plan
    from miles.recipes import get_recipe

    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read()
    block = readme[readme.index("miles train --recipe gb300_qwen3_235b_plan") :].split("```")[0]
    words = block.replace("\\\n", " ").split()
    sets = [w.strip("'") for i, w in enumerate(words) if "=" in w and not w.startswith("--") and i > 0]
    assert "rollout.engine=sglang" in sets and "sync.transport=broadcast" in sets and len(sets) == 9, sets
    ckpt = tmp_path / "Qwen3-8B"
    ckpt.mkdir()
    shutil.copy(
        os.path.join(os.path.dirname(__file__), "..", "..", "miles", "model", "hf_configs", "qwen3-8b.json"),
        ckpt / "config.json",
    )
    sets = [s.replace("/ckpt/Qwen3-8B", str(ckpt)).replace("/shared/runs/q8", str(tmp_path / "run")) for s in sets]
    sets.append(f"model.checkpoint={ckpt}")  # what --model sets (beside the sizes it reads from the weights)
    cfg = apply_overrides(get_recipe("gb300_qwen3_235b_plan"), sets)
    assert resolve_plan(cfg).mode in ("cpu", "gpu")  # train() resolves it before Ray starts: a refusal raises here
    assert cfg.trainer.world_size == 8 and cfg.rollout.num_engines == 2 and cfg.cluster.address == "auto"
    argv = sglang_engine_argv(cfg, 0, 30000)
    assert argv[2] == "sglang.launch_server" and argv[-2:] == ["--tp-size", "4"]


def test_each_launched_engine_gets_its_own_node_gpus_from_its_parallel_sizes(tmp_path):
    from miles.sglang_flags import engine_gpus

    one = _cfg(tmp_path, "rollout.num_engines=4").rollout
    assert [engine_gpus(one, i) for i in range(4)] == [[0], [1], [2], [3]]
    tp2 = _cfg(tmp_path, "rollout.num_engines=2", "rollout.sglang_args=--tp-size,2").rollout
    assert [engine_gpus(tp2, i) for i in range(2)] == [[0, 1], [2, 3]]
    two_nodes = _cfg(tmp_path, "rollout.sglang_args=--tp-size,8,--nnodes,2").rollout
    assert engine_gpus(two_nodes, 0) == [0, 1, 2, 3]
