"""``model.checkpoint`` means "this model" (issue 30, the review's U1-U3 and M31/M32): set through --model or --set
on any recipe, the run's model is the checkpoint's, its tokenizer too; a recipe value that differs is replaced
with a note, an explicit one refused; the weights' headers are checked before Ray starts."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import save_file

from miles.cli import EXIT_BAD_INPUT, explain
from miles.config import apply_overrides
from miles.model.checkpoint import read_hf_state_dict, save_hf
from miles.model.config import ModelConfig
from miles.model.decoder import build_decoder
from miles.model.from_checkpoint import check_weights_match
from miles.recipes import quickstart

TINY = dict(  # every architecture field differs from the quickstart's
    architecture="llama",
    attention_bias=False,
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=1,
    rope_theta=1e6,
    rms_norm_eps=1e-5,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def _saved(directory, **fields):
    model = build_decoder(ModelConfig(**{**TINY, **fields}), seed=3)
    save_hf(model, directory)
    return model


def test_a_checkpoint_set_on_the_quickstart_brings_its_architecture_and_says_what_it_replaced(tmp_path, caplog):
    """U1, M31: the recipe's sizes, rope_theta and rms_norm_eps gave way to nothing; config.json was never read."""
    theirs = _saved(tmp_path)
    with caplog.at_level(logging.INFO, logger="miles"):
        cfg = apply_overrides(quickstart(), [f"model.checkpoint={tmp_path}"])
    for k in ("architecture", "hidden_size", "num_hidden_layers", "num_key_value_heads", "rope_theta", "rms_norm_eps"):
        assert getattr(cfg.model, k) == TINY[k], k
    note = next(r.getMessage() for r in caplog.records if "model from" in r.getMessage())
    assert str(tmp_path / "config.json") in note and "rms_norm_eps 1e-06 -> 1e-05" in note
    assert "tie_word_embeddings True -> False" in note and "hidden_size 128 -> 64" in note
    ours = build_decoder(cfg.model)
    ids = torch.arange(30).reshape(1, 30)
    with torch.no_grad():
        assert torch.equal(ours(ids), theirs(ids))
    assert cfg.model.max_position_embeddings == 64  # the run's length (the quickstart's), within the checkpoint's 256


def test_an_untied_checkpoint_keeps_its_own_head_and_a_tied_model_never_drops_it_silently(tmp_path):
    """M32: the quickstart ties its head; an untied checkpoint's lm_head was dropped without a word."""
    theirs = _saved(tmp_path)
    cfg = apply_overrides(quickstart(), [f"model.checkpoint={tmp_path}"])
    assert not cfg.model.tie_word_embeddings
    assert torch.equal(build_decoder(cfg.model).lm_head.weight, theirs.lm_head.weight)
    with pytest.raises(ValueError) as e:  # asked for by name: refused, the checkpoint's value named
        apply_overrides(quickstart(), [f"model.checkpoint={tmp_path}", "model.tie_word_embeddings=true"])
    assert "model.tie_word_embeddings=True (it says False)" in str(e.value) and explain(e.value)[0] == EXIT_BAD_INPUT
    tied = ModelConfig(**{**TINY, "tie_word_embeddings": True}, checkpoint=str(tmp_path))
    with pytest.raises(ValueError, match="has its own lm_head.weight, unlike its embeddings"):
        build_decoder(tied)  # a hand-built config, past the run's resolution: refused at load


def test_an_explicit_override_that_contradicts_the_checkpoint_is_refused_and_one_that_agrees_is_kept(tmp_path):
    _saved(tmp_path)
    with pytest.raises(ValueError) as e:
        apply_overrides(quickstart(), [f"model.checkpoint={tmp_path}", "model.hidden_size=128", "model.rope_theta=1e4"])
    line = explain(e.value)[1]
    assert "model.hidden_size=128 (it says 64)" in line and "model.rope_theta=10000.0 (it says 1000000.0)" in line
    assert str(tmp_path / "config.json") in line and "drop those overrides" in line
    cfg = apply_overrides(
        quickstart(), [f"model.checkpoint={tmp_path}", "model.hidden_size=64", "model.dtype=bfloat16"]
    )
    assert cfg.model.hidden_size == 64 and cfg.model.dtype == "bfloat16"  # the run's precision is the run's choice
    with pytest.raises(ValueError, match="longer than .* allows \\(256\\); use at most 256"):
        apply_overrides(quickstart(), [f"model.checkpoint={tmp_path}", "model.max_position_embeddings=512"])


def test_config_from_checkpoint_applies_the_explicit_fields_it_is_given_and_refuses_contradictions(tmp_path):
    """Recipes call config_from_checkpoint(path, max_position_embeddings=256): the value was checked against the
    checkpoint but not applied (the run got ModelConfig's default 512)."""
    from miles.model.from_checkpoint import config_from_checkpoint

    _saved(tmp_path)
    cfg = config_from_checkpoint(tmp_path, max_position_embeddings=128, dtype="bfloat16", tokenizer="bytes")
    assert (cfg.max_position_embeddings, cfg.dtype, cfg.tokenizer) == (128, "bfloat16", "bytes")
    assert cfg.hidden_size == 64 and config_from_checkpoint(tmp_path, hidden_size=64).hidden_size == 64
    assert config_from_checkpoint(tmp_path).max_position_embeddings == 256  # unasked: the default, at most its own
    with pytest.raises(ValueError, match="model.hidden_size=128 \\(it says 64\\)"):
        config_from_checkpoint(tmp_path, hidden_size=128)
    with pytest.raises(ValueError, match="longer than .* allows \\(256\\); use at most 256"):
        config_from_checkpoint(tmp_path, max_position_embeddings=512)
    with pytest.raises(ValueError, match="model.hidden_sise is not a model field"):
        config_from_checkpoint(tmp_path, hidden_sise=64)


def test_a_recipe_that_already_has_the_checkpoint_is_not_rebuilt_unless_a_model_field_is_set(tmp_path):
    """A run's saved config (serve --config, resume) keeps what it was resolved to, an explicit tokenizer too."""
    _saved(tmp_path)
    cfg = apply_overrides(quickstart(), [f"model.checkpoint={tmp_path}", "model.tokenizer=bytes"])
    again = apply_overrides(cfg, ["num_steps=3"])
    assert again.model == cfg.model and again.model.tokenizer == "bytes"
    with pytest.raises(ValueError, match="model.num_hidden_layers=3 \\(it says 2\\)"):
        apply_overrides(cfg, ["model.num_hidden_layers=3"])


def test_the_checkpoints_tokenizer_is_used_unless_one_is_set_and_a_different_vocabulary_is_said(tmp_path, caplog):
    """U2: without model.tokenizer the checkpoint trained silently on the byte tokenizer."""
    pytest.importorskip("tokenizers")
    from tests.model.tiny_checkpoints import save_tokenizer

    _saved(tmp_path)
    with caplog.at_level(logging.WARNING, logger="miles"):
        cfg = apply_overrides(quickstart(), [f"model.checkpoint={tmp_path}"])
    assert cfg.model.tokenizer == "bytes" and "has no tokenizer files" in caplog.text  # nothing else to use: said
    save_tokenizer(tmp_path)
    caplog.clear()
    assert apply_overrides(quickstart(), [f"model.checkpoint={tmp_path}"]).model.tokenizer == f"hf:{tmp_path}"
    with caplog.at_level(logging.WARNING, logger="miles"):
        cfg = apply_overrides(quickstart(), [f"model.checkpoint={tmp_path}", "model.tokenizer=bytes"])
    assert cfg.model.tokenizer == "bytes"
    assert "model.tokenizer = 'bytes' has 264 ids" in caplog.text and f"(hf:{tmp_path}) 300" in caplog.text
    small = tmp_path / "small"
    _saved(small, vocab_size=280)  # fewer embeddings than the tokenizer has ids
    save_tokenizer(small)
    with pytest.raises(ValueError, match="has 300 ids, the checkpoint's vocab_size is 280"):
        apply_overrides(quickstart(), [f"model.checkpoint={small}"])


def test_weights_that_do_not_match_the_model_are_refused_from_their_headers_before_ray_starts(tmp_path, monkeypatch):
    """U3: the mismatch was found inside a Ray actor after ~30 s, as a 1,274-character ActorDiedError. (Whether
    Ray is up says nothing here: an earlier test's session cluster may be; so starting Ray is recorded instead.)"""
    import miles.cluster
    from miles.driver import train

    built = []
    monkeypatch.setattr(miles.cluster, "start_ray", lambda *a, **k: built.append(a) or pytest.fail("Ray started"))

    _saved(tmp_path)
    unresolved = quickstart().to_dict()  # the recipe's model with a checkpoint it does not describe
    unresolved["model"]["checkpoint"] = str(tmp_path)
    unresolved["run_dir"] = str(tmp_path / "run")
    from miles.config import RunConfig

    cfg = RunConfig.from_dict(unresolved)
    with pytest.raises(ValueError) as e:
        train(cfg, progress=False)
    assert built == []
    line = explain(e.value)[1]
    assert "lacks" in line and "tensors of another shape" in line and "--model PATH" in line


def test_a_config_json_that_disagrees_with_its_weights_is_refused_naming_the_tensors(tmp_path):
    _saved(tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "intermediate_size": 128, "attention_bias": True}))
    cfg = apply_overrides(quickstart(), [f"model.checkpoint={tmp_path}"])
    with pytest.raises(ValueError) as e:
        check_weights_match(cfg.model)
    line = explain(e.value)[1]
    assert (
        "model.layers.0.self_attn.q_proj.bias" in line and "mlp.gate_proj.weight (96, 64) (expected (128, 64))" in line
    )
    sd = read_hf_state_dict(tmp_path)
    sd["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    save_file(sd, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="has 1 tensors the model does not, e.g. \\['model.layers.0.self_attn.extra"):
        check_weights_match(apply_overrides(quickstart(), [f"model.checkpoint={tmp_path}"]).model)
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match="model.safetensors is not a readable safetensors file"):
        check_weights_match(apply_overrides(quickstart(), [f"model.checkpoint={tmp_path}"]).model)


@pytest.mark.parametrize("target", ["config.json", "empty"])
def test_a_checkpoint_path_that_is_not_a_model_is_refused_naming_what_to_give(tmp_path, target):
    _saved(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError) as e:
        apply_overrides(quickstart(), [f"model.checkpoint={tmp_path / target}"])
    assert explain(e.value)[0] == EXIT_BAD_INPUT and "give an HF directory" in str(e.value)


def test_a_checkpoint_not_on_this_machine_is_kept_as_set_said_and_refused_when_the_run_starts_here(tmp_path, caplog):
    """A cluster's nodes (ray_address) or SGLang servers (rollout.engine_urls) may hold a path this machine lacks."""
    from miles.preflight import check_environment

    with caplog.at_level(logging.WARNING, logger="miles"):
        cfg = apply_overrides(quickstart(), [f"model.checkpoint={tmp_path / 'nosuch'}"])
    assert "is not on this machine" in caplog.text and cfg.model.hidden_size == quickstart().model.hidden_size
    check_environment(apply_overrides(cfg, ["ray_address=ray://head:10001"]))  # the cluster's nodes decide
    with pytest.raises(FileNotFoundError, match="nosuch' does not exist; give an HF directory"):
        check_environment(cfg)


def test_train_plan_and_serve_take_the_model_flag_as_the_checkpoint(tmp_path, capsys):
    from miles.cli.plan import main as plan
    from miles.cli.serve import _parser as serve_parser
    from miles.config_args import config_from_args

    _saved(tmp_path)
    assert plan(["--model", str(tmp_path), "--json", "--mode", "cpu"]) == 0
    model = json.loads(capsys.readouterr().out)["plans"]["cpu"]["model"]
    assert model["name"] == "embedded llama" and model["parameters"] == ModelConfig(**TINY).num_parameters
    served = config_from_args(serve_parser().parse_args(["--model", str(tmp_path)]))
    assert served.model.hidden_size == 64 and served.model.checkpoint == str(tmp_path)
    with pytest.raises(ValueError, match="model.hidden_size=32 \\(it says 64\\)"):  # --set is held against --model
        config_from_args(serve_parser().parse_args(["--model", str(tmp_path), "--set", "model.hidden_size=32"]))
    shipped = ["--recipe", "gb300_qwen3_235b_plan", "--model", str(tmp_path / "config.json"), "--json", "--mode", "cpu"]
    assert plan(shipped) in (0, 3)  # a planning recipe plans the model given in place of its handoff.plan_model
    planned = json.loads(capsys.readouterr().out)["plans"]["cpu"]["model"]
    assert planned["name"] == str(tmp_path / "config.json") and planned["parameters"] == model["parameters"]


def test_a_printed_config_edited_to_name_a_checkpoint_takes_the_checkpoints_model(tmp_path):
    """--print-config writes every field; a file that names a checkpoint and repeats the recipe's architecture
    fields does not contradict it (only fields changed from the recipe are choices against it)."""
    from miles.config_doc import config_toml
    from miles.config_file import load_run_config

    _saved(tmp_path / "ckpt")
    text = config_toml(quickstart(), "quickstart").replace('checkpoint = ""', f'checkpoint = "{tmp_path / "ckpt"}"')
    (tmp_path / "run.toml").write_text(text)
    cfg = load_run_config(None, str(tmp_path / "run.toml"))
    assert cfg.model.hidden_size == 64 and cfg.model.architecture == "llama"
    edited = text.replace("hidden_size = 128", "hidden_size = 96")
    (tmp_path / "run.toml").write_text(edited)
    with pytest.raises(ValueError, match="model.hidden_size=96 \\(it says 64\\)"):
        load_run_config(None, str(tmp_path / "run.toml"))


def test_a_gguf_checkpoint_is_that_model_too_and_a_config_that_does_not_describe_it_is_refused(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    from tests.model.tiny_checkpoints import write_gguf

    monkeypatch.setenv("MILES_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_gguf(path, seed=0)
    cfg = apply_overrides(quickstart(), [f"model.checkpoint={path}"])
    m = cfg.model
    assert (m.architecture, m.vocab_size, m.hidden_size, m.num_hidden_layers, m.num_key_value_heads) == (
        "llama",
        300,
        16,
        1,
        1,
    )
    assert m.tie_word_embeddings and m.rms_norm_eps == pytest.approx(1e-5) and m.tokenizer == f"hf:{path}"
    check_weights_match(m)
    assert torch.equal(
        build_decoder(m).model.embed_tokens.weight, read_hf_state_dict(path)["model.embed_tokens.weight"]
    )
    unresolved = ModelConfig(**{**quickstart().model.as_dict(), "checkpoint": str(path)})
    with pytest.raises(ValueError, match="does not describe .*tiny.gguf \\(GGUF metadata\\): architecture 'qwen2'"):
        check_weights_match(unresolved)
