"""rollout.sglang_args values are checked against the flag's type when the config is built, a value that is a
flag is refused, and a model.checkpoint that SGLang would read as a flag is refused (review 2026-12-04, E1/E3/E6).
The argv is a list with no shell, so none of these could inject; they would only fail minutes later, in SGLang."""

import pytest

from miles.rollout.launch import sglang_engine_argv
from miles.sglang_flags import KNOWN_FLAGS, parse_flags
from tests.conftest import tiny_run_cfg

SG = ("rollout.engine=sglang", "model.checkpoint=/ckpt/qwen3-8b")


@pytest.mark.parametrize(
    "args, message",
    [
        ("--tp-size,4;rm -rf /", r"--tp-size takes an integer >= 1, got '4;rm -rf /'"),
        ("--tp-size=--trust-remote-code", r"value of --tp-size is '--trust-remote-code', which looks like a flag"),
        ("--served-model-name=-x", r"value of --served-model-name is '-x', which looks like a flag"),
        ("--tp-size,0", r"--tp-size takes an integer >= 1, got '0'"),
        ("--nnodes=0", r"--nnodes takes an integer >= 1"),
        ("--node-rank=-1", r"--node-rank takes an integer >= 0"),
        ("--mem-fraction-static=1.5", r"--mem-fraction-static takes a fraction in \(0, 1\], got '1.5'"),
        ("--mem-fraction-static=nan", r"--mem-fraction-static takes a fraction"),
        ("--context-length=4k", r"--context-length takes an integer >= 1, got '4k'"),
        ("--max-total-tokens=lots", r"--max-total-tokens takes a token count"),
        ("--dtype=", r"--dtype takes a non-empty value"),
    ],
)
def test_a_sglang_arg_value_of_the_wrong_type_or_that_is_a_flag_is_refused_at_config_time(tmp_path, args, message):
    with pytest.raises(ValueError, match=message):
        tiny_run_cfg(tmp_path, *SG, f"rollout.sglang_args={args}")


def test_values_sglang_takes_are_passed_through_unchanged(tmp_path):
    args = "--chunked-prefill-size=-1,--max-total-tokens=128k,--mem-fraction-static=0.85,--random-seed,-7,--tp-size,2"
    argv = sglang_engine_argv(tiny_run_cfg(tmp_path, *SG, f"rollout.sglang_args={args}"), 0, 30000)
    pairs = dict(zip(argv[3::2], argv[4::2]))
    assert pairs["--chunked-prefill-size"] == "-1" and pairs["--max-total-tokens"] == "128k"
    assert pairs["--mem-fraction-static"] == "0.85" and pairs["--random-seed"] == "-7" and pairs["--tp-size"] == "2"


def test_every_value_taking_flag_has_a_check_and_every_switch_none():
    assert all(check is None or callable(check) for check in KNOWN_FLAGS.values())
    assert parse_flags(["--trust-remote-code", "--dist-init-addr", "10.0.0.1:5000"]) == {
        "--trust-remote-code": None,
        "--dist-init-addr": "10.0.0.1:5000",
    }


@pytest.mark.parametrize("launcher", ["sglang.launch_server", "miles-serve"])
def test_a_checkpoint_path_that_starts_with_a_dash_is_refused_with_the_fix(tmp_path, launcher):
    with pytest.raises(ValueError, match=r"model.checkpoint = '--trust-remote-code' starts with '-'.*\./--trust"):
        tiny_run_cfg(
            tmp_path,
            "rollout.engine=sglang",
            "model.checkpoint=--trust-remote-code",
            f"rollout.sglang_launcher={launcher}",
        )
