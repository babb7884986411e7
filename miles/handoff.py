"""HandoffPlan: the ordered offload/onload steps between rollout and training, decided once from the config.

The driver executes a plan for real; the planner replays the same steps against estimated sizes. Two
orders (DESIGN §2): peak device ``cpu`` (each side offloads before the other onloads: the host briefly holds
both sides' copies) and ``gpu`` (the other side onloads first: the overlap sits in GPU memory, and the
engine's host mirror and the trainer's host backup never coexist).
"""

from __future__ import annotations

from dataclasses import dataclass

from miles.config import HandoffConfig

TRAIN_ALL = ("params", "grads", "optimizer", "ref")


@dataclass(frozen=True, slots=True)
class Step:
    owner: str  # "engine" | "trainer" | "sync"
    verb: str  # engine: offload/onload; trainer: offload/onload/clear_memory; sync: update_weights
    tags: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.owner}.{self.verb}({', '.join(self.tags)})"


@dataclass(frozen=True, slots=True)
class HandoffPlan:
    mode: str  # "cpu" | "gpu"
    init: tuple[Step, ...]
    rollout_to_train: tuple[Step, ...]
    train_to_rollout: tuple[Step, ...]
    reason: str = ""  # why this mode (for 'auto')

    @classmethod
    def from_config(cls, cfg: HandoffConfig, mode: str | None = None, reason: str = "") -> "HandoffPlan":
        mode = mode or cfg.colocate_memory_peak_device
        if mode == "auto":
            raise ValueError("resolve colocate_memory_peak_device='auto' with miles.planner before building a plan")
        engine_tags = _engine_tags(cfg)
        weights = tuple(t for t in engine_tags if t == "weights")
        kv = tuple(t for t in engine_tags if t != "weights")
        train = TRAIN_ALL if cfg.offload_train != "none" else ()
        sync = Step("sync", "update_weights")
        S = Step
        if mode == "cpu":
            init = (sync, S("trainer", "offload", train))
            r2t = (S("engine", "offload", engine_tags), S("trainer", "onload", train))
            t2r = (S("trainer", "clear_memory"), S("trainer", "offload", train), S("engine", "onload", weights), sync,
                   S("engine", "onload", kv))
        else:
            init = (S("engine", "offload", kv), sync, S("trainer", "offload", train), S("engine", "onload", kv))
            r2t = (S("engine", "offload", kv), S("trainer", "onload", train), S("engine", "offload", weights))
            t2r = (S("trainer", "clear_memory"), S("engine", "onload", weights), S("trainer", "offload", train), sync,
                   S("engine", "onload", kv))
        strip = lambda steps: tuple(s for s in steps if s.owner in ("sync",) or s.verb == "clear_memory" or s.tags)
        return cls(mode, strip(init), strip(r2t), strip(t2r), reason)

    def describe(self) -> str:
        lines = [f"colocate_memory_peak_device = {self.mode}" + (f" ({self.reason})" if self.reason else "")]
        for name in ("init", "rollout_to_train", "train_to_rollout"):
            lines.append(f"  {name}: " + " -> ".join(map(str, getattr(self, name))))
        return "\n".join(lines)


def _engine_tags(cfg: HandoffConfig) -> tuple[str, ...]:
    """Engine tags released while training: cuda_graph always; kv_cache / weights per offload_rollout_level."""
    if not cfg.offload_rollout:
        return ()
    tags = ["cuda_graph"]
    if "kv_cache" in cfg.offload_rollout_level:
        tags.append("kv_cache")
    if "weight" in cfg.offload_rollout_level:
        tags.append("weights")
    return tuple(tags)
