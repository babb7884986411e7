"""LoRA on the engine's fused CUDA path: the adapters of q|k|v and of gate|up applied next to their fused matmul.

The base stays as it is, fused and stored once; adapters are not merged into it. Measured side by side
(``miles bench lora-serving``, benchmarks/results/lora-serving.cpu.json, a 256-wide 4-layer model on a shared 2-core
CPU): unmerged decodes at 0.71-0.77x the merged model's tokens/s at rank 1 and 64 (the adapters' matmuls; the ratio
falls with rank / hidden, so it is small at 8B widths), while merging per version costs a pass over every adapted
weight per sync, a second copy of those weights to merge from (12 MiB there, the whole base at scale), and exactness:
under true_on_policy the unmerged engine's log-probs equal the trainer's (max |diff| 0.0 at ranks 1-64), the merged
one's differ by up to 0.06 (bf16 rounds W + BA once, the trainer rounds W x and the delta separately). Per group the members' A matrices are stacked into one storage (their
parameters become views of it, as the base's are of the fused weights), so the group's delta costs one matmul for
A and one per member for B, added into that member's columns of the fused output. o_proj and down_proj are not
fused: their LoRALinear module adds its own delta. Everything is shape-static and in place, so CUDA graphs capture
it, and a weight sync's in-place copies reach it.

    adapters = FusedAdapters.of(model, stack)   # stack(params) -> one tensor whose views the params become
    qkv = F.linear(h, fused.qkv[i]); adapters.add_qkv(i, h, qkv)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from miles.model.lora import LoRALinear


@dataclass(slots=True)
class AdapterGroup:
    """The adapted members of one fused projection: A stacked [members x rank, in], each member's output columns."""

    a: torch.Tensor
    members: list[tuple[int, int, torch.Tensor, float]]  # (first column, end column, B [out, rank], scale)
    rank: int

    def add_into(self, h: torch.Tensor, out: torch.Tensor) -> None:
        """out[:, cols] += scale * (h A^T) B^T per member; h [N, in], out [N, fused out], FP32 delta, one rounding."""
        ha = F.linear(h.to(self.a.dtype), self.a)  # [N, members x rank]
        r = self.rank
        for j, (lo, hi, b, scale) in enumerate(self.members):
            out[:, lo:hi].add_(F.linear(ha[:, j * r : (j + 1) * r], b), alpha=scale)


class FusedAdapters:
    def __init__(self, qkv: list[AdapterGroup | None], gate_up: list[AdapterGroup | None]):
        self.qkv, self.gate_up = qkv, gate_up

    @classmethod
    def of(cls, model, stack) -> "FusedAdapters | None":
        """None when the model has no adapters on q/k/v or gate/up."""
        qkv, gate_up = [], []
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            qkv.append(_group([a.q_proj, a.k_proj, a.v_proj], stack))
            gate_up.append(_group([m.gate_proj, m.up_proj], stack))
        return cls(qkv, gate_up) if any(qkv) or any(gate_up) else None

    def add_qkv(self, i: int, h: torch.Tensor, out: torch.Tensor) -> None:
        if self.qkv[i] is not None:
            self.qkv[i].add_into(h, out)

    def add_gate_up(self, i: int, h: torch.Tensor, out: torch.Tensor) -> None:
        if self.gate_up[i] is not None:
            self.gate_up[i].add_into(h, out)


def _group(projections: list, stack) -> AdapterGroup | None:
    members, adapted, lo = [], [], 0
    for p in projections:
        hi = lo + p.out_features
        if isinstance(p, LoRALinear):
            adapted.append(p)
            members.append((lo, hi, p.lora_B.weight, p.scale))
        lo = hi
    if not adapted:
        return None
    return AdapterGroup(stack([p.lora_A.weight for p in adapted]), members, adapted[0].lora_A.out_features)
