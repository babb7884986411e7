"""Values into config fields: ``--set section.field=value`` strings, a config file's values and a run's
``config.json``, each parsed by the field's type and validated by building the config again.

A misspelt field or choice is refused with the closest valid names: ``--set trainer.lrr=1e-4`` says "did you mean
trainer.lr?", ``--set lr=1e-4`` says "did you mean trainer.lr?", ``rollout.engine=sglnag`` says "did you mean
'sglang'?".
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import keyword
import types
import typing
from typing import Literal

from miles.config_check import did_you_mean, user_name


def user_dict(d: dict) -> dict:
    """``dataclasses.asdict`` of a config, its keys as users write them (``user_name``)."""
    return {user_name(k): user_dict(v) if isinstance(v, dict) else v for k, v in d.items()}


@functools.cache
def field_types(cls) -> dict:
    """{field name as users write it: its type} of the config dataclass ``cls`` (resolved once: get_type_hints is
    slow)."""
    hints = typing.get_type_hints(cls)
    return {user_name(f.name): hints[f.name] for f in dataclasses.fields(cls)}


def build(cls, d: dict, prefix: str = ""):
    """``cls`` (a config dataclass) from a nested dict of JSON-like values, every value checked by type."""
    if not isinstance(d, dict):
        raise ValueError(f"{prefix.rstrip('.') or 'the config'} should be a table of fields, not {d!r}")
    hints = field_types(cls)
    names = list(hints)
    kw = {}
    for k, v in d.items():
        if k not in names:
            hint = did_you_mean(k, names)
            raise ValueError(f"unknown config field {prefix + k!r}{hint} (valid fields: {sorted(names)})")
        t = hints[k]
        py = k + "_" if keyword.iskeyword(k) else k  # the Python attribute (user_name)
        kw[py] = build(t, v, f"{prefix}{k}.") if dataclasses.is_dataclass(t) else coerce(v, t, prefix + k)
    return cls(**kw)


def coerce(value, tp, path: str):
    """Parse a string (from --set) or check a JSON/TOML value against the field's type."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        if value not in args:
            raise ValueError(f"{path} = {value!r} is not one of {list(args)}{did_you_mean(value, args)}")
        return value
    if origin in (types.UnionType, typing.Union):
        if value in (None, "none", "None") and type(None) in args:
            return None
        return coerce(value, next(a for a in args if a is not type(None)), path)
    if origin is tuple:
        items = [s.strip() for s in value.split(",") if s.strip()] if isinstance(value, str) else list(value)
        elem = args[0]
        if len(args) != 2 or args[1] is not Ellipsis:
            if len(items) != len(args):
                raise ValueError(f"{path} = {value!r} needs {len(args)} comma-separated values")
            return tuple(coerce(x, a, path) for x, a in zip(items, args))
        return tuple(coerce(x, elem, path) for x in items)
    if tp is bool:
        if isinstance(value, bool):
            return value
        low = str(value).lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{path} = {value!r} is not a boolean; use true or false")
    if tp in (int, float):
        if isinstance(value, bool):
            raise ValueError(f"{path} = {value!r} should be {tp.__name__}, got a boolean")
        try:
            if tp is int:
                if isinstance(value, float) and not value.is_integer():
                    raise ValueError
                return int(value) if not isinstance(value, str) else _parse_int(value)
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{path} = {value!r} is not {'an integer' if tp is int else 'a number'}") from None
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ValueError(f"{path} = {value!r} should be a string")
        return str(value)
    return value


_SUFFIXES = {"k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}


def _parse_int(s: str) -> int:
    low = s.strip().lower().replace("_", "")
    for suffix, mult in sorted(_SUFFIXES.items(), key=lambda kv: -len(kv[0])):
        if low.endswith(suffix) and low[: -len(suffix)].replace(".", "", 1).isdigit():
            return int(float(low[: -len(suffix)]) * mult)
    f = float(low)
    if not f.is_integer():
        raise ValueError
    return int(f)


def apply_overrides(cfg, overrides: list[str]):
    """Return a new config with ``["section.field=value", ...]`` applied and validated."""
    pairs = []
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} should look like section.field=value, e.g. trainer.lr=1e-4")
        key, raw = item.split("=", 1)
        pairs.append((key.strip(), raw.strip()))
    return apply_values(cfg, pairs)


def apply_values(cfg, pairs: list[tuple[str, object]], *, repeats_are_choices: bool = True):
    """Return a new config with ``[("section.field", value), ...]`` applied and validated; a value is a string
    (parsed as ``--set`` does) or a typed one (a config file's number, boolean or list). When a ``model.`` field
    is set and the model has a checkpoint, the model is the checkpoint's: its architecture replaces the recipe's,
    and a ``model.`` value that contradicts it is refused (``repeats_are_choices=False``, for a config file that
    lists every field: only a value that differs from ``cfg``'s counts as one set against the checkpoint)."""
    root = type(cfg)
    d = cfg.to_dict()
    for key, value in pairs:
        node, cls, parts = d, root, key.split(".")
        for i, part in enumerate(parts):
            hints = field_types(cls)
            if part not in hints:
                where = ".".join(parts[:i]) or "the run config"
                hint = suggest_field(root, key)
                raise ValueError(
                    f"unknown config field {key!r}: {where} has no field {part!r}{hint} (valid: {sorted(hints)})"
                )
            if i < len(parts) - 1:
                if not dataclasses.is_dataclass(hints[part]):
                    raise ValueError(f"{'.'.join(parts[: i + 1])} is a value, not a section; drop the rest of {key!r}")
                node, cls = node[part], hints[part]
            else:
                if dataclasses.is_dataclass(hints[part]):
                    first = sorted(field_types(hints[part]))[0]
                    raise ValueError(f"{key!r} is a section; set one of its fields, e.g. {key}.{first}=...")
                node[part] = coerce(value, hints[part], key)
    keys = {key for key, _ in pairs}
    m = getattr(cfg, "model", None)
    if (
        m is not None
        and {"model.hidden_size", "model.num_attention_heads"} & keys
        and "model.head_dim" not in keys
        and m.head_dim == m.hidden_size // m.num_attention_heads
    ):
        d["model"]["head_dim"] = 0  # it was derived from the old width: derive it again from the new one
    if m is not None and d["model"]["checkpoint"] and any(k.startswith("model.") for k in keys):
        d["model"] = _checkpoint_model(m, d["model"], keys, repeats_are_choices)
    return build(root, d)


def _checkpoint_model(before, model: dict, keys: set[str], repeats_are_choices: bool) -> dict:
    """``model.checkpoint`` means "this model" (miles.model.from_checkpoint): the model section rebuilt from the
    checkpoint, the values set here held against it."""
    from miles.model.from_checkpoint import run_model_section

    names = {k.removeprefix("model.").split(".")[0] for k in keys if k.startswith("model.")}  # model.lora.rank: lora
    return run_model_section(
        model, {k: model[k] for k in names if repeats_are_choices or model[k] != getattr(before, k)}
    )


def field_paths(cls, prefix: str = "") -> list[str]:
    """Every field of the config dataclass ``cls`` as a dotted path: ``["seed", ..., "trainer.lr", ...]``."""
    out = []
    for name, tp in field_types(cls).items():
        out += field_paths(tp, f"{prefix}{name}.") if dataclasses.is_dataclass(tp) else [prefix + name]
    return out


def suggest_field(root, key: str) -> str:
    """'; did you mean trainer.lr?' for a misspelt dotted ``key`` of the config class ``root``, or ''."""
    paths = field_paths(root)
    leaf = key.rsplit(".", 1)[-1]
    same_leaf = [p for p in paths if p.rsplit(".", 1)[-1] == leaf and p != key]  # lr -> trainer.lr
    fixed = _correct(root, key.split("."))  # trainr.lr -> trainer.lr, trainer.lrr -> trainer.lr
    if not same_leaf and fixed in paths:
        same_leaf = [fixed]
    if not same_leaf:  # num_step -> num_steps, rollout.samples_per_prompt -> rollout.n_samples_per_prompt
        leaves = {p.rsplit(".", 1)[-1] for p in paths}
        close = difflib.get_close_matches(leaf, leaves, n=3, cutoff=0.75)
        same_leaf = [p for p in paths if p.rsplit(".", 1)[-1] in close]
    return f"; did you mean {' or '.join(same_leaf[:3])}?" if same_leaf else ""


def _correct(cls, parts: list[str]) -> str:
    """The dotted path with each unknown part replaced by its closest name at that level, or '' if none is close."""
    out = []
    for part in parts:
        if not dataclasses.is_dataclass(cls):
            return ""
        hints = field_types(cls)
        if part not in hints:
            close = difflib.get_close_matches(part, list(hints), n=1, cutoff=0.6)
            if not close:
                return ""
            part = close[0]
        out.append(part)
        cls = hints[part]
    return ".".join(out)
