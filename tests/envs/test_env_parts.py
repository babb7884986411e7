"""The environment pieces alone: tool-call formats (parsed by transformers' response parser; a call's text is what
the family's template renders for it), the calculator (exact, no eval), the registry and the env-answer checks."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from family_tokenizers import family_tokenizer  # noqa: E402

from miles.envs.api import EnvError, check_reset, check_step  # noqa: E402
from miles.envs.calculator import CalculatorEnv, CalculatorError, calculate, rows  # noqa: E402
from miles.envs.registry import env_class  # noqa: E402
from miles.envs.renderer import Renderer  # noqa: E402
from miles.envs.tool_formats import tool_format  # noqa: E402

HERMES, LLAMA3 = tool_format("hermes"), tool_format("llama3")


def test_hermes_replies_parse_into_content_calls_and_reasoning():
    text = "<think>\nmultiply first\n</think>\n\nLet me compute.\n" + HERMES.call_text(
        "calculate", {"expression": "3*4"}
    )
    text += "\n" + HERMES.call_text("calculate", {"expression": "5+6"}) + "<|im_end|>"
    m = HERMES.parse(text)
    assert m["content"] == "Let me compute." and m["reasoning_content"] == "multiply first"
    assert [c["function"]["arguments"] for c in m["tool_calls"]] == [{"expression": "3*4"}, {"expression": "5+6"}]
    assert "tool_call_errors" not in m


def test_a_malformed_call_is_reported_on_the_message_never_raised():
    m = HERMES.parse('<tool_call>\n{"name": "calculate", "arguments": {"expression": "3*4"\n</tool_call><|im_end|>')
    assert "tool_calls" not in m and "JSON" in m["tool_call_errors"][0] and "<tool_call>" in m["content"]
    m = HERMES.parse("<tool_call>[1, 2]</tool_call><|im_end|>")
    assert "tool_calls" not in m and "needs an object with a string 'name'" in m["tool_call_errors"][0]
    m = HERMES.parse('<tool_call>{"name": "calculate", "arguments": "3*4"}</tool_call>')
    assert "'arguments' must be an object" in m["tool_call_errors"][0]


def test_llama3_json_calls_parse_with_and_without_the_python_tag():
    for prefix in ("", "<|python_tag|>"):
        m = LLAMA3.parse(prefix + LLAMA3.call_text("calculate", {"expression": "3*4"}) + "<|eot_id|>")
        assert m["tool_calls"][0]["function"] == {"name": "calculate", "arguments": {"expression": "3*4"}}
    assert LLAMA3.parse("The answer is 12.<|eot_id|>") == {"role": "assistant", "content": "The answer is 12."}


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_a_calls_text_is_what_the_family_template_renders_for_it(family, tmp_path):
    r = Renderer(family_tokenizer(family, tmp_path))
    call = {
        "type": "function",
        "function": {"name": "calculate", "arguments": {"expression": "(12 + 7) * 3", "note": "é"}},
    }
    text = r.text(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call]}],
        generation_prompt=False,
    )
    assert r.format.call_text("calculate", call["function"]["arguments"]) in text


def test_the_calculator_is_exact_and_evaluates_no_names():
    assert calculate("(12 + 7) * 3 - 4 * 5") == "37" and calculate("7 / 4") == "1.75" and calculate("-3 * -3") == "9"
    for bad in ("__import__('os')", "2 ** 10", "x + 1", "1 / 0", "9" * 40 + " * " + "9" * 40):
        with pytest.raises(CalculatorError):
            calculate(bad)


def test_every_generated_problem_is_solved_by_its_expert_through_the_tool():
    env = CalculatorEnv()
    for row in rows(40, seed=7, levels=(0, 1, 2, 3)):
        messages, tools = env.reset(row)
        call = HERMES.parse(env.expert_reply(messages, HERMES))
        new, reward, done, _ = env.step(call)
        assert not done and new[0]["content"] == row["answer"]
        assert env.step(HERMES.parse(env.expert_reply(messages + [call] + new, HERMES)))[1:3] == (1.0, True)


def test_a_share_of_demonstrations_answers_without_the_tool_and_each_episode_is_one_or_the_other():
    problems = rows(400, seed=7, levels=(0,))

    def calls(share: float) -> list[bool]:
        out = []
        for row in problems:
            env = CalculatorEnv(demo_tool_share=share)
            messages, _ = env.reset(row)
            first = HERMES.parse(env.expert_reply(messages, HERMES))
            out.append(bool(first.get("tool_calls")))
            if not first.get("tool_calls"):  # the answer at once is the right number
                assert env.step(first)[1:3] == (1.0, True)
        return out

    assert all(calls(1.0)) and not any(calls(0.0))
    half = calls(0.5)
    assert 0.4 < sum(half) / len(half) < 0.6
    assert calls(0.5) == half  # fixed by the problem, not drawn per call
    assert all(a <= b for a, b in zip(calls(0.25), half))  # a larger share only adds calls
    with pytest.raises(ValueError, match="demo_tool_share = 1.5"):
        CalculatorEnv(demo_tool_share=1.5)


def test_the_registry_loads_builtins_and_module_classes():
    assert env_class("calculator") is CalculatorEnv
    assert env_class("miles.envs.calculator:CalculatorEnv") is CalculatorEnv
    with pytest.raises(ValueError, match="has no 'Nope'"):
        env_class("miles.envs.calculator:Nope")
    with pytest.raises(ValueError, match="has no reset or step method"):
        env_class("miles.envs.calculator:CalculatorError")


def test_env_answers_that_are_not_steps_are_named():
    with pytest.raises(EnvError, match="must return \\(messages, tools\\)"):
        check_reset([{"role": "user", "content": "x"}], "E")
    with pytest.raises(EnvError, match="needs a 'role'"):
        check_step(([{"role": "robot", "content": "x"}], 0.0, False, {}), "E")
    with pytest.raises(EnvError, match="reward nan"):
        check_step(([], float("nan"), True, {}), "E")
    with pytest.raises(EnvError, match="done = 1"):
        check_step(([], 0.0, 1, {}), "E")
    with pytest.raises(EnvError, match="not done but gave no new message"):
        check_step(([], 0.0, False, {}), "E")
