"""miles train | plan | serve | dashboard | bench | export: the command line over recipes, config files and overrides.

Exit codes: 0 done; 1 the run failed (a worker error, a full or read-only disk, a busy run directory, a port in
use); 2 bad input (an unknown recipe, benchmark or config field, a value out of range, a run_dir that cannot be
used as asked, a missing dependency); 3 miles plan: the plan does not fit the hardware; 130 Ctrl-C. An error is
one line on stderr, with its root cause (from inside a Ray actor too); --debug (anywhere on the line) or
MILES_DEBUG=1 adds the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback

from miles.cli.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED, explain  # noqa: F401 (re-exported)
from miles.config_args import ArgParser


def _delegate(module: str):
    """Subcommands owned by a room: forward the raw arguments to ``<module>.main(argv)``."""

    def run(args) -> int:
        return importlib.import_module(module).main(args.rest)

    return run


_DELEGATED = {
    "plan": ("miles.cli.plan", "predict device/host memory peaks of a recipe on hardware, before launching"),
    "serve": ("miles.cli.serve", "serve the embedded engine over SGLang's HTTP API"),
    "dashboard": ("miles.dashboard.server", "browse a run directory in a web UI"),
    "export": ("miles.cli.export", "write a LoRA checkpoint as a Hugging Face checkpoint with the adapter merged"),
}


def build_parser() -> argparse.ArgumentParser:
    from miles import __version__
    from miles.cli import bench, train

    p = ArgParser(prog="miles", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"miles {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train.add_parser(sub)
    bench.parser(sub)
    for name, (module, text) in _DELEGATED.items():
        s = sub.add_parser(name, help=f"{text} (miles {name} --help)", add_help=False)
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
        args = argparse.Namespace(command=argv[0], rest=argv[1:], func=_delegate(_DELEGATED[argv[0]][0]))
    else:
        args, unknown = build_parser().parse_known_args(argv)
        if unknown:  # the subcommand's parser names its closest option
            args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.func(args)
    except KeyboardInterrupt as e:
        print(f"miles {args.command}: {e or 'interrupted'}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:
        code, line = explain(e)
        if code is None:
            raise  # a bug in miles, not the user's input or machine: the traceback is the report
        hint = " [--debug or MILES_DEBUG=1 for the traceback]" if code == EXIT_FAILED and not debug else ""
        print(f"miles {args.command}: {line}{hint}", file=sys.stderr)
        if debug:
            traceback.print_exception(e)
        return code


if __name__ == "__main__":
    sys.exit(main())
