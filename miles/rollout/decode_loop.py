"""Continuous batching over the engine's KV cache slots, with the rows' state kept on the device.

Each request takes one slot (one row of the KV cache). Requests beyond the slots wait in a queue; a slot freed
by a finished row takes the next waiting request, prefilled with the other newcomers that share its prompt
(a GRPO group prefills once). With ``share_prefix`` (the GPU engine) the group's prompt KV is written once, into
its first slot, and the other rows' attention reads the prompt's positions there; that slot is not handed to a
new request until the whole group is done. A decode step touches only device tensors: the sampled token, its log-prob,
the stop and length checks and the finished flags are written on the device (``advance``), so the host
never waits on a step. It reads the flags every ``check_every`` steps while rows can stop early or requests
wait, otherwise only when the first row reaches its length, which the host knows without asking.

A call made while another one runs joins it: its requests enter the running loop's queue (and take its
random stream; their seed is not used), and the call returns when its own requests are done.

Every token carries the weight version it was sampled under (``GenerateOutput.output_versions``): a weight update
lands between two decode steps (it takes the engine's lock, which each step holds), and the rows in flight continue
under the new version, their KV cache kept; after ``pause_generation("retract")`` they are prefilled again (the KV
recomputed) under the version held at continue. The loop notes the version at every step it runs (a host integer,
no device read) and each row keeps the spans it crossed.

A request may carry a ``watch`` (miles.protocols.engine.RowWatch: stop strings, streaming): at each check the loop
shows it the row's tokens so far, and a returned count ends the row there (finish reason "stop"). Rows with
``min_new_tokens`` have their stop tokens suppressed (logits -inf) until they have that many tokens, as SGLang's
min-new-tokens penalizer does. ``pause_generation("retract")`` (the engine's) returns every running row to the
queue at the next step, its tokens kept, and parks the loop holding no KV state until continue: the rows are then
prefilled again with their tokens so far, under whatever weights the engine holds by then.

The loop owns the request state (the queue, the slot of each request, aborts, pause and retract); the engine owns
the device batch and runs the model; the data between them is miles.rollout.rows (RowState, PrefillBatch,
StepBatch). What the loop asks of the engine: ``start(seed)``, ``prefill(PrefillBatch)``, ``step(StepBatch)``
(each returns the weight version it ran under), ``output(...)``, its ``lock`` (held by a step and by a weight
update), ``state`` (the RowState), ``device`` and ``max_batch_size``.

    loop = DecodeLoop(engine)                       # owned by the EmbeddedEngine
    outs = loop.generate(requests, seed)            # one GenerateOutput per request, in order
    loop.generate(requests, seed, on_output=fn)     # fn(i, output) as each request finishes, before the return
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from miles.rollout.rows import PrefillBatch, StepBatch
from miles.stall.heartbeat import beat


@dataclass(slots=True)
class _Call:
    """One generate call's results; the caller waits on ``done`` (set when every request has an output).
    ``on_output(i, output)``, when given, hears of each request as it finishes (from the loop's thread)."""

    results: list
    left: int
    on_output: Callable[[int, object], None] | None = None
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def put(self, i: int, out) -> None:
        self.results[i] = out
        self.left -= 1
        if self.on_output is not None:
            self.on_output(i, out)
        if not self.left:
            self.done.set()

    def fail(self, e: BaseException) -> None:
        if not self.done.is_set():
            self.error = e
            self.done.set()


@dataclass(slots=True)
class _Carry:
    """What a retracted row had: its original request, its tokens, log-probs and their weight versions so far, how
    often it was retracted."""

    req: object
    ids: list = field(default_factory=list)
    lps: list = field(default_factory=list)
    retractions: int = 0
    versions: list = field(default_factory=list)


@dataclass(slots=True)
class _Row:
    call: _Call
    i: int  # position in the call's request list
    req: object  # GenerateRequest (a retracted row's: its prompt then holds its tokens so far)
    prefix_slot: int  # the slot whose KV holds this row's prompt (its own, or its group's first)
    carry: _Carry | None = None
    steps: int = 1  # tokens generated (the host's count: exact unless a stop token ended the row earlier)
    spans: list = field(default_factory=list)  # (first token index, weight version) each time the version changed


def versions_of(spans: list, n: int) -> list[int]:
    """The weight version of each of a row's first ``n`` tokens, from its (first token index, version) spans."""
    out: list[int] = []
    for (start, v), nxt in zip(spans, [*spans[1:], (n, None)]):
        out += [v] * max(0, min(nxt[0], n) - start)
    return out


def buckets(max_rows: int) -> list[int]:
    """Row counts a decode step runs at (and is captured at): powers of two, then the slot count."""
    out, n = [], 1
    while n < max_rows:
        out.append(n)
        n *= 2
    return out + [max_rows]


class DecodeLoop:
    def __init__(self, engine, *, check_every: int = 16, prefill_tokens: int = 16384, share_prefix: bool = False):
        self.e, self.check_every, self.prefill_tokens = engine, check_every, prefill_tokens
        # share_prefix: a group's prompt KV is written once, into its first slot, and its other rows read it there
        # (that slot stays taken until the whole group is done); otherwise each row gets its own copy
        self.share_prefix = share_prefix
        self.buckets = buckets(engine.max_batch_size)
        # since construction: prompts prefilled, rows admitted, decode steps, host reads of the finish flags
        self.stats = {"prefills": 0, "admitted": 0, "steps": 0, "flag_reads": 0, "joined": 0}
        self._inbox: deque = deque()  # (call, i, request) of calls that joined the running loop
        self._inbox_lock = threading.Lock()
        self._busy = False
        self.parked = False  # a retract pause holds the loop: no row has KV state, memory may be released
        # the request state the engine's control surface sets (abort, pause_generation, continue_generation)
        self.running = threading.Event()
        self.running.set()  # cleared by a pause (in place or retract), set by resume
        self.retracting = False  # a retract pause: running rows go back to the queue
        self.aborted: set[str] = set()  # request ids to finish with 'abort'
        self.abort_all = False

    # ---- control: what abort / pause_generation / continue_generation set -----------------------------------
    def abort(self, rids: Iterable[str] | str = "all") -> None:
        """Finish the given requests (or all) at the next decode step, or in the queue, with finish_reason 'abort'."""
        if rids == "all":
            self.abort_all = True
        else:
            self.aborted |= set(rids)

    def pause(self, retract: bool) -> None:
        """No decode step starts until ``resume``; the caller holds the engine's lock, so none is running either.
        ``retract``: the running rows go back to the queue with their tokens, prefilled again on resume."""
        self.retracting = retract
        self.running.clear()

    def resume(self) -> None:
        self.retracting = False
        self.running.set()

    @property
    def paused(self) -> bool:
        return not self.running.is_set()

    @property
    def holds_no_rows(self) -> bool:
        """No row holds KV state: the loop is not running, or it is parked by a retract pause."""
        return not self._busy or self.parked

    # ---- the loop ---------------------------------------------------------------------------------------------
    def generate(self, requests: list, seed: int, on_output: Callable[[int, object], None] | None = None) -> list:
        call = _Call([None] * len(requests), len(requests), on_output)
        if not requests:
            return []
        items = [(call, i, r, None) for i, r in enumerate(requests)]
        with self._inbox_lock:
            joining = self._busy
            if joining:
                self._inbox.extend(items)
                self.stats["joined"] += len(items)
            self._busy = True
        if joining:
            call.done.wait()
        else:
            self._own(items, seed)
        if call.error is not None:
            raise call.error
        return call.results

    def _own(self, items: list, seed: int) -> None:
        """Run the loop until no request is left, the joined ones included; a failure reaches every caller."""
        calls = {id(items[0][0]): items[0][0]}
        try:
            self.e.start(seed)
            self._run(deque(items), calls)  # clears _busy itself, under the lock, when it finds nothing left
        except BaseException as err:
            with self._inbox_lock:
                self._busy = False
                left, self._inbox = list(self._inbox), deque()
            for c in [*calls.values(), *(item[0] for item in left)]:
                c.fail(err)
            raise
        finally:
            self.abort_all = False
            self.parked = False

    def _run(self, waiting: deque, calls: dict) -> None:
        e = self.e
        active: dict[int, _Row] = {}
        while True:
            while self._inbox:
                item = self._inbox.popleft()
                calls[id(item[0])] = item[0]
                waiting.append(item)
            if not (waiting or active):
                with self._inbox_lock:
                    if not self._inbox:
                        self._busy = False  # the next call starts its own loop
                        return
                continue
            self._drop_aborted_waiting(waiting)
            if self.retracting:
                self._park(waiting)  # nothing is admitted (or prefilled) until continue
                continue
            pinned = {r.prefix_slot for r in active.values()}  # a finished row's slot may still hold a shared prompt
            free = [s for s in range(e.max_batch_size) if s not in active and s not in pinned]
            if waiting and free:
                take = [waiting.popleft() for _ in range(min(len(free), len(waiting)))]
                self._admit(take, free[: len(take)], active)
            if not active:
                continue
            R = next(b for b in self.buckets if b > max(active))
            reqs = [r.req.sampling for r in active.values()]
            flexible = any(s.top_p < 1 or s.top_k > 0 or s.min_new_tokens > 0 for s in reqs)
            suppress = any(s.min_new_tokens > 0 for s in reqs)
            bound = max(len(r.req.input_ids) + r.steps for r in active.values())  # per step: no loop over rows
            steps, done = self._steps_until_check(active, bool(waiting or self._inbox)), 0
            changes: list[tuple[int, int]] = []  # (step of this chunk, weight version) where the version changed
            while done < steps:
                while not self.running.wait(0.05):  # paused in place: aborts and a retract still get through
                    if self.retracting or self._abort_requested(active):
                        break
                if self._abort_requested(active) or self.retracting:
                    break
                with e.lock:  # a pause or a weight update waits for the step; the step sees one version whole
                    if not self.running.is_set():
                        continue  # paused between the wait above and the lock
                    version = e.step(StepBatch(R, bound + done, flexible, suppress))
                if not changes or changes[-1][1] != version:
                    changes.append((done, version))
                done += 1
            self.stats["steps"] += done
            beat()  # progress for the stall watchdog (miles.stall.heartbeat): cheap, at most a file touch per 0.5 s
            for r in active.values():
                for d, v in changes:
                    if r.spans[-1][1] != v:
                        r.spans.append((r.steps + d, v))
                r.steps += done
            self._retire(active)
            if self.retracting and active:
                self._retract(active, waiting)

    def _steps_until_check(self, active: dict[int, _Row], waiting: bool) -> int:
        left = min(r.req.sampling.max_new_tokens - r.steps for r in active.values())
        watches = [r.req.watch for r in active.values() if r.req.watch is not None]
        can_stop = waiting or bool(watches) or any(r.req.sampling.stop_token_ids for r in active.values())
        every = min([self.check_every, *(max(1, w.interval) for w in watches)])
        return max(0, min(left, every) if can_stop else left)

    def _abort_requested(self, active: dict[int, _Row]) -> bool:
        return self.abort_all or (bool(self.aborted) and any(r.req.rid in self.aborted for r in active.values()))

    def _drop_aborted_waiting(self, waiting: deque) -> None:
        if not (self.abort_all or self.aborted):
            return
        for item in list(waiting):
            call, i, req, carry = item
            if self.abort_all or req.rid in self.aborted:
                waiting.remove(item)
                self.aborted.discard(req.rid)
                call.put(i, _output(self.e, req, carry, [], [], "abort"))

    # ---- admission: prefill once per distinct prompt ----------------------------------------------------------
    def _admit(self, take: list, slots: list[int], active: dict[int, _Row]) -> None:
        groups: dict[tuple, list[int]] = {}
        version: dict[int, int] = {}  # slot -> the weight version its first token was sampled under
        for (_, _, req, _), slot in zip(take, slots):
            groups.setdefault(tuple(req.input_ids), []).append(slot)
        by_slot = {slot: item for item, slot in zip(take, slots)}
        holder = {s: (g[0] if self.share_prefix else s) for g in groups.values() for s in g}
        prompts = sorted(groups, key=len)
        chunk: list[tuple] = []
        for p in prompts:
            if chunk and (len(chunk) + 1) * len(p) > self.prefill_tokens:
                version |= self._prefill(chunk, groups, by_slot)
                chunk = []
            chunk.append(p)
        if chunk:
            version |= self._prefill(chunk, groups, by_slot)
        for slot in slots:
            call, i, req, carry = by_slot[slot]
            active[slot] = _Row(call, i, req, prefix_slot=holder[slot], carry=carry, spans=[(0, version[slot])])
        self.stats["prefills"] += len(prompts)
        self.stats["admitted"] += len(slots)

    def _prefill(self, prompts: list[tuple], groups: dict, by_slot: dict) -> dict[int, int]:
        """Prefill the prompts and sample each row's first token; returns {slot: the weight version used}."""
        e = self.e
        P = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), P, dtype=torch.long)
        for u, p in enumerate(prompts):
            ids[u, : len(p)] = torch.tensor(p)
        slots = [s for p in prompts for s in groups[p]]
        src = [u for u, p in enumerate(prompts) for _ in groups[p]]
        reqs = [by_slot[s][2] for s in slots]
        rows = torch.tensor(slots, device=e.device)
        if self.share_prefix:  # the KV goes to each group's first slot only
            kv_slots, kv_src = [groups[p][0] for p in prompts], None  # prompt i into its group's first slot
            holders = [groups[p][0] for p in prompts for _ in groups[p]]
        else:
            kv_slots, kv_src, holders = slots, src, slots
        e.state.admit(rows, reqs, holders, self.share_prefix)
        flexible = any(r.sampling.top_p < 1 or r.sampling.top_k > 0 for r in reqs)
        suppress = any(r.sampling.min_new_tokens > 0 for r in reqs)
        version = e.prefill(
            PrefillBatch(ids, [len(p) for p in prompts], kv_slots, kv_src, src, rows, flexible, suppress)
        )
        return dict.fromkeys(slots, version)

    # ---- retiring finished rows: one read of the flags, one of the finished (and watched) rows' tokens ---------
    def _retire(self, active: dict[int, _Row]) -> None:
        e, st = self.e, self.e.state
        slots = sorted(active)
        idx = torch.tensor(slots, device=e.device)
        # python lists from here: indexing a host tensor element by element costs microseconds per row
        finished, stopped, num_gen = st.flags(idx)
        self.stats["flag_reads"] += 1
        aborted = {s for i, s in enumerate(slots) if not finished[i] and self._aborts(active[s])}
        done = {i for i, s in enumerate(slots) if finished[i] or s in aborted}
        watched = [i for i, s in enumerate(slots) if active[s].req.watch is not None]
        read = sorted(done | set(watched))
        if not read:
            return
        width = max(num_gen[i] for i in read)
        read_idx = idx[torch.tensor(read, device=e.device)]
        tokens = dict(zip(read, zip(*st.tokens_of(read_idx, width))))
        cut = {}
        for i in watched:
            row, (ids, lps) = active[slots[i]], tokens[i]
            n = num_gen[i]
            prior = row.carry or _Carry(row.req)
            keep = row.req.watch.seen(prior.ids + ids[:n], prior.lps + lps[:n])
            if keep is not None:
                cut[i] = max(0, keep - len(prior.ids))
        newly = sorted(set(cut) - done)
        if newly or aborted:  # a freed slot must not advance
            st.finish(idx[torch.tensor(newly + [slots.index(s) for s in aborted], device=e.device)])
        for i in sorted(done | set(cut)):
            row = active.pop(slots[i])
            ids, lps = tokens[i]
            n = min(num_gen[i], cut.get(i, num_gen[i]))
            reason = "stop" if (stopped[i] or i in cut) else "abort" if slots[i] in aborted else "length"
            self.aborted.discard(row.req.rid)
            row.call.put(row.i, _output(e, row.req, row.carry, ids[:n], lps[:n], reason, versions_of(row.spans, n)))

    def _aborts(self, row: _Row) -> bool:
        return self.abort_all or row.req.rid in self.aborted

    # ---- retract: rows back to the queue with their tokens, the loop parked until continue ---------------------
    def _retract(self, active: dict[int, _Row], waiting: deque) -> None:
        """Every live row goes back to the front of the queue as a request whose prompt holds its tokens so far."""
        st, slots = self.e.state, sorted(active)
        idx = torch.tensor(slots, device=self.e.device)
        num_gen = st.num_gen[idx].tolist()
        ids, lps = st.tokens_of(idx, max(num_gen))
        st.finish(idx)
        back = []
        for j, s in enumerate(slots):
            row = active.pop(s)
            n = num_gen[j]
            prior = row.carry or _Carry(row.req)
            versions = prior.versions + versions_of(row.spans, n)
            carry = _Carry(prior.req, prior.ids + ids[j][:n], prior.lps + lps[j][:n], prior.retractions + 1, versions)
            back.append((row.call, row.i, _continued(prior.req, carry), carry))
        waiting.extendleft(reversed(back))
        self.stats["retracted"] = self.stats.get("retracted", 0) + len(back)

    def _park(self, waiting: deque) -> None:
        """Hold, with no row holding KV state, until continue_generation; aborts of queued requests are answered
        meanwhile."""
        self.parked = True
        try:
            while not self.running.wait(0.05):
                self._drop_aborted_waiting(waiting)
        finally:
            self.parked = False


def _continued(req, carry: _Carry):
    """The request a retracted row resumes as: its prompt and tokens so far, the rest of its budget."""
    from dataclasses import replace

    s = req.sampling
    sampling = replace(
        s,
        max_new_tokens=s.max_new_tokens - len(carry.ids),
        min_new_tokens=max(0, s.min_new_tokens - len(carry.ids)),
    )
    return replace(req, input_ids=list(req.input_ids) + carry.ids, sampling=sampling)


def _output(e, req, carry: _Carry | None, ids: list, lps: list, reason: str, versions: list | None = None):
    """The output of ``req`` (a retracted one's original request, its earlier tokens first)."""
    versions = versions or []
    if carry is None:
        return e.output(req, ids, lps, reason, versions)
    out = e.output(carry.req, carry.ids + ids, carry.lps + lps, reason, carry.versions + versions)
    out.retractions = carry.retractions
    return out
