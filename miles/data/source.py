"""DatasetSource: a sample source (beside tasks and agents) that draws prompts from ``data.train`` in a seeded
shuffled order, completes them with the engines and scores them with the row's verifier.

    source = DatasetSource(cfg, tokenizer, engines, pool)   # pool: the run's RewardPool (miles.reward)
    samples, metrics = source.samples(step)       # the next num_prompts_per_step rows, n_samples_per_prompt each
    metrics = source.score(samples, step)         # rewards through the reward contract, under the time limit
    state = source.state_dict(next_step)          # the epoch position for a checkpoint; load_state_dict on resume
"""

from __future__ import annotations

import logging
import random
import time

from miles.data.config import DataConfig
from miles.data.dataset import BadRowError, PromptDataset, PromptRow, load_split
from miles.policy.dapo import step_of_round
from miles.protocols.engine import GenerateRequest, SamplingParams, token_versions
from miles.protocols.reward import Reward, RewardError
from miles.reward.catalog import BUILTIN, reward_for
from miles.reward.pool import RewardPool
from miles.reward.scorer import Job, scorer_for
from miles.rollout.sources import set_rewards
from miles.samples import Sample

log = logging.getLogger("miles")


class PromptRenderer:
    """Rows -> prompt token ids (chat template or raw text), with the length check that makes a row bad."""

    def __init__(self, cfg: DataConfig, tokenizer, max_prompt_tokens: int):
        self.cfg, self.tokenizer, self.max_prompt_tokens = cfg, tokenizer, max_prompt_tokens

    def ids(self, row: PromptRow) -> list[int]:
        if self.cfg.chat_template:
            ids = self.tokenizer.apply_chat_template(row.chat(self.cfg.system_prompt))
        else:
            ids = self.tokenizer.encode(row.prompt, add_bos=True)
        if len(ids) > self.max_prompt_tokens:
            raise BadRowError(
                f"{row.source} row {row.row} field {self.cfg.messages_key or self.cfg.prompt_key!r}: the prompt is "
                f"{len(ids)} tokens, over the {self.max_prompt_tokens} the engine allows (rollout.max_seq_len - "
                "max_new_tokens, or data.max_prompt_tokens)"
            )
        return list(ids)


def max_prompt_tokens(cfg, max_new_tokens: int) -> int:
    if cfg.data.max_prompt_tokens:
        return cfg.data.max_prompt_tokens
    return (cfg.rollout.max_seq_len or cfg.model.max_position_embeddings) - max_new_tokens


class Verifiers:
    """The reward of each row: ``data.reward``, or with 'auto' the row's metadata 'verifier' (a built-in one)."""

    def __init__(self, spec: str):
        self.fixed = None if spec == "auto" else reward_for(spec)

    def reward_of(self, row_meta: dict) -> Reward:
        if self.fixed is not None:
            return self.fixed
        name = row_meta.get("verifier", "math")
        if name not in BUILTIN:  # the pre-Ray check refuses such rows (miles.reward.catalog.check_rewards)
            raise RewardError(f"row metadata names verifier {name!r}; known: {sorted(BUILTIN)}")
        return BUILTIN[name]

    def jobs(self, samples: list[Sample]) -> list[Job]:
        return [Job(self.reward_of(s.metadata), s.prompt, s.response_text, s.target) for s in samples]


def complete(engines, samples: list[Sample], sampling: SamplingParams, seed: int, tokenizer, tag: str) -> None:
    """Generate every sample's response with the engines in equal slices; fills tokens, log-probs and text."""
    reqs = [GenerateRequest(rid=f"{tag}-{s.index}", input_ids=s.prompt_ids, sampling=sampling) for s in samples]
    outs, per_engine = [], -(-len(reqs) // len(engines))
    for i, engine in enumerate(engines):
        outs += engine.generate(reqs[i * per_engine : (i + 1) * per_engine], seed=seed)
    stop = set(tokenizer.stop_token_ids)
    for s, o in zip(samples, outs, strict=True):
        s.response_ids, s.rollout_log_probs = o.output_ids, o.output_log_probs
        s.finish_reason, s.weight_version, s.token_versions = o.finish_reason, o.weight_version, token_versions(o)
        s.response_text = tokenizer.decode([t for t in o.output_ids if t not in stop])


class DatasetSource:
    def __init__(self, cfg, tokenizer, engines: list, pool: RewardPool):
        self.cfg, self.tokenizer, self.engines = cfg, tokenizer, engines
        loaded = load_split(cfg.data.train, cfg.data, "train")
        rows = [r for rows, _ in loaded.values() for r in rows]
        self.skipped = sum(len(s) for _, s in loaded.values())
        self.dataset = PromptDataset(rows, seed=cfg.seed)
        self.render = PromptRenderer(cfg.data, tokenizer, max_prompt_tokens(cfg, cfg.rollout.max_new_tokens))
        self.verifiers = Verifiers(cfg.data.reward)
        self.scorer = scorer_for(cfg, pool)
        self._step, self._state_before = None, self.dataset.state_dict()
        self._after: dict[int, dict] = {}  # RL step -> the position once its prompts were drawn (all its rounds)

    def prompts(self, step: int, *, with_targets: bool = False) -> list[Sample]:
        """The step's rows as Samples, each repeated n_samples_per_prompt times (with targets: SFT, all distinct,
        drawn without moving the epoch position)."""
        r = self.cfg.rollout
        if with_targets:
            rng = random.Random(f"sft/{self.cfg.seed}/{step}")
            rows = [(row, self.render.ids(row)) for row in rng.sample(self.dataset.rows, k=r.num_prompts_per_step)]
            repeat = 1
        else:
            if step != self._step:
                self._step, self._state_before = step, self.dataset.state_dict()
            rows, repeat = self._draw(r.num_prompts_per_step), r.n_samples_per_prompt
            self._after[step_of_round(step)] = self.dataset.state_dict()
            for old in [t for t in self._after if t < step_of_round(step) - 64]:
                del self._after[old]  # an async run reads a few steps back; 64 is plenty
        samples = []
        for g, (row, ids) in enumerate(rows):
            for _ in range(repeat):
                s = Sample(index=len(samples), group=g, prompt=row.prompt, target=row.answer, prompt_ids=list(ids))
                s.metadata = {**row.metadata, "dataset": row.dataset, "row": row.row}
                if with_targets:
                    s.response_ids = self.tokenizer.encode(row.answer) + [self.tokenizer.stop_token_ids[0]]
                samples.append(s)
        return samples

    def _draw(self, n: int) -> list[tuple[PromptRow, list[int]]]:
        out = []
        while len(out) < n:
            row = self.dataset.take(1)[0]
            try:
                out.append((row, self.render.ids(row)))
            except BadRowError as e:
                if not self.cfg.data.skip_bad_rows:
                    raise BadRowError(f"{e}; shorten it or set data.skip_bad_rows=true") from None
                self.skipped += 1
                if self.skipped > 10 * len(self.dataset.rows):
                    raise ValueError(f"every row of data.train is too long for the engine ({e})") from None
        return out

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
        complete(self.engines, samples, sp, self.cfg.seed * 100_003 + step, self.tokenizer, str(step))
        return samples, {
            "time/generate": time.perf_counter() - t0,
            "data/epoch": self.dataset.epoch + self.dataset.index / len(self.dataset.rows),
            "data/skipped_rows": self.skipped,
        }

    def score(self, samples: list[Sample], step: int) -> dict[str, float]:
        return set_rewards(samples, self.scorer.score(self.verifiers.jobs(samples), label=f"step_{step:06d}"))

    def state_dict(self, next_step: int) -> dict:
        """The position at the start of RL step ``next_step``: once step ``next_step - 1`` was drawn. A step drawn but
        not finished, or drawn ahead by an async run (miles.async_config), is drawn again."""
        state = self._after.get(next_step - 1)
        if state is None:
            state = self._state_before if next_step == self._step else self.dataset.state_dict()
        return {**state, "next_step": next_step}

    def load_state_dict(self, state: dict) -> None:
        self.dataset.load_state_dict(state)
        self._step, self._state_before, self._after = None, self.dataset.state_dict(), {}

    def close(self) -> None:
        pass
