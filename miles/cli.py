"""``miles train | plan | serve | dashboard | bench``: the command line over recipes and overrides.

Exit codes: 0 done; 1 the run failed (a worker error, a full or read-only disk, a busy run directory, a port in
use); 2 bad input (an unknown recipe, benchmark or config field, a value out of range, a run_dir that cannot be
used as asked); 3 ``miles plan``: the plan does not fit the hardware; 130 Ctrl-C. An error is one line on stderr;
``--debug`` (anywhere on the line) or ``MILES_DEBUG=1`` adds the traceback.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import json
import logging
import os
import sys
import textwrap
import traceback
from pathlib import Path

EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 1, 2, 130
BAD_INPUT = (ValueError, OverflowError, ImportError, FileNotFoundError, NotADirectoryError, IsADirectoryError)


def _train(args) -> int:
    from miles.config import apply_overrides
    from miles.driver import train
    from miles.recipes import get_recipe

    cfg = apply_overrides(get_recipe(args.recipe), (args.set or []) + (["overwrite=true"] if args.force else []))
    rows = train(cfg, progress=not args.no_progress)
    if rows:
        first, last = rows[: min(3, len(rows))], rows[-min(3, len(rows)) :]
        mean = lambda rs: sum(r["reward"] for r in rs) / len(rs)
        print(f"{len(rows)} RL steps in {cfg.run_dir}: reward {mean(first):.3f} (first 3) -> {mean(last):.3f} (last 3)")
    return 0


def _benchmarks():
    """The checkout's ``benchmarks`` package: the benchmarks are not part of the installed ``miles`` package, so
    they are found in the repository that holds this ``miles`` (an editable install or PYTHONPATH) or in the
    working directory or one of its parents."""
    here = Path(__file__).resolve().parents[1]
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


def _bench(args) -> int:
    bench = _benchmarks()

    if args.name is None:
        print(_bench_parser().format_help(), file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.name not in bench.available():
        raise ValueError(f"unknown benchmark {args.name!r}; available: {', '.join(bench.available())}")
    if "--json" in args.rest:  # `miles bench NAME --json ...` as well as `miles bench --json NAME ...`
        args.rest.remove("--json")
        args.json = True
    out = bench.run(args.name, args.rest)
    print(json.dumps(out, indent=2, default=str) if args.json else _summary(out))
    return 0


def _summary(out: dict) -> str:
    skip = {"machine", "command"}
    return "\n".join(f"{k}: {json.dumps(v, default=str)}" for k, v in out.items() if k not in skip)


def _delegate(module: str):
    """Subcommands owned by a room: forward the raw arguments to ``<module>.main(argv)``."""

    def run(args) -> int:
        return importlib.import_module(module).main(args.rest)

    return run


_DELEGATED = {"plan": "miles.planner", "serve": "miles.rollout.serve_cli", "dashboard": "miles.dashboard.server"}


def _add_train(sub) -> None:
    from miles.recipes import RECIPES

    names = sorted(RECIPES)
    t = sub.add_parser(
        "train",
        help="run RL from a recipe",
        description="Run RL from a recipe; resumes from the run directory's last checkpoint.",
    )
    t.add_argument(
        "--recipe",
        default="quickstart",
        metavar="NAME",
        help=f"the base config (default quickstart): {', '.join(names)}",
    )
    t.add_argument(
        "--set",
        action="extend",
        nargs="+",
        metavar="SECTION.FIELD=VALUE",
        help="override config fields: --set trainer.lr=1e-4 num_steps=8 (repeatable)",
    )
    t.add_argument(
        "--force",
        action="store_true",
        help="same as --set overwrite=true: write into a directory that holds no miles run, or with resume=false "
        "delete the run in run_dir and start over",
    )
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.set_defaults(func=_train)


def _bench_parser(sub=None) -> argparse.ArgumentParser:
    try:
        names = ", ".join(_benchmarks().available())
    except ValueError as e:  # an install without a checkout: the help says how to get the benchmarks
        names = f"none here ({e})"
    kw = dict(
        description="Run a named benchmark of a checkout's benchmarks/; its JSON goes to benchmarks/results/ "
        "(see BENCHMARKS.md).",
        epilog=textwrap.fill(f"benchmarks: {names}", 100, break_on_hyphens=False),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    b = (
        sub.add_parser("bench", help="run a named benchmark", **kw)
        if sub
        else argparse.ArgumentParser("miles bench", **kw)
    )
    b.add_argument("name", nargs="?", metavar="NAME", help="one of the benchmarks below")
    b.add_argument("--json", action="store_true", help="print the full JSON result")
    b.add_argument("rest", nargs=argparse.REMAINDER, metavar="...", help="the benchmark's own options")
    b.set_defaults(func=_bench)
    return b


def build_parser() -> argparse.ArgumentParser:
    from miles import __version__

    p = argparse.ArgumentParser(prog="miles", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"miles {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_train(sub)
    _bench_parser(sub)
    for name, module, text in (
        ("plan", "miles.planner", "predict device/host memory peaks of a recipe on hardware"),
        ("serve", "miles.rollout.serve_cli", "serve the embedded engine over SGLang's HTTP API"),
        ("dashboard", "miles.dashboard.server", "browse a run directory in a web UI"),
    ):
        s = sub.add_parser(name, help=text, add_help=False)
        s.add_argument("rest", nargs=argparse.REMAINDER)
        s.set_defaults(func=_delegate(module))
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = os.environ.get("MILES_DEBUG", "") not in ("", "0")
    if "--debug" in argv:
        argv.remove("--debug")
        debug = True
    if argv and argv[0] in _DELEGATED:  # argparse's REMAINDER drops a leading --option; forward the raw list
        args = argparse.Namespace(command=argv[0], rest=argv[1:], func=_delegate(_DELEGATED[argv[0]]))
    else:
        args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt as e:
        print(f"miles {args.command}: {e or 'interrupted'}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:
        code, line = explain(e)
        if code is None:
            raise  # a bug in miles, not the user's input or machine: the traceback is the report
        print(f"miles {args.command}: {line}", file=sys.stderr)
        if debug:
            traceback.print_exception(e)
        elif code == EXIT_FAILED:
            print("(run with --debug or MILES_DEBUG=1 for the traceback)", file=sys.stderr)
        return code


def explain(e: BaseException) -> tuple[int | None, str]:
    """(exit code, one line) for an error a user's input or machine causes; (None, "") for anything else.
    Ray wraps an actor's exception: the original one is judged."""
    cause = _root_cause(e)
    text = " ".join(str(cause).split()) or type(cause).__name__
    if isinstance(cause, BAD_INPUT):
        return EXIT_BAD_INPUT, f"error: {text}"
    if isinstance(cause, OSError):
        hint = "; pick another --port (or 0 for any free one)" if cause.errno == errno.EADDRINUSE else ""
        return EXIT_FAILED, f"failed: {type(cause).__name__}: {text}{hint}"
    if isinstance(cause, RuntimeError) or type(cause).__name__ == "SafetensorError" or _is_ray_error(e):
        prefix = "" if type(cause) is RuntimeError else f"{type(cause).__name__}: "
        return EXIT_FAILED, f"failed: {prefix}{text}"
    return None, ""


def _root_cause(e: BaseException) -> BaseException:
    cause = getattr(e, "cause", None)
    return _root_cause(cause) if isinstance(cause, BaseException) and cause is not e else e


def _is_ray_error(e: BaseException) -> bool:
    return any(c.__module__.startswith("ray.") for c in type(e).__mro__)


if __name__ == "__main__":
    sys.exit(main())
