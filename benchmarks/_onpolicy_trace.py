"""Where a true_on_policy mismatch starts: the first differing token replayed through the trainer's forward and
through the engine's own prefill and decode steps (one row, eager), every op's output at that token compared in
order, and the keys and values of the earlier positions compared too. Used by benchmarks/true_on_policy.py when a
mode that should read 0 does not; the answer names the layer and the op (or says that the one-row replay agrees,
so the difference comes from the batched, graphed run)."""

from __future__ import annotations

import dataclasses

import torch

LAYER_OPS = ["input_norm", "q_proj", "k_proj", "v_proj", "attention", "o_proj", "post_norm", "gate_proj", "up_proj",
             "silu_mul", "down_proj"]  # fmt: skip
QK_NORM_OPS = ["input_norm", "q_proj", "k_proj", "q_norm", "k_norm", "v_proj", "attention", "o_proj", "post_norm",
               "gate_proj", "up_proj", "silu_mul", "down_proj"]  # fmt: skip


def _tracing(kern, log: list, keys: list):
    """The kernel set with every op's output (and attention's keys and values) appended to ``log`` / ``keys``."""

    def wrap(fn):
        def call(*args, **kw):
            out = fn(*args, **kw)
            log.append(out.detach().clone() if torch.is_tensor(out) else out)
            return out

        return call

    def attention(q, k, v, mask, q_start):
        keys.append((k.detach().clone(), v.detach().clone()))
        return wrap(kern.attention)(q, k, v, mask, q_start)

    def decode_attention(filled, **kw):
        attend = kern.decode_attention(filled, **kw)

        def call(q, k_cache, v_cache):
            keys.append((k_cache.detach().clone(), v_cache.detach().clone()))
            return wrap(attend)(q, k_cache, v_cache)

        return call

    return dataclasses.replace(
        kern, linear=wrap(kern.linear), rms_norm=wrap(kern.rms_norm), silu_mul=wrap(kern.silu_mul),
        attention=attention, decode_attention=decode_attention, logits_into=wrap(kern.logits_into),
    )  # fmt: skip


def _last(out: torch.Tensor, kind: str) -> torch.Tensor:
    """The traced token's row of an op output: the last position of [1, T, ...] (prefill, trainer, decode) tensors,
    or of [1, H, T, D] attention; [1, X] and [1, H, D] (a decode step's attention) are the row itself."""
    if kind == "attention":
        return out[0, :, -1] if out.dim() == 4 else out[0]
    return out[0, -1] if out.dim() >= 3 else out[0]


def _names(cfg) -> list[str]:
    per = QK_NORM_OPS if cfg.qk_norm else LAYER_OPS
    return [f"layer {i} {op}" for i in range(cfg.num_hidden_layers) for op in per] + ["final norm", "lm_head"]


@torch.no_grad()
def first_differing_op(cfg, backend, samples, first: dict, device: str) -> dict:
    """Replay sample ``first['sample']`` up to the token at ``first['position']`` both ways; the first op (in forward
    order) whose output row differs, the first (layer, position) whose keys or values differ, and both log-probs."""
    from miles.model.decoder import KVCache
    from miles.rollout.forward import RopeTable, decode_step, prefill

    model = backend.model.eval()
    s = samples[first["sample"]]
    tokens = s.prompt_ids + s.response_ids
    pos, P = first["position"], len(s.prompt_ids)  # the token at ``pos`` comes out of position pos - 1
    kern = model.kernels
    t_log, t_keys = [], []
    model.kernels = _tracing(kern, t_log, t_keys)
    try:
        trainer_logits = model(torch.tensor([tokens[:pos]], device=device))[:, -1]
        e_log, e_keys = [], []
        cache = KVCache.allocate(cfg, 1, pos + 1, device, next(model.parameters()).dtype)
        rope = RopeTable(cfg, pos + 1, device, cache.k[0].dtype, kern)
        one = torch.zeros(1, dtype=torch.long, device=device)
        ids = torch.tensor([tokens[:P]], device=device)
        model.kernels = _tracing(kern, e_log if pos == P else [], e_keys if pos == P else [])
        logits = prefill(model, cache, rope, ids, torch.tensor([P], device=device), one, None)
        for t in range(P, pos):
            model.kernels = _tracing(kern, e_log if t == pos - 1 else [], e_keys if t == pos - 1 else [])
            logits = torch.empty(1, cfg.vocab_size, dtype=cache.k[0].dtype, device=device)
            decode_step(model, cache, rope, torch.tensor([tokens[t]], device=device), torch.tensor([t], device=device),
                        logits, bound=t + 1)  # fmt: skip
    finally:
        model.kernels = kern
    names = _names(cfg)
    out: dict = {
        "sample": first["sample"],
        "position": pos,
        "prompt_len": P,
        "ops_compared": min(len(t_log), len(e_log)),
    }
    kinds = [n.rsplit(" ", 1)[-1] for n in names]
    for i, (a, b) in enumerate(zip(t_log, e_log)):
        ra, rb = _last(a, kinds[i] if i < len(kinds) else ""), _last(b, kinds[i] if i < len(kinds) else "")
        if ra.shape != rb.shape or not torch.equal(ra, rb):
            diff = float((ra.float() - rb.float()).abs().max()) if ra.shape == rb.shape else None
            out["first_op"] = {"index": i, "name": names[i] if i < len(names) else f"op {i}", "max_abs": diff}
            break
    for layer, ((tk, tv), (ek, ev)) in enumerate(zip(t_keys, e_keys)):
        n = pos  # positions 0..pos-1 are attended to by the traced token
        tk, tv, ek, ev = tk[0, :, :n], tv[0, :, :n], ek[0, :, :n], ev[0, :, :n]
        bad = (tk != ek).any(-1).any(0) | (tv != ev).any(-1).any(0)
        if bad.any():
            out["first_kv"] = {"layer": layer, "position": int(bad.nonzero()[0])}
            break
    from miles.invariant.ops import token_log_probs

    tok = torch.tensor([tokens[pos]], device=device)
    temp = torch.ones(1, device=device)
    replay = {
        "trainer": float(token_log_probs(trainer_logits, tok, temp)[0]),
        "engine": float(token_log_probs(logits, tok, temp)[0]),
    }
    out["log_probs"] = {"reported": {"trainer": first["trainer"], "engine": first["engine"]}, "one_row_replay": replay}
    if "first_op" not in out and "first_kv" not in out:
        off = [side for side in ("trainer", "engine") if replay[side] != first[side]]
        out["verdict"] = (
            "the one-row replays agree op for op; "
            + (" and ".join(f"the {side}'s batched value differs from its one-row replay" for side in off) or "?")
            + ": a kernel whose result depends on the row count (or, for the engine, the decode graphs)"
        )
    return out
