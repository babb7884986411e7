"""How the rotary kernel rounds, against candidate orders of rounding (GPU only): the fraction of bf16 q values
where the kernel differs from each candidate. The candidate it equals names what the compiled kernel computes.

    python -m benchmarks.rope_rounding_probe

Before the kernel's products went through libdevice.mul_rn (2026-12-04, H200, the same comparisons run from a
scratch script): 22% of q values differed from torch's q * cos + rotate_half(q) * sin, and 0% from
fma(q, cos, round(rotate_half(q) * sin)): the product q * cos was fused into the add, skipping its rounding to
bf16. After (this script, 2026-12-04 11:53Z, H200): 0.0% from torch at head_dim 32 and 64; 22.5% / 22.1% from that
fused form, 29.5% / 29.1% from one rounding of the exact sum.
"""

from __future__ import annotations

import torch

from benchmarks.mismatch_probe import torch_rope_kv
from miles.model.config import ModelConfig
from miles.model.decoder import _rotate_half
from miles.rollout.forward import RopeTable
from miles.rollout.kernels import rope_kv


def main() -> None:
    for heads in (dict(hidden_size=128, num_attention_heads=4), dict(hidden_size=896, num_attention_heads=14)):
        cfg = ModelConfig(
            architecture="qwen2", intermediate_size=384, num_hidden_layers=1, num_key_value_heads=2,
            max_position_embeddings=512, dtype="bfloat16", **heads,
        )  # fmt: skip
        rope = RopeTable(cfg, 512, "cuda", torch.bfloat16)
        R, H, KVH, D = 256, cfg.num_attention_heads, 2, cfg.head_dim
        torch.manual_seed(0)
        qkv = torch.randn(R, (H + 2 * KVH) * D, device="cuda").bfloat16()
        lens = torch.randint(0, 500, (R,), device="cuda")
        caches = [torch.zeros(R, KVH, 512, D, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
        got = rope_kv(qkv, rope.cos, rope.sin, lens, caches[0], caches[1], H, KVH, D)
        want = torch_rope_kv(qkv, rope.cos, rope.sin, lens, caches[2], caches[3], H, KVH, D)
        q = qkv[:, : H * D].reshape(R, H, D)
        c, s = rope.cos[lens][:, None].float(), rope.sin[lens][:, None].float()
        x, xr = q.float(), _rotate_half(q).float()
        candidates = {
            "torch (each product rounded, then the sum)": want,
            "one rounding of the exact sum": (x * c + xr * s).bfloat16(),
            "fma(q, cos, round(rot * sin))": torch.addcmul((xr * s).bfloat16().float(), x, c).bfloat16(),
            "fma(rot, sin, round(q * cos))": torch.addcmul((x * c).bfloat16().float(), xr, s).bfloat16(),
        }
        print(f"head_dim {D}:")
        for name, value in candidates.items():
            print(f"  differs from {name}: {(got != value).float().mean().item():.1%}")


if __name__ == "__main__":
    main()
