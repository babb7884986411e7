"""``miles train | plan | serve | dashboard | bench``: the command line over recipes and overrides."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys


def _train(args) -> int:
    from miles.config import apply_overrides
    from miles.driver import train
    from miles.recipes import get_recipe

    cfg = apply_overrides(get_recipe(args.recipe), args.set or [])
    rows = train(cfg, progress=not args.no_progress)
    if rows:
        first, last = rows[: min(3, len(rows))], rows[-min(3, len(rows)) :]
        mean = lambda rs: sum(r["reward"] for r in rs) / len(rs)
        print(f"{len(rows)} RL steps in {cfg.run_dir}: reward {mean(first):.3f} (first 3) -> {mean(last):.3f} (last 3)")
    return 0


def _bench(args) -> int:
    import miles.bench as bench

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


_DELEGATED = {"plan": "miles.planner", "serve": "miles.rollout.server", "dashboard": "miles.dashboard.server"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="miles", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="run RL from a recipe")
    t.add_argument("--recipe", default="quickstart")
    t.add_argument(
        "--set",
        action="extend",
        nargs="+",
        metavar="SECTION.FIELD=VALUE",
        help="override config fields: --set trainer.lr=1e-4 num_steps=8 (repeatable)",
    )
    t.add_argument("--no-progress", action="store_true")
    t.set_defaults(func=_train)
    b = sub.add_parser("bench", help="run a named benchmark; results go to benchmarks/results/")
    b.add_argument("name")
    b.add_argument("--json", action="store_true", help="print the full JSON result")
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(func=_bench)
    for name, module, text in (
        ("plan", "miles.planner", "predict device/host memory peaks of a recipe on hardware"),
        ("serve", "miles.rollout.server", "serve the embedded engine over SGLang's HTTP API"),
        ("dashboard", "miles.dashboard.server", "browse a run directory in a web UI"),
    ):
        s = sub.add_parser(name, help=text, add_help=False)
        s.add_argument("rest", nargs=argparse.REMAINDER)
        s.set_defaults(func=_delegate(module))
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _DELEGATED:  # argparse's REMAINDER drops a leading --option; forward the raw list
        args = argparse.Namespace(command=argv[0], rest=argv[1:], func=_delegate(_DELEGATED[argv[0]]))
    else:
        args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, ImportError, FileNotFoundError) as e:
        print(f"miles {args.command}: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"miles {args.command}: failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; completed steps are in the run directory's checkpoints", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
