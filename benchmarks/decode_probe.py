"""Where a 512-row decode step of the 0.5B engine goes, kernel by kernel, and what the candidate changes cost.

Each piece is timed as a CUDA graph of ``REPS`` back-to-back launches (as the engine replays its step), so the
figures include the gap between dependent kernels. Prints one JSON object.

    python -m benchmarks.decode_probe --rows 512 --ctx 256 > probe.json        # GPU only
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

REPS = 20


def graph_time(fn, reps: int = REPS, tries: int = 5) -> float:
    """Median seconds of one ``fn`` over ``tries`` replays of a graph holding ``reps`` calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(tries):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / reps)
    return sorted(times)[len(times) // 2]


def median_generate(e, rows: int, prompt: int, new: int, group: int, reps: int = 3) -> float:
    """Median wall seconds of ``reps`` whole generates of the bench's requests (device synced around each)."""
    from benchmarks.rollout import requests

    ts = []
    for rep in range(reps):
        reqs = requests(rows, prompt, new, group, e.cfg.vocab_size)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        e.generate(reqs, seed=rep)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def engine_figures(rows: int, prompt: int, group: int) -> dict:
    from benchmarks.rollout import model_cfg, requests
    from miles.rollout.engine import EmbeddedEngine

    cfg = model_cfg("0.5b", prompt + 256, "cuda")
    e = EmbeddedEngine(cfg, max_batch_size=rows, max_seq_len=prompt + 256, device="cuda", seed=0)
    e.generate(requests(rows, prompt, 4, group, cfg.vocab_size, seed=1), seed=1)
    out = {f"generate_{new}_s": median_generate(e, rows, prompt, new, group) for new in (64, 256)}
    out["per_step_ms"] = (out["generate_256_s"] - out["generate_64_s"]) / 192 * 1e3
    # host phases of one 64-token generate, each bracketed by a device sync
    phases: dict = {}

    def timed(name, fn):
        def wrapped(*a, **k):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            r = fn(*a, **k)
            torch.cuda.synchronize()
            phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0
            return r

        return wrapped

    loop = e.loop  # the phases keep their earlier names: _reset_rows is RowState.admit, _start the engine's start
    for name in ("_admit", "_prefill", "_retire"):
        setattr(loop, name, timed(name, getattr(loop, name)))
    e.state.admit = timed("_reset_rows", e.state.admit)
    e.start = timed("_start", e.start)
    reqs = requests(rows, prompt, 64, group, cfg.vocab_size)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    e.generate(reqs, seed=7)
    torch.cuda.synchronize()
    phases["total"] = time.perf_counter() - t0
    out["phases_64_ms"] = {k: round(v * 1e3, 2) for k, v in phases.items()}
    for obj, names in ((loop, ("_admit", "_prefill", "_retire")), (e.state, ("admit",)), (e, ("start",))):
        for name in names:
            obj.__dict__.pop(name, None)
    from torch.profiler import ProfilerActivity, profile

    reqs = requests(rows, prompt, 256, group, cfg.vocab_size)
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        t0 = time.perf_counter()
        e.generate(reqs, seed=5)
        torch.cuda.synchronize()
        out["profiled_generate_256_s"] = time.perf_counter() - t0
    kern = []
    for ev in p.key_averages():
        if ev.device_time_total > 0 and not ev.key.startswith("aten::"):
            kern.append((ev.key[:60], ev.count, ev.device_time_total))
    kern.sort(key=lambda k: -k[2])
    out["kernels_256"] = [f"{k:60s} {n:6d} {t / 1e3:8.2f} ms {t / n:8.2f} us" for k, n, t in kern[:40]]
    out["kernel_sum_us"] = round(sum(k[2] for k in kern), 1)
    del e
    torch.cuda.empty_cache()
    return out


def pieces(rows: int, ctx: int, group: int, compile_gemms: bool = False) -> dict:
    from benchmarks.rollout import SIZES
    from miles.rollout import kernels as K

    c = SIZES["0.5b"]
    Hd, I, V, H, KVH = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_attention_heads"], 2
    D = Hd // H
    dt, dev = torch.bfloat16, "cuda"
    R = rows
    x = torch.randn(R, Hd, device=dev, dtype=dt)
    w_qkv = torch.randn((H + 2 * KVH) * D, Hd, device=dev, dtype=dt) * 0.03
    b_qkv = torch.randn((H + 2 * KVH) * D, device=dev, dtype=dt)
    w_o = torch.randn(Hd, Hd, device=dev, dtype=dt) * 0.03
    w_gu = torch.randn(2 * I, Hd, device=dev, dtype=dt) * 0.03
    w_d = torch.randn(Hd, I, device=dev, dtype=dt) * 0.03
    w_lm = torch.randn(V, Hd, device=dev, dtype=dt) * 0.03
    S = ctx + 64
    kc = torch.randn(R, KVH, S, D, device=dev, dtype=dt)
    vc = torch.randn(R, KVH, S, D, device=dev, dtype=dt)
    lens = torch.full((R,), ctx, device=dev, dtype=torch.long)
    q = torch.randn(R, H, D, device=dev, dtype=dt)
    gu = x @ w_gu.t()
    act = torch.randn(R, I, device=dev, dtype=dt)
    logits = torch.randn(R, V, device=dev, dtype=dt)
    temp = torch.ones(R, device=dev)
    seed = torch.zeros(1, dtype=torch.long, device=dev)
    cos = torch.randn(S + 8, D, device=dev, dtype=dt)
    sin = torch.randn(S + 8, D, device=dev, dtype=dt)
    w_norm = torch.ones(Hd, device=dev, dtype=dt)
    qkv = F.linear(x, w_qkv, b_qkv)
    lm_out = torch.empty(R, V, device=dev, dtype=dt)
    pslot = (torch.arange(R, device=dev) // group) * group
    plen = torch.full((R,), 128, device=dev, dtype=torch.long)
    res = {}
    t = lambda name, fn: res.__setitem__(name, round(graph_time(fn) * 1e6, 2))  # noqa: E731
    t("qkv_linear", lambda: F.linear(x, w_qkv, b_qkv))
    t("o_linear", lambda: F.linear(x, w_o))
    t("gate_up_linear", lambda: F.linear(x, w_gu))
    t("down_linear", lambda: F.linear(act, w_d))
    t("lm_head", lambda: torch.mm(x, w_lm.t(), out=lm_out))
    t("silu_mul", lambda: K.silu_mul(gu))
    t("add_rmsnorm", lambda: K.add_rmsnorm(x, x, w_norm, 1e-6))
    t("rope_kv", lambda: K.rope_kv(qkv, cos, sin, lens, kc, vc, H, KVH, D))
    t("sample", lambda: K.fused_sample(logits, temp, seed))
    for bv in (1024, 2048, 4096):
        for nw in (1, 2, 4, 8):
            t(f"sample_bv{bv}_w{nw}", lambda bv=bv, nw=nw: K.fused_sample(logits, temp, seed, block_v=bv, num_warps=nw))
    for bn in (32, 64):
        for nw in (1, 2):
            for ns in (2, 3, 4):
                t(
                    f"attn_bn{bn}_w{nw}_s{ns}",
                    lambda bn=bn, nw=nw, ns=ns: K.decode_attention_triton(
                        q, kc, vc, lens, 1, block_n=bn, num_warps=nw, num_stages=ns
                    ),
                )
    t("attn_prefix_default", lambda: K.decode_attention_triton(q, kc, vc, lens, 1, (pslot, plen)))
    if compile_gemms:
        import torch._inductor.config as ic

        ic.max_autotune_gemm_backends = "TRITON"
        for name, a, b in (("qkv", x, w_qkv), ("o", x, w_o), ("gate_up", x, w_gu), ("down", act, w_d)):
            t0 = time.perf_counter()
            f = torch.compile(lambda a, b: a @ b.t(), mode="max-autotune-no-cudagraphs", dynamic=False)
            f(a, b)
            t(f"inductor_{name}", lambda f=f, a=a, b=b: f(a, b))
            res[f"inductor_{name}_compile_s"] = round(time.perf_counter() - t0, 1)
            torch._dynamo.reset()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    t("lt_qkv_linear", lambda: F.linear(x, w_qkv, b_qkv))
    t("lt_o_linear", lambda: F.linear(x, w_o))
    t("lt_gate_up_linear", lambda: F.linear(x, w_gu))
    t("lt_down_linear", lambda: F.linear(act, w_d))
    t("lt_lm_head", lambda: torch.mm(x, w_lm.t(), out=lm_out))
    torch.backends.cuda.preferred_blas_library("default")
    xt = x.t().contiguous()
    t("T_gate_up_mm", lambda: torch.mm(w_gu, xt))
    t("T_down_mm", lambda: torch.mm(w_d, act.t()))
    kv_bytes = 2 * R * KVH * ctx * D * 2
    res["attn_bytes"] = kv_bytes
    # the graph's cost per dependent kernel: a chain of tiny kernels
    tiny = torch.zeros(1, device=dev)
    res["tiny_kernel_us"] = round(graph_time(lambda: tiny.add_(1), reps=200) * 1e6, 2)
    try:
        from benchmarks.decode_probe_kernels import gate_up_silu

        out = gate_up_silu(x, w_gu)
        ref = K.silu_mul(F.linear(x, w_gu))
        res["gate_up_silu_maxdiff"] = float((out.float() - ref.float()).abs().max())
        res["gate_up_silu_frac_diff"] = float((out != ref).float().mean())
        t("gate_up_silu_triton", lambda: gate_up_silu(x, w_gu))
    except Exception as e:  # noqa: BLE001 - a probe: report and go on
        res["gate_up_silu_error"] = repr(e)[:300]
    return res


def step_probe(rows: int, ctx: int, group: int, layers: int = 24) -> dict:
    """A whole synthetic decode step (0.5B shapes, each layer its own weights, so they stream from memory as in
    the engine) on one stream, and as two half-batches on two streams whose kernels may overlap."""
    from benchmarks.rollout import SIZES
    from miles.rollout import kernels as K

    c = SIZES["0.5b"]
    Hd, I, V, H, KVH = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_attention_heads"], 2
    D, dt, dev, R = Hd // H, torch.bfloat16, "cuda", rows
    w = lambda *shape: torch.randn(*shape, device=dev, dtype=dt) * 0.02  # noqa: E731
    L = [
        dict(qkv=w((H + 2 * KVH) * D, Hd), b=w((H + 2 * KVH) * D), o=w(Hd, Hd), gu=w(2 * I, Hd), d=w(Hd, I))
        for _ in range(layers)
    ]
    w_lm, nw = w(V, Hd), torch.ones(Hd, device=dev, dtype=dt)
    S = ctx + 64
    kc = [w(R, KVH, S, D) for _ in range(layers)]
    vc = [w(R, KVH, S, D) for _ in range(layers)]
    cos, sin = w(S + 8, D), w(S + 8, D)
    temp, seed = torch.ones(R, device=dev), torch.zeros(1, dtype=torch.long, device=dev)
    lens = torch.full((R,), ctx - 1, device=dev, dtype=torch.long)
    pslot = (torch.arange(R, device=dev) // group) * group
    plen = torch.full((R,), 128, device=dev, dtype=torch.long)
    x_all = w(R, Hd)
    logits = torch.empty(R, V, device=dev, dtype=dt)

    def chain(lo: int, hi: int, prefix: bool):
        x, n = x_all[lo:hi], hi - lo
        ln, filled = lens[lo:hi], lens[lo:hi] + 1
        pre = (pslot[lo:hi] - lo, plen[lo:hi]) if prefix else None
        h = K.add_rmsnorm(x, None, nw, 1e-6)
        for i, p in enumerate(L):
            k, v = kc[i][lo:hi], vc[i][lo:hi]
            q = K.rope_kv(F.linear(h, p["qkv"], p["b"]), cos, sin, ln, k, v, H, KVH, D)
            o = K.decode_attention_triton(q, k, v, filled, 1, pre)
            h = K.add_rmsnorm(x, F.linear(o.reshape(n, -1), p["o"]), nw, 1e-6)
            h = K.add_rmsnorm(x, F.linear(K.silu_mul(F.linear(h, p["gu"])), p["d"]), nw, 1e-6)
        torch.mm(h, w_lm.t(), out=logits[lo:hi])
        return K.fused_sample(logits[lo:hi], temp[lo:hi], seed)

    side = torch.cuda.Stream()

    def two_streams(prefix: bool):
        side.wait_stream(torch.cuda.current_stream())
        chain(0, R // 2, prefix)
        with torch.cuda.stream(side):
            chain(R // 2, R, prefix)
        torch.cuda.current_stream().wait_stream(side)

    res = {}
    for prefix in (False, True):
        tag = "prefix_" if prefix else ""
        res[tag + "one_stream"] = graph_time(lambda p=prefix: chain(0, R, p), reps=4)
        res[tag + "halves_one_stream"] = graph_time(lambda p=prefix: (chain(0, R // 2, p), chain(R // 2, R, p)), reps=4)
        res[tag + "halves_two_streams"] = graph_time(lambda p=prefix: two_streams(p), reps=4)
    return {k: round(v * 1e3, 4) for k, v in res.items()}  # ms per step


def attention_sweep(rows: int, prompt: int, group: int, new: int = 256) -> dict:
    """The engine's whole generate at each decode-attention variant (graphs recaptured for each): the kernel's
    launch configurations, and the row-block kernel of benchmarks/decode_probe_kernels.py that reads a shared
    prompt once per block. The kernel alone, repeated, runs from L2 and ranks variants differently than the
    engine does."""
    import functools

    from benchmarks.decode_probe_kernels import decode_attention_blocks
    from benchmarks.rollout import model_cfg, requests
    from miles.rollout import kernels as K
    from miles.rollout.engine import EmbeddedEngine

    cfg = model_cfg("0.5b", prompt + new, "cuda")
    e = EmbeddedEngine(cfg, max_batch_size=rows, max_seq_len=prompt + new, device="cuda", seed=0)
    orig, out = K.decode_attention_triton, {}
    variants = {
        f"bn{bn}_w{nw}_s{ns}": functools.partial(orig, block_n=bn, num_warps=nw, num_stages=ns)
        for bn, nw, ns in (
            (32, 1, 3),
            (32, 1, 2),
            (32, 1, 4),
            (16, 1, 3),
            (16, 1, 4),
            (64, 1, 2),
            (32, 2, 3),
            (64, 2, 2),
        )
    }
    for rb in (2, 4, 8):
        for bn, nw in ((32, 4), (64, 4), (32, 2)):
            kw = dict(group_rows=rb, block_n=bn, num_warps=nw)
            variants[f"blocks{rb}_bn{bn}_w{nw}"] = functools.partial(decode_attention_blocks, fallback=orig, **kw)
    for name, fn in variants.items():
        K.decode_attention_triton = fn
        e.graphs.release("sweep")
        e.generate(requests(rows, prompt, 4, group, cfg.vocab_size, seed=1), seed=1)  # recapture
        out[name] = round(median_generate(e, rows, prompt, new, group), 4)
        print(name, out[name], flush=True)
    K.decode_attention_triton = orig
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--step-only", action="store_true")
    p.add_argument("--engine-only", action="store_true")
    p.add_argument("--pieces-only", action="store_true")
    p.add_argument("--attn-sweep", action="store_true", help="only the in-engine attention configuration sweep")
    p.add_argument("--compile-gemms", action="store_true", help="time inductor's max-autotune Triton GEMMs too")
    a = p.parse_args(argv)
    out = {"device": torch.cuda.get_device_name(), "rows": a.rows, "ctx": a.ctx}
    if a.attn_sweep:
        out["attention_sweep_s"] = attention_sweep(a.rows, 128, a.group)
        print(json.dumps(out, indent=1))
        return
    if not a.engine_only:
        if not a.pieces_only:
            out["step_ms"] = step_probe(a.rows, a.ctx, a.group)
            print(json.dumps(out, indent=1), flush=True)
            if a.step_only:
                return
        out["pieces_us"] = pieces(a.rows, a.ctx, a.group, a.compile_gemms)
        print(json.dumps(out, indent=1), flush=True)
    if not (a.skip_engine or a.pieces_only):
        out["engine"] = engine_figures(a.rows, 128, a.group)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
