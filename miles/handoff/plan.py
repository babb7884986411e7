"""HandoffPlan: the ordered offload/onload steps between rollout and training, decided once from the config.

The driver executes a plan for real (miles.handoff.executor: miles.cluster.Cluster over Ray, miles.colocated.Colocated
in one process); the planner (miles.handoff.planner) replays the same steps against estimated sizes. Two orders:

peak device ``cpu`` (each side offloads before the other onloads; the host briefly holds both copies)
    init:           engine.offload_kv -> engine.offload_weights -> trainer.build [-> trainer.warmup]
                    -> trainer.offload -> engine.onload_weights -> sync -> engine.onload_kv
    rollout->train: engine.offload_kv -> engine.offload_weights -> trainer.onload
    train->rollout: trainer.offload -> engine.onload_weights -> sync -> engine.onload_kv
peak device ``gpu`` (the other side onloads first: the overlap sits in GPU memory and the engine's host
mirror and the trainer's host backup never coexist)
    init:           engine.offload_kv -> trainer.build [-> engine.offload_weights -> trainer.warmup
                    -> trainer.clear_memory -> engine.onload_weights] -> sync -> trainer.offload -> engine.onload_kv
    rollout->train: engine.offload_kv -> trainer.onload -> engine.offload_weights
    train->rollout: trainer.clear_memory -> engine.onload_weights -> trainer.offload -> sync -> engine.onload_kv

An engine step carries the tags it moves (``engine_level_tags``, decided here once); the executor
(miles.handoff.executor) hands exactly those to ``RolloutManager.offload`` / ``onload``. ``offload_weights`` /
``onload_weights`` stay in the plan with empty tags when ``weight`` is not in ``offload_rollout_level``: they
move nothing (so the executed sequence and the plan are the same list). A step's ``tags`` are
the tags it is expected to move; the planner prices exactly those. ``trainer.build`` marks where the trainer's
memory comes into being: the engines are built first, and in gpu mode they keep their weights resident through
trainer init. ``trainer.warmup`` (only when the run has supervised warm-up steps) sits where the
memory is laid out as for a train step, and the planner prices it as one.

    plan = HandoffPlan.from_config(cfg.handoff)        # 'auto' -> miles.handoff.planner.resolve_plan
    for step in plan.rollout_to_train: ...             # Step("engine", "offload_kv", ("cuda_graph", "kv_cache"))
"""

from __future__ import annotations

from dataclasses import dataclass

from miles.config import GPU_ORDER_NEEDS, HandoffConfig

TRAIN_ALL = ("params", "grads", "optimizer", "ref", "quant_workspace")
ENGINE_VERBS = ("offload_kv", "offload_weights", "onload_weights", "onload_kv")
TRAINER_VERBS = ("build", "warmup", "offload", "onload", "clear_memory")
MODES = ("cpu", "gpu")


@dataclass(frozen=True, slots=True)
class Step:
    owner: str  # "engine" | "trainer" | "sync"
    verb: str  # engine: ENGINE_VERBS; trainer: TRAINER_VERBS; sync: update_weights
    tags: tuple[str, ...] = ()  # the tags this step moves (empty: a guarded no-op, clear_memory or the sync)

    def __str__(self) -> str:
        return f"{self.owner}.{self.verb}({', '.join(self.tags)})"

    @property
    def key(self) -> str:
        return f"{self.owner}.{self.verb}"


@dataclass(frozen=True, slots=True)
class HandoffPlan:
    mode: str  # "cpu" | "gpu"
    init: tuple[Step, ...]
    rollout_to_train: tuple[Step, ...]
    train_to_rollout: tuple[Step, ...]
    reason: str = ""  # why this mode (for 'auto')

    @classmethod
    def from_config(
        cls, cfg: HandoffConfig, mode: str | None = None, reason: str = "", *, warmup: bool = False
    ) -> "HandoffPlan":
        """``warmup``: init holds a ``trainer.warmup`` step (supervised warm-up, RunConfig.trainer.warmup_sft_steps)
        where the memory is laid out as for a train step, so the planner prices it as one."""
        mode = mode or cfg.colocate_memory_peak_device
        if mode == "auto":
            raise ValueError(
                "colocate_memory_peak_device = 'auto' is resolved by miles.handoff.planner.choose_mode(run_cfg); "
                "call miles.handoff.planner.resolve_plan(run_cfg) or pass mode='cpu' / 'gpu'"
            )
        if mode not in MODES:
            raise ValueError(f"colocate_memory_peak_device = {mode!r} is not one of {list(MODES) + ['auto']}")
        if mode == "gpu" and not cfg.can_peak_on_device:
            raise ValueError(f"colocate_memory_peak_device = 'gpu' {GPU_ORDER_NEEDS}")
        e = _engine_steps(cfg)
        train = TRAIN_ALL if cfg.offload_train != "none" else ()
        t_off, t_on = Step("trainer", "offload", train), Step("trainer", "onload", train)
        sync, clear = Step("sync", "update_weights"), Step("trainer", "clear_memory")
        build = Step("trainer", "build")  # the trainer is created here: after the engine released its init tags
        warm = Step("trainer", "warmup") if warmup else None
        if mode == "cpu":
            init = (
                e["offload_kv"],
                e["offload_weights"],
                build,
                warm,
                t_off,
                e["onload_weights"],
                sync,
                e["onload_kv"],
            )
            r2t = (e["offload_kv"], e["offload_weights"], t_on)
            t2r = (t_off, e["onload_weights"], sync, e["onload_kv"])
        else:
            init = (e["offload_kv"], build, sync, t_off, e["onload_kv"])
            if warm:  # as a train step: the engine's weights leave first, the trainer clears before they return
                init = (e["offload_kv"], build, e["offload_weights"], warm, clear, e["onload_weights"], *init[2:])
            r2t = (e["offload_kv"], t_on, e["offload_weights"])
            t2r = (clear, e["onload_weights"], t_off, sync, e["onload_kv"])
        keep = lambda steps: tuple(
            s
            for s in steps
            if s is not None and (s.owner != "trainer" or s.tags or s.verb in ("clear_memory", "build", "warmup"))
        )
        return cls(mode, keep(init), keep(r2t), keep(t2r), reason)

    def phases(self) -> dict[str, tuple[Step, ...]]:
        return {"init": self.init, "rollout_to_train": self.rollout_to_train, "train_to_rollout": self.train_to_rollout}

    def describe(self) -> str:
        lines = [f"colocate_memory_peak_device = {self.mode}" + (f" ({self.reason})" if self.reason else "")]
        for name, steps in self.phases().items():
            lines.append(f"  {name}: " + " -> ".join(map(str, steps)))
        return "\n".join(lines)


def engine_level_tags(cfg: HandoffConfig, verb: str) -> tuple[str, ...]:
    """The tags an engine verb moves at ``offload_rollout_level`` (the only place this rule is written)."""
    if verb in ("offload_kv", "onload_kv"):
        return ("cuda_graph",) + (("kv_cache",) if "kv_cache" in cfg.offload_rollout_level else ())
    if verb in ("offload_weights", "onload_weights"):
        return ("weights",) if "weight" in cfg.offload_rollout_level else ()
    raise ValueError(f"engine verb {verb!r} is not one of {ENGINE_VERBS}")


def _engine_steps(cfg: HandoffConfig) -> dict[str, Step | None]:
    """No engine steps at all without offload_rollout; otherwise every verb, guarded ones with empty tags."""
    if not cfg.offload_rollout:
        return dict.fromkeys(ENGINE_VERBS)
    return {v: Step("engine", v, engine_level_tags(cfg, v)) for v in ENGINE_VERBS}
