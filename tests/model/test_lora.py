"""LoRA on the decoder: bad settings refused with the fix, a fresh adapter is the base, adapters off is the base bit
for bit, only the targeted projections are adapted, and a merge is the base plus scale * B @ A."""

from dataclasses import replace

import pytest
import torch

from miles.config import apply_overrides
from miles.model.config import ModelConfig
from miles.model.decoder import build_decoder
from miles.model.lora import LoRALinear, adapter_parameters, adapters_disabled, merged_state_dict
from miles.model.lora_config import LoRAConfig, adapter_numel
from miles.recipes import quickstart

CFG = ModelConfig(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)


def _lora(rank=4, **kw) -> ModelConfig:
    return replace(CFG, lora=LoRAConfig(rank=rank, **kw))


def _perturbed(cfg: ModelConfig, seed: int = 0):
    """The decoder with non-zero B matrices (a fresh adapter is exactly the base)."""
    model = build_decoder(cfg, seed=3)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in adapter_parameters(model):
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


@pytest.mark.parametrize(
    "override, says",
    [
        ("model.lora.rank=-1", "model.lora.rank = -1 must be >= 0"),
        ("model.lora.alpha=8", "model.lora.rank = 0 (off): set model.lora.rank to 1 or more"),
        ("model.lora.rank=65", "use model.lora.rank <= 64"),  # the quickstart's k_proj has 64 outputs
        ("model.lora.rank=4 model.lora.target_modules=qproj", "did you mean 'q_proj'?"),
        ("model.lora.rank=4 model.lora.target_modules=model.layers.9.*", "matches no projection"),
        ("model.lora.rank=4 model.lora.target_modules=(", "is not a valid regex"),
        ("model.lora.rank=4 model.lora.dropout=1", "model.lora.dropout = 1.0 must be >= 0 and < 1"),
        ("model.lora.rank=4 trainer.backend=megatron device=cuda", "use trainer.backend=torch"),
        ("model.lora.rank=4 trainer.precision=fp8", "use trainer.precision=bf16"),
        ("model.lora.rank=4 rollout.engine=sglang", "use rollout.engine=embedded or http"),
        ("model.lora.rank=4 model.lora.dropout=0.1 true_on_policy=true", "use model.lora.dropout=0"),
        ("model.lora.rank=4 model.lora.warmup=full", "model.lora.warmup = 'full': use adapters"),
        ("model.lora.warmup=base", "model.lora.rank = 0 (off)"),
        ("model.lora.rank=4 model.lora.warmup=base trainer.warmup_sft_steps=0", "trainer.warmup_sft_steps >= 1"),
        ("model.lora.rank=4 model.lora.warmup=base trainer.world_size=2", "start LoRA from it with model.checkpoint"),
        ("model.lora.rank=4 model.lora.warmup=base trainer.optimizer_offload=host", "trainer.optimizer_offload=none"),
        ("model.lora.rank=4 model.lora.warmup=base sync.transport=disk-delta", "use sync.transport=tensor"),
    ],
)
def test_bad_lora_settings_are_refused_with_the_value_and_the_fix(override, says):
    with pytest.raises(ValueError, match="model.lora") as e:
        apply_overrides(quickstart(), override.split())
    assert says in str(e.value)


def test_a_rank_up_to_the_smallest_projection_is_accepted_and_rank_one_too():
    for rank in (1, 64):
        assert apply_overrides(quickstart(), [f"model.lora.rank={rank}"]).model.lora.rank == rank


def test_a_fresh_adapter_leaves_the_model_its_base_and_only_adapters_require_grad():
    base, lora = build_decoder(CFG, seed=3), build_decoder(_lora(), seed=3)
    ids = torch.randint(0, 264, (2, 11), generator=torch.Generator().manual_seed(1))
    assert torch.equal(base(ids), lora(ids))  # B = 0: the delta adds exactly zero
    trained = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert trained == [n for n, _ in adapter_parameters(lora)]
    assert sum(p.numel() for _, p in adapter_parameters(lora)) == adapter_numel(_lora())
    assert all(
        p.dtype == torch.float32 for _, p in adapter_parameters(build_decoder(replace(_lora(), dtype="bfloat16")))
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_adapters_disabled_is_the_base_model_bit_for_bit(dtype):
    cfg = replace(_lora(), dtype=dtype)
    model, base = _perturbed(cfg), build_decoder(replace(CFG, dtype=dtype), seed=3)
    ids = torch.randint(0, 264, (3, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert not torch.equal(model(ids), base(ids))
        with adapters_disabled(model):
            assert torch.equal(model(ids), base(ids))
        assert not torch.equal(model(ids), base(ids))  # back on after the block


def test_target_modules_pick_projections_by_name_or_by_regex_over_module_names():
    names = lambda cfg: sorted(n for n, m in build_decoder(cfg).named_modules() if isinstance(m, LoRALinear))  # noqa: E731
    assert names(_lora(target_modules=("q_proj", "v_proj"))) == [
        f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")
    ]
    assert names(_lora(target_modules=(r"model\.layers\.1\.mlp\..*",))) == [
        f"model.layers.1.mlp.{p}" for p in ("down_proj", "gate_proj", "up_proj")
    ]
    assert len(names(_lora())) == 2 * 7  # all-linear: every projection, never the output head


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_merged_weight_is_the_base_plus_scale_b_a_rounded_once_and_gives_the_adapted_logits(dtype):
    cfg = replace(_lora(rank=2, alpha=8.0), dtype=dtype)
    model = _perturbed(cfg)
    merged = merged_state_dict(model)
    assert not any("lora" in n for n in merged)
    q = model.model.layers[1].self_attn.q_proj
    want = (q.weight.float() + 4.0 * (q.lora_B.weight @ q.lora_A.weight)).to(q.weight.dtype)  # alpha / rank = 4
    assert torch.equal(merged["model.layers.1.self_attn.q_proj.weight"], want)
    plain = build_decoder(replace(CFG, dtype=dtype))
    plain.load_state_dict(merged, strict=False)
    ids = torch.randint(0, 264, (2, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        a, b = model(ids).float(), plain(ids).float()
    tol = 1e-4 if dtype == "float32" else 0.1  # bf16: the merged weight rounds once more than the unmerged sum
    assert (a - b).abs().max() < tol
