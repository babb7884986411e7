"""Held-out eval: the policy on ``data.eval`` every ``eval.every`` RL steps and at the end, as ``eval/...`` metrics.

Per dataset and over all problems: greedy pass@1 (one completion at temperature 0), mean@k (mean reward of k
samples at eval.temperature) and the unbiased pass@j estimator (Chen et al. 2021) for j = 1, 2, 4, ... <= k.
A sample counts as passed when its answer is right: its reward reaches its verifier's ``pass_at`` (1, or 0.9 for
math_format's right but unmarked answer; a format bonus alone is not a pass), and its scoring did not fail.
Scoring runs like a step's (miles.reward): timeouts and errors count in eval/reward_timeouts, eval/reward_errors.

    ev = Evaluator(cfg, tokenizer, engines, train_rows, pool=pool)   # refuses eval rows that are also train rows
    metrics = ev.evaluate(step)   # {"eval/mixed_test/mean@4": ..., "eval/all/pass@4": ..., "time/eval": ...}
"""

from __future__ import annotations

import time
from math import comb

from miles.data.dataset import PromptRow, check_no_overlap, load_split
from miles.data.source import PromptRenderer, Verifiers, complete, max_prompt_tokens
from miles.protocols.engine import SamplingParams
from miles.reward.pool import RewardPool
from miles.reward.scorer import ScoreReport, scorer_for
from miles.samples import Sample


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of P(at least one of k samples passes) from n samples of which c passed."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def ks_up_to(k: int) -> list[int]:
    out, j = [], 1
    while j < k:
        out.append(j)
        j *= 2
    return out + [k]


def summarize(
    greedy: list[float] | None,
    sampled: list[list[float]],
    k: int,
    *,
    greedy_passed: list[bool] | None = None,
    sampled_passed: list[list[bool]] | None = None,
) -> dict[str, float]:
    """Figures of one set of problems: ``sampled[i]`` holds problem i's k rewards, ``greedy[i]`` its greedy one;
    the ``*_passed`` flags say which samples solved their problem (default: reward 1)."""
    if sampled_passed is None:
        sampled_passed = [[x == 1.0 for x in r] for r in sampled]
    out = {f"mean@{k}": sum(sum(r) for r in sampled) / (k * len(sampled))}
    for j in ks_up_to(k):
        out[f"pass@{j}"] = sum(pass_at_k(k, sum(p), j) for p in sampled_passed) / len(sampled)
    if greedy is not None:
        passed = greedy_passed if greedy_passed is not None else [g == 1.0 for g in greedy]
        out["greedy_pass@1"] = sum(passed) / len(greedy)
    out["num_problems"] = len(sampled)
    return out


class Evaluator:
    def __init__(self, cfg, tokenizer, engines, train_rows: list[PromptRow] = (), *, pool: RewardPool):
        self.cfg, self.tokenizer, self.engines = cfg, tokenizer, engines
        self.max_new_tokens = cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens
        render = PromptRenderer(cfg.data, tokenizer, max_prompt_tokens(cfg, self.max_new_tokens))
        loaded = {name: rows for name, (rows, _) in load_split(cfg.data.eval, cfg.data, "eval").items()}
        check_no_overlap(list(train_rows), loaded)
        if cfg.eval.max_problems:
            loaded = {name: rows[: cfg.eval.max_problems] for name, rows in loaded.items()}
        self.sets = {name: [(row, render.ids(row)) for row in rows] for name, rows in loaded.items()}
        self.verifiers = Verifiers(cfg.data.reward)
        self.scorer = scorer_for(cfg, pool)

    def evaluate(self, step: int) -> dict[str, float]:
        t0, e = time.perf_counter(), self.cfg.eval
        stop = self.tokenizer.stop_token_ids
        modes = {"sampled": (SamplingParams(max_new_tokens=self.max_new_tokens, temperature=e.temperature,
                                             stop_token_ids=stop), e.k)}  # fmt: skip
        if e.greedy:
            modes["greedy"] = (
                SamplingParams(max_new_tokens=self.max_new_tokens, temperature=0.0, stop_token_ids=stop),
                1,
            )
        samples = {m: [] for m in modes}
        for mode, (sp, repeat) in modes.items():
            for name, rows in self.sets.items():
                for g, (row, ids) in enumerate(rows):
                    for _ in range(repeat):
                        s = Sample(index=0, group=g, prompt=row.prompt, target=row.answer, prompt_ids=ids)
                        s.metadata = {**row.metadata, "dataset": name}
                        samples[mode].append(s)
            for i, s in enumerate(samples[mode]):
                s.index = i
            complete(self.engines, samples[mode], sp, 1_000_003 + self.cfg.seed, self.tokenizer, f"eval{step}-{mode}")
        every = [s for ss in samples.values() for s in ss]
        report = self.score(every, step)
        out = {}
        for name in [*self.sets, "all"]:
            pick = [s for s in samples["sampled"] if name == "all" or s.metadata["dataset"] == name]
            groups = [pick[i : i + e.k] for i in range(0, len(pick), e.k)]
            greedy = [s for s in samples.get("greedy", []) if name == "all" or s.metadata["dataset"] == name]
            figures = summarize(
                [s.reward for s in greedy] if e.greedy else None,
                [[s.reward for s in g] for g in groups],
                e.k,
                greedy_passed=[s.metadata["passed"] for s in greedy],
                sampled_passed=[[s.metadata["passed"] for s in g] for g in groups],
            )
            out |= {f"eval/{name}/{key}": v for key, v in figures.items()}
        tokens = sum(len(s.response_ids) for s in every)
        seconds = time.perf_counter() - t0
        return out | report.metrics("eval/reward_") | {
            "eval/tokens": tokens, "time/eval": seconds, "eval/tokens_per_s": tokens / seconds}  # fmt: skip

    def score(self, samples: list[Sample], step: int) -> ScoreReport:
        """Each sample's reward, and whether it solved its problem (``metadata["passed"]``): its reward reaches its
        verifier's pass_at and its scoring did not fail."""
        report = self.scorer.score(self.verifiers.jobs(samples), label=f"eval_step_{step:06d}")
        for s, value, failed in zip(samples, report.values, report.failed):
            s.reward = value
            s.metadata["passed"] = not failed and value >= self.verifiers.reward_of(s.metadata).pass_at
        return report
