"""Prompt datasets: three formats, column mapping, bad rows (stop or skip+count), seeded order and its position."""

import json

import pytest

from miles.data.config import DataConfig, parse_specs
from miles.data.dataset import BadRowError, PromptDataset, check_no_overlap, load_rows, read_records

ROWS = [{"q": f"What is {i} + 1?", "a": i + 1, "meta": {"i": i}} for i in range(10)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def cfg(**kw):
    return DataConfig(prompt_key="q", answer_key="a", metadata_key="meta", **kw)


def test_jsonl_parquet_and_datasets_directories_give_the_same_rows(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "plain"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "dict"))
    paths = [write_jsonl(tmp_path / "d.jsonl", ROWS), str(tmp_path / "d.parquet"), str(tmp_path / "plain")]
    paths.append(str(tmp_path / "dict") + "::train")
    loaded = [load_rows("d", p, cfg())[0] for p in paths]
    for rows in loaded:
        assert [(r.prompt, r.answer, r.metadata) for r in rows] == [(r["q"], str(r["a"]), r["meta"]) for r in ROWS]
    with pytest.raises(ValueError, match=r"holds the splits \['train'\]; pick one with"):
        read_records(str(tmp_path / "dict"))


def test_chat_message_columns_are_mapped_and_a_system_prompt_is_prepended(tmp_path):
    rows = [{"msgs": [{"role": "user", "content": "hi?"}], "a": "x"}]
    c = DataConfig(messages_key="msgs", answer_key="a", system_prompt="Be brief.")
    (row,), _ = load_rows("c", write_jsonl(tmp_path / "c.jsonl", rows), c)
    assert row.prompt == "hi?" and row.chat("Be brief.")[0] == {"role": "system", "content": "Be brief."}


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"a": 1}, "'q': missing"),
        ({"q": "  ", "a": 1}, "'q': empty"),
        ({"q": "x"}, "'a': missing"),
        ({"q": "x", "a": ""}, "'a': empty"),
    ],
)
def test_a_bad_row_stops_the_load_naming_file_row_and_field(tmp_path, bad, field):
    path = write_jsonl(tmp_path / "bad.jsonl", ROWS[:3] + [bad] + ROWS[3:])
    with pytest.raises(BadRowError, match=rf"bad.jsonl row 3 field {field}.*data.skip_bad_rows=true"):
        load_rows("bad", path, cfg())


def test_bad_rows_are_skipped_and_counted_when_asked(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", ROWS[:3] + [{"a": 1}, {"q": "x"}] + ROWS[3:])
    rows, skipped = load_rows("bad", path, cfg(skip_bad_rows=True))
    assert len(rows) == 10 and len(skipped) == 2 and "row 4 field 'a'" in skipped[1]
    assert [r.row for r in rows][3] == 5  # rows keep their index in the file


def test_a_torn_jsonl_line_is_named(tmp_path):
    (tmp_path / "t.jsonl").write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    with pytest.raises(BadRowError, match="t.jsonl row 1 \\(line 2\\): not valid JSON"):
        load_rows("t", str(tmp_path / "t.jsonl"), cfg())


def test_a_missing_dataset_file_is_refused_when_the_config_is_built(tmp_path):
    with pytest.raises(ValueError, match=r"data.train: dataset 'nope' at .*nope.jsonl' does not exist"):
        DataConfig(train=str(tmp_path / "nope.jsonl"))
    assert parse_specs("a.jsonl, m=dir/b.parquet") == [("a", "a.jsonl"), ("m", "dir/b.parquet")]
    with pytest.raises(ValueError, match="names a dataset twice"):
        parse_specs("x/a.jsonl,y/a.jsonl")


def test_a_dataset_file_named_eval_or_all_takes_its_folders_name_so_no_metric_reads_eval_eval(tmp_path):
    assert parse_specs("runs/splits/eval.jsonl, data/all.parquet, b.jsonl", "eval") == [
        ("splits_eval", "runs/splits/eval.jsonl"),
        ("data_all", "data/all.parquet"),
        ("b", "b.jsonl"),
    ]
    with pytest.raises(ValueError, match=r"names a dataset 'all' \(eval/all/... is every dataset together\)"):
        parse_specs("all=x.jsonl", "eval")


def test_the_order_is_a_seeded_shuffle_that_visits_every_row_once_per_epoch(tmp_path):
    rows, _ = load_rows("d", write_jsonl(tmp_path / "d.jsonl", ROWS), cfg())
    a, b, c = PromptDataset(rows, seed=1), PromptDataset(rows, seed=1), PromptDataset(rows, seed=2)
    first = [r.row for r in a.take(10)]
    assert sorted(first) == list(range(10)) and first != list(range(10))
    assert first == [r.row for r in b.take(10)] and first != [r.row for r in c.take(10)]
    second = [r.row for r in a.take(10)]
    assert sorted(second) == list(range(10)) and second != first and a.epoch == 1


def test_a_restored_position_continues_the_same_order_with_nothing_repeated_or_skipped(tmp_path):
    rows, _ = load_rows("d", write_jsonl(tmp_path / "d.jsonl", ROWS), cfg())
    straight = PromptDataset(rows, seed=0)
    reference = [r.row for r in straight.take(27)]
    first = PromptDataset(rows, seed=0)
    head = [r.row for r in first.take(13)]
    state = json.loads(json.dumps(first.state_dict()))  # as stored in a checkpoint
    resumed = PromptDataset(rows, seed=0)
    resumed.load_state_dict(state)
    assert head + [r.row for r in resumed.take(14)] == reference
    with pytest.raises(ValueError, match="resume with the same data.train and seed"):
        PromptDataset(rows[:5], seed=0).load_state_dict(state)


def test_eval_rows_that_are_also_train_rows_are_refused(tmp_path):
    train, _ = load_rows("train", write_jsonl(tmp_path / "train.jsonl", ROWS), cfg())
    held, _ = load_rows("held", write_jsonl(tmp_path / "held.jsonl", [{"q": "What is  7 + 1?", "a": 8}]), cfg())
    with pytest.raises(ValueError, match=r"eval dataset 'held' \(.*held.jsonl row 0\) has the prompt of train row 7"):
        check_no_overlap(train, {"held": held})
    fresh, _ = load_rows("f", write_jsonl(tmp_path / "f.jsonl", [{"q": "What is 70 + 1?", "a": 71}]), cfg())
    check_no_overlap(train, {"f": fresh})


def test_an_eval_prompt_equal_to_a_train_prompt_up_to_case_is_refused_too(tmp_path):
    """Review 2026-12-04 D26 (a note): up to whitespace was refused (D25), up to case accepted; it is the same
    problem, so the held-out figure would count a trained one. Chat rows compare the same way."""
    train, _ = load_rows("train", write_jsonl(tmp_path / "train.jsonl", ROWS), cfg())
    held, _ = load_rows("held", write_jsonl(tmp_path / "held.jsonl", [{"q": "WHAT IS 7 + 1?", "a": 8}]), cfg())
    with pytest.raises(ValueError, match=r"eval dataset 'held' \(.*held.jsonl row 0\) has the prompt of train row 7"):
        check_no_overlap(train, {"held": held})
    chat = DataConfig(messages_key="messages")
    turn = lambda text: {"messages": [{"role": "user", "content": text}], "answer": "8"}  # noqa: E731
    t, _ = load_rows("t", write_jsonl(tmp_path / "t.jsonl", [turn("What is 7 + 1?")]), chat)
    e, _ = load_rows("e", write_jsonl(tmp_path / "e.jsonl", [turn("what is  7 + 1?")]), chat)
    with pytest.raises(ValueError, match=r"eval dataset 'e' .* has the prompt of train row 0"):
        check_no_overlap(t, {"e": e})
