"""Environment episodes as an RL step's samples (a SampleSource beside tasks, datasets and agents).

Each step draws ``rollout.num_prompts_per_step`` task rows from ``data.train`` (the dataset's seeded order, its
position saved with checkpoints), opens ``n_samples_per_prompt`` episodes of the environment per row, and runs them
to their end through the run's engines (miles.envs.runner). A sample is one episode: its exact trajectory tokens, the
engine's log-probs, the loss mask over the sampled tokens only, the sum of its turn rewards, and its turn and
tool-call spans for the dashboard. miles.sources.make_sources builds it for ``env.name`` and hands it to the
RolloutManager, which does not import it.

    source = EnvSource(cfg, tokenizer, engines)
    samples, metrics = source.samples(step)        # metrics: env/* (turns, tool calls, errors, drift) and time/*
    source.prompts(step, with_targets=True)        # demonstrations (the env's expert_reply) for the SFT warm-up
    source.evaluate(step)                          # data.eval rows as episodes: greedy pass@1, mean@k, pass@k
"""

from __future__ import annotations

import logging
import random
import time

from miles.data.dataset import PromptDataset, PromptRow, check_no_overlap, load_split
from miles.data.eval import summarize
from miles.envs.episode import Episode, Limits
from miles.envs.registry import env_class, make_env
from miles.envs.renderer import Renderer
from miles.envs.runner import EpisodeRunner
from miles.protocols.engine import GenerateOutput, SamplingParams
from miles.samples import Sample

log = logging.getLogger("miles")
STATUSES = ("done", "max_turns", "budget", "failed", "aborted")
ERRORS = ("raised", "timeout", "garbage")


class EnvSource:
    def __init__(self, cfg, tokenizer, engines: list):
        e, r = cfg.env, cfg.rollout
        if not cfg.data.train:
            raise ValueError(
                f"env.name = {e.name!r} needs task rows: set data.train to a jsonl/parquet of rows for it "
                "(python -m miles.envs.calculator OUT_DIR writes the calculator's train and test splits)"
            )
        self.cfg, self.tok, self.engines = cfg, tokenizer, engines
        self.cls, self.kwargs = env_class(e.name), e.kwargs("args")
        make_env(self.cls, self.kwargs)  # refuse bad env.args now, not in the first episode
        self.renderer = Renderer(tokenizer, tool_format=e.tool_format, template_args=e.kwargs("template_args"))
        max_seq = r.max_seq_len or cfg.model.max_position_embeddings
        self.limits = Limits(
            max_turns=e.max_turns,
            max_tokens_per_turn=e.max_tokens_per_turn or r.max_new_tokens,
            max_episode_tokens=min(e.max_episode_tokens or max_seq, max_seq),
            step_timeout_s=e.step_timeout_s,
            check_drift=e.check_drift,
        )
        self.rows = [row for rows, _ in load_split(cfg.data.train, cfg.data, "train").values() for row in rows]
        self.dataset = PromptDataset(self.rows, seed=cfg.seed)
        self.runner = EpisodeRunner(engines, step_timeout_s=e.step_timeout_s)
        self.stop_ids = self.renderer.stop_token_ids()

    def sampling(self, temperature: float) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=self.limits.max_tokens_per_turn,
            temperature=temperature,
            top_p=self.cfg.rollout.top_p,
            stop_token_ids=self.stop_ids,
        )

    def episodes(self, rows: list[PromptRow], repeat: int) -> list[Episode]:
        out = []
        for g, row in enumerate(rows):
            for _ in range(repeat):
                env = make_env(self.cls, self.kwargs)
                out.append(
                    Episode(env, _row(row), self.renderer, self.limits, index=len(out), group=g, name=self.cls.__name__)
                )
        return out

    # ---- SampleSource ----------------------------------------------------------------------------------------
    def samples(self, step: int) -> tuple[list[Sample], dict[str, float]]:
        r = self.cfg.rollout
        episodes = self.episodes(self.dataset.take(r.num_prompts_per_step), r.n_samples_per_prompt)
        t0 = time.perf_counter()
        times = self.runner.run(
            episodes, self.sampling(r.temperature), seed=self.cfg.seed * 100_003 + step, tag=f"s{step}"
        )
        metrics = episode_metrics(episodes) | times | {"time/env_rollout": time.perf_counter() - t0}
        failed = [ep for ep in episodes if ep.status == "failed"]
        if failed:
            log.warning(
                "RL step %d: %d of %d episodes failed, e.g. %s", step, len(failed), len(episodes), failed[0].error
            )
        return [ep.to_sample() for ep in episodes], metrics

    def score(self, samples: list[Sample], step: int) -> dict[str, float]:
        """Nothing to do: each sample's reward is its episode's return (the environment scored it)."""
        return {}

    def close(self) -> None:
        self.runner.flush()

    def state_dict(self, next_step: int) -> dict:
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.dataset.load_state_dict(state)

    # ---- demonstrations ------------------------------------------------------------------------------------
    def prompts(self, step: int, *, with_targets: bool = False) -> list[Sample]:
        """With targets: episodes played by the environment's ``expert_reply`` (distinct rows, drawn without moving
        the epoch position), whose replies are the trained tokens; for the supervised warm-up."""
        expert = getattr(self.cls, "expert_reply", None)
        if not with_targets or expert is None:
            raise ValueError(
                f"a supervised warm-up (trainer.warmup_sft_steps) plays demonstrations, and {self.cls.__name__} has "
                "no expert_reply(messages, fmt) method; give it one or set trainer.warmup_sft_steps=0"
            )
        r = self.cfg.rollout
        rng = random.Random(f"sft/{self.cfg.seed}/{step}")
        episodes = self.episodes(
            rng.sample(self.rows, k=min(len(self.rows), r.num_prompts_per_step * r.n_samples_per_prompt)), 1
        )
        EpisodeRunner([ExpertEngine(episodes, self.renderer)], step_timeout_s=self.limits.step_timeout_s).run(
            episodes, self.sampling(1.0), seed=step, tag=f"sft{step}"
        )
        return [ep.to_sample() for ep in episodes]

    # ---- held-out eval -------------------------------------------------------------------------------------
    def evaluate(self, step: int) -> dict[str, float]:
        """data.eval rows as episodes: greedy pass@1, mean@k and pass@j by dataset and overall (reward 1 = passed),
        and the episodes' tool calls, turns and drift (miles.data.eval's figures, here over whole episodes)."""
        t0, e = time.perf_counter(), self.cfg.eval
        sets = {name: rows for name, (rows, _) in load_split(self.cfg.data.eval, self.cfg.data, "eval").items()}
        check_no_overlap(self.rows, sets)
        out = {}
        everything = {"sampled": [], "greedy": []}
        for name, rows in sets.items():
            rows = rows[: e.max_problems] if e.max_problems else rows
            runs = {"sampled": (self.episodes(rows, e.k), e.temperature)}
            if e.greedy:
                runs["greedy"] = (self.episodes(rows, 1), 0.0)
            for mode, (eps, temperature) in runs.items():
                self.runner.run(
                    eps, self.sampling(temperature), seed=1_000_003 + self.cfg.seed, tag=f"eval{step}-{name}-{mode}"
                )
                everything[mode] += eps
            out |= _eval_figures(name, runs, e.k)
        out |= _eval_figures("all", {m: (eps, 0.0) for m, eps in everything.items() if eps}, e.k)
        return out | {"time/eval": time.perf_counter() - t0}


class ExpertEngine:
    """An engine that answers each episode's turn with its environment's ``expert_reply`` (for demonstrations)."""

    def __init__(self, episodes: list[Episode], renderer: Renderer):
        self.by_index = {ep.index: ep for ep in episodes}
        self.renderer = renderer
        self.end = renderer.tok.encode(renderer.rules.turn_end)

    def generate(self, requests: list, *, seed: int | None = None) -> list[GenerateOutput]:
        outs = []
        for req in requests:
            ep = self.by_index[int(req.rid.split("-")[-2])]
            ids = self.renderer.tok.encode(ep.env.expert_reply(ep.messages, self.renderer.format)) + self.end
            outs.append(
                GenerateOutput(
                    rid=req.rid,
                    output_ids=ids,
                    output_log_probs=[0.0] * len(ids),
                    finish_reason="stop",
                    weight_version=0,
                )
            )
        return outs

    def abort(self, rids="all") -> None:
        pass


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    n = max(1, len(episodes))
    checked = [ep.drift for ep in episodes if ep.drift is not None]
    out = {
        "env/return": sum(ep.reward for ep in episodes) / n,
        "env/pass_rate": sum(bool(ep.info.get("passed")) for ep in episodes) / n,
        "env/turns": sum(ep.turn for ep in episodes) / n,
        "env/tool_calls": sum(ep.num_tool_calls for ep in episodes) / n,
        "env/malformed_tool_calls": sum(ep.num_malformed for ep in episodes) / n,
        "env/truncated_turns": sum(ep.num_truncated for ep in episodes) / n,
        "env/episode_tokens": sum(len(ep.traj) if ep.traj else 0 for ep in episodes) / n,
        "env/model_tokens": sum(sum(ep.traj.mask) if ep.traj else 0 for ep in episodes) / n,
        "env/drift_checked": len(checked),
        "env/drift_episodes": sum(d.drifted for d in checked) / max(1, len(checked)),
        "env/drift_template_episodes": sum(d.kind == "template" for d in checked) / max(1, len(checked)),
        "env/drift_tokens": sum(d.num_tokens for d in checked) / max(1, len(checked)),
    }
    out |= {f"env/episodes_{s}": sum(ep.status == s for ep in episodes) for s in STATUSES}
    out |= {f"env/errors_{k}": sum(ep.error_kind == k for ep in episodes) for k in ERRORS}
    return out


def _eval_figures(name: str, runs: dict, k: int) -> dict[str, float]:
    sampled_eps = runs["sampled"][0]
    sampled = [[ep.reward for ep in sampled_eps[i : i + k]] for i in range(0, len(sampled_eps), k)]
    greedy = [ep.reward for ep in runs["greedy"][0]] if "greedy" in runs else None
    figures = summarize(greedy, sampled, k)
    n = max(1, len(sampled_eps))
    figures |= {
        "tool_calls": sum(ep.num_tool_calls for ep in sampled_eps) / n,
        "turns": sum(ep.turn for ep in sampled_eps) / n,
        "failed": sum(ep.status == "failed" for ep in sampled_eps) / n,
    }
    return {f"eval/{name}/{key}": v for key, v in figures.items()}


def _row(row: PromptRow) -> dict:
    return {
        "prompt": row.prompt,
        "answer": row.answer,
        "messages": row.messages,
        "metadata": row.metadata,
        "dataset": row.dataset,
        "row": row.row,
    }
