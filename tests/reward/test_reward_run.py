"""Runs through the real ``miles train`` command: a reward that hangs on one sample in ten and raises on another
one in ten does not stop the run, each planted hang is one reward timeout and each planted raise one reward
error in metrics.jsonl, the first failure of each step is in run_dir/reward_errors, and no reward worker is left
behind; a reward or a row verifier that does not exist is refused before Ray starts (V24, D11)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles.cli import EXIT_BAD_INPUT
from miles.data.generate import generated_train

pytestmark = pytest.mark.procs  # it starts processes or servers (tests/conftest.py: the tiers)

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
TINY = [
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_hidden_layers=2",
    "model.max_position_embeddings=160",
    "rollout.max_seq_len=160",
    "rollout.num_prompts_per_step=4",
    "rollout.n_samples_per_prompt=4",
    "rollout.max_new_tokens=4",
    "trainer.warmup_sft_steps=0",
    "num_threads=1",
    "checkpoint_every=0",
]


def miles_train(*sets: str, env=None, timeout=600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)]), "MILES_DEBUG": "", **(env or {})}
    cmd = [sys.executable, "-m", "miles.cli", "train", "--recipe", "quickstart", "--no-progress", "--set", *TINY, *sets]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def workers_of(markers: Path) -> list[int]:
    """Reward worker processes started for this test's run (their environment names its marker folder)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if b"miles.reward.worker" in cmd and f"MILES_TEST_MARKERS={markers}".encode() in environ:
            found.append(int(pid))
    return found


def test_a_run_whose_reward_hangs_on_one_sample_in_ten_finishes_with_every_timeout_counted(tmp_path):
    markers = tmp_path / "markers"
    markers.mkdir()
    run = tmp_path / "run"
    r = miles_train(
        "num_steps=3",
        f"data.train={generated_train('mixed', 100, out_dir=tmp_path)}",
        "data.reward=hostile_rewards:planted",
        "data.reward_timeout_s=2",
        "data.reward_workers=2",
        f"run_dir={run}",
        env={"MILES_TEST_MARKERS": str(markers)},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "step" in row and "phase" not in row]
    hangs = [p for p in markers.iterdir() if p.name.startswith("hang-")]
    raises = [p for p in markers.iterdir() if p.name.startswith("raise-")]
    print(f"planted: {len(hangs)} hangs, {len(raises)} raises in {3 * 16} samples;",
          [(row["step"], row["reward/timeouts"], row["reward/errors"], round(row["time/reward"], 2)) for row in rows])  # fmt: skip
    assert [row["step"] for row in rows] == [0, 1, 2] and hangs and raises
    assert sum(row["reward/timeouts"] for row in rows) == len(hangs)
    assert sum(row["reward/errors"] for row in rows) == len(raises)
    planted = {tuple(p.read_text().split("\n", 1)) for p in hangs + raises}
    for row in rows:
        path = run / "reward_errors" / f"step_{row['step']:06d}.json"
        assert path.exists() == bool(row["reward/timeouts"] + row["reward/errors"])
        if path.exists():
            failure = json.loads(path.read_text())
            assert (failure["prompt"], failure["response"]) in planted and failure["kind"] in ("timeout", "error")
    assert workers_of(markers) == []  # the run closed its pool


def test_v24_d11_a_reward_or_a_row_verifier_that_does_not_exist_exits_2_before_ray_starts(tmp_path):
    data = generated_train("mixed", 20, out_dir=tmp_path)
    r = miles_train(f"data.train={data}", "data.reward=nope_mod:fn", f"run_dir={tmp_path / 'a'}", timeout=120)
    assert r.returncode == EXIT_BAD_INPUT and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "data.reward = 'nope_mod:fn' cannot be loaded (ModuleNotFoundError" in r.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n"
        + json.dumps({"prompt": "2+2?", "answer": "4", "metadata": {"verifier": "os:system"}}) + "\n"
    )  # fmt: skip
    r = miles_train(f"data.train={bad}", f"run_dir={tmp_path / 'b'}", timeout=120)
    assert r.returncode == EXIT_BAD_INPUT, r.stderr[-2000:]
    assert "bad.jsonl row 1 field 'metadata.verifier': 'os:system' is not a verifier" in r.stderr
    r = miles_train(f"run_dir={tmp_path / 'c'}", "task.reward=nope_mod:fn", timeout=120)
    assert r.returncode == EXIT_BAD_INPUT and "task.reward = 'nope_mod:fn' cannot be loaded" in r.stderr
    assert not any((tmp_path / d).exists() for d in "abc")  # refused before the run directory (and Ray)
