"""Optimizers (AdamW, Muon + AdamW) and their state offloaders (host chunks, file-backed NVMe chunks)."""

from miles.optim.build import build_optimizer, make_offloader
from miles.optim.disk_offload import DiskOptimizerStateOffloader, OptimizerOffloadSpaceError, TmpfsOffloadWarning
from miles.optim.muon import MuonWithAdamW
from miles.optim.offload import ChunkedOptimizerStateOffloader, MasterWeightsNotResidentError

__all__ = [
    "build_optimizer",
    "make_offloader",
    "ChunkedOptimizerStateOffloader",
    "DiskOptimizerStateOffloader",
    "MasterWeightsNotResidentError",
    "OptimizerOffloadSpaceError",
    "TmpfsOffloadWarning",
    "MuonWithAdamW",
]
