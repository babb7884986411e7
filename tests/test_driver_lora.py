"""A LoRA run whose warm-up trains the base (model.lora.warmup = base), end to end on real Ray actors: stopped by
Ctrl-C and rerun, it ends where the same run uninterrupted ends (adapters, their optimizer state, the base, every
step's metrics), the engines sample from the warmed-up base (the trainer's and the engine's log-probs agree), and
the warm-up did not run twice."""

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from miles.driver import train
from tests.conftest import tiny_run_cfg

pytestmark = pytest.mark.procs  # it starts processes or servers (tests/conftest.py: the tiers)

LORA = [
    "model.lora.rank=2",
    "model.lora.warmup=base",
    "trainer.warmup_sft_steps=3",
    "num_steps=4",
    "checkpoint_every=0",
    "sync.check_weights=true",
]
SAME = ("step", "reward", "loss", "grad_norm", "train_rollout_logprob_abs_diff", "response_len")


def _rows(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def _checkpoint(run_dir):
    d = Path(run_dir) / "checkpoints" / "step_000004"
    optim = torch.load(d / "optimizer.pt", weights_only=True)
    return load_file(d / "adapter_model.safetensors"), load_file(d / "base" / "model.safetensors"), optim


def test_a_lora_run_stopped_by_ctrl_c_and_rerun_ends_where_the_uninterrupted_run_ends(tmp_path, ray_session):
    whole = tiny_run_cfg(tmp_path / "whole", *LORA)
    train(whole, progress=False)
    cut = tiny_run_cfg(tmp_path / "cut", *LORA)

    def ctrl_c_after_step_1(row):
        if row["step"] == 1:
            os.kill(os.getpid(), signal.SIGINT)  # what a terminal's Ctrl-C sends

    with pytest.raises(KeyboardInterrupt, match=r"RL steps before 2 are saved in .*step_000002"):
        train(cut, progress=False, on_step=ctrl_c_after_step_1)
    assert (tmp_path / "cut" / "run" / "checkpoints" / "step_000002" / "base" / "config.json").is_file()
    train(cut, progress=False)
    a, b = _rows(tmp_path / "whole" / "run"), _rows(tmp_path / "cut" / "run")
    assert [r.get("sft_step") for r in b if r.get("phase") == "sft"] == [0, 1, 2]  # the warm-up ran once
    rl_a, rl_b = [r for r in a if "step" in r], [r for r in b if "step" in r]
    assert [r["step"] for r in rl_b] == [0, 1, 2, 3]
    # the engines sample from the trainer's policy: they hold the warmed-up base (sent once, and again on resume)
    assert max(r["train_rollout_logprob_abs_diff"] for r in rl_a + rl_b) < 1e-4
    for x, y in zip(rl_a, rl_b):
        assert {k: x.get(k) for k in SAME} == {k: y.get(k) for k in SAME}
    (adapters_a, base_a, optim_a), (adapters_b, base_b, optim_b) = _checkpoint(whole.run_dir), _checkpoint(cut.run_dir)
    assert adapters_a.keys() == adapters_b.keys() and all(torch.equal(adapters_a[k], adapters_b[k]) for k in adapters_a)
    assert base_a.keys() == base_b.keys() and all(torch.equal(base_a[k], base_b[k]) for k in base_a)
    moments = lambda o: [t for s in o["state"].values() for t in s.values() if torch.is_tensor(t)]  # noqa: E731
    assert len(moments(optim_a)) == 3 * len(adapters_a)  # step, exp_avg, exp_avg_sq per adapter matrix
    assert all(torch.equal(x, y) for x, y in zip(moments(optim_a), moments(optim_b)))
