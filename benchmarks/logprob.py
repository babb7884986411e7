"""``miles bench logprob``: time and extra peak memory of per-token log-prob implementations, side by side.

Methods: full FP32 upcast (the naive reference), eager chunked (``impl='eager'``), the fused Triton kernel
(``impl='fused'``, also with entropy), a ``torch.compile``'d chunked loop, and Liger-Kernel's cross-entropy
with ``reduction='none'`` read as ``-log p`` when it is importable. Each runs forward only (no grad: rollout
and old-policy log-probs) and forward + backward (the training step).

On CUDA: medians from ``triton.testing.do_bench`` (L2 flushed between runs); extra peak memory is
``max_memory_allocated`` during one call minus the memory allocated before it (it includes the [T, V]
gradient of the logits in forward + backward; ``grad_gib`` says how much that is). On CPU: medians of
``time.perf_counter`` and the peak of live tensor storages created during the call (``peak_extra_bytes``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

import torch

from miles.memory.live_bytes import peak_extra_bytes
from miles.policy.logprob import HAS_TRITON, full_fp32_log_probs_and_entropy, log_probs_and_entropy

GIB = 2**30


def _parse(argv: list[str], cuda: bool) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="miles bench logprob")
    p.add_argument("--json", action="store_true", help="accepted for the CLI; the result is always JSON")
    p.add_argument("--T", type=int, nargs="+", default=[8192, 32768] if cuda else [512, 2048])
    p.add_argument("--V", type=int, default=151_936 if cuda else 32_000)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--chunk-size", type=int, default=1024 if cuda else 256)
    p.add_argument("--methods", nargs="+", default=None, help="subset of the method names")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile'd chunked method")
    p.add_argument("--sweep", action="store_true", help="also time fused kernel tile configs at the first T")
    p.add_argument("--cpu", action="store_true", help="run on CPU even when CUDA is present")
    return p.parse_args(argv)


# ---- peak memory on CUDA (on CPU: miles.memory.live_bytes.peak_extra_bytes) -------------------------------


def _cuda_peak_extra_bytes(fn: Callable[[], object]) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    del out
    return torch.cuda.max_memory_allocated() - base


# ---- methods --------------------------------------------------------------------------------------------


def _liger_ce():
    try:
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction
    except ImportError as e:
        return None, f"not importable ({e.__class__.__name__}: {e})"
    import importlib.metadata

    def liger_log_probs(logits, tokens):
        loss = LigerCrossEntropyFunction.apply(logits, tokens, None, -100, 0.0, 0.0, "none", None, False, False, False)
        return -loss[0].float()

    return liger_log_probs, f"liger-kernel {importlib.metadata.version('liger-kernel')}"


_COMPILED = {}


def _compiled_chunked(logits: torch.Tensor, tokens: torch.Tensor, chunk_size: int) -> torch.Tensor:
    if "fn" not in _COMPILED:
        _COMPILED["fn"] = torch.compile(
            lambda x, t: full_fp32_log_probs_and_entropy(x, t, with_entropy=False)[0], dynamic=False
        )
    fn = _COMPILED["fn"]
    # split() (not slicing) so the backward concatenates chunk grads once instead of one [T, V] zeros per chunk
    return torch.cat([fn(x, t) for x, t in zip(logits.split(chunk_size), tokens.split(chunk_size))])


def _methods(args, cuda: bool) -> tuple[dict[str, Callable], dict[str, str]]:
    C = args.chunk_size
    methods = {
        "full_fp32": lambda x, t: full_fp32_log_probs_and_entropy(x, t, with_entropy=False)[0],
        "eager_chunked": lambda x, t: log_probs_and_entropy(x, t, chunk_size=C, impl="eager")[0],
    }
    notes = {}
    if cuda and HAS_TRITON:
        methods["fused"] = lambda x, t: log_probs_and_entropy(x, t, impl="fused")[0]
        methods["fused_with_entropy"] = lambda x, t: log_probs_and_entropy(x, t, impl="fused", with_entropy=True)[0]
    else:
        notes["fused"] = "skipped: needs CUDA and Triton"
    if cuda and not args.no_compile:  # on CPU the compile alone takes minutes on a shared 2-core box
        methods["compiled_chunked"] = lambda x, t: _compiled_chunked(x, t, C)
    liger, notes["liger"] = _liger_ce() if cuda else (None, "skipped: needs CUDA")
    if liger is not None:
        methods["liger_ce"] = liger
    if args.methods:
        methods = {k: v for k, v in methods.items() if k in args.methods}
    return methods, notes


# ---- timing -------------------------------------------------------------------------------------------------


def _median_ms(fn: Callable[[], object], cuda: bool, grad_to_none) -> float:
    if cuda:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=40, grad_to_none=grad_to_none, return_mode="median"))
    fn()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _measure(name, method, logits, tokens, cuda, lp_ref) -> list[dict]:
    rows = []
    # Liger writes its gradient into its input in place: give it its own copy of the logits.
    x = logits.clone() if name == "liger_ce" else logits
    with torch.no_grad():
        lp = method(x, tokens)
    err = (lp - lp_ref).abs().max().item() if lp_ref is not None else None
    peak = _cuda_peak_extra_bytes if cuda else peak_extra_bytes

    def fwd():
        with torch.no_grad():
            return method(x, tokens)

    x_g = x.detach().requires_grad_(True)
    grad_out = torch.ones(tokens.shape[0], device=x.device)

    def fwd_bwd():
        method(x_g, tokens).backward(grad_out)
        x_g.grad = None

    for pass_name, fn, grad_to_none in (("fwd", fwd, None), ("fwd+bwd", fwd_bwd, [x_g])):
        row = {"method": name, "T": int(tokens.shape[0]), "pass": pass_name}
        try:
            fn()  # compile / autotune outside the timed region
            row["median_ms"] = round(_median_ms(fn, cuda, grad_to_none), 4)
            row["extra_peak_gib"] = round(peak(fn) / GIB, 4)
        except torch.OutOfMemoryError as e:
            row["error"] = f"OOM: {str(e).splitlines()[0]}"
        if pass_name == "fwd+bwd":
            row["grad_gib"] = round(x.numel() * x.element_size() / GIB, 4)
        row["max_abs_err_vs_fp32"] = err
        rows.append(row)
        if cuda:
            torch.cuda.empty_cache()
    return rows


def _sweep(logits, tokens) -> list[dict]:
    import triton.testing

    import miles.policy.fused_logprob as fused

    default = (fused.BLOCK_V, fused.NUM_WARPS)
    x_g = logits.detach().requires_grad_(True)
    out = []
    try:
        for block, warps in [
            (1024, 4),
            (2048, 4),
            (2048, 8),
            (4096, 8),
            (4096, 16),
            (8192, 8),
            (8192, 16),
            (16384, 16),
        ]:
            fused.BLOCK_V, fused.NUM_WARPS = block, warps
            with torch.no_grad():
                f = triton.testing.do_bench(
                    lambda: log_probs_and_entropy(logits, tokens, impl="fused"), warmup=5, rep=20
                )
            fb = triton.testing.do_bench(
                lambda: log_probs_and_entropy(x_g, tokens, impl="fused")[0].sum().backward(),
                warmup=5,
                rep=20,
                grad_to_none=[x_g],
            )
            out.append({"BLOCK_V": block, "num_warps": warps, "fwd_ms": round(f, 4), "fwd+bwd_ms": round(fb, 4)})
    finally:
        fused.BLOCK_V, fused.NUM_WARPS = default
    return out


def run(argv: list[str]) -> dict:
    cuda = torch.cuda.is_available() and "--cpu" not in argv
    args = _parse(argv, cuda)
    device = "cuda" if cuda else "cpu"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    methods, notes = _methods(args, cuda)
    rows, sweep = [], None
    for T in args.T:
        g = torch.Generator(device=device).manual_seed(T)
        logits = (torch.randn(T, args.V, generator=g, device=device) * 3).to(dtype)
        tokens = torch.randint(0, args.V, (T,), generator=g, device=device)
        try:
            with torch.no_grad():
                lp_ref = full_fp32_log_probs_and_entropy(logits, tokens, with_entropy=False)[0]
        except torch.OutOfMemoryError:
            lp_ref = None
        if args.sweep and sweep is None and "fused" in methods:
            sweep = _sweep(logits, tokens)
        for name, method in methods.items():
            try:
                new_rows = _measure(name, method, logits, tokens, cuda, lp_ref)
            except Exception as e:  # one broken method (e.g. an optional library) must not lose the others
                new_rows = [{"method": name, "T": T, "error": f"{e.__class__.__name__}: {str(e)[:300]}"}]
            rows.extend(new_rows)
            for r in new_rows:
                print(json.dumps(r), flush=True)
        del logits, tokens, lp_ref
    _add_speedups(rows)
    return {
        "device": device,
        "dtype": args.dtype,
        "V": args.V,
        "chunk_size": args.chunk_size,
        "temperature": 1.0,
        "timer": "triton.testing.do_bench median" if cuda else "time.perf_counter median of 5",
        "memory": "max_memory_allocated - allocated before" if cuda else "peak live storages created (op level)",
        "notes": notes,
        "rows": rows,
        **({"fused_sweep": sweep} if sweep else {}),
    }


def _add_speedups(rows: list[dict]) -> None:
    eager = {(r["T"], r["pass"]): r.get("median_ms") for r in rows if r["method"] == "eager_chunked"}
    for r in rows:
        base = eager.get((r["T"], r["pass"]))
        if base and r.get("median_ms"):
            r["speedup_vs_eager"] = round(base / r["median_ms"], 2)
