"""Where a run's actors go on a Ray cluster: the ``cluster`` config section, the trainer's placement-group bundles,
the check of the cluster's nodes against them before anything is launched, and each rank's place on its node.

Without ``cluster.address`` Ray starts on this machine and every actor runs here, as before. On a cluster the
trainer's ranks are packed onto as few nodes as hold them or spread one per node as far as the nodes go
(``trainer_placement``), or pinned rank by rank (``trainer_nodes``) to the node that has a Ray resource: every
node's built-in ``node:<ip>``, or a name given to ``ray start --resources``. The rollout manager can be pinned the
same way (``rollout_node``), and engine servers are started on the nodes that ``engine_nodes`` names
(miles.rollout.engine_host), bound to that node's address.

    bundles = trainer_bundles(cfg.cluster, cfg.trainer.world_size, gpu=1)   # one per rank, its pin included
    check_nodes(cfg, gpu=1, nodes=ray.nodes())        # NodeCheckError naming the node, what it lacks and the fix
    local_ranks(["a", "b", "a"])                      # [(0, 2), (0, 1), (1, 2)]: LOCAL_RANK, LOCAL_WORLD_SIZE
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Literal

from miles.config_check import check

PIN_AMOUNT = 0.001  # what a bundle or an actor asks of its pin resource: a node that has the resource hosts many
SAME_HOST_TRANSPORTS = ("tensor",)  # buckets handed over by shared memory / CUDA IPC handles: one host only


@dataclass(kw_only=True, slots=True)
class ClusterConfig:
    # "" starts Ray on this machine; "auto" joins the cluster `ray start` made here (or $RAY_ADDRESS); "host:port"
    # joins the head's GCS (6379 by default); "ray://host:10001" goes through Ray Client
    address: str = ""
    connect_timeout_s: float = 30.0  # how long cluster.address may take to answer before the run is refused
    # the trainer's ranks on as few nodes as hold them (pack), or one per node as far as the nodes go (spread)
    trainer_placement: Literal["pack", "spread"] = "pack"
    # a Ray resource per rank that pins it to the node having it: "node:10.0.0.2" (every node has its own) or a
    # name given to `ray start --resources`; () = Ray places the ranks by trainer_placement
    trainer_nodes: tuple[str, ...] = ()
    rollout_node: str = ""  # a Ray resource pinning the rollout manager (and embedded engines); "" = on rank 0's bundle
    # rollout.engine http / sglang: a Ray resource per engine; its server starts on that node, bound to the node's
    # address with an API key; () = the servers start beside the rollout manager, on loopback
    engine_nodes: tuple[str, ...] = ()

    def __post_init__(self):
        check_address(self.address)
        check("cluster.connect_timeout_s", self.connect_timeout_s, gt=0, fix="seconds, e.g. 30")
        for name in ("trainer_nodes", "engine_nodes"):
            bad = [p for p in getattr(self, name) if not _is_resource(p)]
            if bad:
                raise ValueError(f"cluster.{name} has {bad}, not Ray resource names; e.g. node:10.0.0.2 or node_b")
        if self.rollout_node and not _is_resource(self.rollout_node):
            raise ValueError(
                f"cluster.rollout_node = {self.rollout_node!r} is not a Ray resource name; e.g. node:10.0.0.2 or node_b"
            )


def _is_resource(name: str) -> bool:
    return bool(name) and not any(c.isspace() or c in ",={}\"'" for c in name)


def check_address(address: str) -> None:
    if address in ("", "auto"):
        return
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"cluster.address = {address!r} should be 'auto', 'host:port' (the head's GCS port, 6379 by default) or "
            "'ray://host:10001' (Ray Client); leave it empty to start Ray on this machine"
        )


def address_host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a ``host:port`` or ``ray://host:port`` address; None for "" and "auto"."""
    if address in ("", "auto"):
        return None
    host, _, port = address.removeprefix("ray://").rpartition(":")
    return host.strip("[]"), int(port)


def check_cluster(cfg) -> None:
    """Config-time refusals across sections (a RunConfig ``cfg``): one pin per rank, one per engine, and engine pins
    only for servers miles launches."""
    c, r, n = cfg.cluster, cfg.rollout, cfg.trainer.world_size
    if c.trainer_nodes and len(c.trainer_nodes) != n:
        raise ValueError(
            f"cluster.trainer_nodes has {len(c.trainer_nodes)} entr{'y' if len(c.trainer_nodes) == 1 else 'ies'} for "
            f"trainer.world_size = {n} ranks; give one Ray resource per rank (repeat a node for ranks that share it)"
        )
    if not c.engine_nodes:
        return
    if r.engine == "embedded" or r.engine_urls:
        raise ValueError(
            "cluster.engine_nodes starts engine servers on other nodes, which rollout.engine = 'embedded' (engines in "
            "the rollout manager's process: pin it with cluster.rollout_node) and rollout.engine_urls (servers started "
            "by hand) do not have; use rollout.engine=http or sglang, or clear cluster.engine_nodes"
        )
    if len(c.engine_nodes) != r.num_engines:
        raise ValueError(
            f"cluster.engine_nodes has {len(c.engine_nodes)} entries for rollout.num_engines = {r.num_engines}; give "
            "one Ray resource per engine"
        )


def trainer_bundles(cluster: ClusterConfig, world_size: int, gpu: int) -> list[dict]:
    """The placement group's bundles, one per rank: a CPU, a GPU on CUDA, and the rank's pin when there is one."""
    pins = cluster.trainer_nodes or ("",) * world_size
    return [{"CPU": 1, **({"GPU": gpu} if gpu else {}), **({p: PIN_AMOUNT} if p else {})} for p in pins]


def trainer_strategy(cluster: ClusterConfig) -> str:
    """Ray's placement-group strategy for the trainer's bundles (pins, when given, choose the nodes themselves)."""
    return "SPREAD" if cluster.trainer_placement == "spread" else "PACK"


def pin_options(pin: str) -> dict:
    """Ray actor options that pin an actor to the node having resource ``pin`` ({} for none)."""
    return {"resources": {pin: PIN_AMOUNT}} if pin else {}


def local_ranks(node_ids: list[str]) -> list[tuple[int, int]]:
    """(LOCAL_RANK, LOCAL_WORLD_SIZE) of each rank, from the node each rank runs on (ranks in order)."""
    per_node, seen, out = Counter(node_ids), Counter(), []
    for node in node_ids:
        out.append((seen[node], per_node[node]))
        seen[node] += 1
    return out


class NodeCheckError(ValueError):
    """The cluster's nodes cannot host the run as configured (the message names the node, the need and the fix)."""


@dataclass(frozen=True, slots=True)
class Node:
    node_id: str
    ip: str
    resources: dict

    def show(self) -> str:
        own = sorted(k for k in self.resources if _is_custom(k))
        have = f"CPU {self.resources.get('CPU', 0):g}, GPU {self.resources.get('GPU', 0):g}"
        return f"{self.ip} ({have}{', ' + ', '.join(own) if own else ''})"


def _is_custom(key: str) -> bool:
    return key not in ("CPU", "GPU", "memory", "object_store_memory") and not key.startswith(("node:", "accelerator"))


def alive_nodes(nodes: list[dict]) -> list[Node]:
    """``ray.nodes()`` rows of live nodes."""
    return [Node(n["NodeID"], n["NodeManagerAddress"], dict(n.get("Resources", {}))) for n in nodes if n.get("Alive")]


def check_nodes(cfg, gpu: int, nodes: list[dict]) -> None:
    """Refuse, before anything is launched, a run the live nodes cannot host: a pin no node has, a node without the
    CPUs or GPUs of the ranks pinned to it, a cluster without the GPUs of the whole trainer, an engine pinned to a
    node without its GPUs. ``nodes`` is ``ray.nodes()``; ``gpu`` 1 on CUDA."""
    alive = alive_nodes(nodes)
    c, n = cfg.cluster, cfg.trainer.world_size
    ranks_of: dict[str, list[int]] = {}
    for rank, pin in enumerate(c.trainer_nodes or ("",) * n):
        ranks_of.setdefault(pin, []).append(rank)
    for pin, ranks in ranks_of.items():
        hosts = _hosts(alive, pin, f"cluster.trainer_nodes pins trainer rank(s) {ranks} to", "cluster.trainer_nodes")
        _check_room(hosts, pin, ranks, gpu, cfg.device)
    for pin in dict.fromkeys([*c.engine_nodes, c.rollout_node]):
        if pin:
            field = "cluster.engine_nodes" if pin in c.engine_nodes else "cluster.rollout_node"
            _hosts(alive, pin, f"{field} names", field)
    _check_engine_gpus(cfg, alive)


def _hosts(alive: list[Node], pin: str, what: str, field: str) -> list[Node]:
    hosts = [x for x in alive if not pin or x.resources.get(pin, 0) > 0]
    if not hosts:
        raise NodeCheckError(
            f"{what} {pin!r}, a resource no live node of the cluster has; the nodes: "
            f"{'; '.join(x.show() for x in alive) or 'none'}. Name a node by 'node:<its ip>' or by a resource given to "
            f"`ray start --resources`, or clear {field}"
        )
    return hosts


def _check_room(hosts: list[Node], pin: str, ranks: list[int], gpu: int, device: str) -> None:
    for kind, each in (("CPU", 1), ("GPU", gpu)):
        want, have = each * len(ranks), sum(x.resources.get(kind, 0) for x in hosts)
        if want and have < want:
            where = f"the node(s) with {pin!r}" if pin else "the cluster's live nodes"
            why = f"device = {device!r}: " if kind == "GPU" else ""
            fix = (
                f"add {kind}s there (`ray start --num-{kind.lower()}s`), "
                + ("pin some ranks elsewhere (cluster.trainer_nodes)" if pin else "lower trainer.world_size")
                + (", or use device=cpu" if kind == "GPU" else "")
            )
            raise NodeCheckError(
                f"{why}trainer rank(s) {ranks} need {want:g} {kind} (one per rank), but {where} have {have:g}: "
                f"{'; '.join(x.show() for x in hosts)}; {fix}"
            )


def _check_engine_gpus(cfg, alive: list[Node]) -> None:
    """Real SGLang servers pinned to a node take that node's GPUs (engine_gpus: side by side from GPU 0)."""
    from miles.sglang_flags import STANDIN, engine_gpus

    r, c = cfg.rollout, cfg.cluster
    if not c.engine_nodes or r.engine != "sglang" or r.sglang_launcher == STANDIN:
        return
    each = len(engine_gpus(r, 0))
    for pin, count in Counter(c.engine_nodes).items():
        for x in (x for x in alive if x.resources.get(pin, 0) > 0):
            if x.resources.get("GPU", 0) < each * count:
                raise NodeCheckError(
                    f"cluster.engine_nodes puts {count} SGLang engine(s) of {each} GPU(s) each on {pin!r}, but node "
                    f"{x.show()} has {x.resources.get('GPU', 0):g} GPU; pin fewer engines there or lower --tp-size"
                )


def same_host_refusal(cfg, source_ip: str, source_node: str, receivers: list[tuple[str, str, str]]) -> str:
    """Why the weight sync cannot reach ``receivers`` ([(name, node_id, ip)], the processes that open the trainer's
    buckets) from trainer rank 0 on ``source_node`` ('' when it can): shared memory and CUDA IPC handles open only on
    the host that made them."""
    s = cfg.sync
    rdt_ipc = s.transport == "rdt" and s.rdt_transport == "cuda_ipc"
    same_host = s.transport in SAME_HOST_TRANSPORTS or s.source == "in_place" or rdt_ipc
    if not same_host:
        return ""
    away = [f"{name} on {ip}" for name, node, ip in receivers if node != source_node]
    if not away:
        return ""
    return (
        f"sync.transport = {s.transport!r} (source {s.source!r}) hands the trainer's buckets over by shared memory or "
        f"CUDA IPC, which open only on the trainer rank 0's host ({source_ip}), but {', '.join(away)}; use "
        "sync.transport=broadcast across nodes, or pin the engines to rank 0's node (cluster.engine_nodes, "
        "cluster.rollout_node)"
    )
