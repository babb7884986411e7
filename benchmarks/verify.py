"""``miles bench verify``: responses scored per second by the math verifiers, side by side on the same responses
in one run:

- ``old``: one verifier call per response in one process, no time limit (how rewards were scored before
  miles.reward; the same functions, with their linear-time patterns, or the adversarial strings never end);
- ``scorer_here``: the RewardScorer without a pool (repeated sympy checks folded and remembered, no time limit);
- ``pool``: the RewardScorer with its pool: the linear fast path here, sympy in reward workers under the limit.

``old`` and ``scorer_here`` each run in a process of their own (sympy's caches are per process), and the three
sides take turns batch by batch, so that the shared machine's load drifts alike for all. CPU seconds count the
pool's workers too.

The responses are a seeded mix of what a math policy writes: plain numbers in the usual markings (boxed, ####,
"the answer is", last number, with commas or units), LaTeX that needs sympy (fractions, roots, polynomials), wrong
answers of both kinds, some countdown expressions, and adversarial strings (10k-character unit tails, runs of
spaces after "the answer is", unterminated boxes, exponent towers). Both paths must give the same rewards. They
are scored in step-sized batches (``--batch``, a GRPO step's samples). ``--bombs`` adds answers that sympy cannot
finish (towers the cheap guard does not see) to a third, pool-only run: the reference path would never return.

    miles bench verify --json                         # 100k responses
    miles bench verify --n 20000 --workers 2 --json
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import time

from miles.data.verify import REWARDS
from miles.reward.catalog import reward_for
from miles.reward.pool import RewardPool
from miles.reward.scorer import Job, RewardScorer

MIX = {"plain": 0.62, "latex": 0.12, "wrong": 0.14, "countdown": 0.04, "adversarial": 0.08}


def _plain(rng: random.Random) -> tuple[str, str, str]:
    g = rng.randint(-999, 99_999)
    shown = f"{g:,}" if rng.random() < 0.2 else str(g)
    form = rng.choice(
        ["#### {}", "The answer is {}.", "so the total is {}", "\\boxed{{{}}}", "The answer is {} apples."]
    )
    return (
        "math",
        f"Let me think step by step. {rng.randint(1, 99)} + {rng.randint(1, 99)} ... " + form.format(shown),
        str(g),
    )


def _latex(rng: random.Random) -> tuple[str, str, str]:
    p, q = rng.randint(1, 60), rng.randint(2, 60)
    return rng.choice([
        ("math", f"\\boxed{{\\frac{{{p}}}{{{q}}}}}", f"{p}/{q}"),
        ("math", f"We get \\boxed{{\\dfrac{{{p}}}{{{q}}}}}", str(round(p / q, 6)) if q in (2, 4, 5, 8, 10) else f"{p}/{q}"),
        ("math", f"\\boxed{{\\sqrt{{{p}}}}}", f"{p}^{{1/2}}"),
        ("math", f"\\boxed{{x^2 + {p}x + {q}}}", f"{q} + {p}x + x^2"),
        ("math_format", f"The answer is \\frac{{{2 * p}}}{{{2 * q}}}.", f"\\frac{{{p}}}{{{q}}}"),
    ])  # fmt: skip


def _wrong(rng: random.Random) -> tuple[str, str, str]:
    g = rng.randint(0, 9_999)
    p, q = rng.randint(1, 60), rng.randint(2, 60)
    return rng.choice([
        ("math", f"#### {g + rng.randint(1, 9)}", str(g)),
        ("math_format", f"I think it is {g - 1}", str(g)),
        ("math", f"\\boxed{{\\frac{{{p}}}{{{q + 61}}}}}", f"{p}/{q}"),
        ("math", "\\boxed{x + y}", f"{g}"),
    ])  # fmt: skip


def _countdown(rng: random.Random) -> tuple[str, str, str]:
    a, b, c = rng.randint(1, 12), rng.randint(1, 12), rng.randint(1, 12)
    return "countdown", f"\\boxed{{({a} + {b}) * {c}}}", f"{(a + b) * c} from {a} {b} {c}"


def _adversarial(rng: random.Random) -> tuple[str, str, str]:
    n = rng.randint(20, 10_000)
    return rng.choice([
        ("math", "#### 1 " + "a" * n + "!", "1"),  # the unit-tail pattern that hung: > 200 characters, refused
        ("math", "the answer is x" + " " * n + "y", "7"),
        ("math", "\\boxed{" * (n // 10), "3"),
        ("math", "1" * n, "1"),
        ("math", "\\boxed{9^{9^{9}}}", "5"),  # the guard refuses it before sympy
        ("math", "\\boxed{((10!)!)!}", "5"),
        ("math_format", "The answer is 3 km. " * (n // 20), "3"),
    ])  # fmt: skip


KINDS = {"plain": _plain, "latex": _latex, "wrong": _wrong, "countdown": _countdown, "adversarial": _adversarial}


def corpus(n: int, seed: int = 0) -> list[Job]:
    rng = random.Random(seed)
    names, weights = list(MIX), list(MIX.values())
    rewards = {name: reward_for(name) for name in ("math", "math_format", "countdown")}
    jobs = []
    for _ in range(n):
        verifier, response, target = KINDS[rng.choices(names, weights)[0]](rng)
        jobs.append(Job(rewards[verifier], "prompt", response, target))
    return jobs


def cpu_seconds(pool: RewardPool | None) -> float:
    """CPU seconds of this process, of its children that ended (the workers the pool killed and reaped) and of
    the pool's live workers (the machine is shared: wall time is also its load)."""
    import resource

    import psutil

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = time.process_time() + children.ru_utime + children.ru_stime
    for pid in pool.pids() if pool else ():
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


class Side:
    """One way of scoring, timed batch by batch: wall seconds, CPU seconds (with the pool's workers), counts."""

    def __init__(self, name: str):
        self.name = name
        self.values: list[float] = []
        self.seconds = self.cpu = 0.0
        self.counts = {"timeouts": 0, "errors": 0, "sympy_calls": 0}

    def add(self, values, seconds, cpu, counts) -> None:
        self.values += values
        self.seconds, self.cpu = self.seconds + seconds, self.cpu + cpu
        self.counts = {k: self.counts[k] + counts[k] for k in self.counts}

    def result(self, n: int) -> dict:
        return {"seconds": self.seconds, "cpu_seconds": self.cpu, "responses_per_s": n / self.seconds, **self.counts}


def score_batch(score, jobs: list[Job], pool: RewardPool | None = None):
    """(values, wall seconds, CPU seconds, counts) of one batch."""
    t0, c0 = time.perf_counter(), cpu_seconds(pool)
    values, report = score(jobs)
    seconds, cpu = time.perf_counter() - t0, cpu_seconds(pool) - c0
    counts = {"timeouts": 0, "errors": 0, "sympy_calls": 0}
    if report is not None:
        counts = {"timeouts": report.timeouts, "errors": report.errors, "sympy_calls": report.num_pool_calls}
    return values, seconds, cpu, counts


def old_way(jobs: list[Job]):
    """One verifier call per response, in this process (the reward functions as before miles.reward)."""
    return [REWARDS[j.reward.name](j.prompt, j.response, j.target) for j in jobs], None


def scorer_way(scorer: RewardScorer):
    def score(jobs: list[Job]):
        report = scorer.score(jobs)
        return report.values, report

    return score


def side_process(conn, name: str, n: int, warm: list[Job]) -> None:
    """An in-process side in a process of its own, so that its sympy and math-verify caches are its own (two
    sides sharing one process warm each other's caches)."""
    jobs = corpus(n)
    score = old_way if name == "old" else scorer_way(RewardScorer(None))
    score(warm)
    conn.send("ready")
    while (span := conn.recv()) is not None:
        conn.send(score_batch(score, jobs[span[0] : span[1]]))


def run(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="miles bench verify")
    ap.add_argument("--json", action="store_true", help="accepted for the CLI; the result is always JSON")
    ap.add_argument("--n", type=int, default=100_000, help="responses to score")
    ap.add_argument("--batch", type=int, default=1024, help="responses per scoring call (a step's samples)")
    ap.add_argument("--workers", type=int, default=0, help="reward workers; 0 = min(4, CPU cores)")
    ap.add_argument("--timeout", type=float, default=5.0, help="data.reward_timeout_s")
    ap.add_argument("--bombs", type=int, default=4, help="unfinishable sympy answers for the pool-only run")
    args = ap.parse_args(argv)
    import os

    workers = args.workers or min(4, len(os.sched_getaffinity(0)))
    jobs = corpus(args.n)
    out = {"n": args.n, "batch": args.batch, "workers": workers, "timeout_s": args.timeout, "mix": MIX}
    out["load_before"] = os.getloadavg()
    with RewardPool(workers, args.timeout) as pool:
        warm = [
            Job(reward_for("math"), "p", f"\\boxed{{\\frac{{1}}{{{q}}}}}", "0.5") for q in range(2, 2 + 4 * workers)
        ]
        t0 = time.perf_counter()
        RewardScorer(pool).score(warm)  # every worker started, sympy imported and warm
        out["pool_start_s"] = time.perf_counter() - t0
        ctx = multiprocessing.get_context("spawn")
        conns, procs = {}, []
        for name in ("old", "scorer_here"):
            conns[name], theirs = ctx.Pipe()
            procs.append(ctx.Process(target=side_process, args=(theirs, name, args.n, warm), daemon=True))
            procs[-1].start()
        for c in conns.values():
            assert c.recv() == "ready"
        sides = [Side("old"), Side("scorer_here"), Side("pool")]
        pool_score = scorer_way(RewardScorer(pool))
        for k, i in enumerate(range(0, len(jobs), args.batch)):  # the three sides by turns, batch by batch:
            for side in sides[k % 3 :] + sides[: k % 3]:  # the machine's load drifts alike for each
                span = (i, min(i + args.batch, len(jobs)))
                if side.name == "pool":
                    side.add(*score_batch(pool_score, jobs[span[0] : span[1]], pool))
                else:
                    conns[side.name].send(span)
                    side.add(*conns[side.name].recv())
        for c, proc in zip(conns.values(), procs):
            c.send(None)
            proc.join()
        out |= {side.name: side.result(len(jobs)) for side in sides}
        out["same_rewards"] = sides[0].values == sides[1].values == sides[2].values
        out["speedup_pool_vs_old"] = out["pool"]["responses_per_s"] / out["old"]["responses_per_s"]
        if args.bombs:
            bombs = [Job(reward_for("math"), "p", "\\boxed{9^{(9^{9})}}", "5")] * args.bombs  # parentheses: unseen
            with_bombs = Side("pool_with_bombs")
            with_bombs.add(*score_batch(scorer_way(RewardScorer(pool)), corpus(args.batch, seed=2) + bombs, pool))
            out["pool_with_bombs"] = with_bombs.result(args.batch + args.bombs) | {"bombs": args.bombs}
    out["load_after"] = os.getloadavg()
    return out
