"""The nodes of a Ray cluster as a run meets them: the node this process runs on, reaching a cluster's address within
a bounded wait, which of a run's nodes have left the cluster, and whether every node sees the run directory.

    node = this_node()                          # NodeInfo(node_id, node_ip, hostname, pid); ids "" outside Ray
    probe_address("10.0.0.1:6379", 30)          # ConnectionError naming the address and the fix, within 30 s
    lost_nodes(["8b1a...", "3066..."])          # {node_id: last known ip} of those no longer alive
    check_shared_dir("runs/x", {node_id: ip})   # SharedStorageError naming the node that does not see runs/x
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
import time
from dataclasses import dataclass

_THIS: dict[int, NodeInfo] = {}  # pid -> the node, once Ray has said it
NODE_ID_ENV, NODE_IP_ENV = "MILES_NODE_ID", "MILES_NODE_IP"


@dataclass(frozen=True, slots=True)
class NodeInfo:
    node_id: str  # Ray's node id ("" outside a Ray process)
    node_ip: str  # the address Ray knows the node by: what other nodes reach it at
    hostname: str
    pid: int


def this_node() -> NodeInfo:
    """The node of this process: Ray's node id and address inside a Ray worker or driver, else ids ''."""
    pid = os.getpid()
    if pid in _THIS:
        return _THIS[pid]
    ray = sys.modules.get("ray")
    node_id = ip = ""
    if ray is not None and ray.is_initialized():
        try:
            node_id, ip = ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()
        except Exception:  # noqa: BLE001 - a client-mode driver has no node of its own
            node_id = ip = ""
    if not node_id:  # a server process a Ray actor started on its node (node_env)
        node_id, ip = os.environ.get(NODE_ID_ENV, ""), os.environ.get(NODE_IP_ENV, "")
    node = NodeInfo(node_id, ip, socket.gethostname(), pid)
    if node_id:
        _THIS[pid] = node
    return node


def node_env() -> dict[str, str]:
    """The environment that tells a child process (an engine server) which Ray node it runs on."""
    node = this_node()
    return {NODE_ID_ENV: node.node_id, NODE_IP_ENV: node.node_ip} if node.node_id else {}


def interface_of(ip: str) -> str:
    """The network interface that holds address ``ip`` on this machine ('' if none does, or ``ip`` is '')."""
    if not ip:
        return ""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == ip for a in addrs):
            return name
    return ""


class ClusterUnreachable(ConnectionError):
    """cluster.address did not answer, or Ray could not join the cluster there (the message says what to change)."""


def probe_address(address: str, host: str, port: int, timeout_s: float) -> None:
    """Wait until ``host:port`` accepts a TCP connection (a head that is starting refuses at first), at most
    ``timeout_s``; else ClusterUnreachable. Ray's own join waits minutes on an address where nothing listens."""
    deadline, last = time.monotonic() + timeout_s, None
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                return
        except socket.gaierror as e:
            raise ClusterUnreachable(
                f"cluster.address = {address!r}: the host {host!r} does not resolve ({e.strerror}); fix the address"
            ) from None
        except OSError as e:
            last = e.strerror or type(e).__name__
        if time.monotonic() >= deadline:
            raise ClusterUnreachable(
                f"cluster.address = {address!r}: nothing answered at {host}:{port} within {timeout_s:g} s ({last}); "
                f"start the head there (`ray start --head --port {port}`), fix the address, raise "
                "cluster.connect_timeout_s for a head that is still starting, or leave cluster.address empty to start "
                "Ray on this machine"
            )
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


def join_error(address: str, e: BaseException) -> ClusterUnreachable:
    """Ray's failure to join ``address`` as one line with the fix (Ray's own is a page of gRPC status)."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    hint = (
        "the cluster uses Ray's token authentication: set RAY_AUTH_MODE=token and the cluster's token "
        "(RAY_AUTH_TOKEN or ~/.ray/auth_token) here as on the head"
        if "auth" in str(e).lower()
        else "check that a Ray head of this Ray version runs there (`ray status --address ...`)"
    )
    return ClusterUnreachable(f"cluster.address = {address!r}: Ray could not join the cluster ({text[:300]}); {hint}")


def lost_nodes(node_ids) -> dict[str, str]:
    """{node_id: its last known address} of the given nodes that the cluster no longer counts alive."""
    import ray

    rows = {n["NodeID"]: n for n in ray.nodes()}
    return {
        nid: rows[nid]["NodeManagerAddress"] if nid in rows else "?"
        for nid in dict.fromkeys(node_ids)
        if nid and not rows.get(nid, {}).get("Alive", False)
    }


def unreachable_nodes(node_ids, timeout_s: float = 3.0) -> dict[str, str]:
    """{node_id: address} of the given nodes whose raylet does not accept a connection now: a node that was killed or
    cut off, seconds before the cluster's health checks declare it dead."""
    import ray

    rows = {n["NodeID"]: n for n in ray.nodes()}
    out = {}
    for nid in dict.fromkeys(node_ids):
        row = rows.get(nid)
        if row is None or not row.get("Alive", False):
            continue
        try:
            with socket.create_connection((row["NodeManagerAddress"], row["NodeManagerPort"]), timeout=timeout_s):
                pass
        except OSError:
            out[nid] = row["NodeManagerAddress"]
    return out


class SharedStorageError(RuntimeError):
    """A node of the run does not see the run directory the driver writes."""


MARKER = ".miles-node-check"


def check_shared_dir(directory: str, nodes: dict[str, str], timeout_s: float = 120.0) -> None:
    """Every node in ``nodes`` ({node_id: ip}) reads back the marker the driver writes into ``directory``: checkpoints
    are written by trainer rank 0 on its node and read by the driver, data positions by the rollout manager, so one
    filesystem at one path must be visible everywhere. Raises SharedStorageError naming the node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from miles.atomic import atomic_write_text

    path = os.path.join(os.path.abspath(directory), MARKER)
    token = secrets.token_hex(16)
    atomic_write_text(path, token)
    try:
        read = ray.remote(_read_marker)
        refs = {
            nid: read.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False)).remote(
                path
            )
            for nid in nodes
        }
        deadline = time.monotonic() + timeout_s
        for nid, ref in refs.items():
            try:
                seen = ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
            except Exception as e:  # noqa: BLE001 - a node that cannot run the read is named with Ray's reason
                raise SharedStorageError(
                    f"node {nodes[nid]} (id {nid[:8]}) did not read {path} within {timeout_s:g} s "
                    f"({type(e).__name__}); it cannot be checked to see run_dir"
                ) from None
            if seen != token:
                what = "no such file" if seen is None else "another file of that name"
                raise SharedStorageError(
                    f"run_dir = {directory!r} is not the driver's directory on node {nodes[nid]} (id {nid[:8]}): "
                    f"{path} there is {what}. Checkpoints are written on trainer rank 0's node and read back by the "
                    "driver, so put run_dir on storage every node mounts at the same path (NFS, Lustre, a shared "
                    "volume), or keep the run on this node"
                )
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass


def _read_marker(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None
