"""``miles bench quant-traffic``: for every recipe, the bytes a real trainer offload moves (read from the
MemoryLedger of a TaggedMemory offload) beside the bytes-per-element x modules prediction, with and without
clearing the quantized workspaces first; plus the bit-equality of outputs after clear + offload + rebuild.

``--cuda-graphs`` (needs CUDA): capture the forward in a CUDA graph, then offload with clearing on; the clear
must skip with one log line and move the same bytes as with clearing off.

    miles bench quant-traffic --json
"""

from __future__ import annotations

import argparse

import torch

from miles.memory.traffic import RECIPES
from miles.model.toy_moe import SIZES
from miles.quant.offload_traffic import cuda_graph_check, measure_recipe


def run(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="miles bench quant-traffic")
    ap.add_argument("--size", default="cuda" if torch.cuda.is_available() else "cpu", choices=sorted(SIZES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--cuda-graphs", action="store_true", help="also run the CUDA-graph skip check (CUDA only)")
    ap.add_argument("--json", action="store_true", help="accepted for the CLI; the result is always JSON")
    args = ap.parse_args(argv)
    cfg, device = SIZES[args.size], torch.device(args.device)
    rows = [measure_recipe(cfg, r, clear, device) for r in args.recipes.split(",") for clear in (False, True)]
    by = {(r["recipe"], r["clear_workspaces"]): r["measured_bytes"] for r in rows}
    reduction = {rec: round(1 - by[(rec, True)] / by[(rec, False)], 4) for rec in args.recipes.split(",")}
    out = {
        "size": args.size,
        "model_config": cfg,
        "device": str(device),
        "rows": rows,
        "reduction_with_clearing": reduction,
        "max_abs_deviation": max(abs(r["measured_over_predicted"] - 1) for r in rows),
        "all_outputs_bit_equal": all(r["outputs_bit_equal_after_rebuild"] for r in rows),
    }
    if device.type == "cuda":  # the CUDA allocator's count of freed bytes cross-checks the ledger's
        out["max_allocator_deviation"] = max(abs(r["allocator_over_ledger"] - 1) for r in rows)
    if args.cuda_graphs:
        if device.type != "cuda":
            raise SystemExit("--cuda-graphs needs a CUDA device (--device cuda)")
        out["cuda_graphs"] = [cuda_graph_check(cfg, r, device) for r in ("bf16", "mxfp8")]
    return out
