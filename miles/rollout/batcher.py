"""Batching of concurrent generate calls for a server: collect requests for a few milliseconds, then call
``engine.generate`` once for the whole batch in a worker thread, so the event loop never blocks and 200
concurrent single-prompt requests cost a handful of forward passes instead of 200.

One batch runs at a time (the engine owns one KV cache); requests that arrive meanwhile form the next batch.
Each call is answered as soon as its own requests finish (the engine reports each request as it ends), as
SGLang answers each request, not when the batch's longest one ends; an aborted request is answered at once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass, field

from miles.protocols.engine import EngineError, GenerateOutput, GenerateRequest

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)  # compared by identity (in_flight.remove)
class _Job:
    requests: list[GenerateRequest]
    seed: int | None
    future: asyncio.Future
    aborted: set[str] = field(default_factory=set)


class GenerateBatcher:
    """batcher = GenerateBatcher(engine, wait_s=0.005)
    batcher.start()                                   # inside the running event loop
    outs = await batcher.submit(requests, seed=None)  # from any handler; EngineError for bad input
    batcher.abort(["rid"]) / batcher.abort(None)      # in flight: at the next decode step; queued: at once
    async with batcher.idle: ...                      # no batch runs inside (memory release/resume)
    """

    def __init__(self, engine, *, wait_s: float = 0.005, max_requests: int = 0):
        self.engine, self.wait_s = engine, wait_s
        self.max_requests = max_requests or getattr(engine, "max_batch_size", 256)
        self.queue: list[_Job] = []
        self.in_flight: list[_Job] = []
        self.idle = asyncio.Lock()  # held while a batch runs
        self.stats = {"batches": 0, "requests": 0, "aborted": 0}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()

    @property
    def num_waiting(self) -> int:
        return sum(len(j.requests) for j in self.queue)

    @property
    def num_running(self) -> int:
        return sum(len(j.requests) for j in self.in_flight)

    @property
    def num_tokens(self) -> int:
        """Prompt and budgeted output tokens of every request held (SGLang's load counts its KV tokens)."""
        return sum(
            len(r.input_ids) + r.sampling.max_new_tokens for j in self.queue + self.in_flight for r in j.requests
        )

    def rids(self) -> set[str]:
        return {r.rid for j in self.queue + self.in_flight for r in j.requests}

    async def submit(self, requests: list[GenerateRequest], seed: int | None = None) -> list[GenerateOutput]:
        clash = self.rids() & {r.rid for r in requests}
        if clash or len({r.rid for r in requests}) < len(requests):
            raise EngineError(
                f"rid(s) {sorted(clash)[:5] or 'repeated within the call'} are already in flight; rids must be unique"
            )
        job = _Job(requests, seed, asyncio.get_running_loop().create_future())
        self.queue.append(job)
        self._wakeup.set()
        return await job.future

    def abort(self, rids: list[str] | None) -> int:
        """Abort the given rids (None: all). Returns how many requests were reached."""
        want = None if rids is None else set(rids)
        hit = 0
        for job in list(self.queue):
            mine = {r.rid for r in job.requests if want is None or r.rid in want}
            job.aborted |= mine
            hit += len(mine)
            if len(job.aborted) == len(job.requests):
                self.queue.remove(job)
                job.future.set_result([_aborted(r, self.engine.weight_version) for r in job.requests])
        running = [r.rid for j in self.in_flight for r in j.requests if want is None or r.rid in want]
        if running:
            self.engine.abort(running)  # by rid: engine.abort("all") would also hit the next batch
        self.stats["aborted"] += hit + len(running)
        return hit + len(running)

    async def _loop(self) -> None:
        while True:
            await self._wakeup.wait()
            if self.wait_s:
                await asyncio.sleep(self.wait_s)  # let concurrent requests join this batch
            async with self.idle:
                jobs = self._take()
                if not self.queue:
                    self._wakeup.clear()
                if not jobs:
                    continue
                self.in_flight = list(jobs)  # a job leaves it when answered
                answer = functools.partial(asyncio.get_running_loop().call_soon_threadsafe, self._answer)
                try:
                    results = await asyncio.to_thread(self._run, jobs, answer)
                finally:
                    self.in_flight = []
            for job, res in zip(jobs, results):
                _settle(job, res)

    def _answer(self, job: _Job, res) -> None:
        """A job whose requests are all done while its batch runs: answered now, no longer in flight (its rids may
        be sent again, an abort no longer reaches them)."""
        if job in self.in_flight:
            self.in_flight.remove(job)
        _settle(job, res)

    def _take(self) -> list[_Job]:
        """A seeded job runs alone (its seed then means what it means in-process); unseeded jobs share a batch."""
        if not self.queue:
            return []
        if self.queue[0].seed is not None:
            return [self.queue.pop(0)]
        jobs, n = [], 0
        while (
            self.queue
            and self.queue[0].seed is None
            and (not jobs or n + len(self.queue[0].requests) <= self.max_requests)
        ):
            job = self.queue.pop(0)
            jobs.append(job)
            n += len(job.requests)
        return jobs

    def _run(self, jobs: list[_Job], answer) -> list:
        """Worker thread: one engine.generate for all jobs, ``answer(job, outputs)`` as each job's requests are
        done; when that call fails, each job alone (errors stay with their job)."""
        try:
            return self._generate(jobs, answer)
        except EngineError as e:
            return [e] if len(jobs) == 1 else [self._one(j, answer) for j in jobs]
        except Exception as e:  # noqa: BLE001 - a crash must reach every waiting request, not kill the loop
            log.exception("generate failed")
            return [e] * len(jobs)

    def _one(self, job: _Job, answer):
        try:
            return self._generate([job], answer)[0]
        except Exception as e:  # noqa: BLE001
            return e

    def _generate(self, jobs: list[_Job], answer) -> list[list[GenerateOutput]]:
        live = [(j, r) for j in jobs for r in j.requests if r.rid not in j.aborted]
        outs: dict[str, GenerateOutput] = {}
        left = dict.fromkeys(map(id, jobs), 0)  # requests still running per job
        for j, _ in live:
            left[id(j)] += 1

        def results(job: _Job) -> list[GenerateOutput]:
            wv = self.engine.weight_version
            return [outs.get(r.rid) or _aborted(r, wv) for r in job.requests]

        def on_output(i: int, out: GenerateOutput) -> None:  # the engine's thread, as request i finishes
            job = live[i][0]
            outs[out.rid] = out
            left[id(job)] -= 1
            if not left[id(job)]:
                answer(job, results(job))

        if live:
            self.engine.generate([r for _, r in live], seed=jobs[0].seed, on_output=on_output)
        self.stats["batches"] += 1
        self.stats["requests"] += len(live)
        return [results(j) for j in jobs]


def _settle(job: _Job, res) -> None:
    """A job's answer: its outputs or its error; the first one given stands."""
    if job.future.done():
        return
    if isinstance(res, BaseException):
        job.future.set_exception(res)
    else:
        job.future.set_result(res)


def _aborted(r: GenerateRequest, weight_version: int) -> GenerateOutput:
    return GenerateOutput(
        rid=r.rid, output_ids=[], output_log_probs=[], finish_reason="abort", weight_version=weight_version
    )
