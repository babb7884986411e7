"""A synthetic run directory, written with the same writers the driver uses (config, metrics, memory ledger,
rollout dumps, optionally one very long sample), so the dashboard can be tested, benchmarked and shown in a
notebook without training anything.

    run_dir = synthetic_run("/tmp/run", num_steps=3, long_tokens=65536)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from miles.dashboard.store import RunDirWriter
from miles.memory.ledger import LedgerEvent, pool_peaks
from miles.rollout_dump import RolloutDumpWriter

WORDS = [
    "the",
    "model",
    "reverse",
    "letters",
    "token",
    "answer",
    "so",
    "we",
    "get",
    "step",
    "check",
    "=",
    "+",
    "then",
    "a",
    "b",
    "c",
    "d",
    "e",
    "f",
    "result",
    "is",
    "wait",
    "let",
    "me",
    "think",
    "again",
    "ok",
]
LONG_PROMPT = 2048


def synthetic_sample(
    rng: np.random.Generator,
    *,
    index: int,
    group: int,
    prompt_len: int,
    response_len: int,
    reward: float,
    advantage: float,
    weight_version: int,
) -> dict:
    """A sample shaped like the driver's: tokens, display strings, log-probs that drift, per-token stats."""
    n = prompt_len + response_len
    ids = rng.integers(0, len(WORDS), n)
    newline = rng.random(n) < 0.04
    token_text = [WORDS[i] + ("\n" if nl else " ") for i, nl in zip(ids.tolist(), newline.tolist())]
    rollout = -rng.exponential(0.8, response_len)
    train = rollout + rng.normal(0, 0.05, response_len) * (1 + 4 * (rng.random(response_len) < 0.01))
    mask = np.ones(response_len, dtype=np.int64)
    if response_len > 40:  # a masked span, as a tool output inside an agent turn would be
        mask[response_len // 3 : response_len // 3 + 12] = 0
    return {
        "index": index,
        "group": group,
        "reward": reward,
        "weight_version": weight_version,
        "finish_reason": "length" if response_len > 1000 else "stop",
        "prompt_text": "".join(token_text[:prompt_len]).strip(),
        "response_text": "".join(token_text[prompt_len:]).strip(),
        "tokens": (ids + 100).tolist(),
        "token_text": token_text,
        "prompt_len": prompt_len,
        "loss_mask": mask.tolist(),
        "rollout_log_probs": rollout.tolist(),
        "train_log_probs": train.tolist(),
        "advantages": np.full(response_len, advantage).tolist(),
        "entropy": rng.gamma(2.0, 0.4, response_len).tolist(),
        # an async run's in-flight update: from step 1 on the first half of a response was sampled a version before
        "weight_versions": [max(0, weight_version - 1)] * (response_len // 2)
        + [weight_version] * (response_len - response_len // 2),
    }


def synthetic_step(
    step: int, *, num_groups: int = 4, group_size: int = 4, long_tokens: int = 0, seed: int = 0
) -> list[dict]:
    rng = np.random.default_rng(seed + step)
    samples = []
    for g in range(num_groups):
        rewards = rng.random(group_size).round(3)
        adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        for k in range(group_size):
            idx = g * group_size + k
            is_long = bool(long_tokens) and idx == 1
            prompt_len = (
                min(LONG_PROMPT, long_tokens // 2) if is_long else 40
            )  # a long prompt: the strip must scroll to the response
            response_len = long_tokens - prompt_len if is_long else int(rng.integers(8, 200))
            samples.append(
                synthetic_sample(
                    rng,
                    index=idx,
                    group=g,
                    prompt_len=prompt_len,
                    response_len=response_len,
                    reward=float(rewards[k]),
                    advantage=float(adv[k]),
                    weight_version=step,
                )
            )
    return samples


def synthetic_run(run_dir: str | Path, *, num_steps: int = 3, long_tokens: int = 0, seed: int = 0) -> Path:
    """A run directory like the driver writes: config, metrics, ledger and rollouts for num_steps steps.
    With long_tokens, sample row 1 of the last step has that many tokens, LONG_PROMPT of them prompt."""
    run_dir = Path(run_dir)
    run = RunDirWriter(run_dir=run_dir)
    run.write_config({"run_dir": str(run_dir), "task": {"name": "reverse"}, "synthetic": True})
    rng = np.random.default_rng(seed)
    t = 1_700_000_000.0
    held = {"device": 0, "host": 0}
    for step in range(1, num_steps + 1):
        events = _ledger_step(t, step)
        run.append_ledger(events)
        # mem/<pool>_peak from the run's own events, as the driver computes it: the Metrics and Memory tabs agree
        peaks = pool_peaks([LedgerEvent(**{k: v for k, v in e.items() if k != "step"}) for e in events], held)
        t += 10
        run.append_metrics(
            {
                "step": step,
                "reward": 0.3 + 0.1 * step + 0.05 * rng.random(),
                "loss": 1.0 / step,
                "kl": 0.01 * step,
                "entropy": 1.2 - 0.1 * step,
                "tokens_per_s": 900 + 50 * rng.random(),
                "time/generate": 2.0,
                "time/train": 3.0 + rng.random(),
                "time/sync": 0.4,
                "mem/device_peak": peaks["device"],  # as the driver computes them from the same events
                "mem/host_peak": peaks["host"],
            }
        )
        RolloutDumpWriter(run_dir=run_dir).write_step(
            step, synthetic_step(step, long_tokens=long_tokens if step == num_steps else 0, seed=seed)
        )
    return run_dir


def _ledger_step(t: float, step: int) -> list[dict]:
    """Memory events of one colocated step: engine weights/kv in and out, trainer params/optimizer around train."""
    gib = 1 << 30
    moves = [
        ("engine/0", "weights", "device", 2 * gib, "in", "onload_weights"),
        ("engine/0", "kv_cache", "device", 1 * gib, "in", "onload_kv"),
        ("engine/0", "kv_cache", "device", 1 * gib, "out", "offload_rollout"),
        ("engine/0", "weights", "device", 2 * gib, "out", "offload_rollout"),
        ("engine/0", "weights", "host", 2 * gib, "in", "offload_rollout"),
        ("trainer/0", "params", "device", 2 * gib, "in", "onload_train"),
        ("trainer/0", "optimizer", "device", 4 * gib, "in", "onload_train"),
        ("trainer/0", "grads", "device", 2 * gib, "in", "train"),
        ("trainer/0", "grads", "device", 2 * gib, "out", "train"),
        ("trainer/0", "optimizer", "device", 4 * gib, "out", "offload_train"),
        ("trainer/0", "optimizer", "host", 4 * gib, "in", "offload_train"),
        ("trainer/0", "params", "device", 2 * gib, "out", "offload_train"),
        ("engine/0", "weights", "host", 2 * gib, "out", "onload_weights"),
        ("trainer/0", "optimizer", "host", 4 * gib, "out", "onload_train"),
    ]
    return [
        {
            "time": t + 0.6 * i,
            "owner": o,
            "tag": tag,
            "pool": pool,
            "bytes": b,
            "direction": d,
            "phase": ph,
            "step": step,
        }
        for i, (o, tag, pool, b, d, ph) in enumerate(moves)
    ]
