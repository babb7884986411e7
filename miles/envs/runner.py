"""Many episodes driven in lockstep through the engines: per turn one batched ``generate`` over every live episode
(split over the engines as the task source splits prompts), then every environment's step at once, each bounded.

Any engine of the Engine protocol serves: the embedded engine, ``miles serve`` over HTTP and SGLang (their
clients), a Router over several. ``flush()`` from another thread aborts the requests in flight (``engine.abort``)
and ends every running episode as ``aborted``, counted in the metrics, as the agent rollouts' flush does.

    runner = EpisodeRunner(engines, stop_token_ids, step_timeout_s=10.0)
    seconds = runner.run(episodes, sampling, seed=7, tag="s3")   # every episode over, each with a status
    runner.flush()                                              # from another thread: abort what is in flight
"""

from __future__ import annotations

import threading
import time

from miles.envs.episode import Episode, bounded_all
from miles.protocols.engine import GenerateOutput, SamplingParams


class EpisodeRunner:
    def __init__(self, engines: list, *, step_timeout_s: float):
        self.engines, self.step_timeout_s = engines, step_timeout_s
        self._lock = threading.Lock()
        self._inflight: list[str] = []
        self._episodes: list[Episode] = []
        self._flushed = False
        self.num_flushes = 0

    def run(self, episodes: list[Episode], sampling: SamplingParams, *, seed: int, tag: str) -> dict[str, float]:
        """Every episode from reset to its end; returns the seconds spent generating and in the environments."""
        with self._lock:
            self._episodes, self._flushed = list(episodes), False
        t_gen = t_env = 0.0
        t0 = time.perf_counter()
        for ep, result in zip(
            episodes, bounded_all([ep.reset_call() for ep in episodes], self.step_timeout_s, what="reset")
        ):
            ep.opened(result)
        t_env += time.perf_counter() - t0
        for turn in range(10**6):  # bounded by env.max_turns and the token budget
            live = [(ep, ep.request(sampling, f"{tag}-{ep.index}-t{turn}")) for ep in episodes]
            live = [(ep, r) for ep, r in live if r is not None]
            if not live:
                break
            t0 = time.perf_counter()
            outs = self._generate([r for _, r in live], seed * 1_000_003 + turn)
            t_gen += time.perf_counter() - t0
            for (ep, _), out in zip(live, outs, strict=True):
                ep.absorb(out)
            t0 = time.perf_counter()
            stepping = [ep for ep, _ in live if ep.pending is not None]
            for ep, result in zip(stepping, bounded_all([ep.step_call() for ep in stepping], self.step_timeout_s)):
                ep.finish_step(result)
            t_env += time.perf_counter() - t0
        for ep in episodes:  # a flush between turns leaves episodes that never got their next request
            ep.abort()
        with self._lock:
            self._episodes = []
        return {"time/generate": t_gen, "time/env": t_env}

    def _generate(self, requests: list, seed: int) -> list:
        with self._lock:
            if self._flushed:
                return [_aborted(r) for r in requests]
            self._inflight = [r.rid for r in requests]
        try:
            outs, per = [], -(-len(requests) // len(self.engines))
            for i, engine in enumerate(self.engines):
                part = requests[i * per : (i + 1) * per]
                if part:
                    outs += engine.generate(part, seed=seed)
            return outs
        finally:
            with self._lock:
                self._inflight = []

    def flush(self) -> int:
        """Abort the requests in flight and end every running episode as aborted; returns how many were running."""
        with self._lock:
            self._flushed = True
            rids, running = list(self._inflight), [ep for ep in self._episodes if ep.running]
            self.num_flushes += 1
        if rids:
            for engine in self.engines:
                engine.abort(rids)
        return len(running)


def _aborted(request) -> GenerateOutput:
    return GenerateOutput(rid=request.rid, output_ids=[], output_log_probs=[], finish_reason="abort", weight_version=0)
