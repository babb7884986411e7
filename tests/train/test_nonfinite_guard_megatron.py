"""The Megatron backend's optimizer step (GPU-only as a whole) stops on a non-finite gradient norm like the torch
backend's. Megatron's own optimizer is stood in for by its (ok, grad_norm, num_zeros) answer: this file runs on
CPU, where megatron-core cannot; the GPU tests in test_megatron_backend.py run the real one through train_step."""

import inspect
from types import SimpleNamespace

import pytest
import torch

from miles.train.megatron_backend import MegatronBackend
from miles.train.torch_backend import NonFiniteTrainingError, TorchBackend


def _backend_answering(ok: bool, grad_norm: float):
    b = object.__new__(MegatronBackend)  # no model: only the step's decision is under test
    b.model = SimpleNamespace(finish_grad_sync=lambda: None)
    b.optimizer = SimpleNamespace(step=lambda: (ok, grad_norm, 0))
    b._zero_grads = lambda: None
    return b


def test_the_megatron_step_takes_what_the_shared_train_step_passes():
    assert inspect.signature(MegatronBackend._optimizer_step) == inspect.signature(TorchBackend._optimizer_step)


@pytest.mark.parametrize("ok, grad_norm", [(True, float("nan")), (True, float("inf")), (False, 3.0)])
def test_a_megatron_step_with_a_non_finite_norm_or_skipped_stops_the_run_naming_the_step(ok, grad_norm):
    with pytest.raises(NonFiniteTrainingError, match=rf"RL step 7: grad_norm = {grad_norm} \(loss = nan\)"):
        _backend_answering(ok, grad_norm)._optimizer_step("RL step 7", torch.tensor(float("nan")))
    assert _backend_answering(True, 0.5)._optimizer_step("RL step 7", torch.tensor(1.0)) == 0.5
