"""The synchronous, colocated RL loop. Mode differences live in the HandoffPlan, decided before the loop."""

from __future__ import annotations

import logging
import threading
import time

from miles.cluster import Cluster
from miles.config import RunConfig
from miles.handoff import HandoffPlan
from miles.rollout.tasks import RewardError
from miles.run_dir import RunDir

log = logging.getLogger("miles")


def train(cfg: RunConfig, *, progress: bool = True, stop: threading.Event | None = None, on_step=None) -> list[dict]:
    """Run ``cfg.num_steps`` RL steps (resuming from the last checkpoint); returns the metrics rows."""
    run_dir = RunDir(cfg.run_dir)
    run_dir.write_config(cfg.to_json())
    plan = resolve_plan(cfg)
    log.info(plan.describe())
    with Cluster(cfg) as c:
        book = Bookkeeper(cfg, run_dir, c, on_step)
        start = book.resume()
        if start == 0:
            warmup(cfg, c, book)
        book.ledger(-1, c.execute(plan.init, version=start))
        for step in book.progress(range(start, cfg.num_steps), progress):
            if stop is not None and stop.is_set():
                book.checkpoint(step, reason="stopped")
                break
            t0 = time.perf_counter()
            batches, rollout = book.generate(step)
            moved = c.execute(plan.rollout_to_train)
            results = c.trainer.call_each("train", batches, want_log_probs=cfg.dump_rollouts, step=step)
            moved |= c.execute(plan.train_to_rollout, version=step + 1)
            book.record(step, rollout, results, moved, time.perf_counter() - t0)
        else:
            book.checkpoint(cfg.num_steps, reason="end")
    return book.rows


def resolve_plan(cfg: RunConfig) -> HandoffPlan:
    if cfg.handoff.colocate_memory_peak_device != "auto":
        return HandoffPlan.from_config(cfg.handoff)
    from miles.planner import choose_mode

    mode, reason = choose_mode(cfg)
    return HandoffPlan.from_config(cfg.handoff, mode=mode, reason=reason)


def warmup(cfg: RunConfig, c: Cluster, book: "Bookkeeper") -> None:
    """Supervised steps on reference answers before RL (RunConfig.trainer.warmup_sft_steps); not RL steps."""
    n = cfg.trainer.warmup_sft_steps
    for i in range(n):
        batches = c.get(c.rollout.sft_batches.remote(i))
        m = c.trainer.call_each("sft", batches, lr=cfg.trainer.warmup_sft_lr)[0]
        book.run_dir.append_metrics({"phase": "sft", "sft_step": i, **m})
    if n:
        c.trainer.call("set_lr", cfg.trainer.lr)


class Bookkeeper:
    """Everything around the loop that is not the loop: resume, metrics, ledger, dumps, checkpoints, progress."""

    def __init__(self, cfg: RunConfig, run_dir: RunDir, cluster: Cluster, on_step=None):
        self.cfg, self.run_dir, self.c, self.on_step = cfg, run_dir, cluster, on_step
        self.rows: list[dict] = []
        self.pool_bytes = {"device": 0, "host": 0, "disk": 0}
        self.bar = None

    def resume(self) -> int:
        found = self.run_dir.latest_checkpoint() if self.cfg.resume else None
        if not found:
            self.run_dir.reset()
            return 0
        next_step, path = found
        log.warning("resuming from %s (next RL step %d)", path, next_step)
        self.c.trainer.call("load_checkpoint", str(path))
        self.run_dir.truncate_metrics(next_step)
        self.rows = [r for r in self.run_dir.metrics() if r.get("phase") != "sft"]
        return next_step

    def generate(self, step: int):
        try:
            return self.c.get(self.c.rollout.generate.remote(step))
        except Exception as e:
            cause = _root_cause(e)
            if isinstance(cause, RewardError):
                self.checkpoint(step, reason="reward function failed")
                raise RewardError(
                    f"RL step {step}: {cause}. Steps before {step} are saved in {self.run_dir.ckpt_root}; "
                    f"fix the reward and rerun the same command to resume."
                ) from None
            raise

    def record(self, step: int, rollout: dict, results: list, moved: dict, seconds: float) -> None:
        train = _mean([m for m, _ in results])
        events, samples = self.c.drain_ledgers()
        peaks = self.ledger(step, moved, events, samples)
        row = {
            "step": step,
            **rollout,
            **train,
            **self.c.sync_metrics,
            **peaks,
            "time/step": seconds,
            "samples_per_s": self.cfg.rollout.num_prompts_per_step * self.cfg.rollout.n_samples_per_prompt / seconds,
            "tokens_per_s": rollout["total_tokens"] / seconds,
        }
        self.run_dir.append_metrics(row)
        self.rows.append(row)
        if self.cfg.dump_rollouts:
            self.dump(step, {k: v for _, lps in results for k, v in lps.items()})
        if self.bar is not None:
            self.bar.set_postfix(reward=f"{row['reward']:.3f}", loss=f"{row.get('loss', 0):.3f}")
        if self.on_step:
            self.on_step(row)
        every = self.cfg.checkpoint_every
        if every and (step + 1) % every == 0 and step + 1 < self.cfg.num_steps:
            self.checkpoint(step + 1, reason="periodic")

    def ledger(self, step: int, moved: dict, events=None, samples=None) -> dict:
        if events is None:
            events, samples = self.c.drain_ledgers()
        self.run_dir.append_ledger(step, events, samples)
        peak = dict(self.pool_bytes)
        for e in events:
            self.pool_bytes[e.pool] += e.signed()
            peak[e.pool] = max(peak[e.pool], self.pool_bytes[e.pool])
        out = {f"mem/{pool}_peak": v for pool, v in peak.items()}
        out |= {f"moved/{k}": v for k, v in moved.items()}
        if samples:
            out["mem/rss_max"] = max(s.rss_bytes for s in samples)
        return out

    def dump(self, step: int, train_log_probs: dict) -> None:
        try:
            from miles.dashboard.store import RolloutDumpWriter
        except ImportError:
            return
        rows = self.c.get(self.c.rollout.sample_rows.remote(train_log_probs))
        RolloutDumpWriter(run_dir=self.run_dir.path).write_step(step, rows)

    def checkpoint(self, next_step: int, reason: str) -> None:
        if next_step == 0 and reason != "end":
            return
        path = self.c.save_checkpoint(self.run_dir, next_step)
        log.info("checkpoint %s (%s)", path, reason)

    def progress(self, steps, enabled: bool):
        if not enabled:
            return steps
        from tqdm.auto import tqdm

        self.bar = tqdm(
            steps, desc=f"miles {self.cfg.recipe}", unit="step", initial=steps.start, total=self.cfg.num_steps
        )
        return self.bar


def _mean(dicts: list[dict]) -> dict:
    keys = {k for d in dicts for k in d}
    return {k: sum(d.get(k, 0.0) for d in dicts) / len(dicts) for k in keys}


def _root_cause(e: BaseException) -> BaseException:
    """Ray wraps actor exceptions; find the original one."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException):
        return _root_cause(cause)
    return e
