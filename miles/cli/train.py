"""``miles train``: an RL run from a recipe, a config file and ``--set`` overrides.

The config is built and checked before anything heavy is imported (torch, Ray: seconds), so a mistyped field is
refused at once; a run that already holds every step it is asked for says so instead of starting Ray.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from miles.config_args import add_config_args, config_from_args, print_config
from miles.preflight import check_environment

EXAMPLES = """\
examples:
  miles train                                      the quickstart: GRPO sorts letters on a 2-core CPU
  miles train --recipe smollm2_math --set trainer.lr=1e-5 --set num_steps=50
  miles train --set data.train=train.jsonl data.prompt_key=question data.reward=math
  miles train --print-config > run.toml            every field, its value and its meaning
  miles train --config run.toml --set seed=1       that file (edited), one field changed on top
  miles train --set run_dir=runs/b --debug         --debug: the traceback of an error, not one line

config fields: `miles train --print-config` lists every section.field with its meaning and current value
(after --recipe, --config and --set); a misspelt field or value is refused with the closest valid ones."""


def add_parser(sub) -> None:
    t = sub.add_parser(
        "train",
        help="run RL from a recipe",
        description="Run RL from a recipe; resumes from the run directory's last checkpoint.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(t)
    t.add_argument(
        "--force",
        action="store_true",
        help="same as --set overwrite=true: write into a directory that holds no miles run, or with resume=false "
        "delete the run in run_dir and start over",
    )
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.set_defaults(func=run, parser=t)


def run(args) -> int:
    cfg = config_from_args(args, ["overwrite=true"] if args.force else [])
    if args.print_config:
        return print_config(cfg, args, "miles train")
    if done := finished(cfg):
        print(done)
        return 0
    check_environment(cfg)  # SGLang, CUDA, the model's files: in a second, before torch and Ray are imported
    from miles.driver import train  # torch and Ray: only once the config and the machine are known to be good

    rows = train(cfg, progress=not args.no_progress)
    if rows:
        first, last = rows[: min(3, len(rows))], rows[-min(3, len(rows)) :]
        mean = lambda rs: sum(r["reward"] for r in rs) / len(rs)
        print(f"{len(rows)} RL steps in {cfg.run_dir}: reward {mean(first):.3f} (first 3) -> {mean(last):.3f} (last 3)")
    print(f"next: miles dashboard {cfg.run_dir}")
    return 0


def finished(cfg) -> str:
    """What to say when ``cfg.run_dir`` already holds a verified checkpoint at ``num_steps`` or later (a rerun
    of a finished run would start Ray to train nothing); "" otherwise."""
    from miles.checkpoints import Checkpoints, checkpoint_problem
    from miles.run_dir import check_usable

    if not cfg.resume or check_usable(cfg.run_dir, resume=True, overwrite=cfg.overwrite, config=cfg.to_dict()) != "run":
        return ""  # (a directory that must be refused is refused here, with the reason)
    steps = Checkpoints(Path(cfg.run_dir) / "checkpoints").steps()
    if not steps or steps[0][0] < cfg.num_steps or checkpoint_problem(steps[0][1]):
        return ""
    step, path = steps[0]
    return (
        f"{cfg.run_dir} already holds {step} RL steps (num_steps = {cfg.num_steps}; checkpoint {path}): nothing to "
        f"train. To go on: --set num_steps={step + cfg.num_steps}; a new run: --set run_dir={cfg.run_dir}-2; "
        f"this run from scratch: --force --set resume=false\nnext: miles dashboard {cfg.run_dir}"
    )
