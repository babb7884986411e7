"""Exact tokens across turns: a 4-turn tool conversation (three calculator calls, then the answer) played through
the episode machinery with scripted model replies, for SmolLM2's, Qwen3's and Llama 3.1's real chat templates.
Where the template is append-only the trajectory equals the full re-render token for token (and transformers' own
apply_chat_template); where it is not (Qwen3) the drift is reported, never patched; a template that drops the newline
after earlier assistant headers (the verl#6501 class) and a non-canonical token split are each caught and named."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from family_tokenizers import TEMPLATES, family_tokenizer  # noqa: E402

from miles.envs.calculator import TOOL  # noqa: E402
from miles.envs.drift import compare, rerender_ids  # noqa: E402
from miles.envs.episode import Episode, Limits  # noqa: E402
from miles.envs.renderer import Renderer  # noqa: E402
from miles.envs.runner import EpisodeRunner  # noqa: E402
from miles.protocols.engine import GenerateOutput, SamplingParams  # noqa: E402

QUESTION = "What is (12 + 7) * 3 - 4 * 5? Give the final answer as a number."
CALLS = [("12 + 7", "19"), ("19 * 3", "57"), ("57 - 4 * 5", "37")]
LIMITS = Limits(max_turns=6, max_tokens_per_turn=200, max_episode_tokens=4000, step_timeout_s=10.0)


class ScriptedEnv:
    """The calculator conversation: three tool results, then the episode ends on the answer."""

    def __init__(self):
        self.turn = 0

    def reset(self, row):
        return [{"role": "user", "content": QUESTION}], [TOOL]

    def step(self, message):
        self.turn += 1
        if message.get("tool_calls"):
            return [{"role": "tool", "content": CALLS[self.turn - 1][1], "name": "calculate"}], 0.0, False, {}
        return [], 1.0, True, {"passed": "37" in message["content"]}


def assistant_turns(renderer: Renderer) -> list[dict]:
    calls = [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "calculate", "arguments": {"expression": e}}}],
        }
        for e, _ in CALLS
    ]
    if not renderer.native_tools:  # inline style: the model writes the call as text
        calls = [
            {"role": "assistant", "content": renderer.format.call_text("calculate", {"expression": e})}
            for e, _ in CALLS
        ]
    return [*calls, {"role": "assistant", "content": "The answer is 37."}]


class ScriptedEngine:
    """Replies as the template renders each assistant turn when it is the last message (what a model trained on the
    template writes), tokenized canonically, ending with the turn-end token; ``split`` re-splits one token."""

    def __init__(self, renderer: Renderer, episode: Episode, split_turn: int = -1):
        self.r, self.turns, self.ep, self.split_turn = renderer, assistant_turns(renderer), episode, split_turn
        self.n = 0

    def generate(self, requests, *, seed=None):
        (req,) = requests
        history = self.ep.messages  # the conversation so far, as the episode will re-render it
        prompt = self.r.text(history, [TOOL], generation_prompt=True)
        full = self.r.text(history + [self.turns[self.n]], [TOOL], generation_prompt=False)
        assert full.startswith(prompt)
        end = full.index(self.r.rules.turn_end, len(prompt)) + len(self.r.rules.turn_end)
        ids = self.r.tok.encode(full[len(prompt) : end])
        if self.n == self.split_turn:  # the model sampled a multi-character token as its first byte and the rest
            i = next(i for i, t in enumerate(ids) if len(self.r.tok.decode([t])) > 1)
            a, b = self.r.tok.decode([ids[i]])[:1], self.r.tok.decode([ids[i]])[1:]
            ids = ids[:i] + self.r.tok.encode(a) + self.r.tok.encode(b) + ids[i + 1 :]
        self.n += 1
        return [
            GenerateOutput(
                rid=req.rid, output_ids=ids, output_log_probs=[-0.5] * len(ids), finish_reason="stop", weight_version=3
            )
        ]

    def abort(self, rids="all"):
        pass


def play(renderer: Renderer, **engine_kw) -> Episode:
    ep = Episode(ScriptedEnv(), {"prompt": QUESTION}, renderer, LIMITS, index=0, group=0)
    engine = ScriptedEngine(renderer, ep, **engine_kw)
    sp = SamplingParams(max_new_tokens=200, stop_token_ids=renderer.stop_token_ids())
    EpisodeRunner([engine], step_timeout_s=10.0).run([ep], sp, seed=0, tag="t")
    assert ep.status == "done" and ep.turn == 4 and ep.reward == 1.0
    return ep


@pytest.fixture(scope="module", params=["smollm2", "qwen3", "llama3"])
def family(request, tmp_path_factory):
    return request.param, family_tokenizer(request.param, tmp_path_factory.mktemp(request.param))


def hf_reference(tok, renderer: Renderer, messages) -> list[int]:
    """transformers' own apply_chat_template(tokenize=True) of the whole conversation, cut after the last turn end."""
    msgs, tools = renderer.with_tools(messages, [TOOL])
    out = tok.tok.apply_chat_template(msgs, tools=tools or None, tokenize=True, add_generation_prompt=False)
    ids = list(out["input_ids"] if hasattr(out, "keys") else out)
    end = tok.encode(renderer.rules.turn_end)[0]
    return ids[: len(ids) - ids[::-1].index(end)]


def test_a_four_turn_tool_conversation_is_exact_where_the_template_is_append_only(family):
    name, tok = family
    r = Renderer(tok)
    ep = play(r)
    t = ep.traj
    assert ep.num_tool_calls == 3 and ep.num_malformed == 0
    reference = rerender_ids(r, ep.messages, [TOOL], tok)
    assert reference == hf_reference(tok, r, ep.messages)  # our render is transformers' render, token for token
    if name == "qwen3":  # not append-only: a non-final assistant turn loses the empty think block it was sampled with
        assert ep.drift.kind == "template" and ep.drift.num_tokens > 0
        assert "<think>" in ep.drift.trajectory_text and "<think>" not in ep.drift.rerender_text
        assert t.token_ids != reference
    else:
        assert ep.drift.kind == "none", ep.drift
        assert t.token_ids == reference


def test_the_loss_mask_covers_exactly_the_sampled_tokens(family):
    _, tok = family
    r = Renderer(tok)
    ep = play(r)
    t = ep.traj
    sampled = [i for s, e in t.model_turns() for i in range(s, e)]
    assert [i for i, m in enumerate(t.mask) if m] == sampled and len(t.model_turns()) == 4
    assert all(t.log_probs[i] == -0.5 for i in sampled) and all(
        t.log_probs[i] == 0.0 for i in range(len(t)) if i not in sampled
    )
    sample = ep.to_sample()
    assert sample.prompt_ids == t.token_ids[: t.prompt_len] and sample.metadata["loss_mask"] == t.mask[t.prompt_len :]
    assert sample.weight_version == 3 and sample.reward == 1.0
    kinds = [s["kind"] for s in sample.metadata["spans"]]
    assert kinds.count("model") == 4 and kinds.count("env") == 3
    assert kinds.count("tool_call") == 3 and kinds.count("tool_result") == 3
    results = [s for s in sample.metadata["spans"] if s["kind"] == "tool_result"]
    assert [tok.decode(t.token_ids[s["start"] : s["end"]]).strip().strip('"') for s in results] == ["19", "57", "37"]


def test_the_first_prompt_is_transformers_apply_chat_template(family):
    _, tok = family
    r = Renderer(tok)
    msgs, tools = r.with_tools([{"role": "user", "content": QUESTION}], [TOOL])
    out = tok.tok.apply_chat_template(msgs, tools=tools or None, tokenize=True, add_generation_prompt=True)
    assert tok.encode(r.text([{"role": "user", "content": QUESTION}], [TOOL], generation_prompt=True)) == list(
        out["input_ids"]
    )


def test_a_non_canonical_sampled_split_is_reported_as_tokenization_drift(family):
    _, tok = family
    ep = play(Renderer(tok), split_turn=3)
    assert ep.drift.kind in ("tokenization", "template")  # qwen3's template drift comes first there
    if ep.drift.kind == "tokenization":
        assert ep.drift.num_tokens >= 1 and tok.decode(ep.traj.token_ids) == tok.decode(
            rerender_ids(ep.renderer, ep.messages, [TOOL], tok)
        )


def test_a_template_that_drops_the_newline_after_earlier_headers_is_caught(tmp_path):
    """verl#6501's class: the generation prompt writes '<|im_start|>assistant\\n' but the re-render of an earlier
    assistant turn has no newline there, so a trainer re-tokenizing the transcript trains on a context the policy never
    saw, once per earlier turn."""
    tok = family_tokenizer("smollm2", tmp_path)
    tok.tok.chat_template = (
        (TEMPLATES / "smollm2.jinja")
        .read_text()
        .replace(
            "{{'<|im_start|>' + message['role'] + '\n'",  # the published template has a real newline there
            "{{'<|im_start|>' + message['role'] + ('' if message['role'] == 'assistant' and not loop.last else '\n')",
        )
    )
    assert "not loop.last" in tok.tok.chat_template
    r = Renderer(tok)
    ep = play(r)
    assert ep.drift.kind == "template" and ep.drift.num_tokens == 3  # one newline for each of the 3 earlier turns
    assert ep.drift.first == ep.traj.prompt_len - 1  # the generation prompt's newline, the prompt's last token


def test_compare_counts_the_tokens_outside_matching_blocks(tmp_path):
    tok = family_tokenizer("smollm2", tmp_path)
    a = tok.encode("The answer is 37.")
    assert compare(a, a, tok).kind == "none"
    b = tok.encode("The answer is 38.")
    d = compare(a, b, tok)
    assert d.kind == "template" and d.num_tokens == 1 and d.first == a.index(tok.encode("7")[0], 3)


def test_a_turn_cut_at_its_token_limit_is_closed_by_the_templates_end_token_masked(tmp_path):
    tok = family_tokenizer("smollm2", tmp_path)
    r = Renderer(tok)
    ep = Episode(ScriptedEnv(), {"prompt": QUESTION}, r, LIMITS, index=0, group=0)
    engine = ScriptedEngine(r, ep)
    inner = engine.generate

    def cut_first(requests, seed=None):
        (out,) = inner(requests, seed=seed)
        if engine.n == 1:  # the first turn stops one token short: no end token, finish_reason 'length'
            out.output_ids, out.output_log_probs, out.finish_reason = (
                out.output_ids[:-1],
                out.output_log_probs[:-1],
                "length",
            )
        return [out]

    engine.generate = cut_first
    EpisodeRunner([engine], step_timeout_s=10.0).run([ep], SamplingParams(max_new_tokens=200), seed=0, tag="t")
    assert ep.status == "done" and ep.num_truncated == 1
    assert ep.drift.kind == "none" and ep.traj.token_ids == rerender_ids(r, ep.messages, [TOOL], tok)
    end = tok.encode("<|im_end|>")[0]
    first_env = next(s for s in ep.traj.spans if s.kind == "env")
    assert ep.traj.token_ids[first_env.start] == end and ep.traj.mask[first_env.start] == 0
