"""The planner: GB300 plans for the large recipes, parameter counts against the published totals, host footprint
as the OS sees it, and 'auto'."""

from __future__ import annotations

import json

import pytest
import torch

from miles.cli.plan import main
from miles.config import apply_overrides
from miles.handoff.hardware import get_profile
from miles.handoff.planner import TagSize, choose_mode, plan
from miles.memory.host_arena import arena_footprint, caching_allocator_footprint
from miles.memory.ledger import process_rss_bytes
from miles.memory.tagged import _aligned_offsets, allocate_host_buffer
from miles.model.size import available_hf_configs, count_params, load_hf_config, stated_params
from miles.recipes import get_recipe, quickstart


def plan_json(capsys, recipe: str) -> dict:
    assert main(["--recipe", recipe, "--hardware", "gb300", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("recipe", ["gb300_dsv4_flash_plan", "gb300_kimi_k2_plan"])
def test_large_moe_recipes_overflow_the_gb300_host_in_cpu_mode_fit_in_gpu_mode_and_auto_picks_gpu(capsys, recipe):
    out = plan_json(capsys, recipe)
    cpu, gpu = out["plans"]["cpu"], out["plans"]["gpu"]
    budget = 898 * (1 << 30)
    assert cpu["budget"]["host_per_node"] == gpu["budget"]["host_per_node"] == budget
    assert cpu["peaks"]["host_per_node"] > budget > gpu["peaks"]["host_per_node"]
    assert gpu["fits"] == {"device": True, "host": True}
    assert any("trainer.offload" in s and "host" in s for s in cpu["over_budget_steps"])
    over = {s["step"].split("(")[0] for s in cpu["steps"] if "host" in s["over"]}
    assert over == {"trainer.offload", "engine.offload_weights"}  # the engine mirror joins the trainer backup
    assert out["auto"]["mode"] == "gpu" and "does not fit" in out["auto"]["reason"]


def test_a_model_that_fits_the_host_either_way_keeps_the_cpu_default(capsys):
    out = plan_json(capsys, "gb300_qwen3_235b_plan")
    assert all(p["fits"]["host"] and p["fits"]["device"] for p in out["plans"].values())
    assert out["auto"]["mode"] == "cpu"


@pytest.mark.parametrize("name", [n for n in available_hf_configs()])
def test_parameter_counts_are_within_three_percent_of_the_published_totals(name):
    hf = load_hf_config(name)
    c = count_params(hf)
    assert abs(c.total / stated_params(hf) - 1) < 0.03
    assert c.active <= c.total


def test_deepseek_v3_counts_match_the_published_breakdown():
    c = count_params(load_hf_config("deepseek-v3"))
    assert abs(c.total / 671e9 - 1) < 0.001
    assert abs(c.mtp / 11.5e9 - 1) < 0.02  # README_WEIGHTS: the MTP module adds 11.5B


def test_auto_on_this_cpu_keeps_the_default_order_and_says_why():
    mode, reason = choose_mode(quickstart(), "cpu")
    assert mode == "cpu" and "fits on cpu" in reason


def test_auto_refuses_a_model_that_fits_in_neither_mode_and_names_the_fixes():
    cfg = apply_overrides(get_recipe("gb300_kimi_k2_plan"), ["trainer.world_size=32", "rollout.num_engines=4"])
    with pytest.raises(ValueError, match="neither mode fits on gb300.*trainer.world_size"):
        choose_mode(cfg)


def test_host_backup_footprint_as_the_os_sees_it_is_the_planned_footprint():
    sizes = [41 * 2**20 + 12, 21 * 2**20 + 7, 5 * 2**20 + 3, 999]  # odd sizes: alignment and page rounding matter
    planned = TagSize("trainer", "params", tuple(sizes), "host").footprint()
    assert planned == arena_footprint(_aligned_offsets(sizes)[-1])  # the packing TaggedMemory.pause uses
    assert planned / sum(sizes) < 1.001
    before = process_rss_bytes()
    buf = allocate_host_buffer(_aligned_offsets(sizes)[-1], pin=torch.cuda.is_available())
    buf.fill_(1)
    grown = process_rss_bytes() - before
    assert 0.98 < grown / planned < 1.02
    del buf
    assert process_rss_bytes() - before < 0.02 * planned  # pages go back to the OS, no allocator cache
    assert caching_allocator_footprint(sum(sizes)) / sum(sizes) > 1.9  # what a power-of-two pinned block would hold


def test_the_caching_allocator_model_raises_the_predicted_host_peak():
    cfg = get_recipe("gb300_dsv4_flash_plan")
    arena = plan(cfg, "gb300", mode="gpu")
    caching = plan(cfg, "gb300", mode="gpu", host_allocator="caching")
    assert caching.host_peak > 1.2 * arena.host_peak


def test_cpu_profile_reads_this_machines_memory_budget():
    hw = get_profile("cpu")
    assert hw.unified and 0 < hw.host_bytes <= hw.host_physical_bytes


def test_kept_arenas_are_reused_by_size_and_the_planner_counts_them_for_the_whole_run():
    from miles.memory import host_arena as ha

    ha.keep_pinned(True)
    try:
        a = ha.host_arena(3 * 2**20 + 1)
        a.fill_(7)
        ptr = a.data_ptr()
        del a
        assert ha.kept_bytes() == ha.arena_footprint(3 * 2**20 + 1)
        b = ha.host_arena(3 * 2**20 + 1)
        assert b.data_ptr() == ptr and int(b[0]) == 7  # the same pages, no new mapping or page-locking
        del b
    finally:
        ha.keep_pinned(False)
    assert ha.kept_bytes() == 0
    cfg = get_recipe("gb300_dsv4_flash_plan")
    kept = plan(cfg, "gb300", mode="gpu", host_allocator="arena_kept")
    assert kept.host_peak == plan(cfg, "gb300", mode="cpu").host_peak  # kept arenas undo the gpu order's saving


def test_the_embedded_engines_cuda_graph_tag_is_planned_on_a_gpu_and_empty_on_the_cpu():
    from miles.rollout.cuda_graphs import graph_tag_storages, logits_bytes, pool_segments

    cfg = get_recipe("h200_100m")
    gpu, cpu = plan(cfg, "h200"), plan(cfg, "cpu")
    graphs = gpu.sizes.tags[("engine", "cuda_graph")]
    m, rows = cfg.model, cfg.rollout.max_batch_size
    assert graphs.bytes == sum(graph_tag_storages(m, rows)) == logits_bytes(m, rows) + sum(pool_segments(m, rows))
    assert logits_bytes(m, rows) == rows * m.vocab_size * 2 and ("engine", "cuda_graph") not in cpu.sizes.tags
    offload = next(s for s in gpu.steps if s.phase == "rollout_to_train" and "cuda_graph" in s.moved)
    assert offload.moved["cuda_graph"] == graphs.bytes  # released with the KV cache at every handoff


@pytest.mark.parametrize("steps", [1000000, -1])
def test_plan_step_counts_outside_the_bound_are_refused_before_any_replay(steps):
    with pytest.raises(ValueError, match=rf"\(miles plan --steps\) = {steps} must be in \[0, 100\]; .* the default 2"):
        plan(get_recipe("gb300_kimi_k2_plan"), "gb300", num_steps=steps)  # the API; the CLI's argparse bounds too


def test_the_megatron_trainers_held_bytes_are_what_the_h200_measured():
    """benchmarks/results/megatron-embedded.gpu.json: the Megatron trainer with the embedded engine on one H200
    (benchmarks/megatron_embedded.py), whose trainer held bytes the planner then got wrong (FP32 master weights and
    grad buffer at build, Adam moments at the first step); the planner's replay must give the measured bytes."""
    import json
    from pathlib import Path

    from miles.config import apply_overrides
    from miles.handoff.planner import plan
    from miles.recipes import h200_100m

    measured = json.loads((Path(__file__).parents[2] / "benchmarks/results/megatron-embedded.gpu.json").read_text())
    shrink = [  # benchmarks/megatron_embedded.py's SHRINK
        "rollout.num_prompts_per_step=16",
        "rollout.n_samples_per_prompt=8",
        "rollout.max_new_tokens=16",
        "rollout.max_batch_size=128",
        "trainer.warmup_sft_steps=0",
        "trainer.backend=megatron",
        "device=cuda",
    ]
    cfg = apply_overrides(h200_100m(), shrink)
    assert cfg.model.num_parameters == measured["parameters"]
    rows = iter(plan(cfg, "h200", num_steps=measured["steps"][-1]["step"] + 1).steps)
    trainer = [m for m in measured["held_mismatches"] if m["step"].startswith("trainer.")]
    assert len(trainer) >= 2
    for m in trainer:
        row = next(r for r in rows if r.step == m["step"])
        assert row.device == m["held"], (m["step"], row.device, m["held"])
