"""RolloutManager: prompts -> engine completions -> rewards -> group advantages -> per-rank train batches.

It owns the engines (embedded in-process, or reached over HTTP), the task and the tokenizer, and exposes
the engines' memory controls to the handoff plan. It runs as a Ray actor in a run, or in-process in tests.
"""

from __future__ import annotations

import time

import torch

from miles.config import RunConfig
from miles.memory import MemoryLedger
from miles.model.tokenizer import load_tokenizer
from miles.policy.advantages import compute_advantages
from miles.policy.dapo import fill_groups, round_key, shape_overlong
from miles.rollout.engine import EmbeddedEngine, GenerateRequest, SamplingParams
from miles.rollout.tasks import Task
from miles.samples import Sample, TrainBatch, collate, shard
from miles.sync.receiver import UpdateCalls
from miles.threads import init_on_compute_thread, on_compute_thread

LEVEL_TAGS = {"kv_cache": ("kv_cache", "cuda_graph"), "weight": ("weights",)}


class RolloutManager(UpdateCalls):
    """manager = RolloutManager(cfg, device="cpu")
    batches, metrics = manager.generate(step)        # one TrainBatch per data-parallel rank
    manager.offload(["cuda_graph", "kv_cache", "weights"]); ...; manager.onload(["weights"])
    manager.update_weights_from_bucket(handle, None); manager.set_weight_version(step + 1)
    """

    @init_on_compute_thread("rollout-compute")  # built and run on one thread: see miles/threads.py
    def __init__(self, cfg: RunConfig, device: str = "cpu"):
        self.cfg = cfg
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.tokenizer = load_tokenizer(cfg.model.tokenizer)
        self.task = Task(cfg.task, cfg.seed)
        self.ledger = MemoryLedger()
        r = cfg.rollout
        policy = "host" if cfg.handoff.engine_host_mirror else "discard"
        if r.engine == "http":  # the same engines behind `miles serve` processes (a Router when num_engines > 1)
            from miles.rollout.launch import spawn_http_engines

            self.engines = spawn_http_engines(cfg, device, self.ledger)
        else:
            self.engines = [
                EmbeddedEngine(
                    cfg.model,
                    max_batch_size=r.max_batch_size,
                    max_seq_len=r.max_seq_len,
                    device=device,
                    seed=cfg.seed,
                    ledger=self.ledger,
                    owner=f"engine/{i}",
                    weights_policy=policy,
                    logprob_chunk_size=cfg.trainer.logprob_chunk_size,
                )
                for i in range(r.num_engines)
            ]
        self.last_samples: list[Sample] = []

    # ---- rollout ------------------------------------------------------------------------------------------
    def make_samples(self, step: int, *, with_targets: bool = False) -> list[Sample]:
        """The step's prompts, each repeated n_samples_per_prompt times; with targets, all distinct (for SFT)."""
        r = self.cfg.rollout
        num_prompts, repeat = r.num_prompts_per_step, r.n_samples_per_prompt
        if with_targets:
            num_prompts, repeat = num_prompts * repeat, 1
        samples = []
        for g, prob in enumerate(self.task.problems(step, num_prompts)):
            ids = (
                self.tokenizer.apply_chat_template([{"role": "user", "content": prob.prompt}])
                if prob.chat
                else self.tokenizer.encode(prob.prompt, add_bos=True)
            )
            for _ in range(repeat):
                s = Sample(index=len(samples), group=g, prompt=prob.prompt, target=prob.target, prompt_ids=list(ids))
                if with_targets:
                    s.response_ids = self.tokenizer.encode(prob.target) + [self.tokenizer.stop_token_ids[0]]
                samples.append(s)
        return samples

    @on_compute_thread
    def generate(self, step: int) -> tuple[list[TrainBatch], dict]:
        if (
            self.cfg.task.name == "swe"
        ):  # agent episodes: these engines behind session servers, a harness (miles.agents)
            from miles.agents.generator import generate_batches

            return generate_batches(self, step)
        t0 = time.perf_counter()
        r = self.cfg.rollout
        rounds: dict = {"time/generate": 0.0, "cut": []}
        if r.dynamic_sampling:  # DAPO: groups with equal rewards dropped, refilled from more prompts (bounded)
            draw = lambda k: self._scored_round(round_key(step, k), rounds)  # noqa: E731
            samples, extra = fill_groups(draw, r.num_prompts_per_step, r.dynamic_sampling_max_rounds)
        else:
            samples, extra = self._scored_round(step, rounds), {}
        t_gen = rounds["time/generate"]
        extra["overlong_frac"] = sum(rounds["cut"]) / len(rounds["cut"])  # responses cut at max_new_tokens
        for s, a in zip(
            samples,
            compute_advantages([s.reward for s in samples], [s.group for s in samples], r.advantage_estimator),
        ):
            s.advantage = a
        self.last_samples = samples
        rewards = torch.tensor([s.reward for s in samples])
        resp_len = sum(len(s.response_ids) for s in samples)
        metrics = {
            "reward": rewards.mean().item(),
            "reward_std": rewards.std().item() if len(samples) > 1 else 0.0,
            "exact": sum(s.reward == 1.0 for s in samples) / len(samples),
            "response_len": resp_len / len(samples),
            "rollout_tokens": resp_len,
            "total_tokens": resp_len + sum(len(s.prompt_ids) for s in samples),
            "time/generate": t_gen,
            "time/rollout": time.perf_counter() - t0,
            "weight_version": samples[0].weight_version,
            **extra,
        }
        pad = self.tokenizer.pad_token_id
        return [collate(part, pad) for part in shard(samples, self.cfg.trainer.world_size)], metrics

    def _scored_round(self, key: int, rounds: dict) -> list[Sample]:
        """The prompts of ``key`` (a step, or a refill round of one), completed by the engines and scored, with
        DAPO's overlong shaping applied when configured; generation time and the cut fraction go into ``rounds``."""
        t0 = time.perf_counter()
        r = self.cfg.rollout
        samples = self.make_samples(key)
        sp = SamplingParams(
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature,
            top_p=r.top_p,
            stop_token_ids=self.tokenizer.stop_token_ids,
        )
        reqs = [GenerateRequest(rid=f"{key}-{s.index}", input_ids=s.prompt_ids, sampling=sp) for s in samples]
        outs = []
        per_engine = -(-len(reqs) // len(self.engines))
        for i, engine in enumerate(self.engines):
            outs += engine.generate(reqs[i * per_engine : (i + 1) * per_engine], seed=self.cfg.seed * 100_003 + key)
        rounds["time/generate"] += time.perf_counter() - t0
        stop = set(self.tokenizer.stop_token_ids)
        for s, o in zip(samples, outs):
            s.response_ids, s.rollout_log_probs = o.output_ids, o.output_log_probs
            s.finish_reason, s.weight_version = o.finish_reason, o.weight_version
            s.response_text = self.tokenizer.decode([t for t in o.output_ids if t not in stop])
            s.reward = self.task.score(s.prompt, s.response_text, s.target)
        rounds["cut"].append(
            shape_overlong(
                samples, r.max_new_tokens, r.overlong_buffer_len, r.overlong_penalty_factor, r.overlong_filter
            )
        )
        return samples

    @on_compute_thread
    def sft_batches(self, step: int) -> list[TrainBatch]:
        """Reference answers as train batches (for a supervised warm-up), one per rank."""
        samples = self.make_samples(10_000_000 + step, with_targets=True)
        return [collate(part, self.tokenizer.pad_token_id) for part in shard(samples, self.cfg.trainer.world_size)]

    def sample_rows(self, train_log_probs: dict[int, list[float]] | None = None) -> list[dict]:
        """The last step's samples as plain dicts (dumps, dashboards, notebooks)."""
        tok = self.tokenizer
        rows = []
        for s in self.last_samples:
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
                    "loss_mask": [0] * P + [1] * len(s.response_ids),
                    "rollout_log_probs": [0.0] * P + list(s.rollout_log_probs),
                    "train_log_probs": (train_log_probs or {}).get(s.index),
                    "advantages": [0.0] * P + [s.advantage] * len(s.response_ids),
                    "weight_version": s.weight_version,
                    "finish_reason": s.finish_reason,
                }
            )
        return rows

    # ---- engine control (the handoff plan and weight sync call these) -------------------------------------
    @on_compute_thread
    def offload(self, tags) -> int:
        return sum(e.release_memory(list(tags)) for e in self.engines)

    @on_compute_thread
    def onload(self, tags) -> int:
        return sum(e.resume_memory(list(tags)) for e in self.engines)

    def offload_kv(self) -> int:
        return self.offload(self._level_tags("kv_cache"))

    def onload_kv(self) -> int:
        return self.onload(self._level_tags("kv_cache"))

    def offload_weights(self) -> int:
        """Does nothing unless 'weight' is in handoff.offload_rollout_level."""
        return self.offload(self._level_tags("weight"))

    def onload_weights(self) -> int:
        """Does nothing unless 'weight' is in handoff.offload_rollout_level."""
        return self.onload(self._level_tags("weight"))

    def _level_tags(self, level: str) -> list[str]:
        if level == "kv_cache":
            return ["cuda_graph"] + (["kv_cache"] if "kv_cache" in self.cfg.handoff.offload_rollout_level else [])
        return ["weights"] if level in self.cfg.handoff.offload_rollout_level else []

    def pause_generation(self, mode: str = "in_place") -> None:
        for e in self.engines:
            e.pause_generation(mode)

    def continue_generation(self) -> None:
        for e in self.engines:
            e.continue_generation()

    def flush_cache(self) -> None:
        for e in self.engines:
            e.flush_cache()

    def update_weights_from_disk(self, path: str, version=None) -> None:
        for e in self.engines:
            e.update_weights_from_disk(path, version)

    def update_weights_from_bucket(self, handle, version=None) -> None:
        for e in self.engines:
            e.update_weights_from_bucket(handle, version)

    def set_weight_version(self, version: int) -> None:
        for e in self.engines:
            e.set_weight_version(version)

    # ---- weight sync receive side (miles.sync.receiver): one transfer per process, applied to every engine ----
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

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name, version=None) -> None:
        from miles.sync.receiver import receive_broadcast

        if not hasattr(self.engines[0], "weight_receiver"):  # an HTTP engine: its server process is the group member
            self.engines[0].update_weights_from_distributed(names, dtypes, shapes, group_name, version)
            return
        receive_broadcast(
            group_name, names, dtypes, shapes, [e.weight_receiver() for e in self.engines], self.engines[0].device
        )
        if version is not None:
            self.set_weight_version(version)

    def destroy_weights_update_group(self, group_name) -> None:
        self.engines[0].destroy_weights_update_group(group_name)

    def update_weights_from_rdt(self, tensors, pieces, version=None) -> None:
        from miles.sync.receiver import receive_rdt

        receive_rdt(tensors, pieces, [e.weight_receiver() for e in self.engines])
        if version is not None:
            self.set_weight_version(version)

    def update_weights_in_place(self, shared, version: int) -> dict[str, float]:
        """The trainer's tensors opened once for this process and copied into every engine (miles.sync.in_place)."""
        from miles.sync.in_place import InPlaceEndpoint

        if getattr(self, "_in_place", None) is None:
            self._in_place = InPlaceEndpoint(self.engines)
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

    def drain_ledger(self):
        for i, _ in enumerate(self.engines):
            self.ledger.sample_process(f"engine/{i}")
        return self.ledger.drain()
