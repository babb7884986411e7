"""Environment episodes as samples through a real embedded engine: an environment that raises, hangs or answers with
garbage fails its episode with a counted error and never the run; a flush aborts the requests in flight and ends the
running episodes as aborted (counted, untrained); bounds on turns and tokens hold; samples carry the loss mask over the
sampled tokens only."""

from __future__ import annotations

import json
import threading
import time

import pytest

from miles.config import apply_overrides
from miles.envs.source import EnvSource
from miles.recipes import quickstart
from miles.rollout.manager import RolloutManager
from miles.sources import make_sources

pytestmark = pytest.mark.procs  # it starts processes or servers (tests/conftest.py: the tiers)

FAULTS = ["none", "raise", "hang", "garbage", "nan", "reset_raises"]


def cfg_for(tmp_path, env: str, faults=FAULTS, *extra):
    rows = [{"prompt": f"say hi {i}", "answer": "hi", "metadata": {"fault": f}} for i, f in enumerate(faults)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return apply_overrides(
        quickstart(),
        [
            "model.hidden_size=32",
            "model.intermediate_size=64",
            "model.num_hidden_layers=2",
            "model.max_position_embeddings=256",
            "rollout.max_seq_len=256",
            "rollout.max_batch_size=16",
            "rollout.max_new_tokens=8",
            f"rollout.num_prompts_per_step={len(faults)}",
            "rollout.n_samples_per_prompt=1",
            "rollout.advantage_estimator=reinforce++",
            "num_threads=1",
            f"env.name={env}",
            "env.step_timeout_s=1.0",
            f"data.train={path}",
            f"run_dir={tmp_path / 'run'}",
            *extra,
        ],
    )


def test_an_env_that_raises_hangs_or_returns_garbage_fails_its_episode_not_the_run(tmp_path):
    m = RolloutManager(cfg_for(tmp_path, "faulty_envs:FaultyEnv"), "cpu", sources=make_sources)
    t0 = time.perf_counter()
    batches, metrics = m.generate(0)
    took = time.perf_counter() - t0
    by_fault = {s.metadata["error_kind"] or "ok": s for s in m.last_samples}
    status = {f: s.metadata["status"] for f, s in zip(FAULTS, sorted(m.last_samples, key=lambda s: s.group))}
    assert status.pop("none") == "done"
    assert status == {
        "raise": "failed",
        "hang": "failed",
        "garbage": "failed",
        "nan": "failed",
        "reset_raises": "failed",
    }
    assert (
        metrics["env/errors_raised"] == 2 and metrics["env/errors_timeout"] == 1 and metrics["env/errors_garbage"] == 2
    )
    assert metrics["env/episodes_failed"] == 5 and metrics["env/episodes_done"] == 1
    assert took < 20  # the hung step cost its 1 s bound, not its 60 s sleep
    for s in m.last_samples:
        if s.metadata["status"] == "failed":
            assert sum(s.metadata["loss_mask"]) == 0 and s.reward == 0.0 and s.metadata["error"]
        else:
            assert sum(s.metadata["loss_mask"]) > 0 and s.reward == 0.5
    assert "KeyError" in by_fault["raised"].metadata["error"] or "down" in by_fault["raised"].metadata["error"]
    assert float(batches[0].loss_mask.sum()) == sum(sum(s.metadata["loss_mask"]) for s in m.last_samples)
    _, again = m.generate(1)  # the run goes on
    assert again["env/episodes_failed"] == 5 and again["env/errors_timeout"] == 1


def test_a_failing_env_is_counted_in_each_rl_steps_metrics_row_and_the_run_trains_on(tmp_path):
    """The whole loop (driver.train in this process): every RL step's row in metrics.jsonl counts the failed
    episodes by kind, the trainer steps on the healthy episode, and the run ends with its final checkpoint."""
    import math

    from miles.driver import train_in_process

    cfg = cfg_for(tmp_path, "faulty_envs:FaultyEnv", FAULTS, "num_steps=2", "trainer.warmup_sft_steps=0")
    train_in_process(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if "phase" not in r]
    assert [r["step"] for r in rl] == [0, 1]
    for r in rl:
        errors = (r["env/errors_raised"], r["env/errors_timeout"], r["env/errors_garbage"])
        assert errors == (2, 1, 2) and r["env/episodes_failed"] == 5 and r["env/episodes_done"] == 1
        assert math.isfinite(r["loss"])
    assert list((tmp_path / "run" / "checkpoints").glob("step_*2"))
    # the dashboard's dump of each step holds the failed episodes too (their log-probs from the trainer: none)
    assert sorted(p.name for p in (tmp_path / "run" / "rollouts").iterdir()) == ["step_000000", "step_000001"]


def test_turns_and_tokens_are_bounded(tmp_path):
    cfg = cfg_for(tmp_path, "faulty_envs:TwoTurnEnv", ["none"] * 2, 'env.args={"turns": 50}', "env.max_turns=3")
    m = RolloutManager(cfg, "cpu", sources=make_sources)
    _, metrics = m.generate(0)
    assert metrics["env/episodes_max_turns"] == 2 and metrics["env/turns"] == 3
    cfg = cfg_for(tmp_path, "faulty_envs:TwoTurnEnv", ["none"] * 2, "env.args={\"turns\": 50}", "env.max_turns=50",
                  "env.max_episode_tokens=80")  # fmt: skip
    m = RolloutManager(cfg, "cpu", sources=make_sources)
    m.generate(0)
    for s in m.last_samples:
        assert s.metadata["status"] == "budget" and len(s.tokens) <= 80


def test_a_flush_aborts_the_turn_in_flight_and_counts_the_aborted_episodes(tmp_path):
    cfg = cfg_for(tmp_path, "faulty_envs:TwoTurnEnv", ["none"] * 4, "rollout.max_new_tokens=200", "env.args={\"turns\": 50}",
                  "env.max_turns=50", "rollout.temperature=1.0", "model.vocab_size=264")  # fmt: skip
    m = RolloutManager(cfg, "cpu", sources=make_sources)
    runner = m.source.runner
    engine = runner.engines[0]
    first_call = engine.generate
    flusher = threading.Thread(target=lambda: (time.sleep(0.02), runner.flush()))

    def generate_with_a_flush_in_flight(requests, **kw):  # the flush lands while the first turn's call runs
        engine.generate = first_call
        flusher.start()
        return first_call(requests, **kw)

    engine.generate = generate_with_a_flush_in_flight
    _, metrics = m.generate(0)
    flusher.join()
    assert runner.num_flushes == 1
    assert metrics["env/episodes_aborted"] >= 1
    for s in m.last_samples:
        if s.metadata["status"] == "aborted":
            assert sum(s.metadata["loss_mask"]) == 0 and s.reward == 0.0


def test_env_config_errors_name_the_value_and_the_fix(tmp_path):
    with pytest.raises(ValueError, match="needs task rows: set data.train"):
        apply_overrides(quickstart(), ["env.name=calculator"])
    with pytest.raises(ValueError, match="not a built-in environment.*did you mean 'calculator'"):
        EnvSource(cfg_for(tmp_path, "calculater"), None, [])
    with pytest.raises(ValueError, match=r"env.args .* do not fit TwoTurnEnv\(turns\)"):
        RolloutManager(
            cfg_for(tmp_path, "faulty_envs:TwoTurnEnv", ["none"], 'env.args={"rounds": 3}'),
            "cpu",
            sources=make_sources,
        )
    with pytest.raises(ValueError, match="env.args = .* is not JSON"):
        cfg_for(tmp_path, "calculator", ["none"], "env.args={rounds: 3}")
