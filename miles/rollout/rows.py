"""The device batch: the data between the decode loop and the engine that runs the model.

The decode loop (miles.rollout.decode_loop) owns the request state: the queue, which slot serves which request,
aborts, pause and retract. The engine (miles.rollout.engine, the model runner) owns the device: the weights, the
KV cache, the random stream, and ``RowState``, one row of device tensors per KV-cache slot. They meet only here:

- the loop writes the rows it admits into ``RowState`` (``admit``) and reads them at its checks (``flags``,
  ``tokens``), and ends rows there (``finish``);
- it hands the engine a ``PrefillBatch`` (the admitted rows' distinct prompts and slots) and a ``StepBatch`` (one
  decode step's shape); the engine's prefill and steps write each sampled token into ``RowState`` on the device
  (``advance``), so the host never waits on a step.

Shapes: U distinct prompts, P the longest prompt, R rows of a step (slots [0, R)), V the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles.rollout.sampling import use_triton

STOP_SLOTS = 16  # stop token ids per request held on the device


@dataclass(frozen=True, slots=True)
class PrefillBatch:
    """Admitted rows to prefill: each distinct prompt once, its KV written into ``kv_slots``."""

    ids_UP: torch.Tensor  # the prompts, right-padded (host tensor)
    lens: list[int]  # each prompt's length
    kv_slots: list[int]  # the slot each prompt's KV goes to (one per prompt when shared, else one per row)
    kv_src: list[int] | None  # the prompt of each KV slot (None: kv_slots[i] holds prompt i)
    src: list[int]  # the prompt of each admitted row
    rows: torch.Tensor  # the admitted rows' slots (on the device), in the order of ``src``
    flexible: bool  # a row samples with top-p / top-k
    suppress: bool  # a row's stop tokens are masked until min_new_tokens


@dataclass(frozen=True, slots=True)
class StepBatch:
    """One decode step over slots [0, R)."""

    R: int
    bound: int  # no row's length exceeds this after the step (the attention reads no further)
    flexible: bool  # a row samples with top-p / top-k (outside the step's graph)
    suppress: bool  # a row's stop tokens are masked until min_new_tokens


class RowState:
    """Per-slot device state; fixed addresses, so the decode graphs read and write it in place."""

    def __init__(self, num_slots: int, width: int, device):
        z = lambda dtype: torch.zeros(num_slots, dtype=dtype, device=device)  # noqa: E731
        self.device = torch.device(device)
        self.tokens, self.lens, self.num_gen, self.max_new = (z(torch.long) for _ in range(4))
        self.finished = torch.ones(num_slots, dtype=torch.bool, device=device)
        self.stopped = z(torch.bool)
        self.temperature, self.top_p, self.top_k = z(torch.float32), z(torch.float32) + 1, z(torch.long)
        self.min_new = z(torch.long)  # stop ids are suppressed while num_gen < min_new
        self.stop_ids = torch.full((num_slots, STOP_SLOTS), -1, dtype=torch.long, device=device)
        self.out_ids = torch.zeros(num_slots, width, dtype=torch.long, device=device)  # width > max_new_tokens
        self.out_lps = torch.zeros(num_slots, width, dtype=torch.float32, device=device)
        self.seed = torch.zeros(1, dtype=torch.long, device=device)
        # positions below prefix_len[r] are read from slot prefix_slot[r] (a shared prompt's KV; 0: none shared)
        self.prefix_slot = torch.arange(num_slots, device=device)
        self.prefix_len = z(torch.long)

    def admit(self, rows: torch.Tensor, reqs: list, holders: list[int], shared: bool) -> None:
        """The admitted requests' rows, written with one host-to-device copy per dtype. ``holders``: the slot
        holding each row's prompt KV; ``shared``: the other rows of a group read the prompt there."""
        pad = [-1] * STOP_SLOTS
        longs = torch.tensor(
            [
                [len(r.input_ids) - 1, r.sampling.max_new_tokens, r.sampling.top_k]  # advance() adds the first token
                + [h, len(r.input_ids) if shared else 0, r.sampling.min_new_tokens]
                + (list(r.sampling.stop_token_ids) + pad)[:STOP_SLOTS]
                for r, h in zip(reqs, holders)
            ],
            dtype=torch.long,
        ).to(self.device)
        floats = torch.tensor([[r.sampling.temperature, r.sampling.top_p] for r in reqs], dtype=torch.float32)
        floats = floats.to(self.device)
        self.lens[rows], self.max_new[rows], self.top_k[rows] = longs[:, 0], longs[:, 1], longs[:, 2]
        self.prefix_slot[rows], self.prefix_len[rows] = longs[:, 3], longs[:, 4]
        self.min_new[rows] = longs[:, 5]
        self.stop_ids[rows] = longs[:, 6:]
        self.temperature[rows], self.top_p[rows] = floats[:, 0], floats[:, 1]
        self.num_gen[rows] = 0
        self.finished[rows] = False
        self.stopped[rows] = False

    def flags(self, rows: torch.Tensor) -> tuple[list[int], list[int], list[int]]:
        """Finished, stopped (by a stop token) and tokens generated, per row: one read of the device."""
        return torch.stack([self.finished[rows].long(), self.stopped[rows].long(), self.num_gen[rows]]).tolist()

    def tokens_of(self, rows: torch.Tensor, width: int) -> tuple[list[list[int]], list[list[float]]]:
        """The first ``width`` sampled tokens of each row and their log-probs (python lists)."""
        return self.out_ids[rows, :width].tolist(), self.out_lps[rows, :width].tolist()

    def finish(self, rows: torch.Tensor) -> None:
        """End these rows: a freed slot must not advance."""
        self.finished[rows] = True


def advance(
    st: RowState, rows: torch.Tensor | slice, tok: torch.Tensor, lp: torch.Tensor, *, fused: bool | None = None
) -> None:
    """Record the sampled token of each live row in ``rows`` and decide on the device whether it finished.
    ``rows``: a slice (a decode step over slots [0, R): views, updated in place) or slot indices (a prefill).
    ``fused=None``: a decode step's bookkeeping is one Triton kernel where it can run (about 15 small ops here).
    The two branches do the same: views can be updated in place, indexed rows must be gathered and scattered."""
    if isinstance(rows, slice) and (use_triton(tok) if fused is None else fused):
        from miles.rollout.kernels import advance_rows

        advance_rows(st, tok.shape[0], tok, lp)
        return
    if isinstance(rows, slice):
        idx = torch.arange(tok.shape[0], device=tok.device)
        live = ~st.finished[rows]
        n = st.num_gen[rows]
        st.out_ids[idx, n] = tok  # a finished row writes past its last token: never read
        st.out_lps[idx, n] = lp
        hit = (tok[:, None] == st.stop_ids[rows]).any(1)
        n += live
        st.lens[rows] += live
        torch.where(live, tok, st.tokens[rows], out=st.tokens[rows])
        st.stopped[rows] |= live & hit
        st.finished[rows] |= live & (hit | (n >= st.max_new[rows]))
    else:
        live = ~st.finished[rows]
        n = st.num_gen[rows]
        st.out_ids[rows, n] = tok
        st.out_lps[rows, n] = lp
        hit = (tok[:, None] == st.stop_ids[rows]).any(1)
        n = n + live
        st.num_gen[rows] = n
        st.lens[rows] += live
        st.tokens[rows] = torch.where(live, tok, st.tokens[rows])
        st.stopped[rows] |= live & hit
        st.finished[rows] |= live & (hit | (n >= st.max_new[rows]))
    st.seed += 1


def suppress_stops(st: RowState, rows: torch.Tensor | slice, logits_RV: torch.Tensor) -> None:
    """Stop tokens get logit -inf in rows that have fewer than min_new tokens (SGLang's min_new_tokens)."""
    stop = st.stop_ids[rows]
    block = (st.num_gen[rows] < st.min_new[rows])[:, None] & (stop >= 0)
    ids = stop.clamp_min(0)
    logits_RV.scatter_(1, ids, torch.where(block, float("-inf"), logits_RV.gather(1, ids)))
