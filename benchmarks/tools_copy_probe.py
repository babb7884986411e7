"""Does the quickstart_tools model learn to copy digits from supervised demonstrations alone? A one-off probe.

Plays the calculator environment's tool-using demonstrations (``demo_tool_share`` 1: every episode calls the tool)
with the recipe's renderer and toy tokenizer, then trains the recipe's decoder on them with AdamW, printing every
``--every`` steps the loss on the model's tokens, the loss and accuracy on its digit tokens (a guess costs ln 10 =
2.30 nats), and the accuracy per digit place (the call's four, then the answer's). Not a ``miles bench`` name.

    python benchmarks/tools_copy_probe.py --steps 150 --every 15
    python benchmarks/tools_copy_probe.py --steps 200 --bs 32 --set model.num_attention_heads=8 \\
        model.num_key_value_heads=4 model.head_dim=16
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from miles.config import apply_overrides
from miles.envs.source import EnvSource
from miles.model.decoder import build_decoder
from miles.model.tokenizer import load_tokenizer
from miles.recipes import quickstart_tools

ARGS = '{"describe": false, "partial_credit": true, "demo_tool_share": 1.0}'


def demonstrations(cfg, tok, batches: int) -> list[tuple[list[int], list[int]]]:
    source = EnvSource(cfg, tok, [])
    out = []
    for i in range(batches):
        for s in source.prompts(i, with_targets=True):
            out.append((list(s.tokens), [0] * len(s.prompt_ids) + list(s.metadata["loss_mask"])))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bs", type=int, default=64, help="episodes per step")
    p.add_argument("--every", type=int, default=15)
    p.add_argument("--set", nargs="*", default=[], help="recipe overrides, e.g. model.num_attention_heads=8")
    a = p.parse_args()
    torch.set_num_threads(1)
    cfg = apply_overrides(quickstart_tools(), [f"seed={a.seed}", f"env.args={ARGS}", *a.set])
    tok = load_tokenizer(cfg.model.tokenizer)
    demos = demonstrations(cfg, tok, batches=40)
    digits = torch.tensor(sorted({tok.encode(d)[0] for d in "0123456789"}))
    model = build_decoder(cfg.model, seed=a.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    t0 = time.perf_counter()
    for step in range(a.steps):
        batch = random.Random(step).sample(demos, a.bs)
        width = max(len(t) for t, _ in batch)
        tokens = torch.tensor([t + [0] * (width - len(t)) for t, _ in batch])
        mask = torch.tensor([m + [0] * (width - len(m)) for _, m in batch]).float()[:, 1:]
        logits = model(tokens[:, :-1])
        lp = torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, 1:, None])[..., 0]
        loss = -(lp * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if step % a.every == 0 or step == a.steps - 1:
            with torch.no_grad():
                is_digit = torch.isin(tokens[:, 1:], digits) & (mask > 0)
                right = (logits.argmax(-1) == tokens[:, 1:]) & is_digit
                place = is_digit.cumsum(1) - 1
                by_place = [
                    round(float(right[place == j].sum() / (is_digit & (place == j)).sum()), 2) for j in range(8)
                ]
                print(
                    f"step {step} loss {loss.item():.3f} digit loss {float(-(lp * is_digit).sum() / is_digit.sum()):.3f}"
                    f" digit accuracy {float(right.sum() / is_digit.sum()):.3f} by place {by_place}"
                    f" ({time.perf_counter() - t0:.0f} s)",
                    flush=True,
                )


if __name__ == "__main__":
    main()
