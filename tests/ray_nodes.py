"""A real Ray cluster of several nodes on this one machine, for the ``cluster`` tier.

Each node is a ``ray start --block`` process of its own, with its own node address, ports, resources and (for the
head) temp directory, so that it never meets another Ray instance on a shared machine: the head's address file goes
into that directory, not /tmp/ray, so a plain ``ray.init()`` elsewhere does not join it. The head keeps this
machine's address (Ray swaps 127.0.0.1 for it); the other nodes take 127.0.0.x, which Linux routes to loopback
for all of 127/8, so each node is known by an address of its own, as on separate machines. Nodes are stopped
(SIGTERM, then SIGKILL of what is left) or killed outright (a node lost) by pid, never with ``ray stop``.

    with RayNodes() as nodes:
        nodes.start("head", num_cpus=3, resources={"node_a": 1})
        nodes.start("127.0.0.2", num_cpus=2, resources={"node_b": 1})
        nodes.address                  # "127.0.0.1:<port>": cluster.address for the runs
        nodes.kill("127.0.0.2")        # SIGKILL of that node's whole process tree
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psutil

from miles.cluster import RAY_PATH
from miles.ports import free_ports

REPO = Path(__file__).resolve().parents[1]
PORTS_PER_NODE = 48  # the fixed ports of a node (9) and its workers' range
READY_LINE = "Ray runtime started"
ENV = {"RAY_AUTH_MODE": "disabled", "RAY_enable_metrics_collection": "0", "RAY_agent_register_timeout_ms": "600000"}


class RayNodes:
    def __init__(self, ready_timeout_s: float = 300.0):
        self.dir = Path(tempfile.mkdtemp(prefix="mrc-", dir="/tmp"))  # short: Ray's socket paths live under it
        self.ready_timeout_s = ready_timeout_s
        self.procs: dict[str, subprocess.Popen] = {}
        self.tree: dict[str, list[psutil.Process]] = {}  # psutil refuses to signal a pid taken by another process
        self.address = ""

    @staticmethod
    def env() -> dict[str, str]:
        """The environment of the nodes and of the drivers that join them (this checkout's miles, no token auth)."""
        path = os.pathsep.join([str(RAY_PATH), str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        return {**os.environ, **ENV, "PYTHONPATH": path}

    def start(self, name: str, *, num_cpus: int, resources: dict) -> None:
        """Start node ``name`` ("head", or the node address of a further node) and wait until it has joined."""
        p = free_ports(PORTS_PER_NODE)
        argv = ["ray", "start", "--block", "--disable-usage-stats", f"--num-cpus={num_cpus}"]
        argv += [f"--resources={json.dumps(resources)}", "--object-store-memory=100000000"]
        argv += [f"--node-manager-port={p}", f"--object-manager-port={p + 1}", f"--metrics-export-port={p + 2}"]
        argv += [f"--dashboard-agent-grpc-port={p + 3}", f"--dashboard-agent-listen-port={p + 4}"]
        argv += [f"--runtime-env-agent-port={p + 5}", f"--min-worker-port={p + 10}", f"--max-worker-port={p + 47}"]
        if name == "head":
            argv += ["--head", "--node-ip-address=127.0.0.1", f"--port={p + 6}", f"--ray-client-server-port={p + 7}"]
            argv += [f"--dashboard-port={p + 8}", "--include-dashboard=false", f"--temp-dir={self.dir}"]
            self.address = f"127.0.0.1:{p + 6}"
        else:
            argv += [f"--address={self.address}", f"--node-ip-address={name}"]
        log = open(self.dir / f"{name}.log", "wb")  # noqa: SIM115 - the node's own output, read on failure
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env())
        self._wait_ready(name)

    def _wait_ready(self, name: str) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        path = self.dir / f"{name}.log"
        while time.monotonic() < deadline:
            if READY_LINE in path.read_text(errors="replace"):
                self.tree[name] = self._pids(name)
                return
            if self.procs[name].poll() is not None:
                break
            time.sleep(0.5)
        tail = path.read_text(errors="replace")[-3000:]
        self.stop()
        raise RuntimeError(f"Ray node {name} did not start within {self.ready_timeout_s:g} s; its log ends:\n{tail}")

    def _pids(self, name: str) -> list[psutil.Process]:
        """The node's processes now, and those seen when it started (a process whose parent died is reparented)."""
        try:
            root = psutil.Process(self.procs[name].pid)
            now = [root, *root.children(recursive=True)]
        except psutil.Error:
            now = []
        return now + self.tree.get(name, [])

    def kill(self, name: str) -> None:
        """A node lost: SIGKILL of its ``ray start``, raylet, agents and workers (actors and what they started)."""
        _kill(self._pids(name))
        self.tree.pop(name, None)
        self.procs.pop(name).wait(10)

    def stop(self) -> None:
        for name, proc in list(self.procs.items())[::-1]:  # the other nodes before the head
            procs = self._pids(name)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
            _kill(procs)
            self.procs.pop(name)
            self.tree.pop(name, None)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RayNodes:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _kill(procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)
