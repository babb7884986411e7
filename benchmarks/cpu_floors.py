"""``miles bench cpu-floors``: what one trl_parity RL step costs in arithmetic on this machine, phase by phase.

In one process, on the trl_parity model (random init, FP32, all cores): the matmul throughput at a decode-step
shape and at a training shape (FP32, and bf16 for comparison); the rollout's 32 x 32 tokens through the miles engine and through Hugging Face
``generate`` on the same weights; and one in-process training step (forward + backward + AdamW) of the rollout's
batch. These are the floors under both sides of ``miles bench trl-parity``. Medians of ``--repeats``.

``arithmetic_floor`` turns them into a lower bound on any FP32 implementation's RL step: the matrix-product FLOPs
of the step (weights x tokens only: 6 per weight per trained token, 2 per weight per generated token; attention
scores, norms, sampling, the optimizer and all overheads left out) divided by the best FP32 matmul rate measured
above. No implementation of the same step in FP32 on this machine can be faster than ``step_s``.

    miles bench cpu-floors --json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from miles.config import apply_overrides
from miles.recipes import trl_parity


def _median_s(fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="miles bench cpu-floors")
    ap.add_argument("--json", action="store_true", help="accepted for the CLI; the result is always JSON")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from miles.colocated import Colocated
    from miles.handoff.plan import HandoffPlan

    cfg = apply_overrides(trl_parity(), ["run_dir=/tmp/miles-bench-cpu-floors"])
    m, r = cfg.model, cfg.rollout
    out: dict = {"threads": torch.get_num_threads(), "matmul_gflops": {}}
    for label, (rows, k, n) in {
        "decode_step_linear": (32, m.hidden_size, m.intermediate_size),
        "train_linear": (32 * 43, m.hidden_size, m.intermediate_size),
    }.items():
        for dtype in (torch.float32, torch.bfloat16):  # bf16: what avx512_bf16 / AMX would give the same shapes
            x, w = torch.randn(rows, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
            s = _median_s(lambda x=x, w=w: torch.nn.functional.linear(x, w), max(args.repeats, 50))
            key = label if dtype == torch.float32 else f"{label}_bf16"
            out["matmul_gflops"][key] = {"shape": [rows, k, n], "us": s * 1e6, "gflops": 2 * rows * k * n / s / 1e9}

    co = Colocated(cfg)
    plan = HandoffPlan.from_config(cfg.handoff)
    co.execute(plan.init, version=0)
    steps = iter(range(10**6))
    out["miles_rollout_s"] = _median_s(lambda: co.manager.generate(next(steps)), args.repeats)
    batch = co.manager.generate(0)[0][0]
    out["miles_train_step_s"] = _median_s(lambda: co.backend.train_step(batch), args.repeats)
    out["train_tokens"] = list(batch.tokens.shape)
    out["arithmetic_floor"] = _arithmetic_floor(co.backend.model, cfg, out)

    hf = Qwen2ForCausalLM(Qwen2Config(**m.to_hf())).float().eval()
    hf.load_state_dict(co.backend.model.hf_state_dict(), strict=False)
    n_seq = r.num_prompts_per_step * r.n_samples_per_prompt
    ids = torch.randint(3, m.vocab_size - 1, (n_seq, 12))
    with torch.no_grad():
        out["hf_generate_s"] = _median_s(
            lambda: hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                max_new_tokens=r.max_new_tokens,
                min_new_tokens=r.max_new_tokens,
                pad_token_id=0,
            ),
            args.repeats,
        )
    out["note"] = (
        f"miles rollout = {n_seq} completions of up to {r.max_new_tokens} tokens with rewards and batches; "
        f"HF generate = {n_seq} x {r.max_new_tokens} tokens exactly (no stop), 12-token prompts"
    )
    return out


def _arithmetic_floor(model, cfg, out: dict) -> dict:
    """Seconds the step's weight x token products need at the best FP32 matmul rate measured (a lower bound)."""
    m, r = cfg.model, cfg.rollout
    weights = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in n)
    if m.tie_word_embeddings:  # the output projection is the embedding matrix, used as a matmul
        weights += m.vocab_size * m.hidden_size
    rows, length = out["train_tokens"]
    completions = r.num_prompts_per_step * r.n_samples_per_prompt
    best = max(v["gflops"] for k, v in out["matmul_gflops"].items() if not k.endswith("_bf16")) * 1e9
    train_s = 6 * weights * rows * length / best
    rollout_s = 2 * weights * completions * r.max_new_tokens / best  # generated tokens only, prompts left out
    return {
        "matmul_weights": weights,
        "fp32_gflops_used": best / 1e9,
        "train_s": train_s,
        "rollout_s": rollout_s,
        "step_s": train_s + rollout_s,
    }
