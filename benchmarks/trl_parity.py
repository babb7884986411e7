"""``miles bench trl-parity``: seconds per full RL step, miles vs Hugging Face TRL's GRPOTrainer, side by side.

Same machine, same model (the ``trl_parity`` recipe's random-init Qwen2; TRL's ``Qwen2ForCausalLM`` is built from
``cfg.model.to_hf()`` and given our initial weights, checked logit-for-logit), same task (the reverse prompts of
each step, the same ``positional_credit`` reward), same sample counts (8 prompts x 4 completions of up to 32 new
tokens, one optimizer step per rollout). Each side runs in its own subprocess, one after the other, so they never
share the cores; the load average is recorded before each. miles runs through ``miles.driver.train`` (real Ray
actors; Ray start-up excluded, generate + handoff + train + weight sync included); TRL runs ``GRPOTrainer.train``
on CPU and a step is the time between two consecutive optimizer steps (generation + reward + loss + backward + step).

    miles bench trl-parity --json                    # both sides twice, alternating; 8 measured steps per block
    miles bench trl-parity --steps 4 --side miles    # one side only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from miles.config import RunConfig, apply_overrides
from miles.recipes import trl_parity


def parity_config(num_steps: int, run_dir: str) -> RunConfig:
    return apply_overrides(
        trl_parity(),
        [f"num_steps={num_steps}", f"run_dir={run_dir}", "checkpoint_every=0", "dump_rollouts=false", "resume=false"],
    )


def run(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="miles bench trl-parity")
    ap.add_argument("--steps", type=int, default=8, help="measured RL steps per side (median reported)")
    ap.add_argument("--warmup", type=int, default=2, help="RL steps run first and not measured")
    ap.add_argument("--side", choices=("both", "miles", "trl"), default="both")
    ap.add_argument("--timeout", type=int, default=900, help="seconds allowed per side")
    ap.add_argument(
        "--blocks",
        type=int,
        default=2,
        help="alternate the sides this many times (miles, TRL, then TRL, miles, ...): load that comes and "
        "goes on a shared machine then falls on both sides; medians over every measured step",
    )
    args = ap.parse_args(argv)
    cfg = trl_parity()
    out = {
        "config": {
            "model_parameters": cfg.model.num_parameters,
            "architecture": cfg.model.architecture,
            "prompts_per_step": cfg.rollout.num_prompts_per_step,
            "completions_per_step": cfg.rollout.num_prompts_per_step * cfg.rollout.n_samples_per_prompt,
            "max_new_tokens": cfg.rollout.max_new_tokens,
            "warmup_steps": args.warmup,
            "measured_steps_per_block": args.steps,
            "blocks": args.blocks,
            "torch_threads": "all cores (num_threads=0) on both sides",
        }
    }
    sides = ("miles", "trl") if args.side == "both" else (args.side,)
    blocks: dict[str, list[dict]] = {side: [] for side in sides}
    for b in range(args.blocks):
        for side in sides if b % 2 == 0 else sides[::-1]:
            blocks[side].append(run_side(side, args.steps, args.warmup, args.timeout))
    for side in sides:
        out[side] = merge_blocks(blocks[side], args.warmup)
    if len(sides) == 2:
        out["speedup_s_per_step"] = out["trl"]["s_per_step"] / out["miles"]["s_per_step"]
        out["speedup_completions_per_s"] = out["miles"]["completions_per_s"] / out["trl"]["completions_per_s"]
        out["speedup_completion_tokens_per_s"] = (
            out["miles"]["completion_tokens_per_s"] / out["trl"]["completion_tokens_per_s"]
        )
        # the fastest measured step of each side: the least disturbed by other load on a shared machine
        out["speedup_fastest_step"] = out["trl"]["s_per_step_min"] / out["miles"]["s_per_step_min"]
    return out


def run_side(side: str, steps: int, warmup: int, timeout: int) -> dict:
    """One side in a fresh subprocess; returns its figures plus the load average just before it started."""
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix=f"miles-trl-parity-{side}-") as tmp:
        result = Path(tmp) / "result.json"
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.trl_parity",
            "--child",
            side,
            "--steps",
            str(steps),
            "--warmup",
            str(warmup),
            "--workdir",
            tmp,
            "--result",
            str(result),
        ]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not result.exists():
            raise RuntimeError(
                f"trl-parity {side} side failed (exit {proc.returncode}); stderr tail:\n{proc.stderr[-3000:]}"
            )
        figures = json.loads(result.read_text())
    return {**figures, "loadavg_before": [round(x, 2) for x in load], "process_wall_s": time.perf_counter() - t0}


def merge_blocks(blocks: list[dict], warmup: int) -> dict:
    """One side's figures over all its blocks: medians over every measured step (each block's warm-up dropped)."""
    steps = [s for b in blocks for s in b["s_per_step_all"][warmup:]]
    med = statistics.median(steps)
    per_step = lambda key: statistics.median(b[key] * b["s_per_step"] for b in blocks)  # noqa: E731
    merged = {
        "s_per_step": med,
        "s_per_step_min": min(steps),
        "measured_steps": len(steps),
        "completions_per_s": per_step("completions_per_s") / med,
        "completion_tokens_per_s": per_step("completion_tokens_per_s") / med,
        "block_s_per_step": [round(b["s_per_step"], 4) for b in blocks],
        "blocks": blocks,
    }
    for key in ("mean_completion_tokens", "trl_version", "phase_median_s"):
        if key in blocks[0]:
            merged[key] = blocks[0][key]
    return merged


def summarize(step_s: list[float], completions: list[int], tokens: list[int], warmup: int) -> dict:
    """Median seconds per step over the measured steps, and throughput at that median."""
    s, c, t = step_s[warmup:], completions[warmup:], tokens[warmup:]
    med = statistics.median(s)
    return {
        "s_per_step": med,
        "s_per_step_min": min(s),
        "s_per_step_all": [round(x, 4) for x in step_s],
        "completions_per_s": statistics.median(c) / med,
        "completion_tokens_per_s": statistics.median(t) / med,
        "mean_completion_tokens": sum(t) / max(1, sum(c)),
    }


def miles_side(steps: int, warmup: int, workdir: str) -> dict:
    from miles.driver import train

    cfg = parity_config(warmup + steps, os.path.join(workdir, "run"))
    rows = train(cfg, progress=False)
    n = cfg.rollout.num_prompts_per_step * cfg.rollout.n_samples_per_prompt
    out = summarize([r["time/step"] for r in rows], [n] * len(rows), [int(r["rollout_tokens"]) for r in rows], warmup)
    phases = sorted({k for r in rows for k in r if k.startswith("time/") and k != "time/step"})
    out["phase_median_s"] = {k: statistics.median(r[k] for r in rows[warmup:] if k in r) for k in phases}
    out["reward_per_step"] = [round(r["reward"], 4) for r in rows]
    return out


def trl_side(steps: int, warmup: int, workdir: str) -> dict:
    import torch

    try:
        from datasets import Dataset
        from transformers import Qwen2Config, Qwen2ForCausalLM, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        raise SystemExit(
            f"the TRL side needs trl and its dependencies ({e}): pip install 'trl==1.16.0' "
            "(the version measured in BENCHMARKS.md), or run --side miles"
        ) from None

    from miles.model.decoder import build_decoder
    from miles.rollout.tasks import Task, positional_credit

    cfg = parity_config(warmup + steps, os.path.join(workdir, "run"))
    r = cfg.rollout
    model = same_weights_qwen2(cfg, build_decoder, Qwen2Config, Qwen2ForCausalLM, torch)
    task = Task(cfg.task, cfg.seed)
    problems = [p for step in range(warmup + steps) for p in task.problems(step, r.num_prompts_per_step)]
    data = Dataset.from_dict({"prompt": ["<bos>" + p.prompt for p in problems], "target": [p.target for p in problems]})
    counted = {"completions": [], "tokens": []}

    def reverse_reward(prompts, completions, target, completion_ids=None, **_):
        counted["completions"].append(len(completions))
        counted["tokens"].append(sum(len(ids) for ids in completion_ids))
        return [positional_credit(p, c, t) for p, c, t in zip(prompts, completions, target)]

    marks: list[float] = []

    class StepClock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            marks.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            marks.append(time.perf_counter())

    n = r.num_prompts_per_step * r.n_samples_per_prompt
    args = GRPOConfig(
        output_dir=os.path.join(workdir, "trl"),
        use_cpu=True,
        report_to="none",
        logging_strategy="no",
        save_strategy="no",
        disable_tqdm=True,
        seed=cfg.seed,
        learning_rate=cfg.trainer.lr,
        beta=cfg.trainer.kl_coef,
        max_steps=warmup + steps,
        per_device_train_batch_size=n,
        gradient_accumulation_steps=1,
        generation_batch_size=n,
        num_generations=r.n_samples_per_prompt,
        num_iterations=1,
        max_completion_length=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        dataloader_num_workers=0,
        shuffle_dataset=False,
        gradient_checkpointing=False,
    )  # TRL 1.x defaults to checkpointing; off is faster here
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reverse_reward,
        args=args,
        train_dataset=data,
        processing_class=ByteTokenizerHF(),
        callbacks=[StepClock()],
    )
    trainer.train()
    step_s = [b - a for a, b in zip(marks, marks[1:])]
    out = summarize(step_s, counted["completions"], counted["tokens"], warmup)
    out["trl_version"] = __import__("trl").__version__
    return out


def same_weights_qwen2(cfg: RunConfig, build_decoder, Qwen2Config, Qwen2ForCausalLM, torch):
    """TRL's model: the HF class built from our config, holding our initial weights (checked on one batch)."""
    ours = build_decoder(cfg.model, seed=cfg.seed).eval()
    hf = Qwen2ForCausalLM(Qwen2Config(**cfg.model.to_hf())).float()
    missing, unexpected = hf.load_state_dict(ours.hf_state_dict(), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"weights do not map onto Qwen2ForCausalLM: missing {missing}, unexpected {unexpected}")
    hf.tie_weights()
    ids = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(ids).logits, ours(ids), atol=1e-5, rtol=0)
    return hf.train()


def _byte_tokenizer_hf():
    """A transformers tokenizer with exactly miles' ByteTokenizer ids (TRL needs a ``PreTrainedTokenizer``)."""
    from transformers import PreTrainedTokenizer

    from miles.model.tokenizer import SPECIALS, ByteTokenizer

    class ByteTokenizerHF(PreTrainedTokenizer):
        model_input_names = ["input_ids", "attention_mask"]

        def __init__(self, **kw):
            self.inner = ByteTokenizer()
            self.vocab = {f"<0x{i:02X}>": i for i in range(256)} | self.inner.special_ids
            self.names = {v: k for k, v in self.vocab.items()}
            named = ("<bos>", "<eos>", "<pad>", "<unk>")
            super().__init__(
                bos_token="<bos>",
                eos_token="<eos>",
                pad_token="<pad>",
                unk_token="<unk>",
                additional_special_tokens=[s for s in SPECIALS if s not in named],
                **kw,
            )

        @property
        def vocab_size(self) -> int:
            return self.inner.vocab_size

        def get_vocab(self) -> dict:
            return dict(self.vocab)

        def _tokenize(self, text, **kw):
            return [f"<0x{b:02X}>" for b in text.encode()]

        def _convert_token_to_id(self, token):
            return self.vocab.get(token, self.inner.special_ids["<unk>"])

        def _convert_id_to_token(self, index):
            return self.names.get(index, "<unk>")

        def convert_tokens_to_string(self, tokens):
            return self.inner.decode([self._convert_token_to_id(t) for t in tokens], skip_special_tokens=False)

        def save_vocabulary(self, save_directory, filename_prefix=None):
            return ()

    return ByteTokenizerHF()


ByteTokenizerHF = _byte_tokenizer_hf  # a factory: transformers is imported only on the TRL side


def _child(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", choices=("miles", "trl"), required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--warmup", type=int, required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--result", required=True)
    a = ap.parse_args(argv)
    side = miles_side if a.child == "miles" else trl_side
    Path(a.result).write_text(json.dumps(side(a.steps, a.warmup, a.workdir)))


if __name__ == "__main__":
    _child(sys.argv[1:])
