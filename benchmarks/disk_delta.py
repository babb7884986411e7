"""``miles bench disk-delta``: bytes and time per weight sync through disk deltas, against writing a full
safetensors checkpoint every step, over a sequence of real RL-sized updates.

The updates are real: the HF-compatible decoder with FP32 master weights takes AdamW steps (a next-token loss on
random tokens; with Adam the per-element step is ~lr whatever the loss), and the trainer emits the weights cast
to bf16, as an RL trainer does for its engines. With RL learning rates (1e-6) most bf16 values round back to the
same number, which XOR + zstd exploits. For each learning rate: changed-element density per step, wire bytes
and wall time of the delta vs the full checkpoint, encode throughput of one rank (wall, and per CPU-second of
the process: on a shared machine that is the fair figure) and the engine-side apply time, for several encoder
variants over the same sequence, side by side. A component breakdown (memcpy, XOR, xxh3, zstd) says where
encode time goes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import safetensors.torch
import torch
import xxhash
import zstandard

from miles.model.config import ModelConfig
from miles.model.decoder import build_decoder
from miles.sync.disk_delta.staging_pool import byte_view
from miles.sync.disk_delta.transport import DiskDeltaConfig, DiskDeltaSync, save_baseline
from miles.sync.disk_delta.version import load_version

SIZES = {  # a model whose bf16 weights make a sync long enough to time, trainable in seconds per step
    "cpu": dict(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        tokens=(4, 64),
    ),
    "gpu": dict(
        vocab_size=32768,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=8,
        tokens=(8, 512),
    ),
}


VARIANTS = {  # name -> (encoding, zstd level, zstd threads); the first is DiskDeltaConfig's default
    "sparse_xor-l1": ("sparse_xor", 1, 0),
    "xor-l1": ("xor", 1, 0),
    "xor-l-1": ("xor", -1, 0),
    "overwrite-l1": ("overwrite", 1, 0),
    "sparse_xor-l1-2threads": ("sparse_xor", 1, 2),
    "sparse_xor-l1-all-cores": ("sparse_xor", 1, -1),
}


def _parse(argv: list[str], cuda: bool) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="miles bench disk-delta")
    p.add_argument("--json", action="store_true", help="accepted for the CLI; the result is always JSON")
    p.add_argument("--size", choices=sorted(SIZES), default="gpu" if cuda else "cpu")
    p.add_argument("--steps", type=int, default=4, help="RL steps (syncs) per learning rate")
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5], help="1e-6 is a typical RL learning rate")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--dir", default="", help="where to write (default: a temporary directory; use local NVMe)")
    p.add_argument("--cpu", action="store_true", help="run on CPU even when CUDA is present")
    return p.parse_args(argv)


def _bf16(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(torch.bfloat16) for k, v in model.hf_state_dict().items()}


def _train_step(model, optimizer, tokens: tuple[int, int], vocab: int, seed: int, device) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, tokens, generator=g).to(device)
    logits = model(ids[:, :-1]).float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def _write_full_checkpoint(weights: dict[str, torch.Tensor], path: Path) -> tuple[int, float]:
    t0 = time.perf_counter()
    safetensors.torch.save_file({k: v.contiguous() for k, v in weights.items()}, str(path))
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    return path.stat().st_size, time.perf_counter() - t0


def _density(new: dict[str, torch.Tensor], old: dict[str, torch.Tensor]) -> float:
    changed = sum(int((byte_view(new[k]).view(torch.int16) != byte_view(old[k]).view(torch.int16)).sum()) for k in new)
    return changed / sum(v.numel() for v in new.values())


def _rl_sequence(cfg: ModelConfig, tokens, lr: float, steps: int, device) -> list[dict[str, torch.Tensor]]:
    """bf16 weights before and after each of ``steps`` AdamW steps on FP32 master weights (on the host)."""
    torch.manual_seed(0)
    model = build_decoder(cfg, seed=0, device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.01)
    seq = [{k: v.cpu() for k, v in _bf16(model).items()}]
    for step in range(1, steps + 1):
        _train_step(model, optimizer, tokens, cfg.vocab_size, seed=step, device=device)
        seq.append({k: v.cpu() for k, v in _bf16(model).items()})
    return seq


def _sync_sequence(seq: list[dict], variant: str, work: Path, device) -> list[dict]:
    encoding, level, threads = VARIANTS[variant]
    base = save_baseline(seq[0], work / "baseline.safetensors")
    sync = DiskDeltaSync(
        DiskDeltaConfig(
            root=str(work / variant),
            baseline=str(base),
            encoding=encoding,
            zstd_level=level,
            zstd_threads=threads,
            keep_versions=2,
        )
    )
    engine, steps = dict(seq[0]), []
    for step, weights in enumerate(seq[1:], start=1):
        weights = {k: v.to(device) for k, v in weights.items()}  # the trainer's tensors live on its device
        cpu0 = time.process_time()
        sync.update(weights.items(), version=step)
        cpu_s = time.process_time() - cpu0
        m = sync.metrics()
        t0 = time.perf_counter()
        engine = load_version(work / variant, step, engine, local_version=step - 1)
        steps.append(
            {
                "delta_bytes": m["disk_delta/wire_bytes"],
                "delta_total_s": m["disk_delta/total_s"],
                "encode_s": m["disk_delta/encode_s"],
                "encode_cpu_s": m["disk_delta/encode_cpu_s"],
                "update_cpu_s": cpu_s,
                "apply_s": time.perf_counter() - t0,
                "raw_bytes": m["disk_delta/raw_bytes"],
            }
        )
    assert all(torch.equal(engine[k], v) for k, v in seq[-1].items()), f"{variant}: engine copy differs from trainer"
    shutil.rmtree(work / variant, ignore_errors=True)
    return steps


def _run_lr(args, cfg: ModelConfig, tokens, lr: float, device, work: Path) -> dict:
    work.mkdir(parents=True)
    seq = _rl_sequence(cfg, tokens, lr, args.steps, device)
    full = [_write_full_checkpoint(w, work / "full.safetensors") for w in seq[1:]]
    density = [_density(new, old) for old, new in zip(seq, seq[1:])]
    out = {
        "lr": lr,
        "density_per_step": density,
        "median_density": statistics.median(density),
        "full_bytes": statistics.median(b for b, _ in full),
        "full_s": statistics.median(t for _, t in full),
        "variants": {},
    }
    for variant in args.variants:
        steps = _sync_sequence(seq, variant, work, device)
        med = lambda key, steps=steps: statistics.median(s[key] for s in steps)  # noqa: E731
        raw = steps[0]["raw_bytes"]
        out["variants"][variant] = {
            "delta_bytes": med("delta_bytes"),
            "bytes_ratio_full_over_delta": out["full_bytes"] / max(med("delta_bytes"), 1),
            "delta_total_s": med("delta_total_s"),
            "time_ratio_full_over_delta": out["full_s"] / med("delta_total_s"),
            # thread CPU time misses zstd's worker threads: only meaningful without them
            "encode_gbps_wall": raw / med("encode_s") / 1e9,
            "encode_gbps_per_cpu_s": raw / med("encode_cpu_s") / 1e9 if VARIANTS[variant][2] == 0 else None,
            "update_gbps_per_cpu_s": raw / med("update_cpu_s") / 1e9,
            "apply_gbps_wall": raw / med("apply_s") / 1e9,
        }
    return out


def _components(new: np.ndarray, old: np.ndarray, level: int) -> dict:
    """GB/s of each pass of the XOR encoder over one real update, in CPU time of this thread (min of 3)."""

    def rate(fn) -> float:
        best = min(_cpu_time(fn) for _ in range(3))
        return new.nbytes / best / 1e9

    out = np.empty_like(new)
    xor = np.bitwise_xor(new, old)
    zc = zstandard.ZstdCompressor(level=level)
    payload = zc.compress(xor)
    return {
        "memcpy_gbps": rate(lambda: np.copyto(out, new)),
        "xor_uint64_gbps": rate(
            lambda: np.bitwise_xor(new.view(np.uint64), old.view(np.uint64), out=out.view(np.uint64))
        ),
        "xxh3_128_gbps": rate(lambda: xxhash.xxh3_128(new).digest()),
        f"zstd_l{level}_compress_gbps": rate(lambda: zc.compress(xor)),
        "zstd_decompress_gbps": rate(lambda: zstandard.ZstdDecompressor().decompress(payload)),
        "zstd_ratio": new.nbytes / len(payload),
    }


def _cpu_time(fn) -> float:
    t0 = time.thread_time()
    fn()
    return time.thread_time() - t0


def run(argv: list[str]) -> dict:
    cuda = torch.cuda.is_available()
    args = _parse(argv, cuda)
    device = torch.device("cuda" if cuda and not args.cpu else "cpu")
    size = dict(SIZES[args.size])
    tokens = size.pop("tokens")
    cfg = ModelConfig(**size, max_position_embeddings=1024, dtype="float32", tie_word_embeddings=False)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    work = Path(tempfile.mkdtemp(prefix="miles-bench-disk-delta-", dir=args.dir or None))
    try:
        results = [_run_lr(args, cfg, tokens, lr, device, work / f"lr{lr:g}") for lr in args.lrs]
        # components on the embedding matrix after one Adam-sized step (every element moves by lr)
        master = build_decoder(cfg, seed=0, device="cpu").model.embed_tokens.weight.detach()
        old = byte_view(master.to(torch.bfloat16)).numpy().copy()
        new = byte_view((master + args.lrs[0] * torch.randn_like(master).sign()).to(torch.bfloat16)).numpy().copy()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "updates": "real: HF decoder, FP32 master weights, AdamW steps, bf16 weights synced",
        "device": str(device),
        "size": args.size,
        "num_parameters": cfg.num_parameters,
        "bf16_bytes": cfg.num_parameters * 2,
        "variants": {v: VARIANTS[v] for v in args.variants},
        "steps_per_lr": args.steps,
        "results": results,
        "components_first_lr": _components(new, old, 1),
        "goals": {"bytes_ratio_at_typical_rl_lr": ">= 5", "encode_gbps_per_rank": ">= 1"},
    }
