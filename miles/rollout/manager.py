"""RolloutManager: a sample source's samples -> rewards -> group advantages -> metrics -> per-rank train batches.

It owns the engines (embedded in-process, or reached over HTTP), the sample source it is handed (a task's prompts,
agent episodes or a prompt dataset: miles.sources) and the tokenizer, and exposes the engines' memory controls to
the handoff plan.
It runs as a Ray actor in a run, or in-process in tests.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

import torch

from miles.config import RunConfig
from miles.memory import MemoryLedger
from miles.model.tokenizer import load_tokenizer
from miles.nodes import NodeInfo, this_node
from miles.policy.dapo import fill_groups, round_key
from miles.protocols.engine import ReceivesInProcess, UpdateCalls, supports
from miles.reward.scorer import pool_for
from miles.rollout.engine import EmbeddedEngine
from miles.rollout.engine_host import hosted_engines
from miles.rollout.launch import spawn_miles_servers, spawn_sglang_servers
from miles.rollout.router import Router
from miles.rollout.sglang_client import SGLangClient
from miles.rollout.tail import RoundLog, assign_advantages, rollout_metrics, shape_overlong_of, to_shards
from miles.samples import Sample, TrainBatch
from miles.sglang_flags import STANDIN
from miles.staleness import sample_versions, staleness_metrics
from miles.stall import heartbeat
from miles.threads import init_on_compute_thread, on_compute_thread


class RolloutManager(UpdateCalls):
    """manager = RolloutManager(cfg, device="cpu", sources=make_sources)   # miles.sources
    batches, metrics = manager.generate(step)        # one TrainBatch per data-parallel rank
    manager.offload(["cuda_graph", "kv_cache", "weights"]); ...; manager.onload(["weights"])
    manager.update_weights_from_bucket(handle, None); manager.set_weight_version(step + 1)
    """

    update_pause = "in_place"  # the mode of the sync's hold around an update (pause_generation)

    @init_on_compute_thread("rollout-compute")  # built and run on one thread: see miles/threads.py
    def __init__(self, cfg: RunConfig, device: str = "cpu", *, sources: Callable, hosts: tuple = (), api_key: str = ""):
        """``sources(cfg, tokenizer, engines, rewards)`` makes the run's sample sources (miles.sources.make_sources):
        handed in from above, so the manager knows no source. ``hosts``: EngineHost actors that start the engine
        servers on their nodes (cluster.engine_nodes), reached with ``api_key``; without them the engines live here
        or are launched beside this process."""
        heartbeat.name("rollout")  # under the stall watchdog: its stack file is rollout-<pid>.txt
        self.cfg = cfg
        a = cfg.async_
        if a.partial_rollout and a.kv_on_update == "recompute":
            self.update_pause = "retract"  # in-flight updates recompute the rows' KV (pause_generation)
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.tokenizer = load_tokenizer(cfg.model.tokenizer)
        self.ledger = MemoryLedger()
        r = cfg.rollout
        if hosts:  # servers on the nodes cluster.engine_nodes names, started by their hosts (miles.rollout.engine_host)
            self.engines = hosted_engines(cfg, list(hosts), api_key, self.ledger)
        elif r.engine == "http":  # the same engines behind `miles serve` processes (a Router when num_engines > 1)
            self.engines = spawn_http_engines(cfg, device, self.ledger)
        elif r.engine == "sglang":  # SGLang servers, launched (one per engine) or attached (rollout.engine_urls)
            self.engines = sglang_engines(cfg, device, self.ledger)
        else:
            self.engines = [
                EmbeddedEngine.from_config(cfg, device, owner=f"engine/{i}", ledger=self.ledger)
                for i in range(r.num_engines)
            ]
        self.rewards = pool_for(cfg.data)  # reward worker processes (miles.reward), started below if the run needs them
        found = sources(cfg, self.tokenizer, self.engines, self.rewards)  # miles.sources.make_sources, in a run
        self.source, self.sft_source, self.data, self._evaluator = (
            found.source,
            found.sft,
            found.data,
            found.make_evaluator,
        )
        self.rewards.start(found.reward_calls)  # the workers load the reward while the run starts up
        self.evaluator = None  # built on the first eval (miles.data.eval)
        self.last_samples: list[Sample] = []
        self.samples_by_step: dict[int, list[Sample]] = {}  # the steps generated and not yet dumped (async: several)

    # ---- rollout ------------------------------------------------------------------------------------------
    @on_compute_thread
    def generate(self, step: int) -> tuple[list[TrainBatch], dict]:
        """source -> score -> advantages -> metrics -> one TrainBatch per data-parallel rank (miles.rollout.tail).
        With DAPO's dynamic sampling, rounds of fresh prompts are drawn until enough groups carry signal."""
        t0 = time.perf_counter()
        r = self.cfg.rollout
        rounds = RoundLog()
        draw = lambda k: self._scored_round(round_key(step, k), rounds)  # noqa: E731
        if r.dynamic_sampling:  # DAPO: groups with equal rewards dropped, refilled from more prompts (bounded)
            samples, extra = fill_groups(draw, r.num_prompts_per_step, r.dynamic_sampling_max_rounds)
        else:
            samples, extra = draw(0), {}
        assign_advantages(samples, r.advantage_estimator)
        self.last_samples = self.samples_by_step[step] = samples
        for done in [t for t in self.samples_by_step if t < step - self.cfg.async_.max_staleness - 1]:
            del self.samples_by_step[done]  # the dump of step t is read before step t + max_staleness + 2 starts
        metrics = rollout_metrics(samples) | rounds.metrics() | extra
        sampled = [s for s in samples if s.metadata.get("answered", True)]  # an env episode that failed first: no
        version = max((s.weight_version for s in sampled), default=step)
        metrics |= {"time/rollout": time.perf_counter() - t0, "weight_version": version}
        # trained at step (version step); a sample the engine never answered has no token to be stale
        metrics |= staleness_metrics(step, [sample_versions(s) for s in sampled] or [[version]])
        metrics |= engine_health(self.engines)
        return to_shards(samples, self.tokenizer.pad_token_id, self.cfg.trainer.world_size), metrics

    def _scored_round(self, key: int, rounds: RoundLog) -> list[Sample]:
        """The source's samples of ``key`` (a step, or a refill round of one), scored and overlong-shaped."""
        heartbeat.phase("generate")
        samples, source_metrics = self.source.samples(key)
        heartbeat.phase("reward")  # a stall from here on is the reward's (miles.stall.watchdog)
        scoring = self.source.score(samples, key)
        rounds.add(source_metrics, shape_overlong_of(samples, self.cfg.rollout), scoring)
        return samples

    @on_compute_thread
    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out eval with the engines' current weights (data.eval: miles.data.eval; an environment's own)."""
        if self.evaluator is None:
            self.evaluator = self._evaluator()
        return self.evaluator.evaluate(step)

    def data_state(self, next_step: int) -> dict | None:
        """The dataset's epoch position at the start of ``next_step`` (None without a dataset)."""
        return self.data.state_dict(next_step) if self.data is not None else None

    def save_data_state(self, directory: str, next_step: int) -> None:
        """The dataset's epoch position at the start of ``next_step``, beside the trainer's checkpoint files."""
        write_data_state(directory, self.data_state(next_step))

    def load_data_state(self, checkpoint: str) -> None:
        path = f"{checkpoint}/data_state.json"
        if self.data is not None and os.path.exists(path):
            with open(path) as f:
                self.data.load_state_dict(json.load(f))

    @on_compute_thread
    def sft_batches(self, step: int) -> list[TrainBatch]:
        """Reference answers as train batches (for a supervised warm-up), one per rank."""
        samples = self.sft_source.prompts(10_000_000 + step, with_targets=True)
        return to_shards(samples, self.tokenizer.pad_token_id, self.cfg.trainer.world_size)

    def sample_rows(self, train_log_probs: dict[int, list[float]] | None = None, step: int | None = None) -> list[dict]:
        """The samples of RL step ``step`` (None: the last generated) as plain dicts (dumps, dashboards, notebooks);
        ``weight_versions``: the version each token was sampled under (-1 on the prompt)."""
        tok = self.tokenizer
        rows = []
        for s in self.last_samples if step is None else self.samples_by_step[step]:
            P = len(s.prompt_ids)
            rows.append(
                {
                    "index": s.index,
                    "group": s.group,
                    "reward": s.reward,
                    "prompt_text": s.prompt,
                    "response_text": s.response_text,
                    "target": s.target,
                    "tokens": s.tokens,
                    "token_text": tok.token_text(s.tokens),
                    "prompt_len": P,
                    "loss_mask": [0] * P + list(s.metadata.get("loss_mask") or [1] * len(s.response_ids)),
                    "rollout_log_probs": [0.0] * P + list(s.rollout_log_probs),
                    "train_log_probs": _per_token((train_log_probs or {}).get(s.index), len(s.tokens)),
                    "advantages": [0.0] * P + [s.advantage] * len(s.response_ids),
                    "weight_version": s.weight_version,
                    "weight_versions": [-1] * P + sample_versions(s)[: len(s.response_ids)],
                    "finish_reason": s.finish_reason,
                    **_episode_fields(s.metadata),
                }
            )
        return rows

    # ---- engine control (the handoff plan and weight sync call these) -------------------------------------
    @on_compute_thread
    def offload(self, tags) -> int:
        """No call at all for no tags (SGLang reads a missing tag list as every tag)."""
        return sum(e.offload(list(tags)) for e in self.engines) if tags else 0

    @on_compute_thread
    def onload(self, tags) -> int:
        return sum(e.onload(list(tags)) for e in self.engines) if tags else 0

    # ---- weight sync receive side (miles.sync.receiver): one transfer per process, applied to every engine ----
    # the calls every engine takes alike (miles.protocols.engine: Engine, Transactional), on each engine in order
    def pause_generation(self, mode: str = "in_place") -> None:
        """The sync's hold around an update. Under async.partial_rollout with kv_on_update = 'recompute' its
        in-place hold is a retract: the rows in flight go back to the queue and are prefilled again under the new
        weights; it returns once no row holds KV state (miles.rollout.decode_loop)."""
        if mode == "in_place":
            mode = self.update_pause
        for e in self.engines:
            e.pause_generation(mode)
        if mode == "retract":
            wait_rows_back(self.engines)

    def continue_generation(self) -> None:
        for e in self.engines:
            e.continue_generation()

    def flush_cache(self) -> None:
        for e in self.engines:
            e.flush_cache()

    def update_weights_from_disk(self, path: str, version: int | None = None) -> None:
        for e in self.engines:
            e.update_weights_from_disk(path, version)

    def update_weights_from_bucket(self, handle, version: int | None = None) -> None:
        for e in self.engines:
            e.update_weights_from_bucket(handle, version)

    def set_weight_version(self, version: int) -> None:
        for e in self.engines:
            e.set_weight_version(version)

    def begin_weight_update(self, manifest) -> None:
        for e in self.engines:
            e.begin_weight_update(manifest)

    def abort_weight_update(self) -> None:
        for e in self.engines:
            e.abort_weight_update()

    def init_weights_update_group(
        self, master_address, master_port, rank_offset, world_size, group_name, backend="gloo"
    ):
        self.engines[0].init_weights_update_group(
            master_address, master_port, rank_offset, world_size, group_name, backend
        )

    def update_weights_from_distributed(
        self, names, dtypes, shapes, group_name, version=None, load_format=None
    ) -> None:
        from miles.sync.weight_group import receive_broadcast

        if not supports(self.engines[0], ReceivesInProcess):  # an HTTP engine: its server process is the group member
            self.engines[0].update_weights_from_distributed(names, dtypes, shapes, group_name, version, load_format)
            return

        def apply(named):
            for e in self.engines:
                e.update_weights_from_tensor(named)

        receivers = [e.weight_receiver() for e in self.engines]
        receive_broadcast(
            group_name, names, dtypes, shapes, receivers, self.engines[0].device, load_format,
            check=self.engines[0]._check_weight, apply=apply,
        )  # fmt: skip
        if version is not None:
            self.set_weight_version(version)

    def broadcast_formats(self) -> tuple[str, ...]:
        """What a broadcast to these engines may carry (miles.sync.weight_group.FORMATS), fastest first."""
        from miles.sync.weight_group import FORMATS

        e = self.engines[0]
        return tuple(e.broadcast_formats()) if hasattr(e, "broadcast_formats") else FORMATS

    def destroy_weights_update_group(self, group_name) -> None:
        self.engines[0].destroy_weights_update_group(group_name)

    def group_ranks(self) -> int:
        """In-process engines: this process is one rank for all of them; HTTP engines: their servers' ranks."""
        return self.engines[0].group_ranks()

    def in_weights_group(self, group_name: str) -> bool:
        return self.engines[0].in_weights_group(group_name)

    def update_weights_from_rdt(self, tensors, pieces, version=None) -> None:
        from miles.sync.receiver import receive_rdt

        receive_rdt(tensors, pieces, [e.weight_receiver() for e in self.engines])
        if version is not None:
            self.set_weight_version(version)

    def update_weights_in_place(self, shared, version: int) -> dict[str, float]:
        """The trainer's tensors opened once for this process and copied into every engine (miles.sync.in_place)."""
        from miles.sync.in_place import InPlaceEndpoint

        if getattr(self, "_in_place", None) is None:
            self._in_place = InPlaceEndpoint(self.engines, hold=self)  # held as the sync holds: pause_generation
        return self._in_place.update(shared, version)

    def named_weights(self, engine: int = 0) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.engines[engine].named_weights().items()}

    def engine_count(self) -> int:
        """Engines this manager drives directly (a Router over N HTTP engines counts as one)."""
        return len(self.engines)

    def weight_version(self) -> int:
        """The version every engine holds (an engine interface method, as on one engine); raises if they differ."""
        versions = self.weight_versions()
        if len(set(versions)) != 1:
            raise RuntimeError(f"the engines hold different weight versions {versions}; a sync reached only some")
        return versions[0]

    def weight_versions(self) -> list[int]:
        return [e.weight_version for e in self.engines]

    def close(self) -> None:
        """Stop what the sample source started (an agent source's servers and harness) and the engine servers this
        manager launched (attached rollout.engine_urls servers are only disconnected)."""
        try:
            self.source.close()
        finally:
            self.rewards.close()
            for e in self.engines:
                if hasattr(e, "url") or hasattr(e, "clients"):  # HTTP engines: a client or a Router
                    e.close()

    def node(self) -> NodeInfo:
        return this_node()

    def drain_ledger(self):
        """Memory moves and process samples since the last drain: the embedded engines' process (this one) per
        engine; engine servers sample themselves (their rows come with their ledgers), this process as "rollout"."""
        embedded = self.cfg.rollout.engine == "embedded"
        for owner in [f"engine/{i}" for i in range(len(self.engines))] if embedded else ["rollout"]:
            self.ledger.sample_process(owner)
        return self.ledger.drain()


RETRACT_WAIT_S = 30.0  # how long a retract waits for the rows in flight to go back to the queue


def wait_rows_back(engines, timeout_s: float = RETRACT_WAIT_S) -> None:
    """Wait until no embedded engine's decode loop holds a row with KV state (after a retract pause; an HTTP
    engine's server waits itself before it answers the pause)."""
    deadline = time.monotonic() + timeout_s
    for i, e in enumerate(engines):
        while isinstance(e, EmbeddedEngine) and not e.loop.holds_no_rows:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"engine {i}: the rows in flight did not go back to the queue within {timeout_s:g} s of a "
                    "retract pause (its decode loop is stuck in a step); set async.kv_on_update=keep to update "
                    "without retracting"
                )
            time.sleep(0.005)


def write_data_state(directory: str, state: dict | None) -> None:
    """``state`` (RolloutManager.data_state) as the checkpoint's data_state.json; nothing for None."""
    if state is not None:
        from miles.atomic import atomic_write_text

        atomic_write_text(f"{directory}/data_state.json", json.dumps(state))


def _episode_fields(meta: dict) -> dict:
    """A multi-turn sample's turn and tool spans and episode figures, for the dump (miles.dashboard.store)."""
    keys = ("status", "num_turns", "num_tool_calls", "num_malformed", "error")
    out = {k: meta[k] for k in keys if k in meta}
    if meta.get("spans"):
        out["spans"] = meta["spans"]
    if meta.get("drift"):
        out |= {"drift_kind": meta["drift"]["kind"], "drift_tokens": meta["drift"]["num_tokens"]}
    return out


def spawn_http_engines(cfg, device: str, ledger=None) -> list:
    """The engines RolloutManager holds for ``rollout.engine = "http"``: one client, or a Router over several."""
    n = cfg.rollout.num_engines
    procs = spawn_miles_servers(cfg, n, device=device)
    clients = [SGLangClient(p.url, ledger=ledger, process=p, vocab_size=cfg.model.vocab_size) for p in procs]
    if n == 1:
        return clients
    router = Router(clients, restart=lambda i: procs[i].restart())
    router.start_health_checks()
    return [router]


def sglang_engines(cfg, device: str, ledger=None) -> list:
    """The engines for ``rollout.engine = "sglang"``: clients of servers launched here (stopped on close), or of
    ``rollout.engine_urls`` (attached: never stopped, never restarted); a Router when there are several."""
    r = cfg.rollout
    # the stand-in answers every SGLang endpoint as SGLang does; "miles" adds what only miles serve has (its flat
    # buckets and transactions, the memory ledger, named_weights for check_weights and for a restarted server)
    flavor = "miles" if r.sglang_launcher == STANDIN else "sglang"
    vocab = cfg.model.vocab_size  # every output id is checked against it
    if r.engine_urls:
        clients = [SGLangClient(url, flavor=flavor, ledger=None, vocab_size=vocab) for url in r.engine_urls]
        dead = [c.url for c in clients if not c.healthy(timeout_s=5.0)]
        if dead:
            for c in clients:
                c.close()  # closes our HTTP connections only: these servers are not ours
            raise RuntimeError(
                f"rollout.engine_urls {dead} did not answer GET /health within 5 s; start the server(s) there, "
                "fix the URL(s), or drop rollout.engine_urls to launch servers here"
            )
        restart = None
    else:
        procs = spawn_sglang_servers(cfg, device=device)
        clients = [SGLangClient(p.url, flavor=flavor, ledger=ledger, process=p, vocab_size=vocab) for p in procs]
        restart = lambda i: procs[i].restart()  # noqa: E731
    if len(clients) == 1:
        return clients
    router = Router(clients, restart=restart)
    router.start_health_checks()
    return [router]


def engine_health(engines) -> dict[str, int]:
    """``engines/live``: engines taking requests now; ``engines/recovered``: restarts a Router completed so far in
    this run (a killed server brought back with the current weights). An engine without a router counts as live."""
    routers = [e for e in engines if isinstance(e, Router)]
    live = sum(len(r.live()) for r in routers) + len(engines) - len(routers)
    recovered = sum(kind == "recovered" for r in routers for _, kind, _ in r.events)
    return {"engines/live": live, "engines/recovered": recovered}


def _per_token(values: list[float] | None, num_tokens: int) -> list[float] | None:
    """The trainer's log-probs (up to a sample's last trained token) as one value per token: NaN after it. A sample
    whose tail is masked (an episode that ended on the environment's turn, a failed or aborted one: no trained token)
    gets fewer values than tokens from the trainer."""
    return None if values is None else (list(values) + [float("nan")] * num_tokens)[:num_tokens]
