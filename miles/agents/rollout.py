"""Agentic rollout with oversampling: start more groups than needed, keep the first complete ones, abort the rest.

Aborting is only worth it if it reaches every session-server instance: each instance is flushed (its engine
requests aborted, its sessions dropped) and the harness cancels that instance's episodes and removes their
sandboxes. The instances are the plural map port -> instance id from ``AgentConfig.instances``; they are
flushed concurrently, each with a timeout and bounded retries, and one that fails does not stop the others:
it is reported in the step's metrics. Aborted groups go back to a buffer (rolled out first next step) or are
dropped, per ``AgentConfig.abort_partial``. Every call to the harness and the instances carries the run token
(miles.agents.run_token); an episode names its instance by id, and the harness knows the instances' URLs.
"""

from __future__ import annotations

import math
import random
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import httpx

from miles.agents.run_token import token_headers
from miles.config import AgentConfig


@dataclass(kw_only=True, slots=True)
class FlushResult:
    instance_id: str
    port: int
    ok: bool = False
    attempts: int = 0
    seconds: float = 0.0
    error: str = ""
    session: dict = field(default_factory=dict)  # the session server's answer
    harness: dict = field(default_factory=dict)  # the harness's answer


@dataclass(kw_only=True, slots=True)
class AgentStep:
    groups: list[list[dict]]  # the kept groups: each a list of episode results (one per sample)
    episodes: list[dict]  # every episode's per-episode metrics row (kept, aborted and surplus)
    flush: list[FlushResult]
    metrics: dict


@dataclass(kw_only=True, slots=True)
class _Group:
    gid: int
    task_seed: int
    episode_ids: list[str]
    results: dict = field(default_factory=dict)  # episode id -> result

    @property
    def complete(self) -> bool:
        return len(self.results) == len(self.episode_ids)


class AgentRollout:
    """One rollout step over a harness and N session-server instances.

    rollout = AgentRollout(cfg.agents, harness_url="http://127.0.0.1:8090", token=token, num_groups=4, group_size=2)
    step = rollout.collect(step=0)          # step.groups: num_groups complete groups; step.metrics: flush results
    rollout.buffer                          # task seeds of aborted groups, rolled out first next step
    """

    def __init__(
        self,
        cfg: AgentConfig,
        *,
        harness_url: str,
        token: str,
        num_groups: int,
        group_size: int,
        temperature: float = 1.0,
        seed: int = 0,
        flush: bool = True,
    ):
        """``flush=False`` reproduces the missing flush (surplus episodes run to their end): the agent-abort
        measurement's baseline, not a run option."""
        if not cfg.instances:
            raise ValueError("agents.session_ports is empty; set it to a port ('8100') or a range ('8100-8103')")
        if not harness_url:
            raise ValueError("AgentRollout needs the harness URL (agents.harness_url, or one started by the launcher)")
        self.cfg, self.harness_url = cfg, harness_url.rstrip("/")
        self.instances = dict(cfg.instances)  # port -> instance id: every one of them is flushed
        self.num_groups, self.group_size, self.temperature, self.seed = num_groups, group_size, temperature, seed
        self._flush = flush
        self.buffer: list[int] = []  # task seeds of aborted groups
        self.headers = token_headers(token)
        self._client = httpx.Client(timeout=httpx.Timeout(10.0, connect=2.0), headers=self.headers)
        self.rollout_id = uuid.uuid4().hex[:12]  # names this rollout's sessions on every instance (flush fences)
        self._cursor = self._harness_cursor()

    def session_url(self, port: int) -> str:
        return f"http://{self.cfg.session_host}:{port}"

    # ---- the step -----------------------------------------------------------------------------------------
    def collect(self, step: int) -> AgentStep:
        t0 = time.perf_counter()
        groups = self._start(step)
        outstanding = {eid for g in groups for eid in g.episode_ids}
        kept, harness_error = self._gather(groups, outstanding, enough=True)
        t_collect = time.perf_counter() - t0
        flush: list[FlushResult] = []
        if (outstanding or harness_error) and self._flush:
            flush = self.flush_all(step)
            self._gather(groups, outstanding, enough=False, wait_s=self.cfg.flush_timeout_s)
        elif outstanding:  # no flush: the surplus runs to its end and the step waits for it
            _, err = self._gather(groups, outstanding, enough=False)
            harness_error = harness_error or err
        t_end = time.perf_counter()
        self._requeue([g for g in groups if g not in kept])
        episodes = [_episode_row(r, g.gid in {k.gid for k in kept}) for g in groups for r in g.results.values()]
        metrics = _metrics(kept, episodes, flush, harness_error)
        metrics |= {
            "time/agent_collect": t_collect,
            "time/agent_flush": t_end - t0 - t_collect,
            "time/agent_rollout": t_end - t0,
            "agent/buffer_groups": len(self.buffer),
            "agent/groups_started": len(groups),
            "agent/episodes_unreported": len(outstanding),
        }
        return AgentStep(
            groups=[[g.results[e] for e in g.episode_ids] for g in kept],
            episodes=episodes,
            flush=flush,
            metrics=metrics,
        )

    def _start(self, step: int) -> list[_Group]:
        n = math.ceil(self.cfg.oversample_factor * self.num_groups)
        seeds = self.buffer[:n]
        self.buffer = self.buffer[n:]
        rng = random.Random(self.seed * 1_000_003 + step)
        seeds += [rng.randrange(1 << 30) for _ in range(n - len(seeds))]
        ports = list(self.instances)
        groups, specs = [], []
        for gid, task_seed in enumerate(seeds):
            g = _Group(gid=gid, task_seed=task_seed, episode_ids=[])
            for i in range(self.group_size):
                port = ports[len(specs) % len(ports)]
                eid = f"s{step}-g{gid}-{i}-{rng.randrange(1 << 20):05x}"
                slow = rng.random() < self.cfg.slow_test_fraction
                specs.append(
                    {
                        "episode_id": eid,
                        "rollout_id": self.rollout_id,
                        "step": step,
                        "group": gid,
                        "task_seed": task_seed,
                        "instance_id": self.instances[port],
                        "max_turns": self.cfg.max_turns,
                        "max_tokens": self.cfg.max_tokens_per_turn,
                        "temperature": self.temperature,
                        "slow_s": self.cfg.slow_test_s * slow,
                        "timeout_s": self.cfg.episode_timeout_s,
                        "test_timeout_s": self.cfg.test_timeout_s,
                    }
                )
                g.episode_ids.append(eid)
            groups.append(g)
        r = self._client.post(f"{self.harness_url}/episodes", json={"episodes": specs})
        if r.status_code != 200:
            raise RuntimeError(
                f"the harness at {self.harness_url} refused the episodes: {r.status_code} {r.text[:300]}"
            )
        return groups

    def _gather(
        self, groups: list[_Group], outstanding: set[str], *, enough: bool, wait_s: float | None = None
    ) -> tuple[list[_Group], str]:
        """Read results until ``num_groups`` groups are complete (enough) or nothing is outstanding; bounded."""
        by_id = {eid: g for g in groups for eid in g.episode_ids}
        done: list[_Group] = [g for g in groups if g.complete]
        deadline = time.monotonic() + (wait_s if wait_s is not None else self.cfg.episode_timeout_s + 30.0)
        failures = 0
        while outstanding and time.monotonic() < deadline and not (enough and len(done) >= self.num_groups):
            try:
                r = self._client.get(f"{self.harness_url}/results", params={"cursor": self._cursor, "wait_s": 1.0})
                r.raise_for_status()
                body = r.json()
                failures = 0
            except httpx.HTTPError as e:
                failures += 1
                if failures > self.cfg.flush_retries + 2:
                    why = self._lose(groups, outstanding, f"the harness stopped answering: {e}")
                    return (done + [g for g in groups if g not in done])[: self.num_groups], why
                time.sleep(0.2)
                continue
            self._cursor = body["cursor"]
            for res in body["results"]:
                g = by_id.get(res["episode_id"])
                if g is not None and res["episode_id"] in outstanding:
                    outstanding.discard(res["episode_id"])
                    g.results[res["episode_id"]] = res
                    if g.complete:
                        done.append(g)
        if enough and outstanding and len(done) < self.num_groups:  # deadline: the rest count as zero-reward timeouts
            why = self._lose(groups, outstanding, "the rollout deadline passed")
            return (done + [g for g in groups if g not in done])[: self.num_groups], why
        return done[: self.num_groups], ""

    def _lose(self, groups: list[_Group], outstanding: set[str], why: str) -> str:
        """Episodes that will never report become zero-reward samples that say why (never a hang)."""
        for g in groups:
            for eid in g.episode_ids:
                if eid in outstanding:
                    g.results[eid] = {
                        "episode_id": eid,
                        "group": g.gid,
                        "task_seed": g.task_seed,
                        "status": "lost",
                        "reward": 0.0,
                        "passed": False,
                        "error": why,
                        "num_turns": 0,
                        "num_tool_calls": 0,
                        "num_malformed": 0,
                        "seconds": 0.0,
                        "test_seconds": 0.0,
                        "record": None,
                        "transcript": [],
                        "instance_id": "",
                    }
        outstanding.clear()
        return why

    def _requeue(self, dropped: list[_Group]) -> None:
        if self.cfg.abort_partial == "buffer":
            self.buffer += [g.task_seed for g in dropped]

    # ---- flush --------------------------------------------------------------------------------------------
    def flush_all(self, step: int = -1) -> list[FlushResult]:
        """Flush every instance concurrently; each gets flush_timeout_s per attempt and flush_retries retries.
        With ``step``, each instance also refuses this rollout's sessions for that step or an earlier one afterwards
        (an open that was queued on a stalled instance must not leave a session behind once it runs)."""
        with ThreadPoolExecutor(max_workers=len(self.instances), thread_name_prefix="flush") as pool:
            return list(pool.map(lambda kv: self.flush_instance(*kv, step=step), self.instances.items()))

    def flush_instance(self, port: int, instance_id: str, step: int = -1) -> FlushResult:
        res = FlushResult(instance_id=instance_id, port=port)
        t0 = time.perf_counter()
        timeout = self.cfg.flush_timeout_s
        with httpx.Client(timeout=httpx.Timeout(timeout, connect=min(timeout, 2.0)), headers=self.headers) as client:
            for attempt in range(1 + self.cfg.flush_retries):
                res.attempts = attempt + 1
                errors = []
                if not res.session:
                    try:
                        r = client.post(
                            f"{self.session_url(port)}/flush",
                            json={"timeout_s": timeout / 2, "rollout": self.rollout_id, "step": step},
                        )
                        r.raise_for_status()
                        res.session = r.json()
                    except httpx.HTTPError as e:
                        errors.append(f"session server {self.session_url(port)}: {type(e).__name__}: {e}")
                try:  # the harness side runs even when the session server is gone: its sandboxes still go
                    r = client.post(
                        f"{self.harness_url}/flush", json={"instance_id": instance_id, "timeout_s": timeout / 2}
                    )
                    r.raise_for_status()
                    res.harness = r.json()
                    if res.harness.get("still_running") or res.harness.get("sandboxes_left"):
                        errors.append(
                            f"harness: still running {res.harness['still_running'][:3]}, "
                            f"sandboxes left {res.harness['sandboxes_left'][:3]}"
                        )
                except httpx.HTTPError as e:
                    errors.append(f"harness {self.harness_url}: {type(e).__name__}: {e}")
                res.error = "; ".join(errors)
                res.ok = not errors
                if res.ok:
                    break
        res.seconds = time.perf_counter() - t0
        return res

    def _harness_cursor(self) -> int:
        r = self._client.get(f"{self.harness_url}/results", params={"cursor": 1 << 62, "wait_s": 0})
        r.raise_for_status()
        return r.json()["cursor"]

    def close(self) -> None:
        self._client.close()


def _episode_row(r: dict, kept: bool) -> dict:
    rec = r.get("record") or {}
    return {
        "episode_id": r["episode_id"],
        "group": r.get("group", -1),
        "instance_id": r.get("instance_id", ""),
        "status": r["status"],
        "kept": kept,
        "reward": r["reward"],
        "passed": r.get("passed", False),
        "num_turns": r.get("num_turns", 0),
        "num_tool_calls": r.get("num_tool_calls", 0),
        "num_malformed": r.get("num_malformed", 0),
        "seconds": r.get("seconds", 0.0),
        "test_seconds": r.get("test_seconds", 0.0),
        "num_tokens": len(rec.get("token_ids", [])),
        "num_policy_tokens": sum(rec.get("loss_mask", [])),
        "error": r.get("error", ""),
    }


def _metrics(kept: list[_Group], episodes: list[dict], flush: list[FlushResult], harness_error: str) -> dict:
    rows = [e for e in episodes if e["kept"]]
    n = max(1, len(rows))
    status = {}
    for e in episodes:
        status[e["status"]] = status.get(e["status"], 0) + 1
    out = {
        "agent/groups_kept": len(kept),
        "agent/reward": sum(e["reward"] for e in rows) / n,
        "agent/pass_rate": sum(e["passed"] for e in rows) / n,
        "agent/turns": sum(e["num_turns"] for e in rows) / n,
        "agent/tool_calls": sum(e["num_tool_calls"] for e in rows) / n,
        "agent/malformed_turns": sum(e["num_malformed"] for e in rows) / n,
        "agent/test_seconds": sum(e["test_seconds"] for e in rows) / n,
        **{f"agent/episodes_{k}": v for k, v in sorted(status.items())},
    }
    if flush:
        failed = [f.instance_id for f in flush if not f.ok]
        out |= {
            "flush/instances": len(flush),
            "flush/ok": len(flush) - len(failed),
            "flush/failed": len(failed),
            "flush/failed_instances": ",".join(failed),
            "flush/max_seconds": max(f.seconds for f in flush),
            "flush/sessions_aborted": sum(f.session.get("aborted_sessions", 0) for f in flush),
            "flush/episodes_cancelled": sum(f.harness.get("cancelled", 0) for f in flush),
        }
        out |= {
            f"flush/{f.instance_id}": ("ok" if f.ok else f"failed after {f.attempts}: {f.error[:200]}") for f in flush
        }
    if harness_error:
        out["agent/harness_error"] = harness_error
    return out


def flush_rows(flush: list[FlushResult]) -> list[dict]:
    """Flush results as plain rows (tables in notebooks and benchmark JSON)."""
    return [
        {k: v for k, v in asdict(f).items() if k not in ("session", "harness")}
        | {
            "sessions_aborted": f.session.get("aborted_sessions", 0),
            "episodes_cancelled": f.harness.get("cancelled", 0),
        }
        for f in flush
    ]
