"""``miles bench lora-serving``: how the embedded engine should serve base + LoRA adapter, measured side by side.

Two ways, same base, same adapters, same requests:
* ``unmerged`` (what miles does): the base stored once and never written; each adapted projection adds
  ``scale * (x A^T) B^T`` next to its matmul (on CUDA next to the fused q|k|v and gate|up, miles.rollout.
  fused_adapters). A weight sync writes the adapters only.
* ``merged`` per version: the engine serves ``W + scale * B @ A`` as a plain model, so decoding costs what the
  base costs; but every sync re-merges every adapted projection (timed here as ``merge_seconds``), and to merge
  version n+1 it needs the unmerged base (a second copy of the adapted weights, ``merge_extra_bytes``) or it
  subtracts version n's delta in place, which drifts by one rounding per version.

Reported per rank: decode tokens/s of each, the merge's seconds and extra bytes, and the mismatch of each against
the trainer's forward of the same tokens (the adapter model's full-sequence forward with the run's kernels) under
true_on_policy, where unmerged is exact and merged is not (its weights are rounded differently).

    miles bench lora-serving --json                   # CPU: ranks 1,8,32,64 of a small model
    miles bench lora-serving --json --size 0.5b       # GPU
"""

from __future__ import annotations

import argparse
import time

import torch

from miles.model.config import ModelConfig
from miles.model.lora_config import LoRAConfig

SIZES = {
    "cpu": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=4096),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, rope_theta=1e6),
}  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="miles bench lora-serving")
    p.add_argument("--size", default="cpu", choices=sorted(SIZES))
    p.add_argument("--ranks", default="1,8,32,64")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=3, help="generates timed per engine (the median is reported)")
    p.add_argument("--mismatch-rows", type=int, default=4, help="rows of the true_on_policy mismatch check")
    p.add_argument("--json", action="store_true", help="accepted for the CLI; the result is always JSON")
    return p


def model_cfg(size: str, rank: int, max_len: int, dtype: str) -> ModelConfig:
    return ModelConfig(**SIZES[size], max_position_embeddings=max_len, dtype=dtype, lora=LoRAConfig(rank=rank))


def trained_adapters(engine, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random nonzero adapters (as after some training: B is no longer zero), written into ``engine``."""
    from miles.model.lora import adapter_parameters

    g = torch.Generator().manual_seed(seed)
    out = {n: (torch.randn(p.shape, generator=g) * 0.05).to(p.dtype) for n, p in adapter_parameters(engine.model)}
    engine.update_weights_from_tensor([(n, t.to(engine.device)) for n, t in out.items()], version=1)
    return out


def merged_engine(lora_engine, cfg: ModelConfig, device: str, true_on_policy: bool):
    """A plain engine serving the merged weights of ``lora_engine``; and the seconds the merge took."""
    from miles.model.lora import merged_state_dict
    from miles.rollout.engine import EmbeddedEngine

    plain = EmbeddedEngine(
        _no_lora(cfg), max_batch_size=lora_engine.max_batch_size, max_seq_len=lora_engine.max_seq_len,
        device=device, seed=0, true_on_policy=true_on_policy,
    )  # fmt: skip
    _sync(device)
    t0 = time.perf_counter()
    merged = merged_state_dict(lora_engine.model)
    plain.update_weights_from_tensor(list(merged.items()), version=1)
    _sync(device)
    return plain, time.perf_counter() - t0


def _no_lora(cfg: ModelConfig) -> ModelConfig:
    from dataclasses import replace

    return replace(cfg, lora=LoRAConfig(rank=0))


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def decode_rate(engine, rows: int, prompt: int, new: int, reps: int, device: str) -> float:
    """Median generated tokens per second over ``reps`` generates (greedy-free sampling, no stop tokens)."""
    from benchmarks.rollout import requests

    engine.generate(requests(rows, prompt, 2, 1, engine.cfg.vocab_size, seed=9), seed=9)  # warm (graphs on CUDA)
    ts = []
    for rep in range(reps):
        reqs = requests(rows, prompt, new, 1, engine.cfg.vocab_size, seed=rep)
        _sync(device)
        t0 = time.perf_counter()
        outs = engine.generate(reqs, seed=rep)
        _sync(device)
        ts.append(time.perf_counter() - t0)
        assert all(len(o.output_ids) == new for o in outs)
    return rows * new / sorted(ts)[len(ts) // 2]


def mismatch(backend, engine, rows: int, prompt: int, new: int) -> float:
    """max |engine log-prob - trainer log-prob| over the tokens the engine sampled; the trainer's are
    ``backend.forward_logprobs`` of the same sequences (the adapter model's full-sequence forward)."""
    from benchmarks.rollout import requests
    from miles.samples import Sample, collate

    reqs = requests(rows, prompt, new, 1, engine.cfg.vocab_size, seed=5)
    samples = [
        Sample(index=i, group=i, prompt="", target="", prompt_ids=list(r.input_ids), response_ids=o.output_ids,
               rollout_log_probs=o.output_log_probs)
        for i, (r, o) in enumerate(zip(reqs, engine.generate(reqs, seed=5)))
    ]  # fmt: skip
    batch = collate(samples, pad_id=0)
    on = batch.loss_mask > 0
    ours = backend.forward_logprobs(batch)
    return (ours[on].float().cpu() - batch.rollout_log_probs[on]).abs().max().item()


def true_on_policy_gaps(size: str, rank: int, a, device: str) -> dict:
    """The trainer (bf16, true_on_policy, adapters trained to random values) against an unmerged engine synced
    with its adapters and a plain engine given its merged weights."""
    from miles.config import TrainerConfig
    from miles.model.lora import adapter_parameters, merged_state_dict
    from miles.rollout.engine import EmbeddedEngine
    from miles.train.torch_backend import TorchBackend

    max_len = a.prompt_len + a.new_tokens
    cfg = model_cfg(size, rank, max_len, "bfloat16")
    backend = TorchBackend(cfg, TrainerConfig(), device=device, offload_policy="none", true_on_policy=True)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in adapter_parameters(backend.model):
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    rows = min(a.mismatch_rows, a.rows)
    kw = dict(max_batch_size=rows, max_seq_len=max_len, device=device, seed=0, true_on_policy=True)
    unmerged, merged = EmbeddedEngine(cfg, **kw), EmbeddedEngine(_no_lora(cfg), **kw)
    unmerged.update_weights_from_tensor([(n, t.detach().clone()) for n, t in backend.named_weights()], version=1)
    merged.update_weights_from_tensor(list(merged_state_dict(backend.model).items()), version=1)
    return {
        name: mismatch(backend, e, rows, a.prompt_len, a.new_tokens)
        for name, e in (("unmerged", unmerged), ("merged", merged))
    }


def one_rank(size: str, rank: int, a, device: str) -> dict:
    from miles.model.lora import lora_modules
    from miles.rollout.engine import EmbeddedEngine

    dtype = "float32" if device == "cpu" else "bfloat16"
    max_len = a.prompt_len + a.new_tokens
    cfg = model_cfg(size, rank, max_len, dtype)
    unmerged = EmbeddedEngine(cfg, max_batch_size=a.rows, max_seq_len=max_len, device=device, seed=0)
    adapters = trained_adapters(unmerged)
    merged, merge_s = merged_engine(unmerged, cfg, device, true_on_policy=False)
    rates = {
        name: decode_rate(e, a.rows, a.prompt_len, a.new_tokens, a.reps, device)
        for name, e in (("unmerged", unmerged), ("merged", merged), ("unmerged_again", unmerged))
    }  # unmerged timed twice, before and after merged, so drift of a shared machine shows
    adapted = sum(m.weight.numel() * m.weight.element_size() for _, m in lora_modules(unmerged.model))
    del merged, unmerged
    return {
        "rank": rank,
        "adapter_bytes": sum(t.nbytes for t in adapters.values()),
        "decode_tokens_per_s": {k: round(v, 1) for k, v in rates.items()},
        "unmerged_over_merged": round(min(rates["unmerged"], rates["unmerged_again"]) / rates["merged"], 3),
        "merge_seconds_per_version": round(merge_s, 4),
        "merge_extra_bytes": adapted,  # the pristine adapted weights a merge per version re-merges from
        "true_on_policy_max_abs_logprob_diff_bf16": true_on_policy_gaps(size, rank, a, device),
    }


def run(argv: list[str]) -> dict:
    a = _parser().parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    rows = [one_rank(a.size, int(r), a, device) for r in a.ranks.split(",")]
    return {
        "size": a.size,
        "device": device,
        "rows": a.rows,
        "prompt_len": a.prompt_len,
        "new_tokens": a.new_tokens,
        "threads": torch.get_num_threads(),
        "per_rank": rows,
        "choice": "unmerged: the base stored once and never rewritten, a sync writes only the adapters, and the "
        "engine computes what the trainer computes (0 mismatch under true_on_policy); merged decodes at the base's "
        "speed but re-merges every adapted weight per version and needs a second copy of them to merge from",
    }
