"""What a run needs from this machine is checked before Ray starts, each refusal with its fix (miles.preflight)."""

from __future__ import annotations

import importlib.util

import pytest

from miles.config import apply_overrides
from miles.preflight import check_environment
from miles.recipes import quickstart


def hf_dir(tmp_path):
    """An HF checkpoint of the quickstart's model (the preflight checks its tensors against the model)."""
    from miles.model.checkpoint import save_hf
    from miles.model.decoder import build_decoder

    d = tmp_path / "ckpt"
    save_hf(build_decoder(quickstart().model), d)
    return d


def test_sglang_engines_launched_here_need_their_package_with_the_install_hint(tmp_path):
    cfg = apply_overrides(
        quickstart(),
        ["rollout.engine=sglang", f"model.checkpoint={hf_dir(tmp_path)}", "rollout.sglang_launcher=nosuchpkg.serve"],
    )
    with pytest.raises(ImportError, match=r"launches `python -m nosuchpkg.serve`, but nosuchpkg is not installed"):
        check_environment(cfg)
    if importlib.util.find_spec("sglang") is None:
        real = apply_overrides(cfg, ["rollout.sglang_launcher=sglang.launch_server"])
        with pytest.raises(ImportError, match=r"pip install 'miles\[sglang\]'.*rollout.sglang_launcher=miles-serve"):
            check_environment(real)
    for fine in (["rollout.sglang_launcher=miles-serve"], ["ray_address=ray://head:10001"]):
        check_environment(apply_overrides(cfg, fine))  # the stand-in is miles; a cluster's nodes have their own


def test_a_checkpoint_or_tokenizer_that_is_not_there_is_named_before_ray_starts(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"model.checkpoint = '.*nope' does not exist; give an HF directory"):
        check_environment(apply_overrides(quickstart(), [f"model.checkpoint={tmp_path / 'nope'}"]))
    with pytest.raises(FileNotFoundError, match=r"model.tokenizer = 'hf:.*gone': '.*gone' does not exist"):
        check_environment(apply_overrides(quickstart(), [f"model.tokenizer=hf:{tmp_path / 'gone'}"]))


def test_device_cuda_without_a_gpu_is_refused_with_the_fix():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="device = 'cuda' needs 1 CUDA device.*use device=cpu"):
        check_environment(apply_overrides(quickstart(), ["device=cuda"]))
