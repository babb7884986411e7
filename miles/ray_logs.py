"""What a Ray that miles starts prints on the driver's terminal: every worker's own output, and none of the
noise that asks nothing of a miles user.

- Two start-up warnings are dropped, each by its exact message on its own logger (every other record of those
  loggers passes): "Token authentication is enabled for this Ray cluster" (Ray's default for a local cluster,
  which miles keeps; setting RAY_AUTH_MODE=token instead would silence it only when set before Ray is first
  imported, and a process that imported Ray earlier then fails to authenticate), and "SIGTERM handler is not set
  because current thread is not the main thread" (a notebook's run thread, where miles stops on its own event).
- The traceback an actor's worker prints when its constructor raises ("Exception raised in creation task: ..."
  and the traceback lines after it, about 20 coloured lines) is dropped from what Ray forwards to the driver
  (log_to_driver): the driver gets the same error as an ActorDiedError, and the miles command reports it as one
  line with the root cause (``--debug``: the whole traceback). Every other line of every worker passes.

    quiet_startup_warnings()        # before ray.init
    drop_reported_tracebacks()      # after ray.init(log_to_driver=True)
"""

from __future__ import annotations

import logging

QUIET = {
    "ray._private.authentication.authentication_token_setup": "Token authentication is enabled for this Ray cluster",
    "ray._private.worker": "SIGTERM handler is not set because current thread is not the main thread",
}
CREATION_ERROR = "Exception raised in creation task:"
RAY_HANDLER = "ray_print_logs"  # the name ray.init gives its log_to_driver printer (ray._private.worker)


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


def quiet_startup_warnings() -> None:
    """Drop the two start-up warnings above (idempotent)."""
    for name, prefix in QUIET.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) and f.prefix == prefix for f in logger.filters):
            logger.addFilter(_DropMessage(prefix))


class ReportedTracebacks:
    """A log_to_driver handler: forwards every batch of worker lines to ``forward`` except, from the line that
    starts an actor's creation-task traceback on, that worker's lines (the actor is dead; its process prints
    nothing else)."""

    def __init__(self, forward):
        self.forward = forward
        self.dead: set[tuple] = set()  # (ip, pid) of workers whose actor constructor raised

    def __call__(self, data: dict) -> None:
        key = (data.get("ip"), data.get("pid"))
        lines = [] if key in self.dead else list(data.get("lines", []))
        for i, line in enumerate(lines):
            if CREATION_ERROR in line:
                self.dead.add(key)
                lines = lines[:i]
                break
        if lines:
            self.forward({**data, "lines": lines})


def drop_reported_tracebacks() -> bool:
    """Wrap the driver's log_to_driver printer in ReportedTracebacks; False (nothing changed) when this Ray
    prints worker logs some other way."""
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        return False
    with dispatcher._lock:
        for i, (name, handler) in enumerate(dispatcher.handlers):
            if name == RAY_HANDLER and not isinstance(handler, ReportedTracebacks):
                dispatcher.handlers[i] = (name, ReportedTracebacks(handler))  # ray.shutdown removes it by name
                return True
    return False
