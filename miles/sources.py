"""The sample sources of a run, chosen above the rollout: the RolloutManager (miles.rollout.manager) is handed
``make_sources`` and calls it with its tokenizer, engines and reward pool, so the manager itself knows none of
the sources.

- the task's prompts (``miles.rollout.sources.TaskSource``), or agent episodes for ``task.name = "swe"``
  (``miles.agents.source.AgentSource``);
- a prompt dataset instead when ``data.train`` is set (``miles.data.source.DatasetSource``), whose epoch position a
  checkpoint keeps, and the held-out eval of ``data.eval`` (``miles.data.eval.Evaluator``, built on first use);
- multi-turn environment episodes for ``env.name`` (``miles.envs.source.EnvSource``): they take data.train's rows
  themselves, give the warm-up's demonstrations and run their own eval, and score their own episodes.

    manager = RolloutManager(cfg, "cpu", sources=make_sources)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from miles.agents.source import AgentSource
from miles.config import RunConfig
from miles.reward.scorer import calls_to_start
from miles.rollout.sources import SampleSource, TaskSource


@dataclass(slots=True)
class RunSources:
    source: SampleSource  # what each RL step draws: the task, agent episodes, or the dataset
    sft: SampleSource  # the reference answers of the supervised warm-up: the dataset, else the task
    data: object | None  # the DatasetSource (or EnvSource) over data.train (its position is checkpointed), else None
    make_evaluator: Callable[[], object]  # builds what evaluate(step) is asked of (called on the first eval)
    reward_calls: list  # what the reward workers load while the run starts (miles.reward.scorer.calls_to_start)


def make_sources(cfg: RunConfig, tokenizer, engines: list, rewards) -> RunSources:
    """The run's sources over ``engines``, scoring through the reward pool ``rewards`` (miles.reward)."""
    tasks = TaskSource(cfg, tokenizer, engines, rewards)  # also the SFT warm-up's answers
    source = AgentSource(cfg, engines, tokenizer) if cfg.task.name == "swe" else tasks
    data = None
    if cfg.env.name:  # environment episodes: they take data.train's rows themselves
        from miles.envs.source import EnvSource

        data = source = EnvSource(cfg, tokenizer, engines)
        return RunSources(source=source, sft=data, data=data, make_evaluator=lambda: data, reward_calls=[])
    if cfg.data.train:  # a prompt dataset replaces the task
        from miles.data.source import DatasetSource

        data = source = DatasetSource(cfg, tokenizer, engines, rewards)

    def evaluator():
        from miles.data.eval import Evaluator

        return Evaluator(cfg, tokenizer, engines, data.dataset.rows if data else [], pool=rewards)

    sft = data if data is not None else tasks
    return RunSources(source, sft, data, evaluator, reward_calls=calls_to_start(cfg))
