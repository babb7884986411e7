"""The rollouts in flight while the trainer trains: up to ``async.max_staleness`` RL steps ahead (miles.async_config).

The driver asks the window for each step's rollout; the window starts every rollout admission allows
(miles.group_buffer: step ``t`` once the engines hold version ``t - max_staleness``; here a step's groups start
together, one generate call per step) and waits for the one asked for. Before each weight sync the driver tells it
so (``before_sync``); when the driver asks for step ``s`` the engines hold version ``s``.

- ``max_staleness = 0``: step ``s``'s rollout starts and is waited for before step ``s`` trains, the synchronous
  loop's calls in its order.
- ``max_staleness = k``, no partial rollouts: version ``s + 1`` reaches the engines only after every rollout started
  under an older one has finished, so step ``t`` is sampled under version ``max(first_step, t - k)`` exactly,
  whatever the timings; the run is deterministic for a seed, and each step trains while the next ones generate.
- ``async.partial_rollout``: ``before_sync`` does not wait; version ``s + 1`` lands between two decode steps of
  the rollouts generating (miles.cluster runs them in their own concurrency group of the rollout actor), their rows
  continue under it with the KV kept or recomputed (``async.kv_on_update``), and every token carries its version.
  Step ``t`` starts under ``v >= t - k`` and versions only increase, so the bound holds; where an update lands
  depends on timing, so such a run is not deterministic for a seed. Ray only (miles.colocated refuses it).

    window = RolloutWindow(cluster, cfg, first_step)
    for step in range(first_step, cfg.num_steps):
        batches, rollout = window.take(step)       # the manager's metrics, async/* included
        ...train step...
        window.before_sync()
        cluster.execute(plan.train_to_rollout, version=step + 1)
"""

from __future__ import annotations

import time

from miles.group_buffer import GroupBuffer


class RolloutWindow:
    def __init__(self, cluster, cfg, first_step: int):
        """``cluster``: what the loop runs on (``submit_generate(step)`` -> a handle, ``collect(handle, step)`` ->
        (batches, metrics)); the plan's init sync has given the engines version ``first_step``."""
        a = cfg.async_
        self.c, self.last = cluster, cfg.num_steps - 1
        self.partial = a.partial_rollout
        self.buffer = GroupBuffer(a.max_staleness, groups_per_step=1, first_step=first_step)
        self.version = first_step  # the engines' version
        self.pending: dict[int, object] = {}  # step -> its rollout in flight
        self.done: dict[int, tuple] = {}  # step -> (batches, metrics), collected before a sync

    def take(self, step: int) -> tuple[list, dict]:
        """Step ``step``'s rollout (batches, metrics), once started the rollouts admission allows. The engines hold
        version ``step`` now (the loop synced it after training step ``step - 1``)."""
        self.version = step
        self._start()
        t0 = time.perf_counter()
        batches, metrics = self.done.pop(step) if step in self.done else self._collect(step, untrained=step)
        versions = [int(metrics["async/version_min"]), int(metrics["async/version_max"])]
        self.buffer.finish(step, 0, [versions])
        self.buffer.take(step)  # raises if a sample were staler than the bound
        return batches, metrics | {"async/wait_s": time.perf_counter() - t0, "async/steps_ahead": len(self.pending)}

    def before_sync(self) -> None:
        """The next version lands only once no rollout is generating: each step is sampled under one version.
        With partial rollouts it lands while they generate (between two decode steps): a step started under
        version ``v >= t - max_staleness`` only gets newer tokens, and ``take`` checks every sample's bound."""
        if self.partial:
            return
        for step in sorted(self.pending):
            self.done[step] = self._collect(step, untrained=self.version + 1)  # step self.version is trained

    def _start(self) -> None:
        for step, group in self.buffer.admissible(self.version):
            if step > self.last:
                break
            self.buffer.start(step, group, self.version)
            self.pending[step] = self.c.submit_generate(step)

    def _collect(self, step: int, untrained: int) -> tuple:
        return self.c.collect(self.pending.pop(step), step, untrained)
