"""An error as one line with its root cause and an exit code: what the ``miles`` command prints instead of a
traceback (``--debug`` adds that).

Ray wraps an actor's exception: a method's in ``RayTaskError(<type>)`` (the original in ``.cause``), a
constructor's in an ``ActorDiedError`` whose first argument is that ``RayTaskError``, and an actor whose process
died in an ``ActorDiedError`` with a multi-line report. Each is unwrapped here to the original exception, so
``KeyError: checkpoint ... lacks 30 tensors`` is the line, not the 1,274 characters of Ray's message.
"""

from __future__ import annotations

import errno
import re

EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 1, 2, 130
BAD_INPUT = (ValueError, OverflowError, ImportError, FileNotFoundError, NotADirectoryError, IsADirectoryError)
ANSI = re.compile(r"\x1b\[[0-9;]*m")
PROCTITLE = re.compile(r"ray::([\w.]+)")  # "ray::RolloutManager.__init__() (pid=...)": the worker's process title


def explain(e: BaseException) -> tuple[int | None, str]:
    """(exit code, one line) for an error a user's input or machine causes; (None, "") for anything else.
    Ray wraps an actor's exception: the original one is judged."""
    cause, where = root_cause(e)
    text = _text(cause)
    at = f" (in {where})" if where else ""
    if isinstance(cause, BAD_INPUT):
        return EXIT_BAD_INPUT, f"error: {text}{at}"
    if isinstance(cause, OSError):
        hint = "; pick another --port (or 0 for any free one)" if cause.errno == errno.EADDRINUSE else ""
        return EXIT_FAILED, f"failed: {type(cause).__name__}: {text}{hint}{at}"
    if _is_ray_error(cause):  # an actor's process died, or Ray itself failed: no Python exception beneath
        return EXIT_FAILED, f"failed: {_ray_summary(cause)}"
    if isinstance(cause, RuntimeError) or type(cause).__name__ == "SafetensorError" or _is_ray_error(e):
        prefix = "" if type(cause) is RuntimeError else f"{type(cause).__name__}: "
        return EXIT_FAILED, f"failed: {prefix}{text}{at}"
    return None, ""


def root_cause(e: BaseException) -> tuple[BaseException, str]:
    """(the original exception beneath Ray's wrappers, the actor method it was raised in or "")."""
    where = ""
    for _ in range(32):  # a chain of actors calling actors; bounded against a cycle
        task_error = _task_error(e)
        if task_error is None:
            break
        where = _function(task_error) or where
        cause = getattr(task_error, "cause", None)
        if not isinstance(cause, BaseException) or cause is e:
            break
        e = cause
    return e, where


def _task_error(e: BaseException):
    """The RayTaskError inside ``e``: itself (a method's error), or an ActorDiedError's creation-task error."""
    if _is_task_error(e):
        return e
    if type(e).__name__ == "ActorDiedError" and e.args and _is_task_error(e.args[0]):
        return e.args[0]
    return None


def _is_task_error(e) -> bool:
    return any(c.__name__ == "RayTaskError" and c.__module__.startswith("ray.") for c in type(e).__mro__)


def _function(task_error) -> str:
    """The actor method or task of a RayTaskError ("RolloutManager.__init__"): from the worker's process title
    (which names the class), else its function name."""
    for text in (getattr(task_error, "proctitle", None), str(task_error)):
        if isinstance(text, str) and (m := PROCTITLE.search(ANSI.sub("", text))):
            return m.group(1)
    name = getattr(task_error, "function_name", None)
    return name if isinstance(name, str) else ""


def _text(e: BaseException) -> str:
    """The exception's message on one line; a KeyError's without the quotes its str() adds."""
    if isinstance(e, KeyError) and len(e.args) == 1 and isinstance(e.args[0], str):
        text = e.args[0]
    else:
        text = str(e)
    return " ".join(ANSI.sub("", text).split()) or type(e).__name__


def _ray_summary(e: BaseException) -> str:
    """One line of Ray's own multi-line report; for an actor whose process died: the actor and the reason."""
    lines = [ln.strip() for ln in ANSI.sub("", str(e)).splitlines() if ln.strip()]
    fields = dict(ln.split(": ", 1) for ln in lines[1:] if ": " in ln and ln.split(": ", 1)[0].isidentifier())
    if "class_name" not in fields:
        return f"{type(e).__name__}: {' '.join(lines) or 'no message'}"
    reason = " ".join(ln for ln in lines[1:] if ln.split(": ", 1)[0] not in fields) or lines[0]
    return f"{type(e).__name__}: the {fields['class_name']} actor (pid {fields.get('pid', '?')}) died: {reason}"


def _is_ray_error(e: BaseException) -> bool:
    return any(c.__module__.startswith("ray.") for c in type(e).__mro__)
