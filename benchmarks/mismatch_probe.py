"""Which of the engine's GPU kernels moves its log-probs away from the trainer's (bf16): the engine with every
kernel, with none (the torch reference path), and with one kernel at a time swapped for torch ops that round where
the decoder rounds. A diagnostic for issue 22's mismatch figure, GPU only:

    python -m benchmarks.mismatch_probe [--json OUT]

Each variant builds a fresh engine (the decode graphs are captured with the swap in place), generates the same
requests with the same seed, and scores them with the bench's mismatch (the decoder's full forward).
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from benchmarks.rollout import mismatch, requests
from miles.model.config import ModelConfig

QUICKSTART = dict(
    architecture="qwen2", hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, dtype="bfloat16",
)  # fmt: skip
HALF_B = dict(
    architecture="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
    num_key_value_heads=2, head_dim=64, vocab_size=151936, max_position_embeddings=2048, dtype="bfloat16",
)  # fmt: skip


def torch_add_rmsnorm(x, delta, weight, eps):
    if delta is not None:
        x.add_(delta)
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def torch_silu_mul(gu):
    g, u = gu.chunk(2, -1)
    return F.silu(g) * u


class _SplitLinear:
    """torch.nn.functional with ``linear`` over a fused q|k|v (or gate|up) weight done as separate matmuls."""

    def __init__(self, which: str):
        self.which = which

    def __getattr__(self, name):
        return getattr(F, name)

    def linear(self, x, w, b=None):
        parts = self.sizes["qkv" if self.which == "split_qkv" else "gate_up"]
        if w.shape[0] != sum(parts):
            return F.linear(x, w, b)
        bs = b.split(parts, 0) if b is not None else [None] * len(parts)
        return torch.cat([F.linear(x, wi, bi) for wi, bi in zip(w.split(parts, 0), bs)], -1)


def torch_rope_kv(qkv, cos, sin, lens, k_cache, v_cache, H, KVH, D, qk_norm=None):
    from miles.model.decoder import _rotate_half

    assert qk_norm is None, "the probe's models have no q/k norm"
    R = qkv.shape[0]
    q, k, v = qkv.split([H * D, KVH * D, KVH * D], -1)
    q, k, v = q.reshape(R, H, D), k.reshape(R, KVH, D), v.reshape(R, KVH, D)
    c, s = cos[lens][:, None], sin[lens][:, None]
    q, k = q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s
    rows = torch.arange(R, device=qkv.device)
    k_cache[rows, :, lens] = k
    v_cache[rows, :, lens] = v
    return q.contiguous()


class _BiasApart:
    """torch.nn.functional with ``linear`` as a matmul, then the bias added (two roundings in bf16)."""

    def __getattr__(self, name):
        return getattr(F, name)

    def linear(self, x, w, b=None):
        return F.linear(x, w) + b if b is not None else F.linear(x, w)


@contextmanager
def swapped(name: str):
    import miles.rollout.forward as fw
    import miles.rollout.kernels as kn
    import miles.rollout.sampling as sp

    saved = []

    def put(mod, attr, value):
        saved.append((mod, attr, getattr(mod, attr)))
        setattr(mod, attr, value)

    if name == "reference":
        put(sp, "FORCE_REFERENCE", True)
    elif name == "add_rmsnorm":
        put(kn, "add_rmsnorm", torch_add_rmsnorm)
    elif name == "silu_mul":
        put(kn, "silu_mul", torch_silu_mul)
    elif name == "decode_attention":
        orig = fw.decode_attention
        put(fw, "decode_attention", lambda q, k, v, filled, **kw: orig(q, k, v, filled, num_splits=None, fused=False))
    elif name == "unfused_layers":  # the decoder's own layers (no fused q|k|v, norm, rotary, SiLU); Triton
        import miles.rollout.engine as en  # attention and sampling kept

        put(en, "decode_step_fused", lambda model, fused, *a, **kw: fw.decode_step(model, *a, **kw))
    elif name == "rope_kv":
        put(kn, "rope_kv", torch_rope_kv)
    elif name == "bias_apart":
        put(fw, "F", _BiasApart())
    elif name in ("split_qkv", "split_gate_up"):  # the fused weight's matmul as the separate ones, concatenated
        put(fw, "F", _SplitLinear(name))
    try:
        yield
    finally:
        for mod, attr, value in reversed(saved):
            setattr(mod, attr, value)


def probe(model: dict, variant: str, rows: int, prompt: int, new: int) -> dict:
    from miles.rollout.engine import EmbeddedEngine

    cfg = ModelConfig(**model)
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    _SplitLinear.sizes = {"qkv": [q, kv, kv], "gate_up": [cfg.intermediate_size] * 2}
    with swapped(variant):
        engine = EmbeddedEngine(cfg, max_batch_size=rows, max_seq_len=prompt + new, device="cuda", seed=0)
        reqs = requests(rows, prompt, new, 8, cfg.vocab_size)
        outs = engine.generate(reqs, seed=0)
        torch.cuda.synchronize()
    res = mismatch(engine, reqs[:16], outs[:16])
    del engine
    torch.cuda.empty_cache()
    return res


def main(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.mismatch_probe")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    variants = [
        "kernels",
        "reference",
        "add_rmsnorm",
        "silu_mul",
        "decode_attention",
        "unfused_layers",
        "split_qkv",
        "split_gate_up",
        "rope_kv",
        "bias_apart",
    ]
    out = {"benchmark": "mismatch-probe", "rows": 64, "results": []}
    for label, model, prompt, new in (("quickstart", QUICKSTART, 16, 8), ("0.5b", HALF_B, 128, 64)):
        for v in variants:
            try:
                r = probe(model, v, 64, prompt, new)
            except Exception as e:  # noqa: BLE001 - a swap that does not fit the engine is reported, not fatal
                r = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            r |= {"model": label, "swap": v}
            out["results"].append(r)
            print(json.dumps(r), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
