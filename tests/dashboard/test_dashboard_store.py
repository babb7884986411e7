"""The run-directory format: what the driver writes is what the dashboard reads, live and atomically."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from miles.dashboard.store import SAMPLE_MAGIC, NotInRunDir, RunDirReader, RunDirWriter
from miles.rollout_dump import COLUMNS, RolloutDumpWriter


def sample(n=12, prompt_len=4, **kw):
    s = {
        "index": 7,
        "group": 1,
        "reward": 0.5,
        "tokens": list(range(100, 100 + n)),
        "prompt_len": prompt_len,
        "token_text": [f"t{i}" for i in range(n)],
        "prompt_text": "P",
        "response_text": "R",
        "rollout_log_probs": [-0.5] * (n - prompt_len),
        "advantages": [1.5] * (n - prompt_len),
        "weight_version": 3,
        "finish_reason": "stop",
    }
    s.update(kw)
    return s


def parse_payload(data: bytes) -> tuple[dict, dict]:
    assert data[:4] == SAMPLE_MAGIC
    head_len = int.from_bytes(data[4:8], "little")
    header = json.loads(data[8 : 8 + head_len])
    base = 8 + head_len
    assert base % 8 == 0
    cols = {}
    for c in header["columns"]:
        raw = data[
            base + c["offset"] : base
            + c["offset"]
            + c["length"] * (1 if c["dtype"] == "utf8" else np.dtype(c["dtype"]).itemsize)
        ]
        cols[c["name"]] = raw.decode() if c["dtype"] == "utf8" else np.frombuffer(raw, c["dtype"])
    return header, cols


def read_sample(reader, step, row):
    size, chunks = reader.sample_chunks(step, row)
    data = b"".join(chunks)
    assert len(data) == size
    return parse_payload(data)


def test_a_written_step_reads_back_column_for_column(tmp_path):
    samples = [sample(), sample(n=20, prompt_len=5, index=8, entropy=[0.25] * 20, train_log_probs=[-0.4] * 15)]
    RolloutDumpWriter(run_dir=tmp_path).write_step(2, samples)
    reader = RunDirReader(tmp_path)
    assert [s["step"] for s in reader.steps()] == [2]
    header, cols = read_sample(reader, 2, 1)
    assert header["sample"]["index"] == 8 and header["sample"]["prompt_text"] == "P" and header["num_tokens"] == 20
    assert cols["tokens"].tolist() == list(range(100, 120))
    assert cols["token_text"] == "".join(f"t{i}" for i in range(20))
    assert cols["token_text_len"].tolist() == [len(f"t{i}") for i in range(20)]
    assert np.isnan(cols["rollout_log_probs"][:5]).all() and (cols["rollout_log_probs"][5:] == -0.5).all()
    assert (cols["entropy"] == 0.25).all()
    assert cols["loss_mask"].tolist() == [0] * 5 + [1] * 15
    assert set(COLUMNS) <= set(cols)


def test_full_length_and_response_only_per_token_fields_store_the_same(tmp_path):
    a = sample(loss_mask=[1, 0, 1, 1, 1, 1, 1, 1])
    b = sample(loss_mask=[0, 0, 0, 0, 1, 0, 1, 1, 1, 1, 1, 1], advantages=[float("nan")] * 4 + [1.5] * 8)
    RolloutDumpWriter(run_dir=tmp_path).write_step(0, [a, b])
    reader = RunDirReader(tmp_path)
    (_, ca), (_, cb) = read_sample(reader, 0, 0), read_sample(reader, 0, 1)
    assert ca["loss_mask"].tolist() == cb["loss_mask"].tolist()
    np.testing.assert_array_equal(ca["advantages"], cb["advantages"])


def test_a_per_token_field_of_the_wrong_length_names_both_lengths(tmp_path):
    with pytest.raises(ValueError, match=r"advantages.*12 tokens.*prompt_len 4"):
        RolloutDumpWriter(run_dir=tmp_path).write_step(0, [sample(advantages=[0.0] * 5)])
    assert not (tmp_path / "rollouts" / "step_000000").exists()


def test_unicode_token_text_lengths_are_utf16_units_for_the_browser(tmp_path):
    texts = ["é", "😀", "a", "\n", "\ud800", "漢"]
    RolloutDumpWriter(run_dir=tmp_path).write_step(0, [sample(n=6, prompt_len=1, token_text=texts)])
    _, cols = read_sample(RunDirReader(tmp_path), 0, 0)
    assert cols["token_text_len"].tolist() == [1, 2, 1, 1, 1, 1]  # the lone surrogate became "?"
    assert cols["token_text"] == "é😀a\n?漢"


def test_rewriting_a_step_replaces_it_whole(tmp_path):
    writer = RolloutDumpWriter(run_dir=tmp_path)
    writer.write_step(1, [sample()])
    writer.write_step(1, [sample(), sample(index=9)])
    reader = RunDirReader(tmp_path)
    assert reader.steps()[0]["num_samples"] == 2
    assert [p.name for p in (tmp_path / "rollouts").iterdir()] == ["step_000001"]


def test_a_step_being_written_is_invisible_until_complete(tmp_path):
    (tmp_path / "rollouts" / ".step_000004.new").mkdir(parents=True)
    (tmp_path / "rollouts" / "step_000005").mkdir()  # no index.json yet: skipped, not an error
    assert RunDirReader(tmp_path).steps() == []


def test_a_torn_last_jsonl_line_is_left_for_the_next_poll(tmp_path):
    run = RunDirWriter(run_dir=tmp_path)
    run.append_metrics({"step": 1, "reward": float("nan"), "loss": 0.5})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "rew')
    reader = RunDirReader(tmp_path)
    rows, offset = reader.read_jsonl("metrics.jsonl")
    assert rows == [{"step": 1, "reward": None, "loss": 0.5}]
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('ard": 1.0}\n')
    rows, offset2 = reader.read_jsonl("metrics.jsonl", offset)
    assert rows == [{"step": 2, "reward": 1.0}] and offset2 == os.path.getsize(tmp_path / "metrics.jsonl")


def test_jsonl_pages_are_bounded_and_resume_at_line_boundaries(tmp_path):
    RunDirWriter(run_dir=tmp_path).append_ledger([{"time": i, "tag": "x" * 50, "bytes": i} for i in range(100)])
    reader, offset, got = RunDirReader(tmp_path), 0, []
    while True:
        rows, nxt = reader.read_jsonl("ledger.jsonl", offset, max_bytes=300)
        if nxt == offset:
            break
        got += rows
        offset = nxt
    assert [r["time"] for r in got] == list(range(100))


def test_the_reader_refuses_paths_outside_the_run_dir(tmp_path):
    run = tmp_path / "run"
    RolloutDumpWriter(run_dir=run).write_step(1, [sample()])
    outside = tmp_path / "elsewhere"
    RolloutDumpWriter(run_dir=outside).write_step(9, [sample()])
    os.symlink(outside / "rollouts" / "step_000009", run / "rollouts" / "step_000009")
    reader = RunDirReader(run)
    for parts in [("..", "elsewhere"), ("/etc/passwd",), ("rollouts", "..", "..", "elsewhere")]:
        with pytest.raises(NotInRunDir):
            reader.path(*parts)
    with pytest.raises(NotInRunDir):
        reader.sample_chunks(9, 0)
    with pytest.raises(NotInRunDir):
        reader.read_jsonl("../elsewhere/metrics.jsonl")
    assert [s["step"] for s in reader.steps()] == [1]


def test_nan_rewards_become_null_in_the_index(tmp_path):
    RolloutDumpWriter(run_dir=tmp_path).write_step(0, [sample(reward=float("nan"))])
    index = json.loads((tmp_path / "rollouts" / "step_000000" / "index.json").read_text())
    assert index["samples"][0]["reward"] is None and index["mean_reward"] is None
    assert not math.isnan(RunDirReader(tmp_path).steps()[0]["num_tokens"])


def test_nan_written_by_plain_json_dumps_reads_as_null(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "kl": float("nan"), "x": float("inf")}) + "\n")
    rows, _ = RunDirReader(tmp_path).read_jsonl("metrics.jsonl")
    assert rows == [{"step": 0, "kl": None, "x": None}]


def test_extra_scalar_fields_are_kept_as_metadata_and_writers_take_the_dir_positionally(tmp_path):
    RolloutDumpWriter(tmp_path).write_step(0, [sample(target="fedcba", extra_list=[1, 2])])
    meta = RunDirReader(tmp_path).sample_meta(0, 0)
    assert meta["target"] == "fedcba" and "extra_list" not in meta


def test_decode_sample_gives_back_the_written_token_strings(tmp_path):
    texts = ["é", "😀", "a", "\n", "漢", " b"]
    RolloutDumpWriter(tmp_path).write_step(0, [sample(n=6, prompt_len=2, token_text=texts)])
    size, chunks = RunDirReader(tmp_path).sample_chunks(0, 0)
    from miles.dashboard.store import decode_sample

    out = decode_sample(b"".join(chunks))
    assert out["token_strings"] == texts and out["tokens"].tolist() == list(range(100, 106))
    assert out["prompt_len"] == 2 and out["loss_mask"].tolist() == [0, 0, 1, 1, 1, 1]


def test_the_synthetic_runs_memory_metrics_are_the_peaks_of_its_own_ledger(tmp_path):
    """Notebook 09 shows the synthetic run's Metrics and Memory tabs side by side: mem/<pool>_peak must be what
    the driver would compute from the run's ledger (per step, from the bytes held at its start)."""
    import json

    from miles.dashboard.synthetic import synthetic_run

    run = synthetic_run(tmp_path / "run", num_steps=3)
    events = [json.loads(line) for line in (run / "ledger.jsonl").open()]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    for pool in ("device", "host"):
        held, want = 0, {}
        for e in sorted(events, key=lambda e: e["time"]):
            if e["pool"] == pool:
                start = want.setdefault(e["step"], held)
                held += e["bytes"] if e["direction"] == "in" else -e["bytes"]
                want[e["step"]] = max(start, want[e["step"]], held)
        assert {r["step"]: r[f"mem/{pool}_peak"] for r in rows} == want, pool
    assert rows[0]["mem/device_peak"] == 8 << 30 and rows[0]["mem/host_peak"] == 6 << 30


def test_a_multi_turn_samples_spans_are_kept_and_checked_against_its_length(tmp_path):
    row = {"index": 0, "group": 0, "reward": 1.0, "tokens": list(range(10)), "prompt_len": 4,
           "spans": [{"start": 0, "end": 4, "kind": "prompt", "turn": -1}, {"start": 4, "end": 7, "kind": "model", "turn": 0},
                     {"start": 5, "end": 6, "kind": "tool_call", "turn": 0, "label": "calculate"}]}  # fmt: skip
    RolloutDumpWriter(tmp_path).write_step(0, [row])
    spans = RunDirReader(tmp_path).sample_meta(0, 0)["spans"]
    assert [s["kind"] for s in spans] == ["prompt", "model", "tool_call"] and spans[2]["label"] == "calculate"
    with pytest.raises(ValueError, match=r"span .* must have 0 <= start <= end <= 10"):
        RolloutDumpWriter(tmp_path).write_step(1, [{**row, "spans": [{"start": 8, "end": 12, "kind": "env"}]}])
