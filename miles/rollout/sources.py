"""Sample sources: where an RL step's samples come from. The RolloutManager asks its source for a step's samples
and runs the same tail on all of them (miles.rollout.tail); a source only produces and scores samples.

- ``TaskSource``: a synthetic task's prompts, completed by the engines, scored by the task's reward function.
- ``miles.agents.source.AgentSource``: agent episodes served by the same engines through session servers.

    source = TaskSource(cfg, tokenizer, engines, pool)   # pool: the run's RewardPool (miles.reward)
    samples, metrics = source.samples(step)   # completed samples; metrics has at least "time/generate"
    metrics = source.score(samples, step)     # sets every sample's reward; {"reward/timeouts": 0, ...}
    source.close()
"""

from __future__ import annotations

import time
from typing import Protocol

from miles.config import RunConfig
from miles.protocols.engine import GenerateRequest, SamplingParams, token_versions
from miles.reward.pool import RewardPool
from miles.reward.scorer import Job, ScoreReport, scorer_for
from miles.rollout.tasks import Task
from miles.samples import Sample


class SampleSource(Protocol):
    def samples(self, step: int) -> tuple[list[Sample], dict[str, float]]:
        """The step's completed samples (tokens, engine log-probs, weight version) and the source's own metrics."""
        ...

    def score(self, samples: list[Sample], step: int) -> dict[str, float]:
        """Set each sample's reward; the scoring's metrics (reward/timeouts, reward/errors, time/reward)."""
        ...

    def close(self) -> None:
        """Stop what the source started (servers, processes)."""
        ...


class TaskSource:
    """A task's prompts, each repeated ``n_samples_per_prompt`` times, completed by the engines in equal slices."""

    def __init__(self, cfg: RunConfig, tokenizer, engines: list, pool: RewardPool):
        self.cfg, self.tokenizer, self.engines = cfg, tokenizer, engines
        self.task = Task(cfg.task, cfg.seed)
        self.scorer = scorer_for(cfg, pool)

    def prompts(self, step: int, *, with_targets: bool = False) -> list[Sample]:
        """The step's prompts as Samples; with targets, all distinct and answered by the reference (for SFT)."""
        r = self.cfg.rollout
        num_prompts, repeat = r.num_prompts_per_step, r.n_samples_per_prompt
        if with_targets:
            num_prompts, repeat = num_prompts * repeat, 1
        samples = []
        for g, prob in enumerate(self.task.problems(step, num_prompts)):
            ids = (
                self.tokenizer.apply_chat_template([{"role": "user", "content": prob.prompt}])
                if prob.chat
                else self.tokenizer.encode(prob.prompt, add_bos=True)
            )
            for _ in range(repeat):
                s = Sample(index=len(samples), group=g, prompt=prob.prompt, target=prob.target, prompt_ids=list(ids))
                if with_targets:
                    s.response_ids = self.tokenizer.encode(prob.target) + [self.tokenizer.stop_token_ids[0]]
                samples.append(s)
        return samples

    def samples(self, step: int) -> tuple[list[Sample], dict[str, float]]:
        t0 = time.perf_counter()
        r = self.cfg.rollout
        samples = self.prompts(step)
        sp = SamplingParams(
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature,
            top_p=r.top_p,
            stop_token_ids=self.tokenizer.stop_token_ids,
        )
        reqs = [GenerateRequest(rid=f"{step}-{s.index}", input_ids=s.prompt_ids, sampling=sp) for s in samples]
        outs = []
        per_engine = -(-len(reqs) // len(self.engines))
        for i, engine in enumerate(self.engines):
            outs += engine.generate(reqs[i * per_engine : (i + 1) * per_engine], seed=self.cfg.seed * 100_003 + step)
        t_gen = time.perf_counter() - t0
        stop = set(self.tokenizer.stop_token_ids)
        for s, o in zip(samples, outs, strict=True):
            s.response_ids, s.rollout_log_probs = o.output_ids, o.output_log_probs
            s.finish_reason, s.weight_version, s.token_versions = o.finish_reason, o.weight_version, token_versions(o)
            s.response_text = self.tokenizer.decode([t for t in o.output_ids if t not in stop])
        # rows an in-flight update sent back to be prefilled again (async.kv_on_update = recompute)
        return samples, {"time/generate": t_gen, "async/retractions": sum(o.retractions for o in outs)}

    def score(self, samples: list[Sample], step: int) -> dict[str, float]:
        jobs = [Job(self.task.reward, s.prompt, s.response_text, s.target) for s in samples]
        return set_rewards(samples, self.scorer.score(jobs, label=f"step_{step:06d}"))

    def close(self) -> None:
        pass


def set_rewards(samples: list[Sample], report: ScoreReport) -> dict[str, float]:
    """The report's rewards on the samples (a failed one marked in its metadata), and its step metrics."""
    for s, value, failed in zip(samples, report.values, report.failed):
        s.reward = value
        if failed:
            s.metadata["reward_failed"] = failed
    return report.metrics() | {"time/reward": report.seconds}
