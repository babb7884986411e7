"""Dataset files as others write them: raw line separators inside JSON strings, a byte-order mark, bytes that are
not UTF-8, answers of every JSON type, a column no row has, repeated eval rows, and paths that are not files."""

import json
import logging
import os
import socket
import threading

import pytest

from miles.config import apply_overrides
from miles.data.config import DataConfig
from miles.data.dataset import BadRowError, check_data, load_rows
from miles.recipes import quickstart

# the characters str.splitlines() splits at that JSON lets stand raw in a string (the others are below U+0020,
# which JSON escapes); json.dumps(ensure_ascii=False) writes them raw
SEPARATORS = ["\u2028", "\u2029", "\u0085"]


def cfg(**kw):
    return DataConfig(prompt_key="q", answer_key="a", **kw)


def write(path, text: str | bytes):
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
    return str(path)


def lines(*rows) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


@pytest.mark.parametrize("sep", SEPARATORS, ids=[f"U+{ord(s):04X}" for s in SEPARATORS])
def test_line_separators_raw_inside_a_json_string_stay_in_their_row(tmp_path, sep):
    rows = [{"q": f"first{sep}line", "a": 1}, {"q": "second", "a": f"x{sep}y"}]
    text = lines(*rows)
    assert sep in text  # raw, not escaped: the file a real writer produces
    loaded, skipped = load_rows("s", write(tmp_path / "s.jsonl", text), cfg())
    assert [(r.prompt, r.answer) for r in loaded] == [(f"first{sep}line", "1"), ("second", f"x{sep}y".strip())]
    assert skipped == []


def test_lines_that_do_not_parse_or_decode_are_skipped_and_counted_like_any_bad_row(tmp_path):
    good = lines({"q": "a?", "a": 1}).encode()
    path = write(tmp_path / "mixed.jsonl", good + b'{"q": "torn\n' + b'{"q": "caf\xe9", "a": 2}\n' + good)
    rows, skipped = load_rows("m", path, cfg(skip_bad_rows=True))
    assert len(rows) == 2 and [r.row for r in rows] == [0, 3]
    assert len(skipped) == 2
    assert "mixed.jsonl row 1 (line 2): not valid JSON" in skipped[0]
    assert "mixed.jsonl row 2 (line 3): not UTF-8 (byte 0xe9" in skipped[1]
    with pytest.raises(BadRowError, match=r"row 1 \(line 2\): not valid JSON .*set data.skip_bad_rows=true"):
        load_rows("m", path, cfg())


def test_a_byte_that_is_not_utf8_names_the_file_and_the_line(tmp_path):
    path = write(
        tmp_path / "latin1.jsonl", lines({"q": "a?", "a": 1}).encode() + '{"q": "café", "a": 2}\n'.encode("latin-1")
    )
    with pytest.raises(BadRowError, match=r"latin1.jsonl row 1 \(line 2\): not UTF-8 \(byte 0xe9 at byte 11 "):
        load_rows("l", path, cfg())


def test_a_utf8_byte_order_mark_at_the_start_is_accepted(tmp_path):
    path = write(tmp_path / "bom.jsonl", b"\xef\xbb\xbf" + lines({"q": "a?", "a": 1}, {"q": "b?", "a": 2}).encode())
    rows, _ = load_rows("b", path, cfg())
    assert [(r.prompt, r.answer) for r in rows] == [("a?", "1"), ("b?", "2")]


def test_blank_and_crlf_lines_are_not_rows_and_row_numbers_count_rows(tmp_path):
    path = write(tmp_path / "crlf.jsonl", '{"q": "a?", "a": 1}\r\n\r\n  \n{"q": "b?", "a": 2}\r\n{"q": 5, "a": 3}\n')
    with pytest.raises(BadRowError, match=r"crlf.jsonl row 2 field 'q': empty or not text \(5\)"):
        load_rows("c", path, cfg())


@pytest.mark.parametrize(
    "answer, text",
    [
        (5, "5"),
        (-3, "-3"),
        (2.0, "2"),
        (2.5, "2.5"),
        (10**20, "100000000000000000000"),
        ("  x ", "x"),
        ("[1, 2]", "[1, 2]"),
    ],
)
def test_text_and_finite_number_answers_become_their_string_form(tmp_path, answer, text):
    (row,), _ = load_rows("n", write(tmp_path / "n.jsonl", lines({"q": "a?", "a": answer})), cfg())
    assert row.answer == text


@pytest.mark.parametrize("raw", ["[1, 2]", "true", "false", "NaN", "Infinity", '{"x": 1}'])
def test_an_answer_that_is_not_text_or_a_finite_number_is_refused_naming_row_and_field(tmp_path, raw):
    path = write(tmp_path / "t.jsonl", lines({"q": "a?", "a": 1}) + '{"q": "b?", "a": ' + raw + "}\n")
    with pytest.raises(BadRowError, match=r"t.jsonl row 1 field 'a': the answer must be text or a finite number"):
        load_rows("t", path, cfg())
    rows, skipped = load_rows("t", path, cfg(skip_bad_rows=True))
    assert len(rows) == 1 and len(skipped) == 1


def test_a_prompt_column_no_row_has_asks_for_data_prompt_key_and_lists_the_columns(tmp_path):
    path = write(tmp_path / "qs.jsonl", lines(*({"id": i, "question": "x?", "solution": "1"} for i in range(3))))
    for skip in (False, True):  # not a file of bad rows: skipping them all would be the wrong fix
        c = DataConfig(answer_key="solution", skip_bad_rows=skip)
        with pytest.raises(ValueError) as e:
            load_rows("qs", path, c)
        msg = str(e.value)
        assert "no row has the column 'prompt' (data.prompt_key)" in msg and "set data.prompt_key" in msg, msg
        assert "['id', 'question', 'solution']" in msg and "skip_bad_rows" not in msg, msg
    with pytest.raises(ValueError, match=r"no row has the column 'answer' \(data.answer_key\).*set data.answer_key"):
        load_rows("qs", path, DataConfig(prompt_key="question"))
    rows, _ = load_rows("qs", path, DataConfig(prompt_key="question", answer_key="solution"))
    assert len(rows) == 3


def test_repeated_eval_rows_are_counted_in_one_warning(tmp_path, caplog):
    train = write(tmp_path / "train.jsonl", lines({"prompt": "t?", "answer": 1}))
    rows = [{"prompt": f"p{i}?", "answer": i} for i in range(4)]
    ev = write(tmp_path / "ev.jsonl", lines(*rows, rows[1], {"prompt": "  p2? ", "answer": 2}))
    run = apply_overrides(quickstart(), [f"data.train={train}", f"data.eval={ev}"])
    with caplog.at_level(logging.WARNING, logger="miles"):
        check_data(run)
    warnings = [r.getMessage() for r in caplog.records if "repeat" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "data.eval: 2 row(s) repeat the prompt of an earlier eval row" in warnings[0]
    assert "ev.jsonl row 4 = " in warnings[0] and "ev.jsonl row 1" in warnings[0]


def _returns_within(fn, seconds: float):
    """fn() in a thread: (finished, its exception). A read that blocks is left behind (a daemon thread)."""
    out = {}

    def call():
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out["error"] = e

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive(), out.get("error")


def test_a_fifo_a_device_or_a_socket_as_a_dataset_is_refused_at_once(tmp_path):
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    (tmp_path / "null.jsonl").symlink_to("/dev/null")
    sock_path = tmp_path / "s.jsonl"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(sock_path))
        for path, kind in ((fifo, "FIFO"), (tmp_path / "null.jsonl", "character device"), (sock_path, "socket")):
            done, error = _returns_within(lambda p=path: load_rows("x", str(p), cfg()), 20)
            if not done:  # release the reader blocked in open() so the daemon thread ends
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            assert done, f"reading {path} did not return"
            assert isinstance(error, ValueError) and f"is a {kind}, not a regular file" in str(error), error
