"""Hostile checkpoints (the reliability review's M cases): a config.json whose fields have the wrong type, a shard
index that points outside the checkpoint or is not a map, NaN weights, a cut GGUF file, two GGUF files the old
cache could not tell apart. Each is refused with one line naming the file, the field or tensor, the value and
the fix (exit code 2 through the CLI's ``explain``), or, for the cache, read as what it is."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from miles.cli import EXIT_BAD_INPUT, explain
from miles.config import apply_overrides
from miles.model.checkpoint import read_hf_state_dict, save_hf
from miles.model.config import ModelConfig
from miles.model.decoder import build_decoder
from miles.recipes import quickstart

TINY = dict(
    architecture="llama",
    attention_bias=False,
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
)


def _saved(directory, **fields):
    """A checkpoint miles itself wrote (config.json + model.safetensors), from a random-init decoder."""
    model = build_decoder(ModelConfig(**{**TINY, **fields}))
    save_hf(model, directory)
    return model


def _refused(e: pytest.ExceptionInfo, *needles: str) -> str:
    code, line = explain(e.value)
    assert code == EXIT_BAD_INPUT and "\n" not in line, (code, line)
    for needle in needles:
        assert needle in line, (needle, line)
    return line


@pytest.mark.parametrize(
    "case, field, value, want",
    [
        ("M4", "hidden_size", "64", "a positive integer"),
        ("M5", "hidden_size", 64.5, "a positive integer"),
        ("M6", "tie_word_embeddings", "false", "true or false"),
        ("M7", "num_hidden_layers", True, "a positive integer"),
        ("M8", "rope_theta", None, "a positive number"),
        ("M9", "rms_norm_eps", "abc", "a finite positive number"),
        ("bool as int", "attention_bias", 0, "true or false"),
        ("inf", "rms_norm_eps", float("inf"), "a finite positive number"),
        ("nested", "rope_scaling", {"rope_type": "llama3", "factor": "8", "low_freq_factor": 1.0}, "a finite"),
    ],
)
def test_a_config_json_field_of_the_wrong_type_is_refused_naming_file_field_and_value(
    tmp_path, case, field, value, want
):
    hf = ModelConfig(**TINY).to_hf()
    hf[field] = value
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError) as e:
        ModelConfig.from_hf(tmp_path / "config.json")
    shown = "factor = '8'" if case == "nested" else f"{field} = {value!r}"
    _refused(e, str(tmp_path / "config.json"), shown, want)


@pytest.mark.parametrize(
    "text, kind", [("[1, 2]", "JSON list"), ('"llama"', "JSON string"), ("{oops", "not valid JSON")]
)
def test_a_config_json_that_is_not_an_object_is_refused_naming_the_file(tmp_path, text, kind):
    """M12: a config.json holding a list was an uncaught TypeError."""
    _saved(tmp_path)
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError) as e:
        apply_overrides(quickstart(), [f"model.checkpoint={tmp_path}"])
    _refused(e, str(tmp_path / "config.json"), kind)


def test_a_checkpoint_with_nan_or_inf_weights_is_refused_naming_the_tensor(tmp_path):
    """M21: refused, not warned about: a NaN weight makes every logit NaN, so nothing could be learned from it."""
    _saved(tmp_path)
    sd = read_hf_state_dict(tmp_path)
    sd["model.layers.1.mlp.up_proj.weight"][3, :5] = float("nan")
    sd["model.norm.weight"][0] = float("inf")
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(ValueError) as e:
        build_decoder(ModelConfig.from_hf(tmp_path / "config.json", checkpoint=str(tmp_path)))
    _refused(e, "NaN or inf", "model.layers.1.mlp.up_proj.weight (5 of 6144)", "model.norm.weight (1 of 64)")


def _index(directory, names, shard_of):
    """An index that maps each tensor name to ``shard_of(name)``."""
    index = {"metadata": {}, "weight_map": {k: shard_of(k) for k in names}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def test_an_index_naming_a_shard_outside_the_checkpoint_is_refused_before_opening_it(tmp_path):
    """M25: a valid shard in a sibling directory was loaded; M23: ../../etc/passwd was opened as safetensors."""
    inside, outside = tmp_path / "ckpt", tmp_path / "outside_src"
    _saved(inside)
    _saved(outside)
    (inside / "model.safetensors").rename(inside / "model-1.safetensors")
    names = list(read_hf_state_dict(inside))
    _index(inside, names, lambda k: "../outside_src/model.safetensors" if "norm" in k else "model-1.safetensors")
    with pytest.raises(ValueError) as e:
        read_hf_state_dict(inside)
    _refused(e, "'../outside_src/model.safetensors'", "not a file inside", str(inside))
    _index(inside, names, lambda k: "../../../../../../../../etc/passwd")
    with pytest.raises(ValueError) as e:
        read_hf_state_dict(inside)
    _refused(e, "etc/passwd", "not a file inside")
    _index(inside, names, lambda k: "/etc/passwd")
    with pytest.raises(ValueError, match="not a file inside"):
        read_hf_state_dict(inside)


def test_a_shard_reached_through_a_link_inside_the_checkpoint_still_loads(tmp_path):
    """The Hugging Face cache links every file of a snapshot to a blob outside it: a name is judged, not a target."""
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    _saved(blobs)
    snap.mkdir(parents=True)
    for f in ("config.json", "model.safetensors"):
        os.symlink(blobs / f, snap / f)
    _index(snap, list(read_hf_state_dict(blobs)), lambda k: "model.safetensors")
    assert torch.equal(read_hf_state_dict(snap)["model.norm.weight"], read_hf_state_dict(blobs)["model.norm.weight"])


@pytest.mark.parametrize("weight_map", [["model.safetensors"], {"model.norm.weight": 3}, None, "model.safetensors"])
def test_an_index_whose_weight_map_is_not_a_map_of_names_is_refused(tmp_path, weight_map):
    """M26: a weight_map that was a list gave an uncaught AttributeError."""
    _saved(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError) as e:
        read_hf_state_dict(tmp_path)
    _refused(e, "model.safetensors.index.json", "weight_map", "tensor name -> shard file name")


@pytest.mark.parametrize("keep", [0.1, 0.5, 0.97])
def test_a_cut_gguf_file_is_refused_in_one_line_naming_it(tmp_path, keep):
    """M30: the first MiB of a real GGUF gave an uncaught struct.error; a cut inside the tensor data a reshape
    error that did not say the file was short."""
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    from tests.model.tiny_checkpoints import write_gguf

    whole = tmp_path / "whole.gguf"
    write_gguf(whole, seed=0)
    cut = tmp_path / "model.gguf"
    cut.write_bytes(whole.read_bytes()[: int(whole.stat().st_size * keep)])
    with pytest.raises(ValueError) as e:
        apply_overrides(quickstart(), [f"model.checkpoint={cut}"])
    _refused(e, str(cut), "not a complete GGUF file", "download it again")
    with pytest.raises(ValueError, match="not a complete GGUF file"):
        read_hf_state_dict(cut)


def test_the_gguf_cache_serves_each_file_its_own_weights_whatever_its_name_size_and_mtime(tmp_path, monkeypatch):
    """M33: keyed by (stem, size, whole-second mtime), a second model.gguf of the same size and mtime, in another
    directory or written over the first, got the first one's cached weights. Keyed by content: one entry per
    content, found again for a copy."""
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    from gguf import GGUFReader

    from tests.model.tiny_checkpoints import write_gguf

    monkeypatch.setenv("MILES_CACHE_DIR", str(tmp_path / "cache"))
    a, b = tmp_path / "a" / "model.gguf", tmp_path / "b" / "model.gguf"
    for path, seed in ((a, 0), (b, 1)):
        path.parent.mkdir()
        write_gguf(path, seed=seed)
        os.utime(path, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
    assert a.stat().st_size == b.stat().st_size

    def embeddings(path):  # the file's own token_embd, as written (FP32, [vocab, hidden])
        t = next(t for t in GGUFReader(path).tensors if t.name == "token_embd.weight")
        return torch.from_numpy(t.data.copy()).reshape(300, 16)

    assert torch.equal(read_hf_state_dict(a)["model.embed_tokens.weight"], embeddings(a))
    assert torch.equal(read_hf_state_dict(b)["model.embed_tokens.weight"], embeddings(b))
    b.write_bytes(a.read_bytes())  # b now holds a's bytes: a's cache entry serves it, no third entry
    assert torch.equal(read_hf_state_dict(b)["model.embed_tokens.weight"], embeddings(a))
    assert len(list((tmp_path / "cache" / "gguf").iterdir())) == 2
    a.write_bytes(b"".join([a.read_bytes()[:-64], torch.ones(16).numpy().tobytes()]))  # the last tensor's tail
    os.utime(a, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
    assert torch.equal(read_hf_state_dict(a)["model.layers.0.mlp.down_proj.weight"][-1, -16:], torch.ones(16))
