"""miles: a compact RL post-training engine for language models (trainer, rollout engine, weight sync,
GPU memory offload, agent rollouts, a dashboard), orchestrated by Ray and driven from notebooks."""

import os as _os

__version__ = "0.1.0"

if _os.environ.get("MILES_WATCH_DIR"):  # a process of a run under the stall watchdog registers (miles.stall.heartbeat)
    from miles.stall.heartbeat import register_from_env as _register

    _register()
