"""Each supported family against transformers on a random-init config (FP32, atol 1e-5): Llama (plain RoPE and
Llama 3's rope_type llama3), Qwen2, Qwen3 and a SmolLM2-shaped Llama, loaded from the directory transformers
saves (sharded with an index for one of them); the tokenizer and chat template come from the same directory;
other architectures are refused by name."""

import pytest
import torch

from miles.model.checkpoint import config_from_checkpoint, read_hf_state_dict
from miles.model.config import ModelConfig
from miles.model.decoder import build_decoder

transformers = pytest.importorskip("transformers")

SMALL = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)
FAMILIES = {
    "llama": (transformers.LlamaConfig, dict(rope_theta=10000.0, tie_word_embeddings=False)),
    "llama3": (
        transformers.LlamaConfig,
        dict(
            rope_theta=500000.0,
            rope_scaling={  # original context 16 << the 40 tokens tested: every frequency band is in play
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    "qwen2": (transformers.Qwen2Config, dict(rope_theta=1000000.0, tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=24, rope_theta=1000000.0, tie_word_embeddings=True)),
    "smollm2": (transformers.LlamaConfig, dict(rope_theta=100000.0, tie_word_embeddings=True, num_key_value_heads=1)),
}


def _hf_model(family):
    cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cls(**{**SMALL, **extra}), dtype=torch.float32).eval()
    with torch.no_grad():  # non-trivial norms and biases, so that a missing one shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    return model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_our_decoder_matches_transformers_logits_for_each_family(tmp_path, family):
    theirs = _hf_model(family)
    theirs.save_pretrained(tmp_path, max_shard_size="40KB" if family == "qwen3" else "1GB")
    cfg = config_from_checkpoint(tmp_path)
    ours = build_decoder(cfg).eval()
    ids = torch.randint(0, SMALL["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, atol=1e-5, rtol=0)
    if family == "qwen3":
        assert (tmp_path / "model.safetensors.index.json").exists() and cfg.qk_norm and not cfg.attention_bias
    if family == "llama3":
        assert cfg.rope_type == "llama3" and cfg.rope_original_max_position_embeddings == 16
        plain = build_decoder(
            ModelConfig.from_hf(tmp_path / "config.json", rope_type="default", checkpoint=str(tmp_path))
        )
        with torch.no_grad():
            assert (plain(ids) - theirs(ids).logits).abs().max() > 1e-3  # 100x the tolerance: the scaling matters


def test_a_sharded_checkpoint_missing_a_shard_is_refused_naming_it(tmp_path):
    _hf_model("qwen3").save_pretrained(tmp_path, max_shard_size="40KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    with pytest.raises(FileNotFoundError, match=rf"lists shards that are not in .*{shards[-1].name}"):
        read_hf_state_dict(tmp_path)


@pytest.mark.parametrize(
    "hf, match",
    [
        ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, "architecture MistralForCausalLM"),
        ({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]}, "Qwen3MoeForCausalLM"),
        ({"model_type": "llama", "architectures": ["LlavaForConditionalGeneration"]}, "LlavaForConditionalGeneration"),
        ({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
        ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window=True"),
    ],
)
def test_unsupported_architectures_are_refused_naming_them_and_what_is_supported(hf, match):
    with pytest.raises(ValueError, match=match) as e:
        ModelConfig.from_hf(hf)
    assert "Qwen3" in str(e.value) or "SiLU" in str(e.value) or "'llama3'" in str(e.value)


def test_the_tokenizer_and_chat_template_come_from_the_checkpoint(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    _hf_model("qwen2").save_pretrained(tmp_path)
    # a byte-level BPE like Qwen's, trained here on a few lines (transformers rebuilds it as the Qwen2 tokenizer)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["user assistant hello world", "What is 2 + 3? Answer with the number only."], trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fast.save_pretrained(tmp_path)
    cfg = config_from_checkpoint(tmp_path)
    assert cfg.tokenizer == f"hf:{tmp_path}"
    from miles.model.tokenizer import load_tokenizer

    t = load_tokenizer(cfg.tokenizer)
    ids = t.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}])
    text = t.decode(ids, skip_special_tokens=False)
    assert text == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    assert (
        ids[0] == t.tok.convert_tokens_to_ids("<|im_start|>")
        and t.tok.convert_tokens_to_ids("<|im_end|>") in t.stop_token_ids
    )
    assert t.decode(t.encode("hello world 42")) == "hello world 42"
    assert config_from_checkpoint(tmp_path, tokenizer="bytes").tokenizer == "bytes"
