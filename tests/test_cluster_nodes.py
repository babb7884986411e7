"""Two Ray nodes on this one machine (tests/ray_nodes.py: the head on the machine's address, a second node on
127.0.0.2, each with a resource of its own) carry the quickstart with the trainer's two ranks on different nodes and
an engine server on each, as on two machines: every actor runs where the plan put it (read back from the run's
placement.jsonl and processes.jsonl), rank 1 rendezvouses at rank 0's node address, and the rewards and losses equal
the single-node run's. Rank 0 sits on 127.0.0.2, so a rendezvous at the driver's 127.0.0.1 (the old code) is caught.
The async split: quickstart_async with the rollout manager and its engine on one node and the trainer on the other
runs ahead (staleness up to 2) and equals the same seed on one node, version for version and reward for reward.

The failures: a node without the devices asked for, an address where no cluster answers (each refused before
anything is launched), and a node killed mid-run: named with what ran on it, the checkpoints intact, and the run
resumed on the node that is left reproduces the lost run's steps.

Tier ``cluster`` (within procs). Each run is a ``miles train`` process joining the cluster, as a user's would be;
most of the ~8 minutes (shared 2-core machine at load 10-20) is Ray and Python starting, the RL steps take ~1 s each.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.ray_nodes import REPO, RayNodes

pytestmark = [pytest.mark.procs, pytest.mark.cluster]  # a Ray cluster of two nodes on this machine (tests/conftest.py)

B_IP = "127.0.0.2"
TINY = [
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_hidden_layers=2",
    "rollout.num_prompts_per_step=4",
    "rollout.n_samples_per_prompt=4",
    "rollout.max_new_tokens=6",
    "trainer.warmup_sft_steps=1",
    "num_threads=1",
    "trainer.world_size=2",  # FSDP2 over gloo, one rank per node below
    "rollout.engine=http",
    "rollout.num_engines=2",
    "watchdog_s=0",  # a stall is not what these runs test; the shared machine's pauses must not end one
]
SPREAD = ["cluster.trainer_nodes=node_b,node_a", "cluster.rollout_node=node_a"]  # rank 0 on 127.0.0.2


def _train(run_dir: Path, *sets: str, timeout_s: float = 600, wait: bool = True, recipe: str = "quickstart"):
    argv = [sys.executable, "-m", "miles.cli", "train", "--recipe", recipe]
    for s in [*TINY, *sets, f"run_dir={run_dir}"]:
        argv += ["--set", s]
    env = RayNodes.env()
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if not wait:
        return proc
    out, _ = proc.communicate(timeout=timeout_s)
    return proc.returncode, out


def _rows(run_dir: Path, name: str) -> list[dict]:
    path = run_dir / name
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _curve(run_dir: Path) -> dict[int, tuple[float, float]]:
    """RL step -> (reward, loss) from metrics.jsonl."""
    return {r["step"]: (r["reward"], r["loss"]) for r in _rows(run_dir, "metrics.jsonl") if "phase" not in r}


@pytest.fixture(scope="module")
def nodes():
    t0 = time.monotonic()
    with RayNodes() as n:
        n.start("head", num_cpus=3, resources={"node_a": 1})
        n.start(B_IP, num_cpus=2, resources={"node_b": 1})
        print(f"\ntwo Ray nodes up in {time.monotonic() - t0:.0f} s at {n.address}")
        yield n


@pytest.fixture(scope="module")
def single_node(tmp_path_factory) -> dict[int, tuple[float, float]]:
    """The same run on a Ray started here (no cluster.address): the reference curve."""
    run = tmp_path_factory.mktemp("single") / "run"
    code, out = _train(run, "num_steps=6", "sync.transport=broadcast")
    assert code == 0, out[-3000:]
    return _curve(run)


def test_two_ranks_on_two_nodes_and_an_engine_on_each_run_where_the_plan_put_them(nodes, single_node, tmp_path):
    run = tmp_path / "run"
    code, out = _train(
        run,
        f"cluster.address={nodes.address}",
        *SPREAD,
        "cluster.engine_nodes=node_a,node_b",
        "sync.transport=broadcast",
        "sync.check_weights=true",  # the engines on both nodes equal the trainer, bit for bit, after every sync
        "num_steps=4",
    )
    assert code == 0, out[-3000:]
    placed = {r["owner"]: r for r in _rows(run, "placement.jsonl")}
    head_ip = placed["trainer/1"]["node_ip"]
    assert head_ip != B_IP
    where = {owner: (r["pin"], r["node_ip"]) for owner, r in placed.items()}
    assert where == {
        "trainer/0": ("node_b", B_IP),
        "trainer/1": ("node_a", head_ip),
        "rollout": ("node_a", head_ip),
        "engine/0": ("node_a", head_ip),
        "engine/1": ("node_b", B_IP),
    }, where
    at = placed["trainer/0"]["rendezvous"]
    assert at.startswith(f"{B_IP}:") and placed["trainer/1"]["rendezvous"] == at  # rank 0's node, not 127.0.0.1
    assert placed["engine/1"]["url"].startswith(f"http://{B_IP}:")  # bound to its node's address
    assert placed["engine/0"]["url"].startswith(f"http://{head_ip}:")
    samples = _rows(run, "processes.jsonl")
    seen = {(s["owner"], s["node_ip"]) for s in samples}
    assert seen == {(o, placed[o]["node_ip"]) for o in placed}, seen  # every sample from the node of the plan
    assert {s["node_id"] for s in samples if s["owner"] == "trainer/0"} == {placed["trainer/0"]["node_id"]}
    curve = _curve(run)
    assert sorted(curve) == [0, 1, 2, 3]
    assert curve == {s: single_node[s] for s in curve}  # rewards and losses equal the single-node run's
    print(f"\nplacement: {where}; rendezvous {at}; curve {curve}")


# async: one trainer rank, the rollout manager with its one embedded engine (async.partial_rollout needs embedded)
ASYNC = ["trainer.world_size=1", "rollout.engine=embedded", "rollout.num_engines=1", "sync.transport=broadcast"]
ASYNC += ["num_steps=5", "dump_rollouts=true", "trainer.warmup_sft_steps=20"]


def test_an_async_run_with_rollout_and_trainer_on_two_nodes_equals_it_on_one(nodes, tmp_path):
    """quickstart_async (max_staleness=2): the rollout manager and its engine on the head, the trainer on 127.0.0.2;
    generation for later steps runs on one node while the other trains, and the versions, staleness and rewards
    equal the same seed with everything on the head."""
    split, one = tmp_path / "split", tmp_path / "one"
    at = f"cluster.address={nodes.address}"
    runs = {
        split: ["cluster.trainer_nodes=node_b", "cluster.rollout_node=node_a"],
        one: ["cluster.trainer_nodes=node_a", "cluster.rollout_node=node_a"],
    }
    for run, pins in runs.items():
        code, out = _train(run, at, *ASYNC, *pins, recipe="quickstart_async")
        assert code == 0, out[-3000:]
    placed = {r["owner"]: r for r in _rows(split, "placement.jsonl")}
    head_ip = placed["rollout"]["node_ip"]
    assert head_ip != B_IP
    where = {owner: (r["pin"], r["node_ip"]) for owner, r in placed.items()}
    assert where == {"trainer/0": ("node_b", B_IP), "rollout": ("node_a", head_ip), "engine/0": ("node_a", head_ip)}
    samples = _rows(split, "processes.jsonl")
    seen = {(s["owner"], s["node_id"]) for s in samples}  # the embedded engine's process is the manager's
    assert seen == {(o, placed[o]["node_id"]) for o in ("trainer/0", "engine/0")}, seen
    assert placed["engine/0"]["pid"] == placed["rollout"]["pid"] != placed["trainer/0"]["pid"]
    rows = {run: [r for r in _rows(run, "metrics.jsonl") if "phase" not in r] for run in runs}
    assert [r["step"] for r in rows[split]] == list(range(5))
    stale = [r["async/staleness_max"] for r in rows[split]]
    assert max(stale) <= 2 and max(stale) > 0, stale  # bounded, and generation really ran ahead of training
    for key in ("weight_version", "async/staleness_max", "reward", "loss"):
        assert [r[key] for r in rows[split]] == [r[key] for r in rows[one]], key
    for step in range(5):  # each step's samples were generated under the version its row names
        raw = (split / "rollouts" / f"step_{step:06d}" / "weight_versions.int32").read_bytes()
        assert set(memoryview(raw).cast("i")) - {-1} == {rows[split][step]["weight_version"]}, step
    print(f"\nasync split: {where}; staleness {stale}; rewards {[r['reward'] for r in rows[split]]}")


def test_a_node_without_the_devices_asked_for_is_refused_before_anything_starts(nodes, tmp_path):
    t0 = time.monotonic()
    code, out = _train(tmp_path / "run", f"cluster.address={nodes.address}", *SPREAD, "device=cuda")
    assert code == 2, out[-3000:]
    assert (
        f"error: device = 'cuda': trainer rank(s) [0] need 1 GPU (one per rank), but the node(s) with 'node_b' have 0: {B_IP}"
        in out
    )
    assert "use device=cpu" in out and not (tmp_path / "run" / "placement.jsonl").exists()
    code, out = _train(tmp_path / "run2", f"cluster.address={nodes.address}", "cluster.trainer_nodes=node_c,node_a")
    assert code == 2 and "to 'node_c', a resource no live node of the cluster has; the nodes: " in out, out[-3000:]
    print(f"\nrefused twice in {time.monotonic() - t0:.0f} s")


def test_an_address_where_no_cluster_answers_is_refused_within_the_wait(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    code, out = _train(tmp_path / "run", f"cluster.address=127.0.0.1:{port}", "cluster.connect_timeout_s=3")
    assert code == 1, out[-3000:]
    assert f"cluster.address = '127.0.0.1:{port}': nothing answered at 127.0.0.1:{port} within 3 s" in out
    assert time.monotonic() - t0 < 120  # Python's start and the 3 s wait; Ray's own join would wait minutes


def test_a_node_killed_mid_run_is_named_and_the_run_resumes_on_the_node_left(nodes, single_node, tmp_path):
    """Last in this file: the second node stays dead."""
    run = tmp_path / "run"
    on_b = ["cluster.engine_nodes=node_b,node_b", "sync.transport=tensor"]  # tensor: the engines on rank 0's node
    proc = _train(
        run, f"cluster.address={nodes.address}", *SPREAD, *on_b, "num_steps=40", "checkpoint_every=1", wait=False
    )
    deadline = time.monotonic() + 600
    while not (run / "checkpoints" / "step_000002").exists() and proc.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint at step 2 within 600 s"
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[0][-3000:]
    nodes.kill(B_IP)
    t_kill = time.monotonic()
    out, _ = proc.communicate(timeout=300)
    stopped_s = time.monotonic() - t_kill
    assert proc.returncode == 1, out[-3000:]
    line = next((x for x in out.splitlines() if "NodeLostError" in x), "")
    assert line, out[-4000:]
    assert f"node {B_IP} (id " in line and "where trainer/0, engine/0, engine/1 ran, left the Ray cluster" in line
    assert "RL steps before" in line and "rerun it on the nodes left" in line
    lost = _curve(run)
    from miles.checkpoints import Checkpoints

    latest = Checkpoints(run / "checkpoints").latest()  # verified: every file of it is whole
    assert latest is not None and latest[0] >= 2 and str(latest[1]) in line
    on_a = ["cluster.trainer_nodes=node_a,node_a", "cluster.engine_nodes=node_a,node_a", "cluster.rollout_node=node_a"]
    end = latest[0] + 2
    code, out = _train(run, f"cluster.address={nodes.address}", *on_a, "sync.transport=tensor", f"num_steps={end}")
    assert code == 0, out[-3000:]
    assert f"resuming from {latest[1]}" in out
    resumed = _curve(run)
    assert sorted(resumed) == list(range(end))
    again = {s: resumed[s] for s in range(latest[0], end) if s in lost}
    assert again == {s: lost[s] for s in again}  # the steps the lost run had done come out the same
    shared = {s: resumed[s] for s in resumed if s in single_node}
    assert len(shared) >= 3 and shared == {s: single_node[s] for s in shared}
    starts = _rows(run, "placement.jsonl")
    head_ip = next(r["node_ip"] for r in starts if r["owner"] == "trainer/1")
    assert {r["node_ip"] for r in starts if r["step"] == latest[0]} == {head_ip}  # the resumed run: all on the head
    print(f"\nnode lost -> run stopped in {stopped_s:.0f} s: {line}\nresumed at {latest[0]}: {resumed}")
