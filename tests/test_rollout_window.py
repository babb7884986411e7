"""The async loop (miles.rollout_window in miles.driver.train): at async.max_staleness = 0 it is the synchronous loop
bit for bit; at k each step is sampled under version max(0, step - k) exactly, every generated sample is trained
(accepted lengths are the generated ones) and two runs of a seed give the same numbers."""

from collections import Counter

import pytest
import torch

from miles.colocated import Colocated
from miles.config import apply_overrides
from miles.driver import train
from miles.handoff.planner import resolve_plan
from miles.recipes import quickstart
from miles.rollout_window import RolloutWindow

pytestmark = pytest.mark.unit

RESIDENT = ["handoff.offload_train=none", "handoff.offload_rollout=false", "trainer.rollout_correction=decoupled"]


def small_cfg(tmp_path, *overrides):
    base = [
        "model.hidden_size=32",
        "model.intermediate_size=64",
        "model.num_hidden_layers=2",
        "rollout.num_prompts_per_step=4",
        "rollout.n_samples_per_prompt=2",
        "rollout.max_new_tokens=6",
        "rollout.max_batch_size=8",
        "rollout.max_seq_len=32",
        "trainer.warmup_sft_steps=2",
        "trainer.num_minibatches=1",
        "trainer.lr=1e-2",
        "num_threads=1",
        "num_steps=5",
        "checkpoint_every=0",
        "dump_rollouts=false",
        f"run_dir={tmp_path / 'run'}",
        "overwrite=true",
    ]
    return apply_overrides(quickstart(), base + list(overrides))


class Recorded(Colocated):
    """A Colocated that keeps, per RL step, the responses generated and the batch trained (the real calls)."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.generated: dict[int, list[list[int]]] = {}
        self.trained: list[list[int]] = []  # per train call: each row's response length
        generate, train_step = self.manager.generate, self.trainer.train

        def recording_generate(step):
            out = generate(step)
            self.generated[step] = [list(s.response_ids) for s in self.manager.last_samples]
            return out

        def recording_train(batches, **kw):
            self.trained.append([int(n) for b in batches for n in b.loss_mask.sum(1)])
            return train_step(batches, **kw)

        self.manager.generate, self.trainer.train = recording_generate, recording_train


def run_loop(cfg) -> tuple[list[dict], Recorded]:
    made = []
    rows = train(cfg, progress=False, cluster=lambda c: made.append(Recorded(c)) or made[0])
    return rows, made[0]


def reference_sync_loop(cfg) -> tuple[list[float], Recorded]:
    """The synchronous loop before the window, written out: warm-up, then per step generate, train, sync."""
    co = Recorded(cfg)
    plan = resolve_plan(cfg)

    def warm_up():
        for i in range(cfg.trainer.warmup_sft_steps):
            co.trainer.sft(co.sft_batches(i), lr=cfg.trainer.warmup_sft_lr)
        co.trainer.set_lr(cfg.trainer.lr)

    with co:
        co.execute(plan.init, version=0, phase="init", built=lambda: None, warm_up=warm_up)
        rewards = []
        for step in range(cfg.num_steps):
            batches, metrics = co.generate(step)
            co.execute(plan.rollout_to_train, phase="rollout_to_train")
            co.trainer.train(batches, step=step)
            co.execute(plan.train_to_rollout, version=step + 1, phase="train_to_rollout")
            rewards.append(metrics["reward"])
    return rewards, co


def weights(co) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in co.backend.named_weights()}


def test_staleness_zero_is_the_synchronous_loop_bit_for_bit(tmp_path):
    """Samples, rewards and final weights of the loop at max_staleness = 0 equal the synchronous loop's, exactly
    (the recipe's handoff as it is: the trainer's memory goes to host between steps)."""
    cfg = small_cfg(tmp_path, "async.max_staleness=0")
    rows, co = run_loop(cfg)
    ref_rewards, ref = reference_sync_loop(small_cfg(tmp_path / "ref"))
    assert [r["reward"] for r in rows] == ref_rewards
    assert co.generated == ref.generated and co.trained == ref.trained
    w, w_ref = weights(co), weights(ref)
    assert w.keys() == w_ref.keys() and all(torch.equal(w[k], w_ref[k]) for k in w)
    assert [r["weight_version"] for r in rows] == list(range(cfg.num_steps))


def test_staleness_two_samples_step_t_under_version_t_minus_2_and_trains_every_sample(tmp_path):
    cfg = small_cfg(tmp_path, "async.max_staleness=2", *RESIDENT)
    rows, co = run_loop(cfg)
    assert [r["weight_version"] for r in rows] == [0, 0, 0, 1, 2]
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 2, 2, 2]
    assert all(r["async/version_span_max"] == 0 for r in rows)  # no update lands inside a step's generation
    # every generated sample is trained, in its own step: the accepted lengths are the generated lengths
    generated = [sorted(len(ids) for ids in co.generated[t]) for t in range(cfg.num_steps)]
    assert [sorted(n) for n in co.trained] == generated
    assert Counter(n for g in generated for n in g) == Counter(n for t in co.trained for n in t)


def test_two_async_runs_of_a_seed_give_the_same_rewards_and_weights(tmp_path):
    rows_a, a = run_loop(small_cfg(tmp_path / "a", "async.max_staleness=2", *RESIDENT))
    rows_b, b = run_loop(small_cfg(tmp_path / "b", "async.max_staleness=2", *RESIDENT))
    assert [r["reward"] for r in rows_a] == [r["reward"] for r in rows_b]
    assert a.generated == b.generated
    wa, wb = weights(a), weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_staleness_changes_what_is_sampled(tmp_path):
    """The comparison above can fail: the same seed at staleness 0 and 2 samples differently from step 1 on."""
    _, sync = run_loop(small_cfg(tmp_path / "s", *RESIDENT))
    _, stale = run_loop(small_cfg(tmp_path / "k", "async.max_staleness=2", *RESIDENT))
    assert sync.generated[0] == stale.generated[0] and sync.generated[1] != stale.generated[1]


class CallLog:
    """What the window asks of a cluster, with the engines' version at each rollout's start."""

    def __init__(self):
        self.version, self.calls = 0, []

    def submit_generate(self, step):
        self.calls.append(("submit", step, self.version))
        return step, self.version

    def collect(self, pending, step, untrained=None):
        self.calls.append(("collect", step, untrained))
        return ["batch"], {"async/version_min": pending[1], "async/version_max": pending[1]}


def drive(k: int, num_steps: int = 5, first: int = 0) -> CallLog:
    cfg = apply_overrides(quickstart(), [f"num_steps={num_steps}", f"async.max_staleness={k}", *RESIDENT])
    log = CallLog()
    log.version = first
    window = RolloutWindow(log, cfg, first)
    for step in range(first, num_steps):
        window.take(step)
        window.before_sync()
        log.version = step + 1  # the loop's train_to_rollout sync
    return log


def test_the_window_at_staleness_zero_makes_the_synchronous_calls():
    assert drive(0).calls == [c for t in range(5) for c in (("submit", t, t), ("collect", t, t))]


def test_the_window_at_staleness_two_starts_each_step_under_version_step_minus_two_and_never_past_the_end():
    log = drive(2)
    starts = {step: v for kind, step, v in log.calls if kind == "submit"}
    assert starts == {0: 0, 1: 0, 2: 0, 3: 1, 4: 2}
    # before each sync every started rollout is collected, naming the oldest untrained step for a stall's checkpoint
    assert log.calls[:5] == [("submit", 0, 0), ("submit", 1, 0), ("submit", 2, 0), ("collect", 0, 0), ("collect", 1, 1)]


def test_a_resumed_async_run_starts_its_window_at_the_checkpoint():
    starts = {step: v for kind, step, v in drive(1, num_steps=6, first=3).calls if kind == "submit"}
    assert starts == {3: 3, 4: 3, 5: 4}
