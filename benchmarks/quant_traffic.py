"""``miles bench quant-traffic``: for every recipe, the bytes a real trainer offload moves (read from the
MemoryLedger of a TaggedMemory offload) beside the bytes-per-element x modules prediction, with and without
clearing the quantized workspaces first; plus the bit-equality of outputs after clear + offload + rebuild.

``--cuda-graphs`` (needs CUDA): capture the forward in a CUDA graph, then offload with clearing on; the clear
must skip with one log line and move the same bytes as with clearing off.

The measurement itself (``measure_recipe``, ``offload_once``, ``cuda_graph_check`` on ``miles.model.toy_moe.TinyMoE``)
is here too; tests/quant and notebook 04 call it.

    miles bench quant-traffic --json
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

from miles.memory import MemoryLedger, TaggedMemory
from miles.memory.traffic import RECIPES, offload_bytes, weight_shapes
from miles.model.toy_moe import SIZES, TinyMoE
from miles.quant import ClearReport, apply_precision, clear_quantized_workspaces, quantized_workspace_tensors

TAGS = ("params", "quant_workspace")


def _batch(cfg: dict, device: torch.device, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg["vocab_size"], (cfg["bench_batch"], cfg["bench_seq"]), generator=g).to(device)


def train_step(model: TinyMoE, tokens: torch.Tensor) -> None:
    """One SGD step: builds both workspace copies (rowwise in the forward, columnwise in the backward)."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


@dataclass(slots=True)
class Offload:
    moved: dict[str, int]  # bytes the ledger saw arrive on the host, per tag
    seconds: float  # the pause, host-buffer allocation included
    report: ClearReport | None
    memory: TaggedMemory
    allocator_freed: int | None  # CUDA only: memory_allocated() drop across the pause, the allocator's own count


def offload_once(model: TinyMoE, device: torch.device, *, clear: bool, cuda_graphs_captured: bool = False) -> Offload:
    """Sleep as the trainer does: optionally clear, then pause params + quant_workspace to host."""
    ledger = MemoryLedger()
    mem = TaggedMemory("trainer/0", ledger, device)
    mem.register("params", model.parameters(), policy="host")
    mem.register("quant_workspace", lambda: quantized_workspace_tensors(model), policy="host")
    report = clear_quantized_workspaces(model, cuda_graphs_captured=cuda_graphs_captured) if clear else None
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device) if cuda else 0
    t0 = time.perf_counter()
    mem.offload(TAGS, phase="offload")
    seconds = time.perf_counter() - t0
    freed = before - torch.cuda.memory_allocated(device) if cuda else None
    moved = {tag: ledger.moved(phase="offload").get((tag, "host"), 0) for tag in TAGS}
    return Offload(moved, seconds, report, mem, freed)


def measure_recipe(cfg: dict, recipe: str, clear: bool, device: torch.device) -> dict:
    torch.manual_seed(0)
    model = apply_precision(TinyMoE(cfg, device=device), recipe)
    tokens = _batch(cfg, device)
    train_step(model, tokens)
    with torch.no_grad():
        before = model(tokens)
    off = offload_once(model, device, clear=clear)
    off.memory.onload(TAGS, phase="onload")
    measured, seconds, report = off.moved, off.seconds, off.report
    with torch.no_grad():
        after = model(tokens)  # rebuilds the cleared workspaces on a miss
    predicted = offload_bytes(weight_shapes(cfg), recipe, clear_workspaces=clear)
    p, m = sum(predicted.values()), sum(measured.values())
    return {
        "recipe": recipe,
        "clear_workspaces": clear,
        "predicted_bytes": p,
        "measured_bytes": m,
        "measured_over_predicted": round(m / p, 6),
        "predicted_by_tag": predicted,
        "measured_by_tag": measured,
        "pause_seconds": round(seconds, 6),
        "pause_GBps": round(m / seconds / 1e9, 3) if seconds else None,
        "allocator_freed_bytes": off.allocator_freed,
        "allocator_over_ledger": None if off.allocator_freed is None else round(off.allocator_freed / m, 6),
        "outputs_bit_equal_after_rebuild": bool(torch.equal(before, after)),
        "clear_report": None
        if report is None
        else {
            "cleared_modules": report.cleared_modules,
            "bytes_freed": report.bytes_freed,
            "skipped_reason": report.skipped_reason,
        },
    }


def _capture_attention(model: TinyMoE, tokens: torch.Tensor, device: torch.device) -> tuple[object, bool]:
    """Capture layer 0's attention (four quantized Linears reading their workspaces) in a CUDA graph.

    The MoE routing syncs with the host (group sizes), so the attention is the capturable part. Returns the
    graph (the caller keeps it alive through the offload, as an engine would) and whether a replay equals the
    eager output bit for bit.
    """
    layer = model.layers[0]
    with torch.no_grad():
        static = layer.input_layernorm(model.embed_tokens(tokens))
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            layer.attention(static)  # warm-up off the default stream, as capture requires
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer.attention(static)
        graph.replay()
        torch.cuda.synchronize(device)
        same = bool(torch.equal(out, layer.attention(static)))
    return graph, same


def cuda_graph_check(cfg: dict, recipe: str, device: torch.device) -> dict:
    """With a captured CUDA graph, clearing must skip (one log line) and move the same bytes as clearing off."""
    results = {}
    for clear in (False, True):
        torch.manual_seed(0)
        model = apply_precision(TinyMoE(cfg, device=device), recipe)
        tokens = _batch(cfg, device)
        train_step(model, tokens)
        graph, replay_same = _capture_attention(model, tokens, device)
        off = offload_once(model, device, clear=clear, cuda_graphs_captured=True)
        off.memory.onload(TAGS, phase="onload")
        results["on" if clear else "off"] = {
            "measured_bytes": sum(off.moved.values()),
            "measured_by_tag": off.moved,
            "allocator_freed_bytes": off.allocator_freed,
            "graph_replay_bit_equal_to_eager": replay_same,
            "skipped_reason": None if off.report is None else off.report.skipped_reason,
        }
        del graph
    results["same_bytes"] = results["on"]["measured_bytes"] == results["off"]["measured_bytes"]
    return {"recipe": recipe, **results}


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
