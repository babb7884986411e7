"""Disk-delta sync across 2 real gloo ranks in separate processes: every malformed baseline fails on every rank,
within a bounded time, naming the tensor, both layouts and the failing rank; no version is published and the
engine's weights are unchanged. The two rank processes are started once for the whole module."""

from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import os
import queue
import struct
import traceback

import pytest
import safetensors.torch
import torch

pytestmark = pytest.mark.procs  # it starts processes or servers (tests/conftest.py: the tiers)

WORLD = 2
TIMEOUT_S = 40


# -- what each rank emits, and a small real receiver ---------------------------------------------------------


def trainer_tensors(rank: int, step: int = 0, *, diverge: bool = False) -> dict[str, torch.Tensor]:
    """Rank r owns layers.r.w; both ranks emit the replicated shared.scale (identical unless ``diverge``)."""
    g = torch.Generator().manual_seed(100 * rank + step)
    own = (torch.randn(8, 4, generator=g) * (1 + 0.01 * step)).to(torch.bfloat16)
    scale = torch.tensor(1.0 + step + (rank if diverge else 0), dtype=torch.float32)
    return {f"layers.{rank}.w": own, "shared.scale": scale}


def full_baseline() -> dict[str, torch.Tensor]:
    return {k: v for r in range(WORLD) for k, v in trainer_tensors(r).items()}


class TensorEngine:
    """A receiver holding real tensors, updated only through load_version."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        self.weights = {k: v.clone() for k, v in weights.items()}
        self.weight_version = 0

    def update_weights_from_disk(self, path: str, version: int) -> None:
        from miles.sync.disk_delta.transport import load_version

        self.weights = load_version(path, version, self.weights, local_version=self.weight_version)
        self.weight_version = version

    def named_weights(self) -> dict[str, torch.Tensor]:
        return self.weights


# -- rank processes ------------------------------------------------------------------------------------------


def _run_case(rank: int, case: dict) -> dict:
    from miles.sync.disk_delta.transport import DiskDeltaConfig, DiskDeltaSync
    from miles.sync.disk_delta.version import published_versions

    partition = case.get("partition", "emitted")
    cfg = DiskDeltaConfig(root=case["root"], baseline=case["baseline"], check_weights=True, partition=partition)
    sync = DiskDeltaSync(cfg)
    engine = TensorEngine(case.get("engine_weights") or full_baseline()) if rank == 0 else None
    before = {k: v.clone() for k, v in engine.weights.items()} if engine else None
    sync.connect([engine] if engine else [])
    out: dict = {"error": None}
    try:
        for step in range(1, case.get("num_steps", 1) + 1):
            if partition == "round_robin":  # every rank emits every tensor, like FSDP full tensors
                tensors = {k: v for r in range(WORLD) for k, v in trainer_tensors(r, step).items()}
            else:
                tensors = trainer_tensors(rank, step, diverge=case.get("diverge", False))
            sync.update(tensors.items(), version=step)
        out["metrics"] = sync.metrics()
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["published"] = published_versions(case["root"])
    out["leftovers"] = (
        sorted(p for p in os.listdir(case["root"]) if p.startswith(".")) if os.path.isdir(case["root"]) else []
    )
    if engine:
        out["engine_unchanged"] = all(torch.equal(before[k], engine.weights[k]) for k in before)
        out["engine_version"] = engine.weight_version
        out["engine_equals_trainer"] = all(
            torch.equal(engine.weights[k], v)
            for r in range(WORLD)
            for k, v in trainer_tensors(r, case.get("num_steps", 1)).items()
        )
    return out


def _rank_main(rank: int, init_file: str, inbox, outbox) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    while (case := inbox.get()) is not None:
        try:
            outbox.put((rank, _run_case(rank, case)))
        except Exception:
            outbox.put((rank, {"error": "harness: " + traceback.format_exc()}))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    ctx = mp.get_context("spawn")
    init_file = str(tmp_path_factory.mktemp("gloo") / "init")
    inboxes, outbox = [ctx.Queue() for _ in range(WORLD)], ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, init_file, inboxes[r], outbox), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()

    def run(case: dict) -> list[dict]:
        for box in inboxes:
            box.put(case)
        results = {}
        for _ in range(WORLD):
            try:
                rank, result = outbox.get(timeout=TIMEOUT_S + 20)
            except queue.Empty:
                pytest.fail(f"ranks did not answer within {TIMEOUT_S + 20} s (a rank is stuck in a collective)")
            results[rank] = result
        return [results[r] for r in range(WORLD)]

    yield run
    for box in inboxes:
        box.put(None)
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()


# -- malformed baselines, built as real files ----------------------------------------------------------------


def _save(tensors: dict, path) -> str:
    safetensors.torch.save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return str(path)


def _rewrite_header(path: str, edit) -> None:
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    # keep the data section where it was relative to the new header
    open(path, "wb").write(struct.pack("<Q", len(raw)) + raw + data[8 + n :])


def _wrong_dtype(d):
    t = full_baseline()
    t["layers.1.w"] = t["layers.1.w"].to(torch.float16)  # same byte count: would corrupt silently
    return _save(t, d / "b.safetensors")


def _wrong_shape(d):
    t = full_baseline()
    t["layers.1.w"] = t["layers.1.w"].reshape(4, 8).contiguous()
    return _save(t, d / "b.safetensors")


def _wrong_byte_count(d):
    path = _save(full_baseline(), d / "b.safetensors")

    def edit(h):
        h["layers.1.w"]["shape"] = [8, 3]  # offsets still span 64 bytes

    _rewrite_header(path, edit)
    return path


def _missing(d):
    t = full_baseline()
    del t["layers.1.w"]
    return _save(t, d / "b.safetensors")


def _unsupported_dtype(d):
    path = _save(full_baseline(), d / "b.safetensors")

    def edit(h):
        h["layers.1.w"]["dtype"] = "F8_E8M0"

    _rewrite_header(path, edit)
    return path


def _scalar(d):
    t = full_baseline()
    t["shared.scale"] = t["shared.scale"].reshape(1)  # the trainer emits a 0-d tensor
    return _save(t, d / "b.safetensors")


def _truncated(d):
    path = _save(full_baseline(), d / "b.safetensors")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 40)  # cuts into the last tensor in the data section, layers.1.w
    return path


def _corrupt_header(d):
    path = _save(full_baseline(), d / "b.safetensors")
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(b"{not json at all")
    return path


def _checksum_mismatch(d):
    from miles.sync.disk_delta.transport import Baseline, save_baseline

    path = str(save_baseline(full_baseline(), d / "b.safetensors"))
    entry = Baseline.from_checkpoint(path).entries["layers.1.w"]
    with open(path, "r+b") as f:
        f.seek(entry.offset + 5)
        f.write(b"\x7f")
    return path


CASES = {  # name -> (build baseline, case options, the tensor named, the failing rank, texts the message must hold)
    "wrong dtype": (_wrong_dtype, {}, "layers.1.w", 1, ["F16[8, 4]", "BF16[8, 4]"]),
    "wrong shape": (_wrong_shape, {}, "layers.1.w", 1, ["BF16[4, 8]", "BF16[8, 4]"]),
    "wrong byte count": (_wrong_byte_count, {}, "layers.1.w", 1, ["BF16[8, 3] (64 bytes)", "BF16[8, 4] (64 bytes)"]),
    "missing tensor": (_missing, {}, "layers.1.w", 1, ["not in the baseline"]),
    "unsupported dtype": (_unsupported_dtype, {}, "layers.1.w", 1, ["'F8_E8M0'", "BF16[8, 4]"]),
    "scalar tensor": (_scalar, {}, "shared.scale", 0, ["F32[1] (4 bytes)", "F32[] (4 bytes)"]),
    "truncated file": (_truncated, {}, "layers.1.w", 1, ["truncated", "BF16[8, 4] (64 bytes)"]),
    "corrupt header": (_corrupt_header, {}, "b.safetensors", 0, ["corrupt header"]),
    "checksum mismatch": (_checksum_mismatch, {}, "layers.1.w", 1, ["checksum mismatch", "BF16[8, 4]"]),
    "duplicate name with different bytes": (
        lambda d: _save(full_baseline(), d / "b.safetensors"),
        {"diverge": True},
        "shared.scale",
        1,
        ["rank 0 as F32[] (4 bytes)", "rank 1 as F32[] (4 bytes)"],
    ),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case_name", list(CASES))
def test_malformed_baseline_fails_on_every_rank_naming_tensor_layouts_and_rank(ranks, tmp_path, case_name):
    build, options, tensor, failing_rank, texts = CASES[case_name]
    case = {"root": str(tmp_path / "weights"), "baseline": build(tmp_path), **options}
    results = ranks(case)
    for rank, r in enumerate(results):
        assert r["error"] is not None, f"rank {rank} did not fail for {case_name}"
        assert r["error"].startswith(f"CollectiveError: rank {failing_rank} of {WORLD} failed"), r["error"]
        assert tensor in r["error"], r["error"]
        for text in texts:
            assert text in r["error"], (text, r["error"])
        assert r["published"] == [] and r["leftovers"] == [], r
    assert results[0]["error"] == results[1]["error"]
    assert results[0]["engine_unchanged"] and results[0]["engine_version"] == 0


@pytest.mark.timeout(120)
def test_two_ranks_sync_three_versions_and_engine_matches_trainer(ranks, tmp_path):
    from miles.sync.disk_delta.transport import save_baseline
    from miles.sync.disk_delta.version import read_index

    base = str(save_baseline(full_baseline(), tmp_path / "b.safetensors"))
    results = ranks({"root": str(tmp_path / "weights"), "baseline": base, "num_steps": 3})
    assert [r["error"] for r in results] == [None, None]
    assert results[0]["engine_version"] == 3 and results[0]["engine_equals_trainer"]
    assert results[0]["published"] == [1, 2, 3]
    index = read_index(tmp_path / "weights", 3)
    # the replicated tensor is written once, by the lowest rank emitting it
    assert index["tensors"]["shared.scale"]["shard"] == "shard-00000.safetensors"
    assert index["tensors"]["layers.1.w"]["shard"] == "shard-00001.safetensors"
    assert results[0]["metrics"]["disk_delta/num_tensors"] == 3


@pytest.mark.timeout(120)
def test_engine_rejecting_a_version_fails_every_rank_and_keeps_its_weights(ranks, tmp_path):
    from miles.sync.disk_delta.transport import save_baseline

    base = str(save_baseline(full_baseline(), tmp_path / "b.safetensors"))
    stale = full_baseline()
    stale["layers.1.w"] = stale["layers.1.w"] + 1  # the engine loaded something other than the baseline
    results = ranks({"root": str(tmp_path / "weights"), "baseline": base, "engine_weights": stale})
    for r in results:
        assert r["error"].startswith("CollectiveError: rank 0 of 2 failed: VersionError"), r["error"]
        assert "layers.1.w" in r["error"] and "checksum mismatch" in r["error"]
    assert results[0]["engine_unchanged"] and results[0]["engine_version"] == 0


@pytest.mark.timeout(120)
def test_round_robin_partition_splits_encoding_of_full_tensors_between_ranks(ranks, tmp_path):
    from miles.sync.disk_delta.transport import save_baseline
    from miles.sync.disk_delta.version import read_index

    base = str(save_baseline(full_baseline(), tmp_path / "b.safetensors"))
    results = ranks({"root": str(tmp_path / "weights"), "baseline": base, "num_steps": 2, "partition": "round_robin"})
    assert [r["error"] for r in results] == [None, None]
    assert results[0]["engine_version"] == 2 and results[0]["engine_equals_trainer"]
    shards = {info["shard"] for info in read_index(tmp_path / "weights", 2)["tensors"].values()}
    assert shards == {"shard-00000.safetensors", "shard-00001.safetensors"}
    assert results[0]["metrics"]["disk_delta/rank_raw_bytes"] < results[0]["metrics"]["disk_delta/raw_bytes"]
