"""A server's torch.distributed weight-group calls (join, receive a broadcast, leave), kept off the thread pool
that generation runs on.

A join blocks until every rank reaches the rendezvous and a receive until rank 0 broadcasts. On the shared
``asyncio.to_thread`` pool a few joins to a dead address (each waiting out torch's 300 s store timeout) once took
every worker and stopped ``/generate`` for ten minutes. Here joins run one at a time on an executor of their own,
bounded by a short connect timeout, and a second join while one is pending is refused at once (409).

    calls = GroupCalls(engine, connect_timeout_s=30)
    await calls.join(address, port, rank_offset, world_size, group_name, backend)   # GroupJoinPending: 409
    await calls.receive(names, dtypes, shapes, group_name, version)
    await calls.leave(group_name)
    calls.close()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time


class GroupJoinPending(RuntimeError):
    """A join is already in progress; the caller should retry when it has finished (HTTP 409)."""


class GroupJoinFailed(ValueError):
    """The rendezvous was not reached in time: the address, the port or rank 0 is at fault (HTTP 400)."""


class GroupCalls:
    def __init__(self, engine, *, connect_timeout_s: float = 30.0):
        self.engine, self.connect_timeout_s = engine, connect_timeout_s
        self.pending: dict | None = None  # the join in progress: group_name, address, since
        self._join_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="group-join")
        self._receive_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="group-receive")

    def pending_status(self) -> dict | None:
        if self.pending is None:
            return None
        p = self.pending
        return {"group_name": p["group_name"], "address": p["address"], "seconds": time.monotonic() - p["since"]}

    async def join(self, address: str, port: int, rank: int, world_size: int, group_name: str, backend: str) -> None:
        if self.pending is not None:  # checked and set without an await between: one event loop, no race
            p = self.pending
            raise GroupJoinPending(
                f"a join of group {p['group_name']!r} at {p['address']} is still pending "
                f"({time.monotonic() - p['since']:.0f} s of at most {self.connect_timeout_s:.0f} s); "
                "retry when it has finished"
            )
        self.pending = {"group_name": group_name, "address": f"{address}:{port}", "since": time.monotonic()}
        args = (address, port, rank, world_size, group_name, backend, self.connect_timeout_s)
        try:
            await self._on(self._join_pool, self.engine.init_weights_update_group, *args)
        except (RuntimeError, OSError) as err:  # torch's DistStoreError / DistNetworkError: nobody there in time
            raise GroupJoinFailed(
                f"could not join group {group_name!r} at {address}:{port} within {self.connect_timeout_s:.0f} s "
                f"({str(err).splitlines()[0][:200]}); check master_address / master_port and that rank 0 joins"
            ) from None
        finally:
            self.pending = None

    async def receive(self, names, dtypes, shapes, group_name: str, version: int | None) -> None:
        fn = self.engine.update_weights_from_distributed
        await self._on(self._receive_pool, fn, names, dtypes, shapes, group_name, version)

    async def leave(self, group_name: str) -> None:
        await self._on(self._receive_pool, self.engine.destroy_weights_update_group, group_name)

    def close(self) -> None:
        self._join_pool.shutdown(wait=False, cancel_futures=True)
        self._receive_pool.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    async def _on(pool: concurrent.futures.Executor, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)
