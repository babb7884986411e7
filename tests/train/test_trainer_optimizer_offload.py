"""trainer.optimizer_offload wired through the torch backend: same weights as resident state, bit for bit."""

import pytest
import torch

from miles.config import TrainerConfig
from miles.train.torch_backend import TorchBackend
from tests.train.test_torch_backend import _batch


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.parametrize("mode", ["host", "disk"])
def test_offloaded_optimizer_state_trains_bit_identically_to_resident(tiny_model_cfg, tmp_path, optimizer, mode):
    extra = {"optimizer_offload_dir": str(tmp_path)} if mode == "disk" else {}
    resident = TorchBackend(tiny_model_cfg, TrainerConfig(optimizer=optimizer))
    offloaded = TorchBackend(tiny_model_cfg, TrainerConfig(optimizer=optimizer, optimizer_offload=mode, **extra))
    assert offloaded.optim_offloader is not None and "optimizer" not in offloaded.memory.tags
    for i in range(3):
        resident.train_step(_batch(seed=i))
        offloaded.train_step(_batch(seed=i))
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(resident.named_weights(), offloaded.named_weights()))
