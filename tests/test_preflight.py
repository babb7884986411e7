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


@pytest.mark.parametrize(
    "sizes",
    [
        ["model.vocab_size=1000000000000"],  # M1: 256 TB of embedding, asked of torch after Ray started
        ["model.hidden_size=65536", "model.intermediate_size=262144", "model.num_hidden_layers=64"],  # M2: ~200 GB
    ],
)
def test_a_model_whose_weights_alone_exceed_this_machines_memory_is_refused_before_anything_is_allocated(sizes):
    """Review 2026-12-04 M1/M2 (notes): no size check against RAM; the allocation failed inside an actor (rc 1), or,
    without an address-space cap, the init would touch the pages until the machine swapped or killed it."""
    from miles.handoff.hardware import this_cpu

    cfg = apply_overrides(quickstart(), ["device=cpu", *sizes])
    budget_gib = f"{this_cpu().host_bytes / 2**30:.1f} GiB"
    with pytest.raises(ValueError, match=rf"weights alone take [\d,.]+ GiB .* this machine has {budget_gib} of memory"):
        check_environment(cfg)
    check_environment(apply_overrides(quickstart(), ["device=cpu"]))  # the quickstart's model fits


def test_the_weight_count_of_the_memory_check_matches_reference():
    """ModelConfig.num_parameters (what the check counts, without torch) against the decoder built on meta."""
    from miles.model.size import decoder_storages
    from miles.preflight import WEIGHT_BYTES

    for sizes in ([], ["model.tie_word_embeddings=false"], ["model.architecture=qwen3"], ["model.attention_bias=true"]):
        m = apply_overrides(quickstart(), sizes).model
        assert m.num_parameters * WEIGHT_BYTES[m.dtype] == sum(decoder_storages(m)["params"]), sizes
