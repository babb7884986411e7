"""Held-out eval: the policy on ``data.eval`` every ``eval.every`` RL steps and at the end, as ``eval/...`` metrics.

Per dataset and over all problems: greedy pass@1 (one completion at temperature 0), mean@k (mean reward of k
samples at eval.temperature) and the unbiased pass@j estimator (Chen et al. 2021) for j = 1, 2, 4, ... <= k.
A sample counts as passed when its reward is 1 (the verifiers' "right answer"; a format bonus alone is not).

    ev = Evaluator(cfg, tokenizer, engines, train_rows)      # refuses eval rows that are also train rows
    metrics = ev.evaluate(step)   # {"eval/mixed_test/mean@4": ..., "eval/all/pass@4": ..., "time/eval": ...}
"""

from __future__ import annotations

import time
from math import comb

from miles.data.dataset import PromptRow, check_no_overlap, load_split
from miles.data.source import PromptRenderer, Verifiers, complete, max_prompt_tokens
from miles.protocols.engine import SamplingParams
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


def summarize(greedy: list[float] | None, sampled: list[list[float]], k: int) -> dict[str, float]:
    """Figures of one set of problems: ``sampled[i]`` holds problem i's k rewards, ``greedy[i]`` its greedy one."""
    out = {f"mean@{k}": sum(sum(r) for r in sampled) / (k * len(sampled))}
    for j in ks_up_to(k):
        out[f"pass@{j}"] = sum(pass_at_k(k, sum(x == 1.0 for x in r), j) for r in sampled) / len(sampled)
    if greedy is not None:
        out["greedy_pass@1"] = sum(g == 1.0 for g in greedy) / len(greedy)
    out["num_problems"] = len(sampled)
    return out


class Evaluator:
    def __init__(self, cfg, tokenizer, engines, train_rows: list[PromptRow] = ()):
        self.cfg, self.tokenizer, self.engines = cfg, tokenizer, engines
        self.max_new_tokens = cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens
        render = PromptRenderer(cfg.data, tokenizer, max_prompt_tokens(cfg, self.max_new_tokens))
        loaded = {name: rows for name, (rows, _) in load_split(cfg.data.eval, cfg.data, "eval").items()}
        check_no_overlap(list(train_rows), loaded)
        if cfg.eval.max_problems:
            loaded = {name: rows[: cfg.eval.max_problems] for name, rows in loaded.items()}
        self.sets = {name: [(row, render.ids(row)) for row in rows] for name, rows in loaded.items()}
        self.verifiers = Verifiers(cfg.data.reward)

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
            for s in samples[mode]:
                s.reward = self.verifiers.score(s.metadata, s.prompt, s.response_text, s.target)
        out = {}
        for name in [*self.sets, "all"]:
            pick = [s for s in samples["sampled"] if name == "all" or s.metadata["dataset"] == name]
            sampled = [[s.reward for s in pick[i : i + e.k]] for i in range(0, len(pick), e.k)]
            greedy = None
            if e.greedy:
                greedy = [s.reward for s in samples["greedy"] if name == "all" or s.metadata["dataset"] == name]
            out |= {f"eval/{name}/{key}": v for key, v in summarize(greedy, sampled, e.k).items()}
        tokens = sum(len(s.response_ids) for ss in samples.values() for s in ss)
        seconds = time.perf_counter() - t0
        return out | {"eval/tokens": tokens, "time/eval": seconds, "eval/tokens_per_s": tokens / seconds}
