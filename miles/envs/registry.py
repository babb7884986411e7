"""Environments by name: the built-in ones, or any class given as ``module:Class`` (env.name in the run config).

cls = env_class("calculator")                  # miles.envs.calculator.CalculatorEnv
cls = env_class("my_pkg.envs:Wordle")           # imported from the user's module
env = make_env(cls, {"tools": False})           # one instance per episode
"""

from __future__ import annotations

import importlib
import inspect

from miles.config_check import did_you_mean
from miles.envs.api import Env

BUILTIN = {
    "calculator": ("miles.envs.calculator", "CalculatorEnv"),
    "python": ("miles.envs.python_tool", "PythonEnv"),
    "openenv": ("miles.envs.openenv", "OpenEnvAdapter"),
}


def env_class(name: str) -> type:
    """The class that env.name names; a clear error naming the value and the fix otherwise."""
    if name in BUILTIN:
        module, attr = BUILTIN[name]
    elif ":" in name:
        module, _, attr = name.partition(":")
    else:
        raise ValueError(
            f"env.name = {name!r} is not a built-in environment ({', '.join(BUILTIN)}){did_you_mean(name, BUILTIN)} "
            "nor 'module:Class'"
        )
    try:
        cls = getattr(importlib.import_module(module), attr)
    except ImportError as e:
        raise ValueError(f"env.name = {name!r}: cannot import {module!r} ({e})") from None
    except AttributeError:
        raise ValueError(f"env.name = {name!r}: module {module!r} has no {attr!r}") from None
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(
            f"env.name = {name!r}: {cls.__name__} has no {' or '.join(missing)} method (miles.envs.api.Env)"
        )
    return cls


def make_env(cls: type, kwargs: dict) -> Env:
    """One instance of ``cls`` with ``kwargs`` (env.args); unknown arguments are named with the ones it takes."""
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as e:
        params = [p for p in inspect.signature(cls).parameters if p != "self"]
        raise ValueError(f"env.args {kwargs} do not fit {cls.__name__}({', '.join(params)}): {e}") from None
    return cls(**kwargs)
