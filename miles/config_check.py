"""Range checks for config fields, so that each field's rule reads in one line of its ``__post_init__``.

A value that trains silently wrong (a negative clip norm is gradient ascent, a NaN coefficient writes NaN weights)
or fails late inside an actor is refused when the config is built, before Ray starts, with the field, the value
and the fix in the message:

    require_finite("trainer", self)  # NaN and infinities in every float field, ints beyond 64 bits
    check("trainer.max_grad_norm", self.max_grad_norm, gt=0, fix="e.g. 1.0")
    -> ValueError: trainer.max_grad_norm = -1.0 must be > 0; e.g. 1.0

A misspelt name (a field, a choice, a recipe) gets the closest valid ones: ``did_you_mean("grpoo", choices)``.
"""

from __future__ import annotations

import dataclasses
import difflib
import keyword
import math
import operator

_OPS = (("gt", ">", operator.gt), ("ge", ">=", operator.ge), ("lt", "<", operator.lt), ("le", "<=", operator.le))


def check(path: str, value, *, gt=None, ge=None, lt=None, le=None, fix: str = "") -> None:
    """Raise ValueError unless ``value`` is a finite number within every bound given (gt/ge/lt/le)."""
    bounds = {"gt": gt, "ge": ge, "lt": lt, "le": le}
    rule = [(sign, bounds[key]) for key, sign, _ in _OPS if bounds[key] is not None]
    ok = math.isfinite(value) and all(op(value, bounds[key]) for key, _, op in _OPS if bounds[key] is not None)
    if not ok:
        want = " and ".join(f"{sign} {_num(bound)}" for sign, bound in rule)
        what = f"a finite number {want}" if not math.isfinite(value) else want
        raise ValueError(f"{path} = {value!r} must be {what}" + (f"; {fix}" if fix else ""))


INT_LIMIT = 2**63  # every config integer fits a signed 64-bit integer, what torch and C code read them as


def require_finite(section: str, cfg) -> None:
    """Refuse NaN and infinities in every float field (and every float in a tuple field) of the dataclass ``cfg``,
    and integers beyond 64 bits in its int fields (``num_threads=1e30`` would fail only inside a Ray actor).
    ``section`` "" is the run config's own fields."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        items = value if isinstance(value, tuple) else (value,)
        default = f.default if f.default is not dataclasses.MISSING else None
        hint = f" (the default is {_show(default)})" if default is not None else ""
        path = f"{section}.{user_name(f.name)}" if section else user_name(f.name)
        if any(isinstance(x, float) and not math.isfinite(x) for x in items):
            raise ValueError(f"{path} = {_show(value)} is not a finite number; set a finite value{hint}")
        if any(isinstance(x, int) and not -INT_LIMIT <= x < INT_LIMIT for x in items):
            raise ValueError(f"{path} = {_show(value)} is out of range: a config integer must fit in 64 bits{hint}")


def _num(x) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _show(value) -> str:
    return ",".join(f"{x!r}" for x in value) if isinstance(value, tuple) else repr(value)


def did_you_mean(word, choices, *, sep: str = "; ") -> str:
    """``sep + "did you mean 'grpo'?"`` naming the choices closest to the misspelt ``word``, or '' when none is
    close: the best match and any within 0.1 of its similarity (at most three)."""
    if not isinstance(word, str):
        return ""
    scored = sorted(((difflib.SequenceMatcher(None, word, str(c)).ratio(), str(c)) for c in choices), reverse=True)
    close = [c for r, c in scored if r >= max(0.6, scored[0][0] - 0.1)][:3] if scored else []
    return f"{sep}did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def user_name(name: str) -> str:
    """A field named after a Python keyword has a trailing underscore in Python (``cfg.async_``) and none where a
    user writes it (``--set async.max_staleness=2``, a config file's ``[async]``, config.json)."""
    return name[:-1] if name.endswith("_") and keyword.iskeyword(name[:-1]) else name
