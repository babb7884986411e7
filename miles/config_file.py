"""A run config from a file: ``miles train --config run.toml`` (TOML, YAML or JSON; a run's ``config.json`` too).

The file's fields go on top of a recipe, and ``--set`` on top of the file:

    recipe = "quickstart"   # the base recipe (``--recipe`` wins when given; default quickstart)
    num_steps = 50
    [trainer]
    lr = 1e-4

``miles train --print-config`` writes this format with every field, its value and its meaning. The format goes by
the suffix (.toml, .yaml or .yml; anything else is read as JSON).
"""

from __future__ import annotations

import json
from pathlib import Path

from miles.config_check import did_you_mean

DEFAULT_RECIPE = "quickstart"


def read_config_file(path: str) -> dict:
    """The file's table of sections and fields, by its suffix: .toml, .yaml / .yml, else JSON (a run's
    config.json); FileNotFoundError / ValueError / ImportError naming the file."""
    p = Path(path)
    try:
        text = p.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"--config {path}: no such file") from None
    except IsADirectoryError:
        raise IsADirectoryError(f"--config {path} is a directory; give a .toml, .yaml or .json file") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"--config {path}: not a {_format(p)} RunConfig ({e})") from None
    d = _parse(text, p)
    if not isinstance(d, dict):
        raise ValueError(f"--config {path}: holds a {_format(p)} {type(d).__name__}, not a RunConfig object")
    return d


def _format(p: Path) -> str:
    return {".toml": "TOML", ".yaml": "YAML", ".yml": "YAML"}.get(p.suffix, "JSON")


def _parse(text: str, p: Path):
    if _format(p) == "TOML":
        import tomllib

        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"--config {p}: not a TOML RunConfig ({e})") from None
    if _format(p) == "JSON":
        try:
            return json.loads(text)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"--config {p}: not a JSON RunConfig ({str(e)[:120]}); give a run's config.json") from None
    try:
        import yaml
    except ImportError:
        raise ImportError(
            f"--config {p} is YAML, which needs PyYAML: pip install pyyaml (or write it as TOML, which Python reads "
            "without an extra package: miles train --print-config > run.toml)"
        ) from None
    try:
        return yaml.safe_load(text) or {}
    except (yaml.YAMLError, RecursionError) as e:
        raise ValueError(f"--config {p}: not a YAML RunConfig ({' '.join(str(e).split())[:200]})") from None


def flatten(d: dict, prefix: str = "") -> list[tuple[str, object]]:
    """``{"trainer": {"lr": 1e-4}, "seed": 1}`` -> ``[("trainer.lr", 1e-4), ("seed", 1)]``."""
    out = []
    for k, v in d.items():
        out += flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else [(prefix + str(k), v)]
    return out


def base_recipe(recipe: str | None, file_fields: dict) -> str:
    """The recipe a config file's fields go on top of: ``--recipe``, else the file's ``recipe`` when it names one,
    else quickstart. A file's recipe that is not a recipe is a run's label (a run's config.json built in Python
    says "custom"), unless it is a near miss of one, which is refused."""
    from miles.recipes import RECIPES

    if recipe:
        return recipe
    named = file_fields.get("recipe")
    if named in RECIPES:
        return named
    if isinstance(named, str) and (hint := did_you_mean(named, RECIPES)):
        raise ValueError(f"--config: recipe = {named!r} is not a recipe{hint}")
    return DEFAULT_RECIPE


def load_run_config(
    recipe: str | None = None, config_file: str = "", overrides: list[str] = (), *, model: str = "", plan: bool = False
):
    """The RunConfig of a command line: the recipe, the config file's fields on it, then ``--model`` (the model's
    checkpoint; ``plan``: handoff.plan_model instead where the recipe plans with one), then ``--set``."""
    from miles.config import apply_overrides, apply_values
    from miles.recipes import get_recipe

    fields = read_config_file(config_file) if config_file else {}
    cfg = get_recipe(base_recipe(recipe, fields))
    if fields:
        try:
            cfg = apply_values(cfg, flatten(fields), repeats_are_choices=False)  # --print-config lists them all
        except ValueError as e:
            raise ValueError(f"--config {config_file}: {e}") from None
    if model:  # before --set, so that a --set model.X= is held against the checkpoint
        field = "handoff.plan_model" if plan and cfg.handoff.plan_model else "model.checkpoint"
        overrides = [f"{field}={model}", *overrides]
    return apply_overrides(cfg, list(overrides))
