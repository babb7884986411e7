"""Prefill scoring: the log-prob of every token of a sequence given the ones before it, and the top-k tokens at
each position, from one causal forward of the engine's model. ``/generate`` uses it for SGLang's
``input_token_logprobs`` (``max_new_tokens: 0`` with ``logprob_start_len``: how RL clients recompute a rollout's
log-probs) and for ``input_top_logprobs`` / ``output_top_logprobs`` (the sampled tokens' own log-probs still come
from the decode step that sampled them).

    scores = score(engine, [prompt + output], temperatures=[1.0], top_k=5)
    scores[0].token_lps[j]      # log p(seq[j + 1] | seq[: j + 1]), at the request's temperature
    scores[0].top[j]            # [(log-prob, token id), ...] of the distribution that predicts seq[j + 1]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles.protocols.engine import EngineError


@dataclass(slots=True)
class Scores:
    token_lps: list[float]  # len(seq) - 1 entries
    top: list[list[tuple[float, int]]]  # len(seq) - 1 entries of top_k pairs (empty lists when top_k = 0)


MAX_SCORE_TOKENS = 16384  # tokens per forward: longer batches are scored in several


@torch.no_grad()
def score(engine, seqs: list[list[int]], temperatures: list[float], top_k: int = 0) -> list[Scores]:
    """Scores of each sequence (at least 2 tokens to score anything), under the engine's lock (a weight update
    cannot land in the middle of a forward)."""
    for name in ("weights",):
        if engine.memory.is_offloaded(name):
            raise EngineError(f"the engine's {name} are released; resume_memory_occupation before scoring")
    if not engine.weights_synced:
        raise EngineError(engine.unsynced_message())
    out: list[Scores | None] = [None] * len(seqs)
    for chunk in _chunks(list(range(len(seqs))), seqs):
        for i, sc in zip(chunk, _score_chunk(engine, [(seqs[i], temperatures[i]) for i in chunk], top_k)):
            out[i] = sc
    return out


def _chunks(order: list[int], seqs: list[list[int]]) -> list[list[int]]:
    """Indices of sequences grouped (shortest first) into forwards of at most MAX_SCORE_TOKENS padded tokens."""
    chunks, cur = [], []
    for i in sorted(order, key=lambda i: len(seqs[i])):
        if cur and (len(cur) + 1) * len(seqs[i]) > MAX_SCORE_TOKENS:
            chunks.append(cur)
            cur = []
        cur.append(i)
    return chunks + ([cur] if cur else [])


def _score_chunk(engine, chunk: list, top_k: int) -> list[Scores]:
    dev = engine.device
    T = max(len(s) for s, _ in chunk)
    ids = torch.zeros(len(chunk), T, dtype=torch.long, device=dev)  # right padding: causal attention needs no mask
    for b, (s, _) in enumerate(chunk):
        ids[b, : len(s)] = torch.tensor(s, device=dev)
    with engine.lock:
        logits = engine.model(ids)
    res = []
    for b, (s, t) in enumerate(chunk):
        n = len(s) - 1
        logp = torch.log_softmax(logits[b, :n].float() / (t or 1.0), -1)
        lps = logp.gather(-1, ids[b, 1 : n + 1, None])[:, 0].tolist()
        top = [[] for _ in range(n)]
        if top_k and n:
            v, i = logp.topk(min(top_k, logp.shape[-1]), -1)
            top = [list(zip(vv, ii)) for vv, ii in zip(v.tolist(), i.tolist())]
        res.append(Scores(lps, top))
    return res
