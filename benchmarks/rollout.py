"""``miles bench rollout``: the embedded engine against HF ``generate`` on the same random-init weights, and
both against the hardware floor, at ~0.1B and ~0.5B (Qwen2.5-0.5B dimensions), 64 and 512 rows, 256 and 1024
new tokens. Prompts of 128 tokens, in GRPO groups of 8 samples (one prompt per group), temperature 1, no stop
tokens, so every row generates every token.

The floor per decode step is the larger of (weights + every row's filled KV cache read once) over the
measured copy bandwidth and (2 FLOPs per parameter per row) over the measured bf16 matrix rate; the prefill
adds 2 FLOPs per parameter per distinct prompt token. The engine's sampled log-probs are checked against the
trainer's log-probs of the same tokens (mean / max |difference|).

    miles bench rollout --json                       # the GPU table (add --profile for a torch.profiler summary)
    miles bench rollout --json --cpu                 # a small CPU variant
"""

from __future__ import annotations

import argparse
import time

import torch

from miles.model.config import ModelConfig

SIZES = {
    "0.1b": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, vocab_size=32000),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, rope_theta=1e6),
    "cpu": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=4096),
}  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="miles bench rollout")
    p.add_argument("--sizes", default="0.1b,0.5b")
    p.add_argument("--rows", default="64,512")
    p.add_argument("--new-tokens", default="256,1024")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--group", type=int, default=8, help="samples per prompt (they share one prefill)")
    p.add_argument("--hf-max-new-tokens", type=int, default=256, help="HF generate only up to this length")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--cpu", action="store_true", help="the small CPU variant")
    p.add_argument("--profile", default="", help="write a torch.profiler summary of one 0.5B run to this file")
    p.add_argument("--profile-rows", type=int, default=64, help="rows of the profiled run")
    p.add_argument("--json", action="store_true", help="accepted for the CLI; the result is always JSON")
    return p


def model_cfg(size: str, max_len: int, device: str) -> ModelConfig:
    dtype = "float32" if device == "cpu" else "bfloat16"
    return ModelConfig(**SIZES[size], max_position_embeddings=max_len, dtype=dtype)


def ceilings(device: str) -> dict:
    """Copy bandwidth (bytes read + written per second) and bf16 matrix rate, measured here."""
    if device == "cpu":
        return {"bandwidth": 0.0, "flops": 0.0}
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    bw = 2 * x.numel() / _cuda_time(lambda: y.copy_(x), 20)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    rate = 2 * 8192**3 / _cuda_time(lambda: a @ a, 10)
    return {"bandwidth": bw, "flops": rate}  # the buffers go with this frame


def _cuda_time(fn, n: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / n


def floor_seconds(cfg: ModelConfig, num_params: int, rows: int, prompt: int, new: int, group: int, ceil: dict):
    if not ceil["bandwidth"]:
        return None
    from miles.model.size import DTYPE_BYTES

    dt = DTYPE_BYTES[cfg.dtype]
    kv_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * dt
    total = 2 * num_params * (rows // group) * prompt / ceil["flops"]
    for t in range(new - 1):
        read = num_params * dt + rows * (prompt + t + 1) * kv_token
        total += max(read / ceil["bandwidth"], 2 * num_params * rows / ceil["flops"])
    return total


def requests(rows: int, prompt: int, new: int, group: int, vocab: int, seed: int = 0):
    from miles.protocols.engine import GenerateRequest, SamplingParams

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, vocab, (rows // group, prompt), generator=g).tolist()
    sp = SamplingParams(max_new_tokens=new, temperature=1.0)
    return [GenerateRequest(rid=f"{i}", input_ids=prompts[i // group], sampling=sp) for i in range(rows)]


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def bench_engine(cfg: ModelConfig, rows: int, prompt: int, new: int, group: int, device: str) -> tuple[dict, object]:
    from miles.rollout.engine import EmbeddedEngine

    engine = EmbeddedEngine(cfg, max_batch_size=rows, max_seq_len=prompt + new, device=device, seed=0)
    engine.generate(requests(rows, prompt, 4, group, cfg.vocab_size, seed=1), seed=1)  # captures the graphs
    reqs = requests(rows, prompt, new, group, cfg.vocab_size)
    if device != "cpu":
        torch.cuda.reset_peak_memory_stats()
    _sync(device)
    t0 = time.perf_counter()
    outs = engine.generate(reqs, seed=0)
    _sync(device)
    dt = time.perf_counter() - t0
    assert all(len(o.output_ids) == new for o in outs), "a row stopped early: the bench needs full-length rows"
    res = {"seconds": dt, "tokens_per_s": rows * new / dt, "flag_reads": engine.loop.stats["flag_reads"]}
    if device != "cpu":
        res["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        res["cuda_graph_bytes"] = engine.memory.resident_bytes("cuda_graph") + engine.graphs.bytes
    res["mismatch"] = mismatch(engine, reqs[: min(16, rows)], outs[: min(16, rows)])
    return res, engine


def mismatch(engine, reqs, outs) -> dict:
    """|engine log-prob - trainer log-prob| over the same tokens (the trainer's full-sequence forward)."""
    from miles.policy.logprob import log_probs_and_entropy

    diffs = []
    with torch.no_grad():
        for r, o in zip(reqs, outs):
            seq = torch.tensor([r.input_ids + o.output_ids], device=engine.device)
            logits = engine.model(seq)[0, len(r.input_ids) - 1 : -1]
            lp, _ = log_probs_and_entropy(logits, seq[0, len(r.input_ids) :], temperature=r.sampling.temperature)
            diffs.append((lp.float().cpu() - torch.tensor(o.output_log_probs)).abs())
    d = torch.cat(diffs)
    return {"mean": float(d.mean()), "max": float(d.max())}


def bench_hf(engine, rows: int, prompt: int, new: int, group: int) -> dict:
    """HF transformers ``generate`` on the engine's own weights (Qwen2 layout), sampling every token."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    c = engine.cfg
    hf_cfg = Qwen2Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
        rope_theta=c.rope_theta, rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=c.tie_word_embeddings,
    )  # fmt: skip
    with torch.device(engine.device):
        hf = Qwen2ForCausalLM(hf_cfg).to(torch.bfloat16).eval()
    hf.load_state_dict(engine.named_weights(), strict=False)
    ids = torch.tensor([r.input_ids for r in requests(rows, prompt, new, group, c.vocab_size)], device=engine.device)
    kw = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=new, min_new_tokens=new)
    kw |= dict(pad_token_id=0, eos_token_id=None)
    hf.generate(ids[:, :8], **(kw | dict(max_new_tokens=2, min_new_tokens=2)))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = hf.generate(ids, **kw)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    del hf
    torch.cuda.empty_cache()
    return {"seconds": dt, "tokens_per_s": rows * (out.shape[1] - prompt) / dt}


def run(argv: list[str]) -> dict:
    args = _parser().parse_args(argv)
    device = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
    if device == "cpu":
        sizes, rows_list, news = ["cpu"], [8, 32], [32]
        args.prompt_len, args.no_hf = 16, True
    else:
        sizes = args.sizes.split(",")
        rows_list, news = [int(x) for x in args.rows.split(",")], [int(x) for x in args.new_tokens.split(",")]
    ceil = ceilings(device)
    table = []
    for size in sizes:
        for rows in rows_list:
            for new in news:
                table.append(_one(size, rows, new, args, device, ceil))
                print(_fmt(table[-1]), flush=True)
    out = {"ceilings": ceil, "prompt_len": args.prompt_len, "group": args.group, "table": table}
    if args.profile and device != "cpu":
        out["profile"] = profile(args.profile, args.prompt_len, args.group, args.profile_rows)
    return out


def _one(size: str, rows: int, new: int, args, device: str, ceil: dict) -> dict:
    cfg = model_cfg(size, args.prompt_len + new, device)
    res, engine = bench_engine(cfg, rows, args.prompt_len, new, args.group, device)
    n = sum(p.numel() for p in engine.model.parameters())
    row = {"size": size, "parameters": n, "rows": rows, "new_tokens": new, "engine": res}
    floor = floor_seconds(cfg, n, rows, args.prompt_len, new, args.group, ceil)
    if floor:
        row["floor_seconds"], row["engine_over_floor"] = floor, res["seconds"] / floor
        # the same floor with every row's prompt prefilled (no GRPO sharing), as issue 21's own floor figures count
        row["floor_every_prompt_seconds"] = floor_seconds(cfg, n, rows, args.prompt_len, new, 1, ceil)
    if not args.no_hf and new <= args.hf_max_new_tokens:
        row["hf_generate"] = bench_hf(engine, rows, args.prompt_len, new, args.group)
        row["speedup_over_hf"] = row["hf_generate"]["seconds"] / res["seconds"]
    del engine
    if device != "cpu":
        torch.cuda.empty_cache()
    return row


def _fmt(r: dict) -> str:
    e = r["engine"]
    s = f"{r['size']} rows={r['rows']} new={r['new_tokens']}: engine {e['seconds']:.3f}s ({e['tokens_per_s']:.0f} tok/s)"
    if "floor_seconds" in r:
        s += f" floor {r['floor_seconds']:.3f}s x{r['engine_over_floor']:.2f}"
    if "hf_generate" in r:
        s += f" HF {r['hf_generate']['seconds']:.2f}s ({r['speedup_over_hf']:.1f}x)"
    return s + f" mismatch mean {e['mismatch']['mean']:.2e} max {e['mismatch']['max']:.2e}"


def profile(path: str, prompt: int, group: int, rows: int = 64) -> str:
    """torch.profiler over one 0.5B, ``rows``-row, 64-token generate (graphs replayed) and the same run eager."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    cfg = model_cfg("0.5b", prompt + 64, "cuda")
    from miles.rollout.engine import EmbeddedEngine

    engine = EmbeddedEngine(cfg, max_batch_size=rows, max_seq_len=prompt + 64, device="cuda")
    reqs = requests(rows, prompt, 64, group, cfg.vocab_size)
    engine.generate(reqs, seed=0)
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        engine.generate(reqs, seed=1)
        torch.cuda.synchronize()
    graphs, engine.graphs = engine.graphs, None
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as q:
        engine.generate(reqs, seed=2)
        torch.cuda.synchronize()
    engine.graphs = graphs
    text = "== graphed ==\n" + p.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    text += "\n== eager ==\n" + q.key_averages().table(sort_by="cuda_time_total", row_limit=40)
    with open(path, "w") as f:
        f.write(text)
    return path
