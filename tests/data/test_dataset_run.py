"""A run on a prompt dataset, end to end on Ray with a tiny model: held-out eval rows in metrics.jsonl at the start,
every eval.every steps and at the end; eval prompts never trained on; a verifier that raises stops the run with
its steps kept (data.reward_on_error=raise), and the resumed run continues the same prompt order; eval rows that are also train rows are
refused before anything starts; trackers get the same rows."""

import hashlib
import json
import tempfile
from pathlib import Path

import pytest

from miles.config import apply_overrides
from miles.dashboard.store import RunDirReader
from miles.data.dataset import PromptDataset, load_rows
from miles.data.generate import generated_train, held_out_rows, split_path
from miles.driver import train
from miles.recipes import quickstart
from miles.rollout.tasks import RewardError
from miles.rollout_dump import ROLLOUTS, step_dir_name

pytestmark = pytest.mark.procs  # it starts processes or servers (tests/conftest.py: the tiers)

BROKEN = Path(tempfile.gettempdir()) / f"miles-broken-verifier-{hashlib.sha1(__file__.encode()).hexdigest()[:12]}"


def breaks_at_step_2(prompt, response, target):
    """Breaks once the flag file exists (set after step 1: rewards run in worker processes, the flag is shared)."""
    if BROKEN.exists():
        raise ZeroDivisionError("verifier broke")
    return float(response.strip() == target)


def exact(prompt, response, target):
    return float(response.strip() == target)


def run_cfg(tmp_path, *overrides, name="run"):
    base = [
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
        f"data.train={generated_train('mixed', 200, out_dir=tmp_path)}",
        f"run_dir={tmp_path / name}",
    ]
    return apply_overrides(quickstart(), base + list(overrides))


def _metrics(cfg):
    return [json.loads(line) for line in open(f"{cfg.run_dir}/metrics.jsonl")]


def _prompts(cfg, step):
    reader = RunDirReader(cfg.run_dir)
    n = len(reader.step_index(step)["samples"])
    step_dir = reader.path(ROLLOUTS, step_dir_name(step))
    return [reader._texts(step_dir, reader.sample_meta(step, i))["prompt_text"] for i in range(0, n, 4)]  # per group


def test_eval_rows_land_in_metrics_at_start_every_and_end_and_eval_prompts_are_never_trained(tmp_path, ray_session):
    cfg = run_cfg(
        tmp_path,
        "num_steps=3",
        "checkpoint_every=0",
        f"data.eval={split_path('mixed')}",
        "eval.every=2",
        "eval.k=2",
        "eval.max_problems=6",
        "log.trackers=jsonl,tensorboard",
    )
    rows = train(cfg, progress=False)
    assert [r["step"] for r in rows] == [0, 1, 2]  # RL rows only
    evals = [r for r in _metrics(cfg) if r.get("phase") == "eval"]
    assert [r["step"] for r in evals] == [0, 2, 3]
    for r in evals:
        assert r["eval/mixed_test/num_problems"] == 6 and r["eval/all/num_problems"] == 6
        assert {"eval/all/mean@2", "eval/all/pass@1", "eval/all/pass@2", "eval/all/greedy_pass@1"} <= set(r)
        assert 0 <= r["eval/all/mean@2"] <= r["eval/all/pass@2"] <= 1 and r["eval/tokens"] > 0
    held_out = {r["prompt"] for r in held_out_rows("mixed")}
    trained = {p for step in range(3) for p in _prompts(cfg, step)}
    assert len(trained) == 12 and not trained & held_out
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard")).Reload()
    assert [e.step for e in acc.Scalars("eval/all/mean@2")] == [0, 2, 3]
    assert [e.value for e in acc.Scalars("reward")] == pytest.approx([r["reward"] for r in rows])


def test_a_verifier_that_raises_keeps_the_steps_and_the_resumed_run_continues_the_same_order(tmp_path, ray_session):
    cfg = run_cfg(
        tmp_path,
        "num_steps=4",
        "checkpoint_every=0",
        f"data.reward={__name__}:breaks_at_step_2",
        "data.reward_on_error=raise",
    )
    BROKEN.unlink(missing_ok=True)
    try:
        with pytest.raises(RewardError, match=r"RL step 2: reward function .*breaks_at_step_2 raised ZeroDivisionErr"):
            train(cfg, progress=False, on_step=lambda row: row["step"] == 1 and BROKEN.touch())
    finally:
        BROKEN.unlink(missing_ok=True)
    assert [r["step"] for r in _metrics(cfg)] == [0, 1]
    state = json.loads(open(f"{cfg.run_dir}/checkpoints/step_000002/data_state.json").read())
    assert state == {"epoch": 0, "index": 8, "num_rows": 200, "seed": 0, "next_step": 2}
    fixed = apply_overrides(cfg, [f"data.reward={__name__}:exact"])
    assert [r["step"] for r in train(fixed, progress=False)] == [0, 1, 2, 3]
    rows, _ = load_rows("mixed_train", cfg.data.train, cfg.data)
    order = [r.prompt for r in PromptDataset(rows, seed=0).take(16)]
    assert [p for step in range(4) for p in _prompts(cfg, step)] == order  # nothing repeated or skipped


def test_eval_rows_that_are_also_train_rows_stop_the_run_before_anything_starts(tmp_path):
    train_path = tmp_path / "train.jsonl"
    rows = held_out_rows("mixed")[:3] + [{"prompt": "What is 1 + 1?", "answer": "2"}]
    train_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = run_cfg(tmp_path, f"data.train={train_path}", f"data.eval={split_path('mixed')}")
    with pytest.raises(ValueError, match=r"eval dataset 'mixed_test' \(.*mixed_test.jsonl row 0\) has the prompt"):
        train(cfg, progress=False)
    assert not (tmp_path / "run").exists()  # refused before the run directory or Ray


def test_a_missing_column_stops_the_run_naming_file_row_and_field(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"prompt": "What is 2 + 2?", "answer": "4"}) + "\n" + json.dumps({"question": "x"}) + "\n"
    )
    with pytest.raises(ValueError, match=r"bad.jsonl row 1 field 'prompt': missing \(columns: \['question'\]\)"):
        train(run_cfg(tmp_path, f"data.train={bad}"), progress=False)
    with pytest.raises(ValueError, match=r"data.train: dataset 'gone' at .*gone.jsonl' does not exist"):
        run_cfg(tmp_path, f"data.train={tmp_path / 'gone.jsonl'}")
