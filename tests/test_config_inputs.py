"""Absurd numbers in the config are refused when it is built (exit 2, before Ray), naming the field and the fix:
integers beyond 64 bits in any int field, more torch threads than a machine has, an eval.k no eval can afford."""

import typing

import pytest

from miles import cli
from miles.config import MAX_THREADS, RunConfig, apply_overrides
from miles.data.config import MAX_EVAL_K
from miles.recipes import quickstart


def _int_fields():
    """Dotted path of every int field of the run config and of its sections."""
    import dataclasses

    for name, tp in typing.get_type_hints(RunConfig).items():
        if tp is int:
            yield name
        if dataclasses.is_dataclass(tp):
            yield from (f"{name}.{f}" for f, ftp in typing.get_type_hints(tp).items() if ftp is int)


@pytest.mark.parametrize("path", list(_int_fields()))
def test_every_integer_config_field_refuses_a_value_beyond_64_bits(path):
    for raw in ("1e30", str(2**63), str(-(2**63) - 1)):
        with pytest.raises(ValueError) as e:
            apply_overrides(quickstart(), [f"{path}={raw}"])
        assert path.rsplit(".", 1)[-1] in str(e.value), (path, raw, str(e.value))


def test_a_config_json_with_a_huge_integer_is_refused_like_an_override():
    d = quickstart().to_dict()
    d["rollout"]["max_batch_size"] = 10**30
    with pytest.raises(ValueError, match=r"rollout.max_batch_size = 10{30} is out of range: .* fit in 64 bits"):
        RunConfig.from_dict(d)


def test_torch_threads_are_bounded_by_what_a_machine_can_have():
    assert apply_overrides(quickstart(), [f"num_threads={MAX_THREADS}"]).num_threads == MAX_THREADS
    with pytest.raises(ValueError, match=rf"num_threads = 1000000 must be >= 0 and <= {MAX_THREADS}; torch threads"):
        apply_overrides(quickstart(), ["num_threads=1e6"])


def test_num_threads_1e30_exits_2_with_one_line_before_ray_starts(monkeypatch, capsys):
    import miles.driver

    def no_run(*a, **k):
        raise AssertionError("the run started: the config should have been refused first")

    monkeypatch.setattr(miles.driver, "train", no_run)
    assert cli.main(["train", "--set", "num_threads=1e30"]) == cli.EXIT_BAD_INPUT
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("miles ")]
    assert len(err) == 1 and "num_threads = " in err[0] and "fit in 64 bits" in err[0], err


def test_eval_k_is_bounded_generously_and_the_error_gives_the_fix():
    assert apply_overrides(quickstart(), [f"eval.k={MAX_EVAL_K}"]).eval.k == MAX_EVAL_K
    with pytest.raises(ValueError, match=rf"eval.k = 1000000000 .* over the limit of {MAX_EVAL_K} .* eval.k=16"):
        apply_overrides(quickstart(), ["eval.k=1e9"])
