"""Cluster: the Ray side of a run — placement group, train actors, the rollout manager — and the executor
that turns HandoffPlan steps into calls on them."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from miles.cluster_nodes import Placement, engine_api_key, rollout_scheduling, start_engine_hosts
from miles.config import RunConfig
from miles.handoff.executor import PlanExecutor
from miles.handoff.plan import TRAIN_ALL
from miles.nodes import join_error, probe_address
from miles.placement import address_host_port, check_nodes, trainer_bundles, trainer_strategy
from miles.preflight import check_environment
from miles.ray_logs import drop_reported_tracebacks, quiet_startup_warnings
from miles.stall.watchdog import ROLLOUT_PHASES, Watchdog
from miles.threads import actor_options
from miles.train.actor import TrainGroup, resolve_device

log = logging.getLogger("miles")

GENERATE_GROUP = "generate"  # the rollout actor's concurrency group for generate under async.partial_rollout
PG_READY_TIMEOUT_S = {"local": 120.0, "cluster": 1800.0}  # a joined cluster may be starting nodes (autoscaler)


def wait_for_placement_group(pg, bundles: list[dict], timeout_s: float) -> None:
    """Wait for ``pg`` to be placed; after ``timeout_s`` remove it and raise naming what the cluster lacks."""
    import ray
    from ray.exceptions import GetTimeoutError
    from ray.util.placement_group import remove_placement_group

    try:
        ray.get(pg.ready(), timeout=timeout_s)
        return
    except GetTimeoutError:
        remove_placement_group(pg)
    need: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            need[k] = need.get(k, 0) + v
    have = ray.cluster_resources()
    short = [f"{k} {v:g} (the cluster has {have.get(k, 0):g})" for k, v in sorted(need.items()) if have.get(k, 0) < v]
    why = f"it needs {'; '.join(short)}" if short else f"the cluster has {need} in total, but other work holds it"
    raise RuntimeError(
        f"Ray could not place the run's {len(bundles)} bundle(s) of {bundles[0]} within {timeout_s:g} s: {why}; "
        "lower trainer.world_size, use device=cpu, or add the resources"
    )


RAY_PATH = Path(__file__).parent / "ray_path"


def start_ray(
    address: str = "", *, num_cpus: int | None = None, threads: int = 1, connect_timeout_s: float = 30.0
) -> None:
    """Join ``address`` or start a local Ray. On a loaded machine the raylet's default 30 s wait for its agent's
    port file runs out and the raylet aborts ("Timed out waiting for file .../metrics_agent_port..."), so the wait
    is raised here before the raylet starts. An address is probed first: where nothing listens, Ray's own join
    waits minutes before it fails (miles.nodes.probe_address)."""
    import ray

    if where := address_host_port(address):
        probe_address(address, *where, connect_timeout_s)

    os.environ.setdefault("RAY_agent_register_timeout_ms", "600000")
    os.environ.setdefault("RAY_enable_metrics_collection", "0")  # no metrics agent to wait for; miles has its ledger
    env = {"OMP_NUM_THREADS": str(threads), "PYTHONPATH": _driver_pythonpath()}
    # a Ray started here runs its workers with this process's environment, so the variables go there (the
    # runtime-env agent would set itself up before the first actor); a cluster joined gets them as a runtime_env
    local = not (address or os.environ.get("RAY_ADDRESS"))
    quiet_startup_warnings()  # Ray's token-auth and SIGTERM-handler warnings (miles.ray_logs)
    if local:  # and its processes skip a slow optional import (miles/ray_path; miles bench startup)
        env["PYTHONPATH"] = os.pathsep.join([str(RAY_PATH), env["PYTHONPATH"]])
    for attempt in range(3):  # Ray's own wait for the node to register is a fixed 30 s; retry on a loaded machine
        try:
            with _environ(env if local else {}):
                ray.init(
                    address=address or None,
                    num_cpus=None if address else num_cpus,
                    include_dashboard=False,
                    logging_level=logging.WARNING,
                    log_to_driver=True,
                    runtime_env=None if local else {"env_vars": env},
                )
            drop_reported_tracebacks()  # an actor's constructor error is reported once, by the driver
            return
        except Exception as e:
            if not local:
                raise join_error(address or os.environ["RAY_ADDRESS"], e) from None
            if "timed out during startup" not in str(e) or attempt == 2:
                raise
            log.warning("Ray did not start in time (%s); retrying (%d/3)", e, attempt + 2)
            ray.shutdown()
            _kill_ray_children()


@contextlib.contextmanager
def _environ(env: dict[str, str]):
    """``env`` set in os.environ for the block (the processes it starts inherit them), then put back."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _driver_pythonpath() -> str:
    """The driver's own import roots (cwd, a test directory, a user's script folder) for the actors, so that a
    ``module:function`` spec such as ``task.reward`` resolves in an actor as it does here. Installed packages are
    left to the actor's interpreter."""
    import sys

    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)}
    roots = []
    for p in sys.path:
        p = os.path.realpath(p or os.getcwd())
        if os.path.isdir(p) and not any(p.startswith(x + os.sep) for x in prefixes) and p not in roots:
            roots.append(p)
    extra = os.environ.get("PYTHONPATH", "")
    return os.pathsep.join(roots + ([extra] if extra else []))


def _kill_ray_children() -> None:
    """Kill the Ray processes this process started (a failed start leaves its GCS server and dashboard running,
    and on a loaded machine each orphan makes the next start slower still). Other Ray clusters are left alone."""
    import signal

    me = str(os.getpid())
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = f.read().rsplit(")", 1)[1].split()[1]
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if ppid == me and b"/ray/" in cmd:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


def kill_process_trees(pids: list[int]) -> None:
    """SIGKILL each process and every process it started (psutil checks that a pid still names the same process)."""
    import psutil

    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            procs += [p, *p.children(recursive=True)]
        except psutil.Error:
            continue
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=5)


class Cluster(PlanExecutor):
    """with Cluster(cfg) as c: c.execute(plan.init, version=0); c.rollout.generate.remote(step); c.trainer.train(...)

    The engines start first, then the trainer's actors (no model yet); ``plan.init``'s trainer.build step builds
    the model, then calls the ``built`` hook given to ``execute`` (a resumed run loads its checkpoint there) and
    its trainer.warmup step calls ``warm_up``. The stall watchdog (miles.stall.watchdog) watches from then on: ``execute``, ``generate``,
    ``evaluate`` and ``save_checkpoint`` name its phases, and on a stall it calls ``abort``."""

    PHASES = {"init": "init", "rollout_to_train": "train", "train_to_rollout": "sync"}  # execute's phase -> watched

    def __init__(self, cfg: RunConfig):
        import ray
        from ray.util.placement_group import placement_group

        from miles.rollout.manager import RolloutManager
        from miles.sources import make_sources

        self.cfg = cfg
        check_environment(cfg)  # before Ray starts: GPUs, SGLang, the model's files (miles.preflight)
        self.owns_ray = not ray.is_initialized()
        if self.owns_ray:
            start_ray(
                cfg.cluster.address,
                num_cpus=max(os.cpu_count() or 1, cfg.trainer.world_size),
                threads=cfg.num_threads or os.cpu_count() or 1,
                connect_timeout_s=cfg.cluster.connect_timeout_s,
            )
        self.device = resolve_device(cfg)
        gpu = 1 if self.device == "cuda" else 0
        bundles = trainer_bundles(cfg.cluster, cfg.trainer.world_size, gpu)  # a pin per rank (miles.placement)
        try:
            check_nodes(cfg, gpu, ray.nodes())  # before anything is launched: pins, CPUs and GPUs of each node
            self.pg = placement_group(bundles, strategy=trainer_strategy(cfg.cluster))
            wait_for_placement_group(
                self.pg, bundles, PG_READY_TIMEOUT_S["cluster" if cfg.cluster.address else "local"]
            )
        except BaseException:
            if self.owns_ray:
                ray.shutdown()
            raise
        # the planner's order (miles.handoff.planner.replay): the engines are built first; the trainer's actors start
        # here holding no model, which the plan's trainer.build step creates
        # the engine side of rdt: its receive call waits inside the actor while Ray's transfer needs a second slot
        rdt = cfg.sync.transport == "rdt"
        # partial rollouts: the generate calls run one at a time, in order, in their own concurrency group, so the
        # sync's calls (pause, buckets, commit, continue) reach the actor while a rollout generates on its compute
        # thread; the engine's lock lands the update between two decode steps (miles.rollout.decode_loop)
        partial = cfg.async_.partial_rollout
        self.dead: set[str] = set()  # "rollout", "trainer": stopped by the watchdog
        self.data_states: dict[
            int, dict
        ] = {}  # next_step -> the dataset position, for a checkpoint without the rollout
        self.watchdog = Watchdog(cfg.watchdog_s, cfg.run_dir, stop=self.abort)
        env = self.watchdog.env()  # the actors, and every process they start, register with it (miles.stall.heartbeat)
        self.engine_hosts = start_engine_hosts(cfg, self.device, env)  # servers on other nodes (cluster.engine_nodes)
        remote = ray.remote(concurrency_groups={GENERATE_GROUP: 1}) if partial else ray.remote
        self.rollout = (
            remote(RolloutManager)
            .options(
                num_cpus=0.01,
                num_gpus=0.45 * gpu,
                **actor_options(2 if rdt or partial else 1, env),  # one torch thread: miles/threads.py
                **({"enable_tensor_transport": True} if rdt else {}),
                **rollout_scheduling(cfg, self.pg),  # trainer rank 0's bundle, or cluster.rollout_node
            )
            .remote(
                cfg,
                self.device,
                sources=make_sources,
                hosts=self.engine_hosts,
                api_key=engine_api_key(cfg) if self.engine_hosts else "",
            )
        )
        # the trainer's processes start meanwhile (Python and torch imports, ~6 s on 2 cores); they hold no model
        self.trainer = TrainGroup(cfg, self.pg, num_gpus_per_actor=0.45 * gpu, wait=False, env=env)
        try:
            self.get(self.rollout.engine_count.remote())  # built (a launch error surfaces here, before the trainer)
            self.trainer.wait_ready()  # the ranks rendezvous at rank 0's node
            self.placement = Placement.read(cfg, self.trainer, self.rollout, self.engine_hosts)
            self.placement.check(cfg)  # the sync reaches every engine; every node sees run_dir (miles.cluster_nodes)
            log.info("placement: %s", self.placement.describe())
            self.trainer.connect_sync([self.rollout])
            self.watchdog.start()
        except BaseException:
            self.close()  # nothing left running: the engines (and servers they launched), the group, Ray
            raise
        self.sync_metrics: dict = {}

    def get(self, ref):
        import ray

        return ray.get(ref)

    def execute(self, steps, version: int | None = None, phase: str = "", **hooks) -> dict[str, int]:
        name = self.PHASES.get(phase, phase or "init")
        self.watchdog.phase(name, version if name == "init" else None)  # init's version is the step it starts at
        return super().execute(steps, version, phase, **hooks)

    def generate(self, step: int):
        """The rollout of RL step ``step`` (batches, metrics); the dataset's position after it is kept."""
        return self.collect(self.submit_generate(step), step)

    def submit_generate(self, step: int):
        """Start the rollout of RL step ``step`` on the rollout actor; ``collect`` waits for it (async runs start
        several ahead: miles.rollout_window)."""
        if self.cfg.async_.partial_rollout:
            return self.rollout.generate.options(concurrency_group=GENERATE_GROUP).remote(step)
        return self.rollout.generate.remote(step)

    def collect(self, pending, step: int, untrained: int | None = None):
        """The rollout ``submit_generate(step)`` started: (batches, metrics). ``untrained``: the oldest step not yet
        trained (default ``step``), where a checkpoint after a stall in this wait resumes."""
        self.watchdog.phase("generate", step if untrained is None else untrained)
        out = self.get(pending)
        if self.cfg.data.train:  # a checkpoint after a stall on the rollout side is written without the rollout
            self.data_states[step + 1] = self.get(self.rollout.data_state.remote(step + 1))
            for old in [t for t in self.data_states if t < step - self.cfg.async_.max_staleness]:
                del self.data_states[old]  # an async run's untrained steps are at most max_staleness behind
        return out

    def evaluate(self, step: int) -> dict[str, float]:
        self.watchdog.phase("eval", step)
        return self.get(self.rollout.evaluate.remote(step))

    def sft_batches(self, i: int) -> list:
        """The reference answers of supervised warm-up step ``i``, one TrainBatch per rank."""
        return self.get(self.rollout.sft_batches.remote(i))

    def sample_rows(self, train_log_probs: dict, step: int | None = None) -> list[dict]:
        """Step ``step``'s samples (None: the last rollout's) as rollout-dump rows (miles.rollout_dump), with the
        trainer's log-probs."""
        return self.get(self.rollout.sample_rows.remote(train_log_probs, step))

    def abort(self, side: str) -> None:
        """The watchdog's stop: kill the stuck side's processes and everything they started (engine and agent
        servers, reward workers), so that the driver's wait on them ends. A stall on the rollout side (generate,
        reward, eval) leaves the trainer, which is idle meanwhile, to save the steps before it; any other stops
        both sides."""
        import ray

        victims = {"rollout": [self.rollout]}
        if side not in ROLLOUT_PHASES:
            victims |= {f"train-{r}": [a] for r, a in enumerate(self.trainer.actors)}
        self.dead |= {"rollout"} | ({"trainer"} if len(victims) > 1 else set())  # before the driver wakes up
        kill_process_trees([p.pid for role in victims for p in self.watchdog.processes(role)])
        for actor in (a for actors in victims.values() for a in actors):
            ray.kill(actor, no_restart=True)  # an actor that never registered, and Ray's own bookkeeping

    def lost_node(self, e: BaseException):
        """After ``e`` from a call into the cluster: a NodeLostError naming the run's node that left the cluster (the
        actors left are then only killed on close), or None (miles.cluster_nodes.Placement.lost)."""
        if self.dead or self.watchdog.stall is not None or not hasattr(self, "placement"):
            return None  # the watchdog stopped the actors: their deaths are its doing
        lost = self.placement.lost(e)
        if lost is not None:
            self.dead |= {"rollout", "trainer"}
        return lost

    def synced(self, metrics: list[dict]) -> None:
        self.sync_metrics = metrics[0]
        if self.cfg.sync.check_weights:
            self.check_weights()

    def check_weights(self) -> None:
        """Engine weights must equal the trainer's, bit for bit (dtype, shape and every byte), after a sync."""
        from miles.sync.check import check_weights

        trainer = self.trainer.named_weights()[0]
        for i in range(self.get(self.rollout.engine_count.remote())):
            check_weights(trainer, self.get(self.rollout.named_weights.remote(i)), label=f"engine {i}")

    def save_checkpoint(self, run_dir, next_step: int):
        self.watchdog.phase("checkpoint")
        tags = list(TRAIN_ALL) if self.cfg.handoff.offload_train != "none" else []
        self.trainer.onload(tags)
        try:
            return run_dir.save_checkpoint(next_step, lambda d: self._write_checkpoint(d, next_step))
        finally:
            self.trainer.offload(tags)

    def _write_checkpoint(self, directory: str, next_step: int) -> None:
        from miles.rollout.manager import write_data_state

        self.trainer.save_checkpoint(directory)
        if "rollout" not in self.dead:
            self.get(self.rollout.save_data_state.remote(directory, next_step))  # the dataset's epoch position
        elif self.cfg.data.train:
            if next_step not in self.data_states:
                raise RuntimeError(f"the dataset position at RL step {next_step} is not known; no checkpoint there")
            write_data_state(directory, self.data_states[next_step])

    def load_data_state(self, checkpoint) -> None:
        self.get(self.rollout.load_data_state.remote(str(checkpoint)))

    def drain_ledgers(self):
        events, samples = [], []
        for e, s in self.trainer.drain_ledger() + [self.get(self.rollout.drain_ledger.remote())]:
            events += e
            samples += s
        return sorted(events, key=lambda e: e.time), samples

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        self.watchdog.close()
        trainer = getattr(self, "trainer", None)  # None when the engines failed to start
        try:
            if trainer is not None and "trainer" not in self.dead:
                trainer.close()
            if "rollout" not in self.dead:
                ray.get(self.rollout.close.remote(), timeout=60)  # stops launched engine servers (ray.kill: no atexit)
        except Exception:
            if not self.dead:
                raise
            log.warning("after the stop, the processes left did not close cleanly; they are killed", exc_info=True)
        finally:
            for a in (trainer.actors if trainer is not None else []) + [self.rollout, *self.engine_hosts]:
                ray.kill(a)
            remove_placement_group(self.pg)
            if self.owns_ray:
                ray.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
