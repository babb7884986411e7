"""CPU tests of the Megatron backend's pure parts: HF <-> Megatron weight layouts, and the install hint."""

import importlib.util

import pytest
import torch

from miles.model.config import ModelConfig
from miles.model.decoder import build_decoder
from miles.train.megatron_convert import fuse_qkv, hf_to_megatron, megatron_to_hf, split_qkv

HAS_MEGATRON = (
    importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
)


@pytest.mark.parametrize(
    "tie,bias,heads,kv", [(True, True, 4, 2), (False, False, 4, 1), (True, False, 4, 4), (False, True, 6, 2)]
)
def test_hf_to_megatron_to_hf_round_trip_is_bit_exact(tie, bias, heads, kv):
    cfg = ModelConfig(
        tie_word_embeddings=tie,
        attention_bias=bias,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        hidden_size=96,
        num_hidden_layers=2,
        architecture="qwen2" if bias else "llama",
    )
    hf = build_decoder(cfg, seed=3).hf_state_dict()
    back = dict(megatron_to_hf(hf_to_megatron(hf, cfg).items(), cfg))
    assert back.keys() == hf.keys()
    for name, t in hf.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


def test_fused_qkv_puts_each_kv_heads_queries_then_its_key_and_value():
    cfg = ModelConfig(hidden_size=8, num_attention_heads=4, num_key_value_heads=2, head_dim=2)
    # label every row with (kind, head): q rows 0..7 -> 0..7, k rows -> 100+, v rows -> 200+
    q, k, v = torch.arange(8.0)[:, None], 100 + torch.arange(4.0)[:, None], 200 + torch.arange(4.0)[:, None]
    fused = fuse_qkv(q, k, v, cfg).flatten().tolist()
    assert fused == [0, 1, 2, 3, 100, 101, 200, 201, 4, 5, 6, 7, 102, 103, 202, 203]
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fuse_qkv(q, k, v, cfg), cfg), (q, k, v)))


def test_megatron_names_cover_every_hf_tensor_once():
    cfg = ModelConfig(tie_word_embeddings=False)
    mcore = hf_to_megatron(build_decoder(cfg, seed=0).hf_state_dict(), cfg)
    assert "output_layer.weight" in mcore and "decoder.layers.0.self_attention.linear_qkv.bias" in mcore
    assert mcore["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * cfg.intermediate_size, cfg.hidden_size)
    with pytest.raises(KeyError, match="local GPT spec"):
        list(megatron_to_hf([("decoder.layers.0.mlp.router.weight", torch.zeros(1))], cfg))


def test_the_backend_module_imports_without_megatron_core():
    import miles.train.megatron_backend as mb

    assert "pip install 'miles[gpu]'" in mb.INSTALL_HINT


@pytest.mark.skipif(HAS_MEGATRON, reason="megatron-core is installed here")
def test_building_the_backend_without_megatron_core_says_how_to_install_it():
    from miles.config import TrainerConfig
    from miles.train.megatron_backend import MegatronBackend

    with pytest.raises(ImportError, match=r"pip install 'miles\[gpu\]'"):
        MegatronBackend(ModelConfig(), TrainerConfig(backend="megatron"), device="cuda")
