"""Benchmarks behind ``miles bench NAME``: each is a module ``benchmarks/<name>.py`` of the repository (hyphens
become underscores) exposing ``run(argv: list[str]) -> dict``. Results are JSON, written atomically to
``benchmarks/results/<name>.{cpu,gpu}.json`` with the machine, date and command; BENCHMARKS.md quotes them.
They live outside the ``miles`` package; a harness that tests or notebooks call as well stays in its benchmark
module (a notebook puts the checkout on sys.path with ``miles.cli.bench.benchmarks()``, as ``miles bench`` does).
``*_probe.py`` files are one-off scripts run by path (their docstring says how), not ``miles bench`` names."""

from __future__ import annotations

import datetime
import importlib
import json
import os
import pkgutil
import platform
import sys
from pathlib import Path

from miles.atomic import atomic_write_text


def available() -> list[str]:
    here = Path(__file__).parent
    names = (m.name for m in pkgutil.iter_modules([str(here)]))
    return sorted(n.replace("_", "-") for n in names if not n.startswith("_") and not n.endswith("_probe"))


def machine_info() -> dict:
    import torch

    info = {
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def run(name: str, argv: list[str], results_dir: str | os.PathLike = "benchmarks/results") -> dict:
    if name not in available():
        raise SystemExit(f"unknown benchmark {name!r}; available: {', '.join(available())}")
    module = importlib.import_module(f"benchmarks.{name.replace('-', '_')}")
    result = module.run(list(argv))
    out = {"benchmark": name, "command": " ".join(["miles", "bench", name, *argv]), "machine": machine_info(), **result}
    tag = "gpu" if "gpu" in out["machine"] else "cpu"
    atomic_write_text(Path(results_dir) / f"{name}.{tag}.json", json.dumps(out, indent=2, default=str))
    return out


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - thin CLI shim
    argv = list(sys.argv[1:] if argv is None else argv)
    print(json.dumps(run(argv[0], argv[1:]), indent=2, default=str))
    return 0
