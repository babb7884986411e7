"""`miles serve` arguments that are the user's mistake exit 2 with one line naming the value (review 2026-12-04,
C3/C4): a --host that is no address of this machine, a --config file that is not a JSON RunConfig."""

import json

import pytest

from miles import cli


def _serve(capsys, *args) -> tuple[int, list[str]]:
    code = cli.main(["serve", *args])
    err = capsys.readouterr().err.splitlines()
    return code, err


@pytest.mark.parametrize(
    "host, message",
    [("999.1.1.1", "is not an IPv4 address"), ("192.0.2.123", "is not an address of this machine")],  # TEST-NET-1
)
def test_a_host_that_is_no_address_of_this_machine_exits_2_with_one_line(capsys, host, message):
    code, err = _serve(capsys, "--host", host, "--port", "0")
    assert code == cli.EXIT_BAD_INPUT, err
    assert len(err) == 1 and err[0].startswith(f"miles serve: error: --host '{host}' {message}"), err
    assert "127.0.0.1" in err[0] and "0.0.0.0" in err[0]


@pytest.mark.parametrize(
    "content, message",
    [
        (b"not json at all\n", "not a JSON RunConfig (Expecting value"),
        (b"\xff\xfe{}", "not a JSON RunConfig ('utf-8' codec"),
        (b"[1, 2]", "holds a JSON list, not a RunConfig object"),
        (json.dumps({"rollout": {"max_new_tokens": "many"}}).encode(), "rollout.max_new_tokens = 'many' is not an"),
    ],
)
def test_a_config_file_that_is_not_a_json_run_config_is_named_in_one_line(tmp_path, capsys, content, message):
    path = tmp_path / "afile"
    path.write_bytes(content)
    code, err = _serve(capsys, "--config", str(path), "--port", "0")
    assert code == cli.EXIT_BAD_INPUT, err
    assert len(err) == 1 and err[0].startswith(f"miles serve: error: --config {path}: ") and message in err[0], err
