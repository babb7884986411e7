"""RewardScorer: the rewards of many samples at once. Each reward's quick part runs here (linear-time code: the
plain-number fast path, answer extraction, countdown), everything else (sympy checks, a user's function) in the
RewardPool under ``data.reward_timeout_s``. A call that raises, times out, or returns something that is not a
finite number scores ``data.reward_on_error`` and is counted; the first of a step is written to
``<run_dir>/reward_errors/<label>.json``. With ``reward_on_error = raise`` the first one stops the run instead
(RewardError), after the file is written.

    scorer = RewardScorer(pool, on_error=0.0, failures_dir=run_dir / "reward_errors")
    report = scorer.score([Job(reward, prompt, response, target), ...], label="step_000003")
    report.values                      # one float per job, in order
    report.timeouts, report.errors     # counts; report.first is the first failure (a Failure) or None

``pool=None`` runs everything in this process without a time limit: the reference path (tests and
``miles bench verify`` compare both).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import traceback
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from miles.atomic import atomic_write_text
from miles.data.verify import SYMBOLIC
from miles.protocols.reward import Call, CallResult, Deferred, Reward, RewardError
from miles.reward.catalog import BUILTIN
from miles.reward.pool import RewardPool
from miles.reward.worker import load

log = logging.getLogger("miles")


@dataclass(frozen=True, slots=True)
class Job:
    reward: Reward
    prompt: str
    response: str
    target: str


@dataclass(slots=True)
class Failure:
    """A reward call that did not give a reward: what it was given and what went wrong."""

    reward: str
    kind: str  # "timeout" | "error"
    error: str
    seconds: float
    prompt: str
    response: str
    target: str
    traceback: str = ""

    def message(self) -> str:
        what = self.error if self.kind == "error" else f"timed out: {self.error}"
        return (
            f"reward function {self.reward} {'raised ' if self.kind == 'error' else ''}{what} "
            f"(prompt={self.prompt[:80]!r}, response={self.response[:80]!r}, target={self.target[:80]!r})"
        )


@dataclass(slots=True)
class ScoreReport:
    values: list[float]
    failed: list[str]  # per job: "" (scored), "timeout" or "error"
    timeouts: int = 0
    errors: int = 0
    seconds: float = 0.0
    first: Failure | None = None
    path: Path | None = None  # where the first failure was written
    num_pool_calls: int = 0  # calls that went to the pool (after folding repeated sympy checks into one)
    pool_seconds: float = field(default=0.0, repr=False)

    def metrics(self, prefix: str = "reward/") -> dict[str, float]:
        return {f"{prefix}timeouts": self.timeouts, f"{prefix}errors": self.errors}


class RewardScorer:
    def __init__(
        self, pool: RewardPool | None, *, on_error: float | None = 0.0, failures_dir=None, memo_size: int = 65536
    ):
        self.pool, self.on_error = pool, on_error
        self.failures_dir = Path(failures_dir) if failures_dir else None
        self._here: dict[str, object] = {}  # the reference path's loaded functions
        # answers of the built-in sympy checks (pure functions) across calls: eval re-scores the same problems,
        # and a policy repeats its answers; failures are never kept (a timeout may be the machine's load)
        self._memo: OrderedDict[Call, float] = OrderedDict()
        self.memo_size = memo_size

    def score(self, jobs: list[Job], label: str = "") -> ScoreReport:
        t0 = time.perf_counter()
        results: list[CallResult | None] = [None] * len(jobs)
        deferred: list[Deferred | None] = [None] * len(jobs)
        batch: list[Call] = []  # what goes to the pool, and whose result each is
        owners: list[list[int]] = []
        folded: dict[Call, int] = {}  # a sympy check asked twice runs once; a user's call always runs (it may sample)
        for i, job in enumerate(jobs):
            if job.reward.quick is None:
                batch.append(Call(job.reward.call, (job.prompt, job.response, job.target)))
                owners.append([i])
                continue
            try:
                out = job.reward.quick(job.prompt, job.response, job.target)
            except Exception as e:
                results[i] = CallResult(error=f"{type(e).__name__}: {e}", traceback=_tb(e))
                continue
            if not isinstance(out, Deferred):
                results[i] = _checked(out)
                continue
            deferred[i], call = out, Call(out.call, out.args)
            if call in self._memo:
                self._memo.move_to_end(call)
                results[i] = CallResult(value=out.if_true if self._memo[call] else out.if_false)
                continue
            if call not in folded:
                folded[call] = len(batch)
                batch.append(call)
                owners.append([])
            owners[folded[call]].append(i)
        t_pool = time.perf_counter()
        for k, res in enumerate(self._run(batch)):
            if res.ok and deferred[owners[k][0]] is not None:
                self._remember(batch[k], res.value)
            for i in owners[k]:
                d = deferred[i]
                if not res.ok:
                    results[i] = res
                elif d is None:
                    results[i] = _checked(res.value, res.seconds)
                else:
                    results[i] = CallResult(value=d.if_true if res.value else d.if_false, seconds=res.seconds)
        report = self._report(jobs, results)
        report.num_pool_calls, report.pool_seconds = len(batch), time.perf_counter() - t_pool
        report.seconds = time.perf_counter() - t0
        if report.first is not None:
            self._record(report, label)
        return report

    def _remember(self, call: Call, value: float) -> None:
        self._memo[call] = value
        if len(self._memo) > self.memo_size:
            self._memo.popitem(last=False)

    def _run(self, calls: list[Call]) -> list[CallResult]:
        if not calls:
            return []
        if self.pool is not None:
            return self.pool.run(calls)
        out = []
        for c in calls:  # the reference path: here, in order, no limit
            fn = self._here.get(c.call) or self._here.setdefault(c.call, load(c.call))
            t0 = time.perf_counter()
            try:
                out.append(CallResult(value=float(fn(*c.args)), seconds=time.perf_counter() - t0))
            except Exception as e:
                out.append(CallResult(error=f"{type(e).__name__}: {e}", traceback=_tb(e)))
        return out

    def _report(self, jobs: list[Job], results: list[CallResult]) -> ScoreReport:
        fallback = 0.0 if self.on_error is None else self.on_error
        report = ScoreReport(
            values=[r.value if r.ok else fallback for r in results],
            failed=["" if r.ok else "timeout" if r.timed_out else "error" for r in results],
        )
        for job, r in zip(jobs, results):
            if r.ok:
                continue
            report.timeouts += r.timed_out
            report.errors += not r.timed_out
            if report.first is None:
                report.first = Failure(
                    reward=job.reward.name,
                    kind="timeout" if r.timed_out else "error",
                    error=r.error,
                    seconds=r.seconds,
                    prompt=job.prompt,
                    response=job.response,
                    target=job.target,
                    traceback=r.traceback,
                )
        return report

    def _record(self, report: ScoreReport, label: str) -> None:
        """Write the first failure, log one line, and raise when failures stop the run."""
        if self.failures_dir is not None and label:
            report.path = self.failures_dir / f"{label}.json"
            row = {"label": label, **asdict(report.first), "timeouts": report.timeouts, "errors": report.errors}
            atomic_write_text(report.path, json.dumps(row, indent=2))
        where = f"; the first is in {report.path}" if report.path else ""
        if self.on_error is None:
            raise RewardError(f"{report.first.message()}{where}; fix it, or set data.reward_on_error to a number")
        log.warning(
            "%s: %d reward timeout(s) and %d error(s) scored %g (data.reward_on_error)%s; first: %s",
            label or "rewards",
            report.timeouts,
            report.errors,
            self.on_error,
            where,
            report.first.message(),
        )


def _checked(value: float, seconds: float = 0.0) -> CallResult:
    try:
        value = float(value)
    except (TypeError, ValueError, OverflowError):
        return CallResult(error=f"returned {value!r:.200}, not a number")
    if not math.isfinite(value):
        return CallResult(error=f"returned {value}; rewards must be finite", seconds=seconds)
    return CallResult(value=value, seconds=seconds)


def _tb(e: BaseException) -> str:
    return "".join(traceback.format_exception(e)[-6:])[-8000:]


def pool_for(d) -> RewardPool:
    """The reward workers of a run (``d``: its DataConfig); none starts before the first call that needs one."""
    n = d.reward_workers or min(4, len(os.sched_getaffinity(0)))
    return RewardPool(n, d.reward_timeout_s, memory_bytes=int(d.reward_memory_gb * 2**30))


def calls_to_start(cfg) -> list[str]:
    """What a run's reward workers will run ('module:function'), so that they can start and load it with the
    rollout rather than inside a step: the user's reward of the sample source, or the sympy check of math."""
    d = cfg.data
    spec = d.reward if (d.train or d.eval) else cfg.task.reward
    if spec in ("auto", "math", "math_format"):
        return [SYMBOLIC]
    return [spec] if spec and spec not in BUILTIN else []


def scorer_for(cfg, pool: RewardPool) -> RewardScorer:
    """A run's scorer: its reward_on_error, its failures under <run_dir>/reward_errors."""
    return RewardScorer(pool, on_error=cfg.data.error_reward, failures_dir=Path(cfg.run_dir) / "reward_errors")
