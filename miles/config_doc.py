"""Every config field with its one-line meaning and its value: ``miles train --print-config``.

A field is documented once, by the comment beside it (or the comment lines right above it) in its dataclass;
this module reads those comments from the source, so the listing cannot drift from the code. The listing is a
TOML file that ``--config`` reads back:

    miles train --recipe quickstart --set trainer.lr=1e-4 --print-config > run.toml
    miles train --config run.toml
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import json
import math
import textwrap
import tokenize
import typing
from typing import Literal

from miles.config_check import user_name

KEY_COLUMN = 36  # `key = value` is padded to this width before its comment, when it fits


@functools.cache
def field_docs(cls) -> dict[str, str]:
    """{field: its meaning} from the comments beside and right above each field of the dataclass ``cls``."""
    src = textwrap.dedent(inspect.getsource(cls))
    lines = src.splitlines()
    comments = {
        tok.start[0]: tok.string.lstrip("#").strip()
        for tok in tokenize.generate_tokens(io.StringIO(src).readline)
        if tok.type == tokenize.COMMENT
    }
    out = {}
    for node in ast.parse(src).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, ln = [], node.lineno - 1
        while ln >= 1 and lines[ln - 1].strip().startswith("#"):
            above.insert(0, comments[ln])
            ln -= 1
        beside = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
        out[node.target.id] = " ".join(above + beside)
    return out


def meaning(cls, name: str) -> str:
    """The field's comment, with its choices when it is a Literal and the comment does not name them all."""
    doc = field_docs(cls).get(name, "")
    tp = typing.get_type_hints(cls)[name]
    if typing.get_origin(tp) is Literal:
        choices = [str(c) for c in typing.get_args(tp)]
        if not all(c in doc for c in choices):
            doc = f"{doc} [{' | '.join(choices)}]".strip()
    return doc


def toml_value(v) -> str:
    """A field's value as TOML (strings as JSON-escaped basic strings, tuples as arrays)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ("nan" if math.isnan(v) else ("inf" if v > 0 else "-inf"))
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    raise TypeError(f"no TOML form for {v!r}")


def config_toml(cfg, header: str = "") -> str:
    """The config as a commented TOML file: top-level fields first, then one table per section."""
    out = [f"# {line}" for line in header.splitlines()]
    return "\n".join(out + _section(cfg, "")) + "\n"


def _section(obj, path: str) -> list[str]:
    """``obj``'s plain fields, then a ``[path.name]`` table for each section in it (model.lora in model)."""
    values, sections = [], []
    for f in dataclasses.fields(obj):
        (sections if dataclasses.is_dataclass(getattr(obj, f.name)) else values).append(f.name)
    out = _block(obj, values)
    for name in sections:
        doc = field_docs(type(obj)).get(name, "")
        out += ["", f"[{path}{user_name(name)}]" + (f"  # {doc}" if doc else "")]
        out += _section(getattr(obj, name), f"{path}{user_name(name)}.")
    return out


def _block(obj, names: list[str]) -> list[str]:
    rows = []
    for name in names:
        v = getattr(obj, name)
        key = f"{name} = {toml_value(v)}" if v is not None else f"# {name} is unset"
        doc = meaning(type(obj), name)
        rows.append(f"{key.ljust(KEY_COLUMN)}  # {doc}" if doc else key)
    return rows
