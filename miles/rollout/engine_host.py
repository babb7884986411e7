"""Engine servers on other nodes: EngineHost, a Ray actor that starts one engine server (``miles serve``, SGLang or
its stand-in) on the node it is placed on, bound to that node's address with the run's API key; and the rollout
manager's side of it, ``hosted_engines``: clients of those servers (a Router over several), whose stop and restart
go through the host actor.

A server the rollout manager starts itself binds loopback on the manager's node; one that trainer ranks and a
router on other nodes must reach binds the address Ray knows its node by, and is refused there without a key.

    host = ray.remote(EngineHost).options(resources={"node_b": 0.001}).remote(cfg, index=1, gpu_index=0)
    engines = hosted_engines(cfg, [host, ...], api_key, ledger)    # in the rollout manager: starts them all
    ray.get(host.node.remote())                                      # NodeInfo of the node it runs on
"""

from __future__ import annotations

import logging

from miles.nodes import NodeInfo, this_node
from miles.rollout.launch import ServerProcess, engine_server
from miles.rollout.router import Router
from miles.rollout.sglang_client import SGLangClient
from miles.sglang_flags import STANDIN
from miles.stall import heartbeat

log = logging.getLogger(__name__)
STOP_TIMEOUT_S = 30.0


class EngineHost:
    """host = EngineHost(cfg, index, gpu_index, device); url = host.start(api_key); host.restart(); host.stop()"""

    def __init__(self, cfg, index: int, gpu_index: int = 0, device: str = ""):
        heartbeat.name(f"engine-host-{index}")
        self.cfg, self.index, self.gpu_index, self.device = cfg, index, gpu_index, device
        self.proc: ServerProcess | None = None
        self.api_key = ""

    def node(self) -> NodeInfo:
        return this_node()

    def start(self, api_key: str) -> str:
        """Start the server on this node's address (Ray's address of the node) and wait until /health answers."""
        self.api_key = api_key
        host = this_node().node_ip or "127.0.0.1"
        self.proc = engine_server(
            self.cfg, self.index, host=host, api_key=api_key, gpu_index=self.gpu_index, device=self.device
        )
        return self.proc.start()

    def restart(self) -> str:
        """A fresh server process (the router's recovery of a dead engine); its URL may change."""
        return self.proc.restart()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    def url(self) -> str:
        return self.proc.url if self.proc is not None else ""


class RemoteServer:
    """What an SGLangClient and a Router hold of a server started by an EngineHost: stop and restart, through it."""

    def __init__(self, host, url: str):
        self.host, self.url = host, url

    def restart(self) -> str:
        import ray

        self.url = ray.get(self.host.restart.remote())
        return self.url

    def stop(self) -> None:
        import ray

        try:
            ray.get(self.host.stop.remote(), timeout=STOP_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - a host on a lost node: its server went with it (--parent-pid)
            log.warning("engine server at %s was not stopped through its host (%s)", self.url, type(e).__name__)


def hosted_engines(cfg, hosts: list, api_key: str, ledger=None) -> list:
    """Start every host's server (in parallel) and return the rollout manager's engines: one client, or a Router
    over several that restarts a dead one through its host."""
    import ray

    refs = [h.start.remote(api_key) for h in hosts]
    try:
        urls = ray.get(refs)
    except BaseException:
        for h in hosts:  # the servers that did start go too
            RemoteServer(h, "").stop()
        raise
    r = cfg.rollout
    flavor = "miles" if r.engine == "http" or r.sglang_launcher == STANDIN else "sglang"
    servers = [RemoteServer(h, url) for h, url in zip(hosts, urls)]
    clients = [
        SGLangClient(s.url, flavor=flavor, ledger=ledger, process=s, api_key=api_key, vocab_size=cfg.model.vocab_size)
        for s in servers
    ]
    if len(clients) == 1:
        return clients
    router = Router(clients, restart=lambda i: servers[i].restart())
    router.start_health_checks()
    return [router]
