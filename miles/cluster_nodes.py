"""A run's actors on the nodes of a Ray cluster, the Ray side of miles.placement: the options that put the rollout
manager on its node, the engine hosts on theirs, the checks once everything is placed (the weight sync reaches
every engine; every node sees run_dir), the placement record (``run_dir/placement.jsonl``), and a lost node named
with what ran on it.

    options = rollout_scheduling(cfg, pg)                 # on the trainer's bundle 0, or pinned (cluster.rollout_node)
    hosts = start_engine_hosts(cfg, device, env)          # EngineHost actors, [] without cluster.engine_nodes
    places = Placement.read(cfg, trainer, rollout, hosts) # where every actor runs (asks each one)
    places.check(cfg)                                     # before the model is built: sync reach, shared run_dir
    places.rows()                                         # one placement.jsonl row per actor
    places.lost(exc)                                      # NodeLostError naming the node and its actors, or None
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from dataclasses import asdict, dataclass

from miles.http_guard import API_KEY_ENV
from miles.nodes import NodeInfo, check_shared_dir, lost_nodes, this_node, unreachable_nodes
from miles.placement import pin_options, same_host_refusal
from miles.sglang_flags import STANDIN
from miles.threads import actor_options

log = logging.getLogger("miles")
LOST_WAIT_S = 60.0  # after an actor died: how long the cluster may take to declare its node dead (health checks)


def rollout_scheduling(cfg, pg) -> dict:
    """Ray options placing the rollout manager: pinned by cluster.rollout_node, else on the trainer's bundle 0
    (sharing rank 0's device, as the colocated handoff expects)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if cfg.cluster.rollout_node:
        return pin_options(cfg.cluster.rollout_node)
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)}


def engine_api_key(cfg) -> str:
    """The key the hosted engine servers require and the rollout manager's clients send: an --api-key given in
    rollout.sglang_args, else $MILES_API_KEY, else a fresh one for this run (never written to the run directory)."""
    from miles.sglang_flags import parse_flags

    given = parse_flags(cfg.rollout.sglang_args).get("--api-key") if cfg.rollout.engine == "sglang" else None
    return given or os.environ.get(API_KEY_ENV) or secrets.token_urlsafe(32)


def start_engine_hosts(cfg, device: str, env: dict) -> list:
    """One EngineHost per engine, pinned to its node (cluster.engine_nodes); their servers start when the rollout
    manager asks (miles.rollout.engine_host.hosted_engines). Engine i takes the GPUs of its place among the engines
    pinned to the same node."""
    import ray

    from miles.rollout.engine_host import EngineHost

    hosts, seen = [], {}
    for i, pin in enumerate(cfg.cluster.engine_nodes):
        local = seen[pin] = seen.get(pin, -1) + 1
        opts = {"num_cpus": 0.01, **pin_options(pin), **actor_options(1, env)}
        hosts.append(ray.remote(EngineHost).options(**opts).remote(cfg, i, local, device))
    return hosts


class NodeLostError(RuntimeError):
    """A node of the run left the Ray cluster mid-run; the message names it and what ran there."""


@dataclass(frozen=True, slots=True)
class Place:
    owner: str  # "trainer/0", "rollout", "engine/1"
    pin: str  # the Ray resource that placed it ("" = Ray's choice)
    node: NodeInfo
    rendezvous: str = ""  # trainer ranks: the "addr:port" each joined its world at
    url: str = ""  # engines started by an EngineHost: the server's address (bound to its node's)


class Placement:
    """Where a run's actors are: read once they have started, checked, recorded, and consulted when one dies."""

    def __init__(self, places: list[Place]):
        self.places = places

    @classmethod
    def read(cls, cfg, trainer, rollout, hosts: list) -> Placement:
        """Ask each actor for its node: the trainer's ranks (already rendezvoused), the rollout manager, the engine
        hosts; engines the manager holds itself are on its node."""
        import ray

        c = cfg.cluster
        pins = c.trainer_nodes or ("",) * len(trainer.actors)
        places = [
            Place(f"trainer/{r}", pin, node, at)
            for r, (pin, node, at) in enumerate(zip(pins, trainer.nodes, trainer.rendezvous))
        ]
        manager = ray.get(rollout.node.remote())
        places.append(Place("rollout", c.rollout_node, manager))
        host_nodes = ray.get([h.node.remote() for h in hosts])
        urls = ray.get([h.url.remote() for h in hosts])
        for i in range(cfg.rollout.num_engines):
            if hosts:
                places.append(Place(f"engine/{i}", c.engine_nodes[i], host_nodes[i], url=urls[i]))
            else:  # in the manager's process, or servers it started beside itself
                places.append(Place(f"engine/{i}", c.rollout_node, manager))
        return cls(places)

    def node_of(self, owner: str) -> NodeInfo:
        return next(p.node for p in self.places if p.owner == owner)

    def check(self, cfg) -> None:
        """Before the model is built: the weight sync reaches every engine from trainer rank 0's host, and every
        node but the driver's sees run_dir (when the run has one open: miles.nodes.check_shared_dir)."""
        src = self.node_of("trainer/0")
        r = cfg.rollout
        opens = ("engine/", "rollout") if r.engine == "sglang" and r.sglang_launcher != STANDIN else ("engine/",)
        receivers = [(p.owner.replace("/", " "), p.node.node_id, p.node.node_ip) for p in self.places]
        receivers = [x for x, p in zip(receivers, self.places) if p.owner.startswith(opens)]  # who opens the buckets
        if why := same_host_refusal(cfg, src.node_ip, src.node_id, receivers):
            raise ValueError(why)
        here = this_node().node_id
        others = {p.node.node_id: p.node.node_ip for p in self.places if p.node.node_id not in ("", here)}
        if others and os.path.isdir(cfg.run_dir):
            check_shared_dir(cfg.run_dir, others)

    def rows(self) -> list[dict]:
        extra = lambda p: {k: v for k, v in (("rendezvous", p.rendezvous), ("url", p.url)) if v}  # noqa: E731
        return [{"owner": p.owner, "pin": p.pin, **asdict(p.node), **extra(p)} for p in self.places]

    def describe(self) -> str:
        by_node: dict[str, list[str]] = {}
        for p in self.places:
            by_node.setdefault(p.node.node_ip or "this machine", []).append(p.owner)
        return "; ".join(f"{ip}: {', '.join(owners)}" for ip, owners in by_node.items())

    def lost(self, exc: BaseException, wait_s: float = LOST_WAIT_S) -> NodeLostError | None:
        """After ``exc`` from a call into the cluster: a NodeLostError naming the run's node(s) the cluster counts
        dead, or whose raylet no longer answers (then up to ``wait_s`` is given to the cluster's verdict, which its
        health checks take seconds to reach); None when every node of the run is there."""
        ids = [p.node.node_id for p in self.places if p.node.node_id]
        if not ids:
            return None
        gone = lost_nodes(ids)
        suspects = {} if gone else unreachable_nodes(ids)
        deadline = time.monotonic() + wait_s
        while suspects and not gone and time.monotonic() < deadline:
            time.sleep(1.0)
            gone = lost_nodes(suspects)
        gone = gone or suspects  # a raylet silent for the whole wait is as good as gone
        if not gone:
            return None
        lines = [
            f"node {ip} (id {nid[:8]}), where {', '.join(p.owner for p in self.places if p.node.node_id == nid)} ran,"
            for nid, ip in gone.items()
        ]
        return NodeLostError(f"{' and '.join(lines)} left the Ray cluster ({type(exc).__name__})")
