"""Rewards by name: the built-in verifiers (math, math_format, countdown: miles.data.verify) and a user's
'module:function', and the check, before Ray starts, that every reward a run names can be found.

    reward_for("math")                    # Reward(name='math', quick=math_quick, ...)
    reward_for("my_rewards:exact")        # imported here to check it, run in a reward worker
    check_rewards(cfg, rows)              # ValueError naming the field (or the row) and the fix
"""

from __future__ import annotations

import importlib

from miles.data.verify import FORMAT_PASS, countdown_reward, math_format_quick, math_quick
from miles.protocols.reward import Reward

BUILTIN: dict[str, Reward] = {
    "math": Reward("math", quick=math_quick),
    "math_format": Reward("math_format", quick=math_format_quick, pass_at=FORMAT_PASS),
    "countdown": Reward("countdown", quick=countdown_reward),
}


def load_function(spec: str, field: str):
    """The callable named by 'module:function', imported in this process; ValueError naming ``field`` if it is not."""
    module, _, name = spec.partition(":")
    if not (module and name):
        raise ValueError(
            f"{field} = {spec!r} should be 'module:function', e.g. 'my_rewards:exact' (or a built-in verifier: "
            f"{', '.join(BUILTIN)})"
        )
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"{field} = {spec!r} cannot be loaded ({type(e).__name__}: {e}); check the module is importable "
            "(the run's working directory and PYTHONPATH are on the path)"
        ) from e
    if not callable(fn):
        raise ValueError(f"{field} = {spec!r} is not callable")
    return fn


def reward_for(spec: str, field: str = "data.reward", *, check_import: bool = True) -> Reward:
    """A built-in verifier by name, or a user's 'module:function' (checked by importing it here, unless
    ``check_import`` is False: a run that joins a cluster imports it on the cluster's nodes only)."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    if check_import:
        load_function(spec, field)
    elif not all(spec.partition(":")[::2]):
        raise ValueError(f"{field} = {spec!r} should be 'module:function', e.g. 'my_rewards:exact'")
    return Reward(spec, call=spec)


def check_rewards(cfg, rows=()) -> None:
    """Every reward the run names exists: task.reward and (with datasets) data.reward are importable, and with
    data.reward = auto each dataset row's verifier is a built-in one (``rows``: the PromptRows of data.train and
    data.eval). A run that joins a cluster (cluster.address) is not asked to import the user's module here: its
    actors run on other nodes, with their own files."""
    here = not cfg.cluster.address
    if cfg.task.reward:
        reward_for(cfg.task.reward, "task.reward", check_import=here)
    d = cfg.data
    if not (d.train or d.eval):
        return
    if d.reward != "auto":
        reward_for(d.reward, check_import=here)
        return
    for row in rows:
        name = row.metadata.get("verifier", "math")
        if name not in BUILTIN:
            raise ValueError(
                f"{row.source} row {row.row} field '{d.metadata_key}.verifier': {name!r} is not a verifier "
                f"(known: {sorted(BUILTIN)}); with data.reward = auto a row picks a built-in one: fix the row, or set "
                "data.reward to one reward for every row (a built-in name or 'module:function')"
            )
