"""Moved to miles.sglang_flags (the config layer); this name stays only until notebook 01 imports it from there."""

from miles.sglang_flags import engine_gpus  # noqa: F401
