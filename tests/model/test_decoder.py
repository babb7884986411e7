import pytest
import torch

from miles.model.checkpoint import save_hf
from miles.model.config import ModelConfig
from miles.model.decoder import KVCache, build_decoder
from miles.model.from_checkpoint import config_from_checkpoint


@pytest.mark.parametrize("arch, tied", [("qwen2", True), ("llama", False)])
def test_logits_match_transformers_on_a_saved_checkpoint(tmp_path, arch, tied):
    transformers = pytest.importorskip("transformers")
    cfg = ModelConfig(
        architecture=arch,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
        attention_bias=arch == "qwen2",
        vocab_size=300,
    )
    ours = build_decoder(cfg, seed=3).eval()
    with torch.no_grad():  # non-trivial norms and biases so that every parameter matters
        for name, p in ours.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    save_hf(ours, tmp_path)
    cls = {"qwen2": transformers.Qwen2ForCausalLM, "llama": transformers.LlamaForCausalLM}[arch]
    theirs = cls.from_pretrained(tmp_path, torch_dtype=torch.float32).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 17))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, atol=1e-5, rtol=0)


def test_checkpoint_round_trip_rebuilds_the_same_model(tmp_path):
    cfg = ModelConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    a = build_decoder(cfg, seed=1)
    save_hf(a, tmp_path)
    b = build_decoder(config_from_checkpoint(tmp_path), seed=99)
    ids = torch.randint(0, cfg.vocab_size, (1, 9))
    assert torch.equal(a(ids), b(ids))


def test_decoding_against_the_kv_cache_matches_the_full_forward(tiny_model_cfg):
    m = build_decoder(tiny_model_cfg, seed=0).eval()
    ids = torch.randint(0, tiny_model_cfg.vocab_size, (3, 12))
    with torch.no_grad():
        full = m(ids)
        cache = KVCache.allocate(tiny_model_cfg, 4, 32, "cpu", torch.float32)
        steps = [m(ids[:, :5], cache=cache, cache_pos=0)] + [
            m(ids[:, t : t + 1], cache=cache, cache_pos=t) for t in range(5, 12)
        ]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=0)


def test_bad_architecture_values_are_rejected_with_the_fix():
    with pytest.raises(ValueError, match="not a multiple of model.num_key_value_heads = 3"):
        ModelConfig(num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="model_type 'mistral' is not supported"):
        ModelConfig.from_hf({"model_type": "mistral"})


def test_parameter_count_formula_matches_the_module(tiny_model_cfg):
    assert tiny_model_cfg.num_parameters == sum(p.numel() for p in build_decoder(tiny_model_cfg).parameters())
