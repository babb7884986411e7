"""The rollout benchmark's floor (benchmarks/rollout.py): per decode step the larger of memory and matmul time,
plus the prefill of each distinct prompt, or of every row's prompt when no group shares one."""

import pytest

from benchmarks.rollout import floor_seconds, model_cfg


def test_the_floor_is_the_larger_term_per_step_plus_the_prefill_of_the_prompts_it_counts():
    cfg = model_cfg("cpu", 64, "cuda")  # bf16: 2 bytes per value
    params, rows, prompt, new, ceil = 1_000_000, 16, 8, 4, {"bandwidth": 1e12, "flops": 1e13}
    kv_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    steps = sum(
        max((params * 2 + rows * (prompt + t + 1) * kv_token) / 1e12, 2 * params * rows / 1e13) for t in range(new - 1)
    )
    prefill_row = 2 * params * prompt / 1e13
    shared = floor_seconds(cfg, params, rows, prompt, new, 8, ceil)
    every = floor_seconds(cfg, params, rows, prompt, new, 1, ceil)
    assert shared == pytest.approx(steps + prefill_row * rows / 8)
    assert every == pytest.approx(steps + prefill_row * rows)
    assert floor_seconds(cfg, params, rows, prompt, new, 8, {"bandwidth": 0.0, "flops": 0.0}) is None  # CPU: none
