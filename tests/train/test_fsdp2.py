"""FSDP2 over two real gloo processes gives the same update as one process on the whole batch."""

import socket

import pytest
import torch
import torch.multiprocessing as mp

from miles.config import TrainerConfig
from tests.conftest import tiny_model
from tests.train.test_torch_backend import _batch

pytestmark = pytest.mark.procs  # it starts processes or servers (tests/conftest.py: the tiers)

CFG = tiny_model(max_position_embeddings=512)


def _equal_length_batch():
    b = _batch(n=8, seed=11)
    b.loss_mask[:, :] = 0
    b.loss_mask[:, 4:9] = 1  # every sample trains on 5 tokens, so per-rank means average to the global mean
    return b


def _rank(rank, port, out):
    import torch.distributed as dist

    from miles.train.torch_backend import TorchBackend

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    b = TorchBackend(CFG, TrainerConfig(), rank=rank, world_size=2)
    full = _equal_length_batch()
    b.train_step(full.split(2)[rank])
    weights = {k: v.clone() for k, v in b.named_weights()}
    b.offload()
    b.onload()
    if rank == 0:
        torch.save(weights, out)
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_fsdp2_two_ranks_match_a_single_process_step(tmp_path):
    from miles.train.torch_backend import TorchBackend

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "w.pt")
    mp.start_processes(_rank, args=(port, out), nprocs=2, join=True, start_method="spawn")
    sharded = torch.load(out)
    single = TorchBackend(CFG, TrainerConfig())
    single.train_step(_equal_length_batch())
    # Adam's first step moves a weight by lr * g / (|g| + eps): where g nearly cancels (|g| << eps = 1e-8, e.g. an
    # embedding row's gradient summed over the batch) the update is g * 1e5, so the two summation orders (one batch
    # vs two ranks' halves averaged) differ there by a few 1e-6 (seen: 5e-6 at one element of 8448). 1e-5 is 1% of
    # lr = 1e-3, the size of every other element's move, so a wrong shard or a missing half still fails.
    for name, w in single.named_weights():
        torch.testing.assert_close(sharded[name], w, atol=1e-5, rtol=1e-5)


def _rank_syncs_from_host_offload(rank, port, out):
    import torch.distributed as dist

    from miles.rollout.engine import EmbeddedEngine
    from miles.train.torch_backend import TorchBackend

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    b = TorchBackend(CFG, TrainerConfig(), rank=rank, world_size=2, offload_policy="host")
    b.train_step(_equal_length_batch().split(2)[rank])
    resident = {k: v.clone() for k, v in b.named_weights()}
    b.offload()  # params now live only in each rank's host arena, as during a colocated weight sync
    assert b.memory.is_offloaded("params")
    engine = EmbeddedEngine(CFG, max_batch_size=1, max_seq_len=8, seed=1)
    engine.update_weights_from_tensor(b.named_weights(), version=1)  # collective: every rank gathers
    if rank == 0:
        torch.save({"resident": resident, "engine": dict(engine.named_weights())}, out)
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_fsdp2_ranks_with_host_offload_sync_the_full_weights_to_an_engine(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "w.pt")
    mp.start_processes(_rank_syncs_from_host_offload, args=(port, out), nprocs=2, join=True, start_method="spawn")
    got = torch.load(out)
    for name, w in got["resident"].items():
        assert torch.equal(got["engine"][name], w), name
    assert set(got["resident"]) <= set(got["engine"])
