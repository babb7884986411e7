"""TrainActor (one per data-parallel rank, a Ray actor) and TrainGroup (the driver's handle on all of them).

Each TrainActor owns a trainer backend and the sending side of the weight sync. The group fans calls out to
every rank and gathers the results; collectives (FSDP2, named_weights) run inside the actors.
"""

from __future__ import annotations

import os

import torch

from miles.config import RunConfig
from miles.memory import MemoryLedger
from miles.nodes import NodeInfo, interface_of, this_node
from miles.placement import local_ranks
from miles.ports import free_port
from miles.stall import heartbeat
from miles.threads import actor_options, init_on_compute_thread, on_compute_thread
from miles.train.backend import build_backend, read_checkpoint_files, sample_log_probs, write_checkpoint_files


def resolve_device(cfg: RunConfig) -> str:
    if cfg.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.device


class TrainActor:
    """actor = TrainActor(cfg, rank, world_size)
    addr, port = actor.rendezvous_address()       # on rank 0: its node's address and a port free there
    actor.join(addr, port, local_rank, local_world_size)   # every rank: the torch.distributed world
    actor.connect_sync([rollout_manager]); actor.train(step, batch); actor.offload(tags); actor.update_weights(v)
    """

    @init_on_compute_thread("train-compute")  # built and run on one thread: see miles/threads.py
    def __init__(self, cfg: RunConfig, rank: int, world_size: int):
        heartbeat.name(f"train-{rank}")  # under the stall watchdog: its stack file is train-<rank>-<pid>.txt
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.device = resolve_device(cfg)
        self.rendezvous = ""  # "addr:port" this rank joined its world at (join)
        self.ledger = MemoryLedger()
        self.backend = None  # built by the plan's trainer.build step (build): after the engines, as priced
        self.sync = None

    def node(self) -> NodeInfo:
        return this_node()

    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0's side of the rendezvous: the address of this node, which the other ranks reach it at, and a port
        free on it (chosen here: the driver's machine says nothing about this node's ports)."""
        addr = this_node().node_ip or "127.0.0.1"
        return addr, free_port(addr)

    @on_compute_thread
    def join(self, master_addr: str, master_port: int, local_rank: int = 0, local_world_size: int = 1) -> str:
        """Join the trainer's torch.distributed world at rank 0's ``master_addr:master_port``; ``local_rank`` among
        the ranks on this node (LOCAL_RANK, LOCAL_WORLD_SIZE, as torchrun sets them). Returns where it rendezvoused."""
        os.environ.update(LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(local_world_size))
        if self.world_size > 1:
            import torch.distributed as dist

            if self.device == "cuda":  # Ray gives each rank its own GPU (one visible device) unless told otherwise
                torch.cuda.set_device(local_rank if torch.cuda.device_count() > 1 else 0)
            elif "GLOO_SOCKET_IFNAME" not in os.environ and (ifname := interface_of(this_node().node_ip)):
                os.environ["GLOO_SOCKET_IFNAME"] = ifname  # gloo's own guess, the hostname, may name a loopback address
            dist.init_process_group(
                "nccl" if self.device == "cuda" else "gloo",
                init_method=f"tcp://{master_addr}:{master_port}",
                rank=self.rank,
                world_size=self.world_size,
            )
        self.rendezvous = f"{master_addr}:{master_port}"
        return self.rendezvous

    def ready(self) -> bool:
        return True

    @on_compute_thread
    def build(self) -> None:
        """Create the model and optimizer: the trainer's memory comes into being here (miles.handoff.plan)."""
        if self.backend is not None:
            return
        disk_dir = os.path.join(self.cfg.run_dir, "offload", f"rank{self.rank}")
        self.backend = build_backend(
            self.cfg, self.device, rank=self.rank, world_size=self.world_size, ledger=self.ledger, disk_dir=disk_dir
        )

    def connect_sync(self, engines) -> None:
        from miles.sync import make_sync

        self.sync = make_sync(self.cfg, self.device, is_source=self.rank == 0)
        self.sync.connect(engines)

    @on_compute_thread
    def update_weights(self, version: int) -> dict:
        self.sync.update(self.backend.weights_to_sync(), version)
        self.backend.weights_synced()
        return self.sync.metrics()

    @on_compute_thread
    def train(self, batch, want_log_probs: bool = False, step: int | None = None) -> tuple[dict, dict]:
        metrics = self.backend.train_step(batch, step=step)
        return metrics, sample_log_probs(self.backend, batch) if want_log_probs else {}

    @on_compute_thread
    def sft(self, batch, lr: float | None = None) -> dict:
        if lr is not None:
            self.backend.set_lr(lr)
        return self.backend.sft_step(batch)

    def set_lr(self, lr: float) -> None:
        self.backend.set_lr(lr)

    @on_compute_thread
    def end_warmup(self) -> None:
        self.backend.end_warmup()

    @on_compute_thread
    def offload(self, tags) -> int:
        return self.backend.offload(tuple(tags))

    @on_compute_thread
    def onload(self, tags) -> int:
        return self.backend.onload(tuple(tags))

    def clear_memory(self) -> None:
        self.backend.clear_memory()

    @on_compute_thread
    def named_weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.backend.named_weights()}

    def save_checkpoint(self, directory: str) -> None:
        """Every rank joins (full state dicts are collective); rank 0 writes into ``directory``."""
        state = self.backend.state_dict()
        if self.rank == 0:
            write_checkpoint_files(directory, state)

    def load_checkpoint(self, directory: str) -> None:
        self.backend.load_state_dict(read_checkpoint_files(directory))

    def close(self) -> None:
        if self.sync is not None and hasattr(self.sync, "close"):
            self.sync.close()

    def drain_ledger(self):
        self.ledger.sample_process(f"trainer/{self.rank}")
        return self.ledger.drain()


class TrainGroup:
    """The driver's view of all train ranks: each method runs on every rank and returns the per-rank results.

    group = TrainGroup(cfg, placement_group, num_gpus_per_actor=0)   # ranks started, rendezvoused at rank 0's node
    group.nodes; group.rendezvous                          # where each rank runs; the "addr:port" each one joined at
    group.connect_sync([rollout_manager])
    results = group.train(batches, want_log_probs=False)   # one batch per rank -> [(metrics, log_probs)] per rank
    group.offload(tags); group.onload(tags); metrics = group.update_weights(version)[0]
    """

    def __init__(
        self, cfg: RunConfig, placement_group, num_gpus_per_actor: float, wait: bool = True, env: dict | None = None
    ):
        """``wait=False``: return once the actors are asked for; ``wait_ready`` then waits for their processes.
        ``env``: more environment variables for every rank (the stall watchdog's, miles.stall.watchdog)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        n = cfg.trainer.world_size
        cls = ray.remote(TrainActor)
        rdt = {}
        if cfg.sync.transport == "rdt":
            from miles.sync.rdt import actor_options as rdt_options

            rdt = rdt_options(gpus_per_engine=1)  # an embedded engine holds one device
        concurrency = rdt.pop("max_concurrency", 1)  # the driver calls one method at a time (miles/threads.py)
        self.actors = [
            cls.options(
                num_cpus=0.01,
                num_gpus=num_gpus_per_actor,
                **rdt,
                **actor_options(concurrency, env),
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group, placement_group_bundle_index=r),
            ).remote(cfg, r, n)
            for r in range(n)
        ]
        self.nodes: list[NodeInfo] = []
        self.rendezvous: list[str] = []
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Wait for every rank's process, then form the world at rank 0's node: its address and a port free there,
        each rank's LOCAL_RANK among the ranks on its own node."""
        self.nodes = gather([a.node.remote() for a in self.actors])
        addr, port = gather([self.actors[0].rendezvous_address.remote()])[0]
        local = local_ranks([n.node_id for n in self.nodes])
        self.rendezvous = gather([a.join.remote(addr, port, *lr) for a, lr in zip(self.actors, local)])

    def connect_sync(self, engines) -> list:
        return self._all("connect_sync", engines)

    def train(self, batches: list, want_log_probs: bool = False, step: int | None = None) -> list[tuple[dict, dict]]:
        """One RL step; ``batches[r]`` goes to rank r."""
        return self._each("train", batches, want_log_probs=want_log_probs, step=step)

    def sft(self, batches: list, lr: float | None = None) -> list[dict]:
        """One supervised step on reference answers; ``batches[r]`` goes to rank r."""
        return self._each("sft", batches, lr=lr)

    def set_lr(self, lr: float) -> list:
        return self._all("set_lr", lr)

    def end_warmup(self) -> list:
        """After the supervised warm-up: with model.lora.warmup = base, each rank freezes the base it trained."""
        return self._all("end_warmup")

    def build(self) -> list:
        """The plan's ``trainer.build`` step: each rank creates its model and optimizer (the actors themselves
        start in the constructor, holding no model)."""
        return self._all("build")

    def offload(self, tags) -> list[int]:
        """Bytes each rank moved off the device."""
        return self._all("offload", tags)

    def onload(self, tags) -> list[int]:
        """Bytes each rank moved back onto the device."""
        return self._all("onload", tags)

    def clear_memory(self) -> list:
        return self._all("clear_memory")

    def update_weights(self, version: int) -> list[dict]:
        """Send the weights to the connected engines as ``version``; each rank's sync metrics."""
        return self._all("update_weights", version)

    def named_weights(self) -> list[dict[str, torch.Tensor]]:
        return self._all("named_weights")

    def save_checkpoint(self, directory: str) -> list:
        return self._all("save_checkpoint", directory)

    def load_checkpoint(self, directory: str) -> list:
        return self._all("load_checkpoint", directory)

    def drain_ledger(self) -> list:
        return self._all("drain_ledger")

    def close(self) -> list:
        return self._all("close")

    def _all(self, method: str, *args, **kwargs) -> list:
        return gather([getattr(a, method).remote(*args, **kwargs) for a in self.actors])

    def _each(self, method: str, per_rank_args: list, **kwargs) -> list:
        return gather([getattr(a, method).remote(x, **kwargs) for a, x in zip(self.actors, per_rank_args)])


def gather(refs: list) -> list:
    """``ray.get(refs)``, but the first failure is raised as soon as it is known: a rank that died leaves the others
    waiting in a collective, and ``ray.get`` of them all would wait with them."""
    import ray

    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        ray.get(done)  # raises the failed rank's error now
    return ray.get(refs)
