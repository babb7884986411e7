"""``miles bench train-step``: tokens/s of one GRPO training step, torch backend vs Megatron-core backend, side by side.

Both backends get the same ~1B-parameter Qwen2-style model (bf16 weights from the same seed) and the same
batch; a step is forward + log-probs + loss + backward + optimizer step. The backends differ in what they
keep: torch trains the bf16 parameters directly with AdamW (bf16 state); Megatron keeps FP32 master weights,
FP32 gradient buffers and FP32 Adam moments (Float16Module + its mixed-precision optimizer), and its local
spec's attention is unfused (``megatron-sdpa`` swaps in torch SDPA, as the torch backend uses). Medians over
``--steps`` timed steps after ``--warmup`` untimed ones. On a machine without CUDA only the torch backend runs,
on a tiny model.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import statistics
import time

import torch

from miles.config import TrainerConfig
from miles.model.config import ModelConfig
from miles.samples import TrainBatch


def _parse(argv: list[str], cuda: bool) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="miles bench train-step")
    p.add_argument("--json", action="store_true", help="accepted for the CLI; the result is always JSON")
    p.add_argument(
        "--backends",
        nargs="+",
        default=["torch", "megatron", "megatron-sdpa"] if cuda else ["torch"],
        help="torch, megatron (local spec attention), megatron-sdpa (local spec with torch SDPA attention)",
    )
    p.add_argument("--hidden", type=int, default=2048 if cuda else 128)
    p.add_argument("--intermediate", type=int, default=6144 if cuda else 384)
    p.add_argument("--layers", type=int, default=14 if cuda else 2)
    p.add_argument("--heads", type=int, default=16 if cuda else 4)
    p.add_argument("--kv-heads", type=int, default=8 if cuda else 2)
    p.add_argument("--vocab", type=int, default=151_936 if cuda else 1024)
    p.add_argument("--batch", type=int, default=8 if cuda else 2, help="sequences per step")
    p.add_argument("--seq", type=int, default=1024 if cuda else 64, help="tokens per sequence")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    return p.parse_args(argv)


def _batch(a, device) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g)
    mask = torch.zeros(a.batch, a.seq)
    mask[:, a.seq // 4 :] = 1
    return TrainBatch(
        tokens, mask, torch.zeros(a.batch, a.seq), torch.randn(a.batch, generator=g), list(range(a.batch))
    )


def _one(name: str, model_cfg: ModelConfig, a, device: str) -> dict:
    if name.startswith("megatron"):
        from miles.train.megatron_backend import MegatronBackend as Backend
    else:
        from miles.train.torch_backend import TorchBackend as Backend
    attention = "sdpa" if name == "megatron-sdpa" else "local"
    cfg = TrainerConfig(
        backend="megatron" if name.startswith("megatron") else "torch", lr=1e-5, megatron_attention=attention
    )
    backend = Backend(model_cfg, cfg, device=device, seed=0, offload_policy="none")
    batch = _batch(a, device)
    times = []
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for i in range(a.warmup + a.steps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        backend.train_step(batch)
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    out = {
        "step_s_median": med,
        "step_s": times,
        "tokens_per_s": a.batch * a.seq / med,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
    }
    del backend
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def run(argv: list[str]) -> dict:
    cuda = torch.cuda.is_available()
    a = _parse(argv, cuda)
    device = "cuda" if cuda else "cpu"
    model_cfg = ModelConfig(
        architecture="qwen2",
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=a.intermediate,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        max_position_embeddings=max(a.seq, 512),
        dtype="bfloat16" if cuda else "float32",
    )
    results, skipped = {}, {}
    for name in a.backends:
        if name.startswith("megatron") and not (cuda and importlib.util.find_spec("megatron") is not None):
            skipped[name] = "needs CUDA and megatron-core (pip install 'miles[gpu]')"
            continue
        results[name] = _one(name, model_cfg, a, device)
    out = {
        "num_parameters": model_cfg.num_parameters,
        "tokens_per_step": a.batch * a.seq,
        "device": device,
        "config": vars(a),
        "results": results,
        "skipped": skipped,
    }
    for name in results:
        if name != "torch" and "torch" in results:
            out[f"{name}_over_torch_tokens_per_s"] = results[name]["tokens_per_s"] / results["torch"]["tokens_per_s"]
    return out
