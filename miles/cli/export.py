"""``miles export --merged CHECKPOINT --out DIR``: a LoRA run's checkpoint (or any PEFT LoRA adapter) written as a
plain Hugging Face checkpoint with the adapter merged into the base (miles.model.merged_export)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from miles.config_args import ArgParser


def _parser() -> argparse.ArgumentParser:
    p = ArgParser(prog="miles export", description=__doc__)
    p.add_argument("checkpoint", help="run_dir/checkpoints/step_N of a LoRA run, or a PEFT adapter directory")
    p.add_argument("--merged", action="store_true", help="merge the adapter into the base (the only export so far)")
    p.add_argument("--out", required=True, help="the directory to write config.json + model.safetensors into")
    p.add_argument(
        "--base", default="", help="the Hugging Face base directory (default: the adapter's, else the run's)"
    )
    p.add_argument(
        "--run-config", default="", help="the config.json of the run that saved it (default: run_dir/config.json)"
    )
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if not args.merged:
        raise ValueError("miles export writes merged checkpoints only: add --merged")
    from miles.model.merged_export import export_merged, read_lora

    model_cfg, seed = base_of(Path(args.checkpoint), read_lora(args.checkpoint), args.base, args.run_config)
    out = export_merged(args.checkpoint, args.out, model_cfg, seed=seed)
    print(f"wrote {out}/config.json and {out}/model.safetensors (the base with {args.checkpoint} merged)")
    return 0


def base_of(adapter_dir: Path, lora, base: str, run_config: str):
    """(the base's model config with ``lora``, the seed of its random init): from ``--base``, the base a warm-up
    trained (the checkpoint's base/, model.lora.warmup = base), the base the adapter names, or the config.json of the
    run that saved it (run_dir/config.json above checkpoints/step_N)."""
    from miles.checkpoints import BASE_DIR
    from miles.model.merged_export import hf_base_config, named_base

    if not base and (adapter_dir / BASE_DIR / "config.json").is_file():
        base = str(adapter_dir / BASE_DIR)
    base = base or ("" if run_config else named_base(adapter_dir))
    if base:
        return hf_base_config(base, lora), 0
    run = Path(run_config) if run_config else adapter_dir.parent.parent / "config.json"
    if not run.is_file():
        raise ValueError(
            f"{adapter_dir} names no base model (base_model_name_or_path is empty: a random-init run) and {run} does "
            "not exist; pass --base HF_DIR, or --run-config with the config.json of the run that saved it"
        )
    from miles.config_file import load_run_config

    cfg = load_run_config(config_file=str(run))
    saved = cfg.model.lora
    if (saved.rank, saved.alpha) != (lora.rank, lora.alpha):
        raise ValueError(
            f"{run} trains LoRA rank {saved.rank} alpha {saved.alpha} but {adapter_dir} holds rank {lora.rank} "
            f"alpha {lora.alpha}; pass --run-config with the config.json of the run that saved it"
        )
    return replace(cfg.model, lora=lora), cfg.seed
