import torch

from miles.memory import MemoryLedger, TaggedMemory


def _module():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Linear(24, 8, bias=False))


def test_pause_and_resume_restore_bytes_exactly_and_keep_tensor_identity():
    m = _module()
    before = {k: v.detach().clone() for k, v in m.state_dict().items()}
    ids = [id(p) for p in m.parameters()]
    mem = TaggedMemory("t/0", MemoryLedger(), "cpu")
    mem.register("params", m.parameters())
    moved = mem.offload(["params"])
    assert moved == sum(p.numel() * 4 for p in m.parameters())
    assert all(p.untyped_storage().nbytes() == 0 for p in m.parameters())
    mem.onload(["params"])
    assert [id(p) for p in m.parameters()] == ids
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())


def test_second_pause_and_second_resume_are_no_ops():
    m = _module()
    mem = TaggedMemory("t/0", MemoryLedger(), "cpu")
    mem.register("params", m.parameters())
    assert mem.offload(["params"]) > 0 and mem.offload(["params"]) == 0
    assert mem.onload(["params"]) > 0 and mem.onload(["params"]) == 0


def test_ledger_records_each_move_and_the_peak_per_pool():
    m = _module()
    ledger = MemoryLedger()
    mem = TaggedMemory("t/0", ledger, "cpu")
    mem.register("params", m.parameters())
    n = mem.resident_bytes("params")
    mem.offload(["params"], phase="offload")
    mem.onload(["params"], phase="onload")
    assert [(e.pool, e.direction, e.phase) for e in ledger.events] == [
        ("device", "in", "init"),
        ("device", "out", "offload"),
        ("host", "in", "offload"),
        ("host", "out", "onload"),
        ("device", "in", "onload"),
    ]
    assert ledger.peaks() == {"device": n, "host": n, "disk": 0}
    assert ledger.held()[("t/0", "params", "host")] == 0


def test_discarded_tag_frees_memory_without_a_backup():
    kv = [torch.ones(64), torch.ones(32)]
    ledger = MemoryLedger()
    mem = TaggedMemory("e/0", ledger, "cpu")
    mem.register("kv_cache", kv, policy="discard")
    mem.offload(["kv_cache"])
    assert ledger.peaks()["host"] == 0
    mem.onload(["kv_cache"])
    assert kv[0].numel() == 64 and kv[0].untyped_storage().nbytes() == 256


def test_disk_policy_round_trips_through_a_file(tmp_path):
    m = _module()
    before = [p.detach().clone() for p in m.parameters()]
    mem = TaggedMemory("t/0", MemoryLedger(), "cpu", disk_dir=str(tmp_path))
    mem.register("params", m.parameters(), policy="disk")
    mem.offload(["params"])
    assert list(tmp_path.iterdir()) == []  # the file is unlinked once mapped; nothing leaks on exit
    mem.onload(["params"])
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))


def test_backup_view_reads_a_paused_tensor_without_resuming_it():
    m = _module()
    before = [p.detach().clone() for p in m.parameters()]
    mem = TaggedMemory("t/0", MemoryLedger(), "cpu")
    mem.register("params", m.parameters())
    mem.offload(["params"])
    assert all(torch.equal(mem.backup_view("params", p), b) for p, b in zip(m.parameters(), before))
    assert mem.is_offloaded("params")


def test_tied_weights_are_moved_once():
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    mem = TaggedMemory("t/0", MemoryLedger(), "cpu")
    mem.register("params", [emb.weight, head.weight])
    assert mem.offload(["params"]) == 10 * 4 * 4


def test_tensors_allocated_after_registration_enter_the_ledger_before_they_leave():
    state = []
    ledger = MemoryLedger()
    mem = TaggedMemory("t/0", ledger, "cpu")
    mem.register("optimizer", lambda: state)  # empty until the first optimizer step
    state.append(torch.zeros(100))
    mem.offload(["optimizer"])
    assert ledger.held()[("t/0", "optimizer", "device")] == 0
    assert ledger.peaks()["device"] == 400 and ledger.held()[("t/0", "optimizer", "host")] == 400
