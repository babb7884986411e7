"""Host-chunked optimizer-state offload: bit-identical to resident state, guarded steps, checkpoints, config."""

import pytest
import torch

from miles.config import TrainerConfig
from miles.memory.ledger import MemoryLedger
from miles.memory.tagged import TaggedMemory
from miles.optim import (
    ChunkedOptimizerStateOffloader,
    DiskOptimizerStateOffloader,
    MasterWeightsNotResidentError,
    MuonWithAdamW,
    build_optimizer,
    make_offloader,
)


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 16)
        self.up = torch.nn.Linear(16, 24)
        self.down = torch.nn.Linear(24, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.lm_head = torch.nn.Linear(16, 11, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        return self.lm_head(self.norm(h + self.down(torch.relu(self.up(h)))))


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return TinyLM()


def loss_at(model: torch.nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, 11, (4, 6), generator=g).to(model.lm_head.weight.device)
    logits = model(tokens)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(1, dims=1).flatten())


def train(optimizer_name: str, offload: str, num_steps: int, tmp_path, chunk_bytes: int = 1000, start=None):
    model = tiny_model()
    cfg = TrainerConfig(optimizer=optimizer_name, lr=1e-2, weight_decay=0.01)
    opt = build_optimizer(model.named_parameters(), cfg)
    offloader = None
    if offload == "host":
        offloader = ChunkedOptimizerStateOffloader(opt, chunk_bytes=chunk_bytes)
    elif offload.startswith("disk"):  # "disk" (fd I/O) or "disk-mmap" (copies through the mapping)
        io = offload.partition("-")[2] or "fd"
        offloader = DiskOptimizerStateOffloader(opt, directory=str(tmp_path), chunk_bytes=chunk_bytes, io=io)
    for step in range(num_steps):
        loss_at(model, step).backward()
        if offloader:
            offloader.restore()
        opt.step()
        opt.zero_grad()
        if offloader:
            offloader.offload()
    return model, opt, offloader


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("optimizer_name", ["adamw", "muon"])
@pytest.mark.parametrize("offload", ["host", "disk", "disk-mmap"])
@pytest.mark.parametrize("chunk_bytes", [100, 1 << 20])  # 100 B: every matrix spans several chunks
def test_offloaded_state_matches_resident_state_bit_for_bit(optimizer_name, offload, chunk_bytes, tmp_path):
    reference, _, _ = train(optimizer_name, "none", 5, tmp_path)
    model, _, offloader = train(optimizer_name, offload, 5, tmp_path, chunk_bytes)
    assert offloader.is_offloaded and offloader.offloaded_bytes > 0
    for a, b in zip(params_of(reference), params_of(model)):
        assert torch.equal(a, b)


def test_state_storages_are_empty_while_offloaded_and_whole_after_restore(tmp_path):
    _, opt, offloader = train("adamw", "host", 2, tmp_path)
    states = [v for st in opt.state.values() for v in st.values()]
    assert all(v.untyped_storage().nbytes() == 0 for v in states)
    offloader.restore()
    assert all(v.untyped_storage().nbytes() == v.numel() * v.element_size() for v in states)


def test_step_with_master_weights_offloaded_raises(tmp_path):
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    offloader = ChunkedOptimizerStateOffloader(opt, chunk_bytes=256, master_params=list(model.parameters()))
    loss_at(model, 0).backward()
    opt.step()
    offloader.offload()
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    with pytest.raises(MasterWeightsNotResidentError, match="master weights not resident.*offloader.restore"):
        opt.step()
    offloader.restore()
    opt.step()  # resident again: the guard lets it through


def test_step_with_params_paused_by_tagged_memory_raises():
    model = tiny_model()
    opt = build_optimizer(model.named_parameters(), TrainerConfig(optimizer="muon"))
    offloader = ChunkedOptimizerStateOffloader(opt)
    loss_at(model, 0).backward()
    mem = TaggedMemory("trainer/0", MemoryLedger(), torch.device("cpu"))
    mem.register("params", model.parameters(), policy="host")
    mem.offload(["params"])
    with pytest.raises(MasterWeightsNotResidentError, match=r"8 of 8 master weights"):
        offloader.restore()
        opt.step()
    mem.onload(["params"])
    opt.step()


def test_step_while_state_is_offloaded_raises(tmp_path):
    model, opt, offloader = train("muon", "host", 1, tmp_path)
    loss_at(model, 1).backward()
    with pytest.raises(RuntimeError, match="call offloader.restore"):
        opt.step()


@pytest.mark.parametrize("optimizer_name", ["adamw", "muon"])
def test_state_dict_while_offloaded_equals_resident_state_dict(optimizer_name, tmp_path):
    _, ref_opt, _ = train(optimizer_name, "none", 3, tmp_path)
    _, opt, offloader = train(optimizer_name, "host", 3, tmp_path)
    assert offloader.is_offloaded
    got, want = opt.state_dict(), ref_opt.state_dict()
    assert not offloader.is_offloaded  # the state_dict pre-hook restored it
    flat = lambda sd: [
        v
        for o in (sd.values() if optimizer_name == "muon" else [sd])
        for st in o["state"].values()
        for v in st.values()
    ]
    assert all(torch.equal(a, b) for a, b in zip(flat(got), flat(want)))


def test_load_state_dict_while_offloaded_then_training_matches_reference(tmp_path):
    reference, _, _ = train("muon", "none", 6, tmp_path)
    model, opt, offloader = train("muon", "host", 3, tmp_path)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    sd = {
        name: {
            "state": {i: {k: v.clone() for k, v in st.items()} for i, st in o["state"].items()},
            "param_groups": o["param_groups"],
        }
        for name, o in opt.state_dict().items()
    }
    offloader.offload()
    opt.load_state_dict(sd)  # loaded while offloaded
    model.load_state_dict(saved)
    for step in range(3, 6):
        loss_at(model, step).backward()
        offloader.restore()
        opt.step()
        opt.zero_grad()
        offloader.offload()
    assert all(torch.equal(a, b) for a, b in zip(params_of(reference), params_of(model)))


def test_muon_takes_hidden_matrices_and_adamw_the_rest():
    model = tiny_model()
    opt = build_optimizer(model.named_parameters(), TrainerConfig(optimizer="muon"))
    assert isinstance(opt, MuonWithAdamW)
    muon_ids = {id(p) for g in opt.children["muon"].param_groups for p in g["params"]}
    assert muon_ids == {id(model.up.weight), id(model.down.weight)}  # embed, head, biases and norm: AdamW
    assert len(opt.param_groups) == 2 and sum(len(g["params"]) for g in opt.param_groups) == 8


def test_make_offloader_follows_the_config(tmp_path):
    opt = torch.optim.AdamW(tiny_model().parameters())
    assert make_offloader(TrainerConfig(), opt, None, rank=0) is None
    host = make_offloader(TrainerConfig(optimizer_offload="host", optimizer_offload_chunk_bytes=4096), opt, None, 0)
    assert type(host) is ChunkedOptimizerStateOffloader and host.chunk_bytes == 4096
    disk = make_offloader(TrainerConfig(optimizer_offload="disk", optimizer_offload_dir=str(tmp_path)), opt, None, 3)
    assert isinstance(disk, DiskOptimizerStateOffloader) and disk.directory == str(tmp_path / "rank3")
    assert disk.owner == "trainer/3"


def test_ledger_records_optimizer_moves_between_device_and_pool(tmp_path):
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters())
    ledger = MemoryLedger()
    offloader = ChunkedOptimizerStateOffloader(opt, chunk_bytes=512, ledger=ledger, owner="trainer/0")
    loss_at(model, 0).backward()
    opt.step()
    nbytes = offloader.offload()
    state_bytes = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values())
    assert nbytes == state_bytes
    assert ledger.held()[("trainer/0", "optimizer", "host")] == nbytes
    assert ledger.held()[("trainer/0", "optimizer", "device")] == 0
    offloader.restore()
    assert ledger.held()[("trainer/0", "optimizer", "device")] == nbytes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("offload", ["host", "disk"])
def test_cuda_offloaded_muon_state_matches_resident_state_bit_for_bit(offload, tmp_path):
    def run(mode):
        model = tiny_model().cuda()
        opt = build_optimizer(model.named_parameters(), TrainerConfig(optimizer="muon"))
        off = {
            "none": None,
            "host": lambda: ChunkedOptimizerStateOffloader(opt, chunk_bytes=300),
            "disk": lambda: DiskOptimizerStateOffloader(opt, directory=str(tmp_path), chunk_bytes=300),
        }[mode]
        off = off() if off else None
        for step in range(4):
            loss_at(model, step).backward()
            if off:
                off.restore()
            opt.step()
            opt.zero_grad()
            if off:
                off.offload()
        return params_of(model)

    assert all(torch.equal(a, b) for a, b in zip(run("none"), run(offload)))
