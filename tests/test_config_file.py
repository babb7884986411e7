"""Config discoverability: every field's meaning (--print-config), config files (TOML, YAML, JSON) under --set, and
"did you mean" for misspelt fields, choices and recipes."""

from __future__ import annotations

import dataclasses
import json
import sys
import tomllib
import typing

import pytest

from miles.config import RunConfig, apply_overrides
from miles.config_check import user_name
from miles.config_doc import config_toml, field_docs
from miles.config_file import load_run_config
from miles.recipes import get_recipe, quickstart


def every_field(cls=RunConfig, prefix=""):
    """(dataclass, field name, dotted path) of every field, sections included."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        yield cls, f.name, prefix + user_name(f.name)  # async_ is written async
        if dataclasses.is_dataclass(hints[f.name]):
            yield from every_field(hints[f.name], f"{prefix}{user_name(f.name)}.")


def test_every_config_field_has_a_one_line_meaning_beside_it():
    undocumented = [path for cls, name, path in every_field() if not field_docs(cls).get(name)]
    assert undocumented == [], f"document these fields with a comment beside them: {undocumented}"


def test_print_config_lists_every_field_with_its_value_and_reads_back_as_the_same_config(tmp_path):
    tricky = ['data.system_prompt=be "brief"\\n', "task.alphabet=abcé", "handoff.offload_rollout_level=kv_cache"]
    cfg = apply_overrides(quickstart(), ["trainer.lr=1e-4", *tricky])
    text = config_toml(cfg, "miles train --set trainer.lr=1e-4")
    table = tomllib.loads(text)
    assert table["trainer"]["lr"] == 1e-4 and table["handoff"]["offload_rollout_level"] == ["kv_cache"]
    for *_, path in every_field():
        *sections, leaf = path.split(".")
        node = table
        for name in sections:  # model.lora.rank: the [model.lora] table inside [model]
            node = node[name]
        assert leaf in node, path
    assert "lr = 0.0001" in text and "# learning rate of the RL steps" in text
    assert "[embedded | http | sglang]" in text  # a Literal's choices, where its comment does not name them
    (tmp_path / "run.toml").write_text(text)
    assert load_run_config(None, str(tmp_path / "run.toml")) == cfg


@pytest.mark.parametrize("recipe", ["quickstart", "trl_parity", "h200_100m", "gb300_kimi_k2_plan", "agent_swe"])
def test_every_recipe_round_trips_through_its_printed_config(tmp_path, recipe):
    cfg = get_recipe(recipe)
    (tmp_path / "r.toml").write_text(config_toml(cfg))
    assert load_run_config(None, str(tmp_path / "r.toml")) == cfg


def write(tmp_path, name: str, text: str) -> str:
    (tmp_path / name).write_text(text)
    return str(tmp_path / name)


def test_a_config_file_goes_on_top_of_its_recipe_and_set_goes_on_top_of_the_file(tmp_path):
    toml = write(tmp_path, "a.toml", 'recipe = "trl_parity"\nnum_steps = 7\n[trainer]\nlr = 2e-4\nbetas = [0.8, 0.9]\n')
    cfg = load_run_config(None, toml, ["num_steps=9"])
    base = get_recipe("trl_parity")
    assert cfg.num_steps == 9 and cfg.trainer.lr == 2e-4 and cfg.trainer.betas == (0.8, 0.9)
    assert cfg.rollout == base.rollout and cfg.recipe == "trl_parity"  # the rest is the file's recipe
    assert load_run_config("quickstart", toml).rollout == quickstart().rollout  # --recipe wins over the file's
    yaml_file = write(tmp_path, "a.yaml", "num_steps: 7\ntrainer:\n  lr: 2.0e-4\n")
    json_file = write(tmp_path, "a.json", json.dumps({"num_steps": 7, "trainer": {"lr": 2e-4}}))
    assert load_run_config(None, yaml_file) == load_run_config(None, json_file)
    assert load_run_config(None, json_file).recipe == "quickstart"  # no recipe named: the default one


def test_a_run_config_json_loads_as_it_was_even_when_its_recipe_is_a_label(tmp_path):
    cfg = apply_overrides(RunConfig(), ["recipe=custom", "num_steps=3", "model.hidden_size=64"])
    assert load_run_config(None, write(tmp_path, "config.json", cfg.to_json())) == cfg


@pytest.mark.parametrize(
    "name, text, message",
    [
        (
            "bad.toml",
            "[trainer]\nlrr = 1e-4\n",
            "--config {f}: unknown config field 'trainer.lrr'.*did you mean trainer.lr",
        ),
        ("bad.toml", "trainer = 3\n", "'trainer' is a section"),
        ("bad.toml", "[trainer\n", "--config {f}: not a TOML RunConfig"),
        ("bad.json", "[1, 2]", "--config {f}: holds a JSON list, not a RunConfig object"),
        ("bad.yaml", "- 1\n- 2\n", "--config {f}: holds a YAML list"),
        ("bad.toml", 'recipe = "quickstat"\n', "recipe = 'quickstat' is not a recipe; did you mean 'quickstart'"),
        ("bad.toml", '[rollout]\nengine = "sglnag"\n', "did you mean 'sglang'"),
        ("config", "{", "--config {f}: not a JSON RunConfig"),  # no suffix: JSON, as a run's config.json
    ],
)
def test_a_bad_config_file_is_refused_naming_the_file_and_the_fix(tmp_path, name, text, message):
    f = write(tmp_path, name, text)
    with pytest.raises(ValueError, match=message.format(f=f).replace("[", r"\[")):
        load_run_config(None, f)


def test_a_missing_config_file_or_pyyaml_says_what_to_do(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="--config .*nope.toml: no such file"):
        load_run_config(None, str(tmp_path / "nope.toml"))
    monkeypatch.setitem(sys.modules, "yaml", None)  # PyYAML not installed
    with pytest.raises(ImportError, match="needs PyYAML: pip install pyyaml"):
        load_run_config(None, write(tmp_path, "a.yml", "num_steps: 3\n"))


@pytest.mark.parametrize(
    "override, suggestion",
    [
        ("trainer.lrr=1e-4", "did you mean trainer.lr?"),
        ("lr=1e-4", "did you mean trainer.lr?"),  # the section left out
        ("trainr.lr=1e-4", "did you mean trainer.lr?"),  # the section misspelt
        ("num_step=5", "did you mean num_steps?"),
        ("rollout.samples_per_prompt=2", "did you mean rollout.n_samples_per_prompt?"),
        ("rollout.advantage_estimator=grpoo", "did you mean 'grpo'?"),
        ("trainer.loss=gspoo", "did you mean 'gspo'?"),
    ],
)
def test_a_misspelt_field_or_choice_names_the_closest_valid_one(override, suggestion):
    with pytest.raises(ValueError) as e:
        apply_overrides(quickstart(), [override])
    assert suggestion in str(e.value)


def test_a_name_far_from_every_field_gets_no_guess_but_the_valid_list():
    with pytest.raises(ValueError) as e:
        apply_overrides(quickstart(), ["trainer.nope=1"])
    assert "did you mean" not in str(e.value) and "(valid: ['backend'" in str(e.value)
