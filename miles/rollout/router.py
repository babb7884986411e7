"""The router: one engine interface over N HTTP engines. Generate requests go to the least-loaded live engine;
an engine that fails ``max_failures`` times in a row (requests or health checks) is marked dead and its work
retried elsewhere; a background health check restarts dead engines and pushes them the current weights before
they take traffic again. RolloutManager holds a Router when ``rollout.engine = "http"`` and ``num_engines > 1``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from miles.protocols.engine import GenerateOutput, GenerateRequest
from miles.rollout.sglang_client import EngineUnavailable, SGLangClient

log = logging.getLogger(__name__)


class NoEngineAlive(RuntimeError):
    """Every engine behind the router is dead."""


class Router:
    """router = Router(clients, restart=lambda i: procs[i].restart())   # restart returns the new URL
    router.start_health_checks(interval_s=1.0)
    outs = router.generate(requests, seed=3)        # split over live engines; a failed chunk is retried elsewhere
    outs = await router.agenerate(requests)         # the whole call to the least-loaded engine (serving path)
    router.offload(["kv_cache"]); router.update_weights_from_bucket(h, None); router.set_weight_version(4)
    router.close()
    """

    def __init__(
        self, clients: list[SGLangClient], *, restart: Callable[[int], str] | None = None, max_failures: int = 3
    ):
        self.clients = list(clients)
        self.restart, self.max_failures = restart, max_failures
        self.alive = [True] * len(clients)
        self.failures = [0] * len(clients)
        self.in_flight = [0] * len(clients)
        self.released: set[str] = (
            set()
        )  # tags released on every engine; a recovered engine is brought to the same state
        self.events: list[tuple[float, str, int]] = []  # (time, "dead" | "recovered", engine index)
        self._lock = threading.Lock()  # alive / failures / in_flight
        self._control = threading.RLock()  # control calls and recovery never interleave
        self._sync_open = False  # between the first weight bucket and set_weight_version
        self._group: str | None = None  # the broadcast weight update group the members below joined
        self._group_members: list[int] = []
        self._joining: list[int] | None = None  # the servers group_ranks counted, for the init that follows it
        self._next = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- engine choice and failure accounting ---------------------------------------------------------------
    def live(self) -> list[int]:
        with self._lock:
            return [i for i, a in enumerate(self.alive) if a]

    def _pick(self, exclude: set[int], num_requests: int = 0) -> int:
        """The least-loaded live engine not in ``exclude``; its in-flight count grows by ``num_requests`` at once."""
        with self._lock:
            cands = [i for i, a in enumerate(self.alive) if a and i not in exclude]
            if not cands:
                dead = [i for i, a in enumerate(self.alive) if not a]
                raise NoEngineAlive(
                    f"no live engine to take the request (dead: {dead}, tried: {sorted(exclude)}); "
                    "check the engine logs"
                )
            n = len(self.clients)
            i = min(cands, key=lambda c: (self.in_flight[c], (c - self._next) % n))
            self._next = (i + 1) % n
            self.in_flight[i] += num_requests
            return i

    def _failed(self, i: int, err: Exception) -> None:
        with self._lock:
            self.failures[i] += 1
            if self.alive[i] and self.failures[i] >= self.max_failures:
                self.alive[i] = False
                self.events.append((time.time(), "dead", i))
                log.warning(
                    "engine %d (%s) marked dead after %d failures: %s", i, self.clients[i].url, self.failures[i], err
                )

    def _succeeded(self, i: int) -> None:
        with self._lock:
            self.failures[i] = 0

    # ---- generation ---------------------------------------------------------------------------------------
    def generate(self, requests: list[GenerateRequest], *, seed: int | None = None) -> list[GenerateOutput]:
        """Contiguous chunks, one per live engine, in parallel; a chunk whose engine fails goes to another one."""
        if not requests:
            return []
        live = self.live() or [self._pick(set())]
        per = -(-len(requests) // len(live))
        chunks = [requests[k : k + per] for k in range(0, len(requests), per)]
        with ThreadPoolExecutor(len(chunks)) as pool:
            parts = list(pool.map(lambda c: self._send(c, seed), chunks))
        return [o for part in parts for o in part]

    def _send(self, requests: list[GenerateRequest], seed: int | None) -> list[GenerateOutput]:
        tried: set[int] = set()
        while True:
            i = self._pick(tried, len(requests))
            try:
                out = self.clients[i].generate(requests, seed=seed)
                self._succeeded(i)
                return out
            except EngineUnavailable as e:
                self._failed(i, e)
                tried.add(i)
            finally:
                with self._lock:
                    self.in_flight[i] -= len(requests)

    async def agenerate(self, requests: list[GenerateRequest], *, seed: int | None = None) -> list[GenerateOutput]:
        tried: set[int] = set()
        while True:
            i = self._pick(tried, len(requests))
            try:
                out = await self.clients[i].agenerate(requests, seed=seed)
                self._succeeded(i)
                return out
            except EngineUnavailable as e:
                self._failed(i, e)
                tried.add(i)
            finally:
                with self._lock:
                    self.in_flight[i] -= len(requests)

    async def aclose(self) -> None:
        for c in self.clients:
            await c.aclose()

    # ---- control calls: every live engine ---------------------------------------------------------------------
    def _each(self, method: str, *args):
        out = []
        with self._control:
            for i in self.live():
                try:
                    out.append(getattr(self.clients[i], method)(*args))
                    self._succeeded(i)
                except EngineUnavailable as e:  # a dead engine is brought up to date when it recovers
                    self._failed(i, e)
                    log.warning("engine %d: %s failed: %s", i, method, e)
        return out

    def offload(self, tags: Iterable[str]) -> int:
        tags = list(tags)
        with self._control:
            self.released |= set(tags)
            return sum(self._each("offload", tags))

    def onload(self, tags: Iterable[str]) -> int:
        tags = list(tags)
        with self._control:
            self.released -= set(tags)
            return sum(self._each("onload", tags))

    def update_weights_from_bucket(self, handle, version: int | None = None) -> None:
        with self._control:
            self._sync_open = version is None
            self._each("update_weights_from_bucket", handle, version)

    def update_weights_from_tensor(self, named_tensors, version: int | None = None) -> None:
        named = list(named_tensors)
        with self._control:
            self._sync_open = version is None
            self._each("update_weights_from_tensor", named, version)

    def begin_weight_update(self, manifest) -> None:
        with self._control:
            self._sync_open = True
            self._each("begin_weight_update", manifest)

    def abort_weight_update(self) -> None:
        with self._control:
            self._each("abort_weight_update")
            self._sync_open = False

    def update_weights_from_disk(self, path: str, version: int | None = None) -> None:
        self._each("update_weights_from_disk", path, version)

    def set_weight_version(self, version: int) -> None:
        with self._control:
            self._each("set_weight_version", version)
            self._sync_open = False

    def pause_generation(self, mode: str = "in_place") -> None:
        self._each("pause_generation", mode)

    def continue_generation(self) -> None:
        self._each("continue_generation")

    def flush_cache(self) -> None:
        self._each("flush_cache")

    def abort(self, rids="all") -> None:
        self._each("abort", rids)

    # ---- broadcast weight sync: every live server joins one group, ranks side by side --------------------------
    def group_ranks(self) -> int:
        """The ranks of the servers that will join: the live ones that answer /health now (the next
        init_weights_update_group takes exactly these)."""
        with self._control:
            self._joining = [i for i in self.live() if self._answers(i)]
            return sum(self.clients[i].group_ranks() for i in self._joining)

    def init_weights_update_group(
        self, master_address, master_port, rank_offset, world_size, group_name, backend="gloo"
    ) -> None:
        """Every live server joins at once (a join blocks until the whole group has formed), server ``k`` from rank
        ``rank_offset`` + the ranks of the servers before it."""
        with self._control:
            members = self.live() if self._joining is None else self._joining
            offset, calls, self._joining = rank_offset, [], None
            for i in members:
                args = (master_address, master_port, offset, world_size, group_name, backend)
                calls.append((i, "init_weights_update_group", args))
                offset += self.clients[i].group_ranks()
            self._at_once(calls)
            self._group, self._group_members = group_name, members

    def update_weights_from_distributed(
        self, names, dtypes, shapes, group_name, version=None, load_format=None
    ) -> None:
        """Every member receives the same broadcast, so all are called at once."""
        with self._control:
            self._sync_open = version is None
            args = (names, dtypes, shapes, group_name, version, load_format)
            self._at_once([(i, "update_weights_from_distributed", args) for i in self._group_members])

    def destroy_weights_update_group(self, group_name) -> None:
        with self._control:
            members = [i for i in self._group_members if self.alive[i]] if self._group == group_name else []
            self._group, self._group_members = None, []
            for i in members:
                try:
                    self.clients[i].destroy_weights_update_group(group_name)
                except EngineUnavailable as e:
                    log.warning("engine %d: leaving weight update group %s failed: %s", i, group_name, e)

    def broadcast_formats(self) -> tuple[str, ...]:
        """The broadcast formats every live server takes, in the first one's order of preference."""
        each = [self.clients[i].broadcast_formats() for i in self.live()]
        return tuple(f for f in each[0] if all(f in e for e in each[1:])) if each else ("per_tensor",)

    def in_weights_group(self, group_name: str) -> bool:
        """False once a member died or was restarted, or a server came back that is not a member: the sync forms
        the group again over the live servers."""
        with self._control:
            if self._group != group_name or self._group_members != self.live():
                return False
            return all(self.clients[i].in_weights_group(group_name) and self._answers(i) for i in self._group_members)

    def _answers(self, i: int) -> bool:
        """/health answers; a failure counts toward marking the engine dead (a broadcast to a dead member fails)."""
        if self.clients[i].healthy():
            return True
        self._failed(i, EngineUnavailable(f"{self.clients[i].url}/health did not answer"))
        return False

    def _at_once(self, calls: list[tuple[int, str, tuple]]) -> None:
        """``calls`` (engine, method, args) in parallel threads: calls that block on one another (a group's
        rendezvous, a broadcast) cannot go one by one. Raises after all finished, naming every failure."""

        def one(call):
            i, method, args = call
            try:
                getattr(self.clients[i], method)(*args)
                self._succeeded(i)
            except EngineUnavailable as e:
                self._failed(i, e)
                return f"engine {i} ({self.clients[i].url}): {e}"
            return ""

        with ThreadPoolExecutor(max(len(calls), 1)) as pool:
            errors = [e for e in pool.map(one, calls) if e]
        if errors:
            raise EngineUnavailable(
                f"{calls[0][1]} failed on {len(errors)} of {len(calls)} engines: {'; '.join(errors)}"
            )

    def _ask_live(self, read: Callable[[SGLangClient], object]):
        """``read`` on the first live engine that answers; one that fails (killed, not yet marked dead) counts a
        failure and the next live one is asked."""
        errors = []
        for i in self.live():
            try:
                out = read(self.clients[i])
                self._succeeded(i)
                return out
            except EngineUnavailable as e:
                self._failed(i, e)
                errors.append(f"engine {i}: {e}")
        raise NoEngineAlive(f"no engine behind the router answered ({'; '.join(errors) or 'all dead'})")

    @property
    def weight_version(self) -> int:
        return self._ask_live(lambda c: c.weight_version)

    def named_weights(self):
        return self._ask_live(lambda c: c.named_weights())

    # ---- health and recovery ------------------------------------------------------------------------------
    def start_health_checks(self, interval_s: float = 1.0) -> None:
        self._thread = threading.Thread(target=self._health_loop, args=(interval_s,), daemon=True, name="router-health")
        self._thread.start()

    def _health_loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.check_health()

    def check_health(self) -> None:
        """One round: probe live engines, try to recover dead ones."""
        for i, c in enumerate(list(self.clients)):
            if self._stop.is_set():
                return
            if self.alive[i]:
                if c.healthy():
                    self._succeeded(i)
                else:
                    self._failed(i, EngineUnavailable(f"{c.url}/health did not answer"))
            elif self.restart is not None:
                try:
                    self.recover(i)
                except Exception as e:  # noqa: BLE001 - keep checking the others; retried next round
                    log.warning("engine %d: recovery failed (%s); retrying", i, e)

    def recover(self, i: int) -> None:
        """Restart engine ``i``, give it a live peer's weights and version and the fleet's memory state, then route to it."""
        with self._control:
            if self.alive[i] or self._sync_open:
                return  # mid-sync: the peers hold half-updated weights; try next round
            old = self.clients[i]
            url = self.restart(i)
            new = SGLangClient(
                url,
                flavor=old.flavor,
                timeout_s=old.timeout_s,
                ledger=old.ledger,
                process=old.process,
                api_key=old.api_key,
                vocab_size=old.vocab_size,
            )
            old.http.close()
            peers = [j for j in self.live() if j != i]
            if peers:
                peer = self.clients[peers[0]]
                if "weights" not in self.released:
                    new.update_weights_from_tensor(peer.named_weights().items(), peer.weight_version)
                else:  # the next sync writes every engine's weights; the version comes with it
                    new.set_weight_version(peer.weight_version)
            if self.released:
                new.offload(sorted(self.released))
            self.clients[i] = new
            with self._lock:
                self.alive[i], self.failures[i] = True, 0
                self.events.append((time.time(), "recovered", i))
            log.warning("engine %d recovered at %s", i, url)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for c in self.clients:
            c.close()
