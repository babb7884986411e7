"""Broadcast weight sync over several servers: the rank each server takes (SGLang's tensor-parallel workers one
each), all joins at once, and a group that lost a member reported as such. The whole path over real `miles serve`
processes, a server killed and the group formed again, is tests/rollout/test_sglang_engine_loop.py."""

from __future__ import annotations

import threading

import httpx
import pytest

from miles.rollout.router import Router
from miles.rollout.sglang_client import EngineUnavailable, SGLangClient


class Server:
    """A recording stand-in for one server's client: its ranks, its health, the group calls it got."""

    def __init__(self, url: str, ranks: int, barrier: threading.Barrier | None = None):
        self.url, self.ranks, self.barrier = url, ranks, barrier
        self.up, self.joined, self.received = True, [], 0
        self.groups: set[str] = set()

    def healthy(self, timeout_s: float = 2.0) -> bool:
        return self.up

    def group_ranks(self) -> int:
        return self.ranks

    def init_weights_update_group(self, addr, port, rank_offset, world_size, group_name, backend="gloo"):
        if not self.up:
            raise EngineUnavailable(f"{self.url}: connection refused")
        if self.barrier is not None:
            self.barrier.wait(timeout=5)  # a real join returns only when every rank joined
        self.joined.append((rank_offset, world_size))
        self.groups.add(group_name)

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name, version=None, load_format=None):
        if self.barrier is not None:
            self.barrier.wait(timeout=5)
        self.received += 1

    def destroy_weights_update_group(self, group_name):
        self.groups.discard(group_name)

    def in_weights_group(self, group_name: str) -> bool:
        return group_name in self.groups

    def close(self):
        pass


def _form(router: Router, name: str = "g") -> int:
    """What BroadcastSync does with one router: count its ranks, then every server joins after rank 0."""
    world = 1 + router.group_ranks()
    router.init_weights_update_group("127.0.0.1", 1234, 1, world, name)
    return world


def test_each_server_takes_its_tensor_parallel_ranks_side_by_side_after_rank_0():
    servers = [Server("a", 2), Server("b", 1), Server("c", 4)]
    router = Router(servers)
    assert _form(router) == 8
    assert [s.joined for s in servers] == [[(1, 8)], [(3, 8)], [(4, 8)]]
    assert router.in_weights_group("g") and not router.in_weights_group("other")


def test_joins_and_receives_happen_at_once_since_each_blocks_until_all_arrive():
    barrier = threading.Barrier(3)  # one call per server, as a rendezvous or a broadcast needs
    servers = [Server(u, 1, barrier) for u in "abc"]
    router = Router(servers)
    _form(router)  # one after another, the first join would wait on the barrier until it broke
    router.update_weights_from_distributed(["w"], ["float32"], [[2]], "g", None)
    assert [s.received for s in servers] == [1, 1, 1]


def test_a_server_that_does_not_answer_is_left_out_of_the_group_and_counted_as_a_failure():
    servers = [Server("a", 1), Server("b", 2), Server("c", 1)]
    servers[1].up = False
    router = Router(servers)
    assert _form(router) == 3
    assert servers[0].joined == [(1, 3)] and servers[1].joined == [] and servers[2].joined == [(2, 3)]
    assert router.failures[1] == 1
    assert not router.in_weights_group("g")  # b is still live but not a member: the sync forms the group again


def test_a_member_that_died_or_came_back_restarted_breaks_the_group():
    servers = [Server("a", 1), Server("b", 1)]
    router = Router(servers)
    _form(router)
    assert router.in_weights_group("g")
    servers[0].up = False  # died: /health no longer answers
    assert not router.in_weights_group("g")
    servers[0].up = True
    router.clients[0] = Server("a2", 1)  # recovered as a new server, which joined nothing
    assert not router.in_weights_group("g")
    _form(router, "g2")
    assert router.in_weights_group("g2")


def test_a_failed_join_names_every_server_that_failed():
    servers = [Server("a", 1), Server("b", 1)]
    router = Router(servers)
    world = 1 + router.group_ranks()
    servers[1].up = False  # died between counting and joining
    with pytest.raises(EngineUnavailable, match=r"init_weights_update_group failed on 1 of 2 engines: engine 1 \(b\)"):
        router.init_weights_update_group("127.0.0.1", 1234, 1, world, "g")


@pytest.mark.parametrize("flavor, info, ranks", [("sglang", {"tp_size": 4}, 4), ("sglang", {}, 1), ("miles", {}, 1)])
def test_a_client_counts_a_real_sglang_servers_tp_workers_and_one_rank_for_miles_serve(flavor, info, ranks):
    asked = []

    def answer(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        return httpx.Response(200, json={"model_path": "m", **info})

    client = SGLangClient("http://127.0.0.1:1", flavor=flavor)
    client.http = httpx.Client(base_url=client.url, transport=httpx.MockTransport(answer))
    assert client.group_ranks() == ranks
    assert asked == (["/server_info"] if flavor == "sglang" else [])  # SGLang 0.5.10: /get_server_info deprecated
