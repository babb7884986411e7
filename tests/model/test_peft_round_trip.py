"""LoRA checkpoints against the libraries that read them: an adapter miles trained and saved loads with ``peft``
onto the Hugging Face base (``transformers``' own random-init model, saved with ``save_pretrained``) and gives the
logits miles gives; ``miles export --merged`` writes the checkpoint ``peft``'s ``merge_and_unload`` writes, which
``transformers`` loads as a plain model with the same logits."""

from __future__ import annotations

import json

import pytest
import torch

from miles.config import TrainerConfig
from miles.model.config import ModelConfig
from miles.model.lora_config import LoRAConfig
from miles.train.backend import write_checkpoint_files
from miles.train.torch_backend import TorchBackend
from tests.model.tiny_checkpoints import hf_model
from tests.train.test_torch_backend import _batch

peft = pytest.importorskip("peft", reason="the PEFT round trip needs peft: pip install 'miles[dev]'")


def _trained_adapter(tmp_path, family: str, dtype: str, lora: LoRAConfig):
    """(the HF base directory, the adapter directory miles saved, the trained miles backend): three train steps."""
    base = tmp_path / "base"
    hf_model(family).save_pretrained(base)
    cfg = ModelConfig.from_hf(base / "config.json", checkpoint=str(base), dtype=dtype, lora=lora)
    backend = TorchBackend(cfg, TrainerConfig(lr=2e-2), offload_policy="none")
    for step in range(3):  # B moves first, then A: after three steps every adapter matrix is nonzero
        backend.train_step(_batch(seed=step), step=step)
    adapter = tmp_path / "adapter"
    write_checkpoint_files(str(adapter), backend.state_dict())
    return base, adapter, backend


def _hf(base, dtype: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(base, dtype=getattr(torch, dtype)).eval()


IDS = torch.tensor([[5, 17, 200, 3, 99, 42, 7, 250, 1, 64]])
CASES = [  # (family, dtype, lora, logit tolerance): FP32 to summation order, bf16 to a few roundings of logits ~1
    ("llama3", "float32", LoRAConfig(rank=4), 2e-5),
    ("qwen3", "float32", LoRAConfig(rank=2, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj")), 2e-5),
    ("llama3", "bfloat16", LoRAConfig(rank=8), 6e-2),
]


@pytest.mark.parametrize("family,dtype,lora,tol", CASES)
def test_a_miles_saved_adapter_loads_with_peft_onto_the_hf_base_and_gives_miles_logits(
    tmp_path, family, dtype, lora, tol
):
    base, adapter, backend = _trained_adapter(tmp_path, family, dtype, lora)
    saved = json.loads((adapter / "adapter_config.json").read_text())
    assert saved["r"] == lora.rank and saved["base_model_name_or_path"] == str(base)
    theirs = peft.PeftModel.from_pretrained(_hf(base, dtype), adapter).eval()
    n_lora = sum(1 for n, _ in theirs.named_parameters() if "lora_" in n)
    assert n_lora == sum(1 for _ in backend.named_weights())  # every adapter matrix loaded, none left at init
    backend.model.eval()
    with torch.no_grad():
        ours, got = backend.model(IDS).float(), theirs(input_ids=IDS).logits.float()
        plain = _hf(base, dtype)(input_ids=IDS).logits.float()
    assert (got - plain).abs().max() > 10 * tol  # the adapter changes the logits well beyond the tolerance
    torch.testing.assert_close(got, ours, atol=tol, rtol=0)


@pytest.mark.parametrize("family,dtype,lora,tol", CASES[:2])
def test_miles_export_merged_writes_what_peft_merge_and_unload_writes(tmp_path, family, dtype, lora, tol):
    from miles.cli import main

    base, adapter, backend = _trained_adapter(tmp_path, family, dtype, lora)
    out = tmp_path / "merged"
    assert main(["export", str(adapter), "--merged", "--out", str(out)]) == 0  # the base named by the adapter
    merged = _hf(out, dtype)
    reference = peft.PeftModel.from_pretrained(_hf(base, dtype), adapter).merge_and_unload()
    ours, theirs = merged.state_dict(), reference.state_dict()
    assert set(ours) == set(theirs)
    for name, t in theirs.items():
        torch.testing.assert_close(ours[name], t, atol=1e-6, rtol=0, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=IDS).logits, backend.model.eval()(IDS), atol=tol, rtol=0)


def test_export_merged_of_a_random_init_run_rebuilds_its_base_from_the_runs_config(tmp_path):
    """A quickstart-like run has no base on disk: its config.json (model, seed) rebuilds the same base."""
    from miles.cli import main
    from miles.cli.export import main as export
    from miles.model.lora import merged_state_dict
    from miles.train.backend import build_backend
    from tests.conftest import tiny_run_cfg

    cfg = tiny_run_cfg(tmp_path, "model.lora.rank=2", "seed=7")
    backend = build_backend(cfg, "cpu")
    for step in range(2):
        backend.train_step(_batch(seed=step), step=step)
    run = tmp_path / "run"
    step_dir = run / "checkpoints" / "step_000002"
    write_checkpoint_files(str(step_dir), backend.state_dict())
    (run / "config.json").write_text(cfg.to_json())
    assert main(["export", "--merged", str(step_dir), "--out", str(tmp_path / "merged")]) == 0
    import safetensors.torch

    got = safetensors.torch.load_file(tmp_path / "merged" / "model.safetensors")
    want = merged_state_dict(backend.model)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    hf = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert hf["hidden_size"] == 32 and "lora" not in json.dumps(hf)
    (run / "config.json").unlink()
    with pytest.raises(ValueError, match="names no base model .* pass --base HF_DIR, or --run-config"):
        export(["--merged", str(step_dir), "--out", str(tmp_path / "again")])
    assert not (tmp_path / "again").exists()  # nothing half-written


def test_a_checkpoint_after_a_base_warm_up_carries_its_base_which_peft_and_export_merged_load(tmp_path):
    """model.lora.warmup = base: the checkpoint's base/ is a HF checkpoint of the warmed-up base; peft puts the
    adapter on it and gives miles' logits, and export --merged merges into it (not into the seed's random init)."""
    from miles.cli import main
    from miles.model.lora import merged_state_dict
    from miles.train.backend import build_backend
    from tests.conftest import tiny_run_cfg

    cfg = tiny_run_cfg(tmp_path, "model.lora.rank=2", "model.lora.warmup=base", "seed=7")
    backend = build_backend(cfg, "cpu")
    for i in range(2):
        backend.sft_step(_batch(seed=10 + i))
    backend.end_warmup()
    for step in range(3):
        backend.train_step(_batch(seed=step), step=step)
    step_dir = tmp_path / "run" / "checkpoints" / "step_000003"
    write_checkpoint_files(str(step_dir), backend.state_dict())
    theirs = peft.PeftModel.from_pretrained(_hf(step_dir / "base", "float32"), step_dir).eval()
    backend.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=IDS).logits.float(), backend.model(IDS).float(), atol=2e-5, rtol=0)
    assert main(["export", "--merged", str(step_dir), "--out", str(tmp_path / "merged")]) == 0  # no run config needed
    import safetensors.torch

    got = safetensors.torch.load_file(tmp_path / "merged" / "model.safetensors")
    want = merged_state_dict(backend.model)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
