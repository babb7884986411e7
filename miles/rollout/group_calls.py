"""A server's torch.distributed weight-group calls (join, receive a broadcast, leave), kept off the thread pool
that generation runs on.

A join blocks until every rank reaches the rendezvous and a receive until rank 0 broadcasts. On the shared
``asyncio.to_thread`` pool a few joins to a dead address (each waiting out torch's 300 s store timeout) once took
every worker and stopped ``/generate`` for ten minutes. Here joins run one at a time on a thread of their own and a
second join while one is pending is refused at once (409).

The answer comes within ``connect_timeout_s``, as the 409 says: torch's store client does not keep to its own
timeout (an unreachable address retries past it: 48 s for a 30 s bound in the 2026-12-04 review; an address that
accepts and never answers holds it forever), so the join is answered at the bound and its thread is abandoned. An abandoned join that
succeeds later leaves the group at once; while MAX_ABANDONED of them are still stuck in torch, joins are refused.

    calls = GroupCalls(engine, connect_timeout_s=30)
    await calls.join(address, port, rank_offset, world_size, group_name, backend)   # GroupJoinPending: 409
    await calls.receive(names, dtypes, shapes, group_name, version)
    await calls.leave(group_name)
    calls.close()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time


class GroupJoinPending(RuntimeError):
    """A join is already in progress; the caller should retry when it has finished (HTTP 409)."""


class GroupJoinFailed(ValueError):
    """The rendezvous was not reached in time: the address, the port or rank 0 is at fault (HTTP 400)."""


MAX_ABANDONED = 4  # joins left running past their bound (each holds a thread and a socket) before joins are refused


class GroupCalls:
    def __init__(self, engine, *, connect_timeout_s: float = 30.0):
        self.engine, self.connect_timeout_s = engine, connect_timeout_s
        self.pending: dict | None = None  # the join in progress: group_name, address, since
        self.abandoned: set[concurrent.futures.Future] = set()  # joins answered at the bound, still inside torch
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
        if len(self.abandoned) >= MAX_ABANDONED:
            raise GroupJoinPending(
                f"{len(self.abandoned)} earlier joins passed their {self.connect_timeout_s:.0f} s bound and are still "
                "waiting inside torch's store client; retry later, or restart this server"
            )
        self.pending = {"group_name": group_name, "address": f"{address}:{port}", "since": time.monotonic()}
        args = (address, port, rank, world_size, group_name, backend, self.connect_timeout_s)
        done = _in_thread(self.engine.init_weights_update_group, *args)
        joined = asyncio.wrap_future(done)
        try:
            await asyncio.wait_for(asyncio.shield(joined), self.connect_timeout_s)
        except TimeoutError:
            joined.add_done_callback(lambda f: f.cancelled() or f.exception())  # its late error was answered already
            self._abandon(done, group_name)
            raise GroupJoinFailed(
                f"could not join group {group_name!r} at {address}:{port} within {self.connect_timeout_s:.0f} s "
                "(no rendezvous: nothing answered as a torch.distributed store there); check master_address / "
                "master_port and that rank 0 joins"
            ) from None
        except (RuntimeError, OSError) as err:  # torch's DistStoreError / DistNetworkError: nobody there in time
            raise GroupJoinFailed(
                f"could not join group {group_name!r} at {address}:{port} within {self.connect_timeout_s:.0f} s "
                f"({str(err).splitlines()[0][:200]}); check master_address / master_port and that rank 0 joins"
            ) from None
        finally:
            self.pending = None

    def _abandon(self, done: concurrent.futures.Future, group_name: str) -> None:
        """The caller was told the join failed: a late success must not leave this engine in that group."""
        self.abandoned.add(done)

        def finished(f: concurrent.futures.Future) -> None:
            self.abandoned.discard(f)
            if f.exception() is None:
                self.engine.destroy_weights_update_group(group_name)

        done.add_done_callback(finished)

    async def receive(
        self, names, dtypes, shapes, group_name: str, version: int | None, load_format: str | None = None
    ) -> None:
        fn = self.engine.update_weights_from_distributed
        await self._on(self._receive_pool, fn, names, dtypes, shapes, group_name, version, load_format)

    async def leave(self, group_name: str) -> None:
        await self._on(self._receive_pool, self.engine.destroy_weights_update_group, group_name)

    def close(self) -> None:
        self._receive_pool.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    async def _on(pool: concurrent.futures.Executor, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)


def _in_thread(fn, *args) -> concurrent.futures.Future:
    """``fn(*args)`` on a daemon thread of its own: a join stuck in torch forever must not hold up the process's exit
    (a ThreadPoolExecutor's workers are joined at exit)."""
    done: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            done.set_result(fn(*args))
        except BaseException as e:  # handed to the caller
            done.set_exception(e)

    threading.Thread(target=run, name="group-join", daemon=True).start()
    return done
