"""The command-line side of a run config, shared by ``miles train``, ``miles serve`` and ``miles plan``:
``--recipe``, ``--config FILE``, ``--set`` and ``--print-config``; and the argument parser of miles' commands,
whose errors are one line with the closest valid option or choice.

Nothing here imports torch or Ray, so a mistyped argument is refused in a fraction of a second.

    p = ArgParser(prog="miles plan")
    add_config_args(p)
    args = p.parse_args(argv)
    cfg = config_from_args(args)         # recipe < --config file < --set, validated
    if args.print_config: print(config_listing(cfg, args))
"""

from __future__ import annotations

import argparse
import sys

from miles.config_check import did_you_mean
from miles.config_file import DEFAULT_RECIPE


class ArgParser(argparse.ArgumentParser):
    """argparse, with one-line errors that name the closest option or choice and point to --help."""

    def error(self, message: str):
        if message.startswith("unrecognized arguments: "):
            options = [o for o in self._option_string_actions if o.startswith("--")]
            hints = [did_you_mean(a.split("=", 1)[0], options, sep=" ") for a in message.split()[2:] if a[:1] == "-"]
            message += ";" + "".join(hints) if any(hints) else ""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def _check_value(self, action, value):
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as e:
            raise argparse.ArgumentError(action, e.message + did_you_mean(value, action.choices)) from None


def recipe_names() -> list[str]:
    from miles.recipes import RECIPES

    return sorted(RECIPES)


def add_config_args(p: argparse.ArgumentParser) -> None:
    """--recipe, --config, --model, --set and --print-config on ``p``."""
    p.add_argument(
        "--recipe",
        default=None,
        metavar="NAME",
        help=f"the base config (default: the config file's recipe, else {DEFAULT_RECIPE}): {', '.join(recipe_names())}",
    )
    p.add_argument(
        "--config",
        default="",
        metavar="FILE",
        help="a config file (.toml, .yaml or .json; a run's config.json too) on top of the recipe; "
        "--print-config writes one",
    )
    p.add_argument(
        "--model",
        default="",
        metavar="PATH",
        help="the model: an HF directory (config.json, *.safetensors, tokenizer files) or a .gguf file; its "
        "architecture and tokenizer replace the recipe's (--set model.checkpoint=PATH; miles plan on a recipe that "
        "plans with handoff.plan_model: that field)",
    )
    p.add_argument(
        "--set",
        action="extend",
        nargs="+",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override config fields, on top of the recipe and the file: --set trainer.lr=1e-4 num_steps=8 "
        "(repeatable)",
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print every config field with its value and meaning (as TOML, which --config reads) and exit",
    )


def config_from_args(args: argparse.Namespace, extra: list[str] = (), *, plan: bool = False):
    """The RunConfig of the command line: recipe, then the config file, then ``--model`` (``plan``: as
    handoff.plan_model where the recipe plans with one), then ``--set`` (and ``extra`` after)."""
    from miles.config_file import load_run_config

    return load_run_config(args.recipe, args.config, list(args.set) + list(extra), model=args.model, plan=plan)


def config_listing(cfg, args: argparse.Namespace, prog: str) -> str:
    """``--print-config``'s output: the command that built ``cfg``, then every field (miles.config_doc)."""
    from miles.config_doc import config_toml

    parts = [prog] + [f"--recipe {args.recipe}"] * bool(args.recipe) + [f"--config {args.config}"] * bool(args.config)
    parts += [f"--model {args.model}"] * bool(args.model)
    parts += [f"--set {s}" for s in args.set]
    header = (
        f"{' '.join(parts)}\n"
        "every field: value  # meaning. Precedence: recipe < --config FILE < --set. Save this output as a .toml "
        "file,\nedit it, and run it with: miles train --config FILE"
    )
    return config_toml(cfg, header)


def print_config(cfg, args: argparse.Namespace, prog: str) -> int:
    sys.stdout.write(config_listing(cfg, args, prog))
    return 0
