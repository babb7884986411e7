"""``miles bench NAME``: a benchmark of the checkout's ``benchmarks/`` (not installed with the package)."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import textwrap
from pathlib import Path

from miles.cli.errors import EXIT_BAD_INPUT
from miles.config_args import ArgParser
from miles.config_check import did_you_mean


def benchmarks():
    """The checkout's ``benchmarks`` package: the benchmarks are not part of the installed ``miles`` package, so
    they are found in the repository that holds this ``miles`` (an editable install or PYTHONPATH) or in the
    working directory or one of its parents."""
    here = Path(__file__).resolve().parents[2]
    for root in (here, Path.cwd(), *Path.cwd().parents):
        if (root / "benchmarks" / "__init__.py").is_file():
            if str(root) not in sys.path:
                sys.path.insert(0, str(root))
                # benchmarks that run a side in a child process (``python -m benchmarks.x``) find it too
                os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
            return importlib.import_module("benchmarks")
    raise ValueError(
        "miles bench runs the benchmarks of a checkout of the miles repository (benchmarks/ is not installed "
        f"with the package; none found above {Path.cwd()}): git clone the repository, pip install -e . in it "
        "and run miles bench from there"
    )


def run(args) -> int:
    bench = benchmarks()

    if args.name is None:
        print(parser().format_help(), file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.name not in bench.available():
        hint = did_you_mean(args.name, bench.available())
        raise ValueError(f"unknown benchmark {args.name!r}{hint} (available: {', '.join(bench.available())})")
    if "--json" in args.rest:  # `miles bench NAME --json ...` as well as `miles bench --json NAME ...`
        args.rest.remove("--json")
        args.json = True
    out = bench.run(args.name, args.rest)
    print(json.dumps(out, indent=2, default=str) if args.json else _summary(out))
    return 0


def _summary(out: dict) -> str:
    skip = {"machine", "command"}
    return "\n".join(f"{k}: {json.dumps(v, default=str)}" for k, v in out.items() if k not in skip)


def parser(sub=None) -> argparse.ArgumentParser:
    try:
        names = ", ".join(benchmarks().available())
    except ValueError as e:  # an install without a checkout: the help says how to get the benchmarks
        names = f"none here ({e})"
    kw = dict(
        description="Run a named benchmark of a checkout's benchmarks/; its JSON goes to benchmarks/results/ "
        "(see BENCHMARKS.md).",
        epilog=textwrap.fill(f"benchmarks: {names}", 100, break_on_hyphens=False),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    b = sub.add_parser("bench", help="run a named benchmark", **kw) if sub else ArgParser("miles bench", **kw)
    b.add_argument("name", nargs="?", metavar="NAME", help="one of the benchmarks below")
    b.add_argument("--json", action="store_true", help="print the full JSON result")
    b.add_argument("rest", nargs=argparse.REMAINDER, metavar="...", help="the benchmark's own options")
    b.set_defaults(func=run, parser=b)
    return b
