"""Each supported family against transformers on a random-init config (FP32, atol 1e-5): Llama (plain RoPE and
Llama 3's rope_type llama3), Qwen2, Qwen3 and a SmolLM2-shaped Llama, loaded from the directory transformers
saves (sharded with an index for one of them); the tokenizer and chat template come from the same directory;
other architectures are refused by name."""

import pytest
import torch

from miles.config import apply_overrides
from miles.model.checkpoint import read_hf_state_dict
from miles.model.config import ModelConfig
from miles.model.decoder import build_decoder
from miles.model.from_checkpoint import config_from_checkpoint
from miles.recipes import quickstart
from tests.model.tiny_checkpoints import FAMILIES, SMALL, save_checkpoint, save_tokenizer
from tests.model.tiny_checkpoints import hf_model as _hf_model

transformers = pytest.importorskip("transformers")


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


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_the_quickstart_given_a_checkpoint_is_that_model_logit_for_logit_with_its_tokenizer(tmp_path, family):
    """`miles train --recipe quickstart --model PATH`'s model: the quickstart's Qwen2 (128 wide, 4 layers, tied,
    rms_norm_eps 1e-6, rope_theta 1e4, byte tokenizer) gives way to the checkpoint's in every field."""
    pytest.importorskip("tokenizers")
    theirs = save_checkpoint(tmp_path, family)
    cfg = apply_overrides(quickstart(), [f"model.checkpoint={tmp_path}"]).model
    assert cfg.tokenizer == f"hf:{tmp_path}" and cfg.architecture == {"qwen3": "qwen3", "llama3": "llama"}[family]
    assert cfg.max_position_embeddings == quickstart().model.max_position_embeddings  # the run's length is kept
    ours = build_decoder(cfg).eval()
    ids = torch.randint(0, SMALL["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, atol=1e-5, rtol=0)
    if family == "llama3":
        assert cfg.rope_type == "llama3" and cfg.rms_norm_eps == 1e-5 and not cfg.tie_word_embeddings
        assert torch.equal(ours.lm_head.weight, theirs.lm_head.weight)  # its own head, not the embeddings


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
    pytest.importorskip("tokenizers")
    _hf_model("qwen2").save_pretrained(tmp_path)
    save_tokenizer(tmp_path)
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
