"""Agent episodes as an RL step's samples (a SampleSource): the RolloutManager's engines served as session-server
instances.

Inside a run the engines live in the RolloutManager (they receive the weight syncs), so each session-server
instance runs as a server thread of that process, one per port of ``agents.session_ports``, over an engine of
the manager; the harness is a separate process (or ``agents.harness_url``). Each kept episode becomes one
Sample: the session's exact tokens, the engine's log-probs, and the per-token mask of what the policy wrote.

    source = AgentSource(cfg, engines, tokenizer)
    samples, metrics = source.samples(step)   # the first call starts the instances and the harness
    source.score(samples, step)               # the harness's rewards are already on the samples
    source.close()

Per-episode rows go to <run_dir>/agent_episodes.jsonl.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from miles.agents.launcher import AgentProcesses, ThreadServer, free_port_range
from miles.agents.policy import EmbeddedPolicy, HttpPolicy
from miles.agents.rollout import AgentRollout
from miles.agents.run_token import TOKEN_ENV, new_token
from miles.agents.session_server import SessionServer, create_app
from miles.config import RunConfig
from miles.rollout.engine import EmbeddedEngine
from miles.samples import Sample

log = logging.getLogger("miles.agents")


class AgentSource:
    """Agent episodes as samples; the session servers and the harness start on the first ``samples`` call."""

    def __init__(self, cfg: RunConfig, engines: list, tokenizer):
        self.cfg, self.engines, self.tok = cfg, engines, tokenizer
        self.policies: list = []
        self.servers: list[ThreadServer] = []
        self.harness: AgentProcesses | None = None
        self.rollout: AgentRollout | None = None

    def _start(self) -> None:
        a, r = self.cfg.agents, self.cfg.rollout
        if not a.instances:
            raise ValueError("task.name = 'swe' needs agents.session_ports, e.g. agents.session_ports=8100-8101")
        token = run_token(a.harness_url, a.session_ports)
        self.policies = [policy_for(self.engines[i % len(self.engines)]) for i in range(len(a.instances))]
        try:
            for (port, iid), policy in zip(a.instances.items(), self.policies):
                app = create_app(SessionServer(policy, self.tok, instance_id=iid), token=token, host=a.session_host)
                self.servers.append(ThreadServer(app, port=port, host=a.session_host).start())
            url = a.harness_url
            if not url:
                instances = {iid: f"http://{a.session_host}:{port}" for port, iid in a.instances.items()}
                self.harness = AgentProcesses.start(
                    ports=[], harness_port=free_port_range(1), token=token, instances=instances
                )
                url = self.harness.harness_url
            self.rollout = AgentRollout(
                a,
                harness_url=url,
                token=token,
                num_groups=r.num_prompts_per_step,
                group_size=r.n_samples_per_prompt,
                temperature=r.temperature,
                seed=self.cfg.seed,
            )
        except BaseException:
            self.close()
            raise

    def samples(self, step: int) -> tuple[list[Sample], dict[str, float]]:
        if self.rollout is None:
            self._start()
        out = self.rollout.collect(step)
        samples = [
            episode_sample(res, len(group) * g + i, g, self.tok)
            for g, group in enumerate(out.groups)
            for i, res in enumerate(group)
        ]
        failed = [f for f in out.flush if not f.ok]
        for f in failed:
            log.warning(
                "step %d: flush of instance %s failed after %d attempt(s): %s", step, f.instance_id, f.attempts, f.error
            )
        numeric = {k: v for k, v in out.metrics.items() if isinstance(v, (int, float))}
        numeric |= {f"flush/{f.instance_id}/ok": float(f.ok) for f in out.flush}
        _append_jsonl(Path(self.cfg.run_dir) / "agent_episodes.jsonl", [{"step": step, **e} for e in out.episodes])
        return samples, numeric | {"time/generate": numeric["time/agent_rollout"]}

    def score(self, samples: list[Sample], step: int) -> dict[str, float]:
        """Nothing to do: the harness judged each episode, and its reward came with the sample."""
        return {}

    def close(self) -> None:
        for s in self.servers:
            s.stop()
        for p in self.policies:
            p.close()
        if self.harness is not None:
            self.harness.stop()


def run_token(harness_url: str, session_ports: str) -> str:
    """The run's agent token: ``$MILES_AGENT_TOKEN`` when set, else a fresh one. A harness started outside the run
    (``agents.harness_url``) must have been given the same token, so there the variable is required."""
    token = os.environ.get(TOKEN_ENV, "")
    if harness_url and not token:
        raise ValueError(
            f"agents.harness_url = {harness_url!r} is a harness started outside this run: set ${TOKEN_ENV} to the "
            "token it was started with (its --token-file, or the file it printed), and start it with "
            f"--instance agent-PORT=http://HOST:PORT for each port of agents.session_ports = {session_ports!r}"
        )
    return token or new_token()


def policy_for(engine):
    """An in-process engine gets the batching EmbeddedPolicy; an HTTP client (``.url``) gets HttpPolicy."""
    if isinstance(engine, EmbeddedEngine):
        return EmbeddedPolicy(engine)
    if isinstance(getattr(engine, "url", None), str):
        return HttpPolicy(engine.url)
    raise ValueError(
        f"agent rollouts cannot reach engine {engine!r}: need an EmbeddedEngine or a client with a .url "
        "(with several HTTP engines behind a router, use rollout.engine=embedded or one engine per instance)"
    )


def episode_sample(res: dict, index: int, group: int, tok) -> Sample:
    """One episode result -> a Sample whose tokens are the session's record (no re-tokenization)."""
    rec = res.get("record") or {}
    ids = rec.get("token_ids") or []
    if not ids:  # the episode ended before its first turn: a zero-reward sample with one masked stop token
        prompt = list(tok.apply_chat_template([{"role": "user", "content": "(no episode)"}]))
        return Sample(
            index=index,
            group=group,
            prompt="",
            target="",
            prompt_ids=prompt,
            response_ids=[tok.stop_token_ids[0]],
            rollout_log_probs=[0.0],
            finish_reason="abort",
            reward=0.0,
            metadata={"loss_mask": [0], "status": res["status"], "error": res.get("error", "")},
        )
    p = rec["prompt_len"]
    return Sample(
        index=index,
        group=group,
        prompt=tok.decode(ids[:p]),
        target="",
        prompt_ids=ids[:p],
        response_ids=ids[p:],
        rollout_log_probs=rec["log_probs"][p:],
        response_text=tok.decode(ids[p:], skip_special_tokens=False),
        finish_reason=(rec.get("finish_reasons") or ["stop"])[-1],
        reward=float(res["reward"]),
        weight_version=(rec.get("weight_versions") or [0])[-1],
        metadata={
            "loss_mask": rec["loss_mask"][p:],
            "status": res["status"],
            "episode_id": res["episode_id"],
            "num_turns": res.get("num_turns", 0),
            "instance_id": res.get("instance_id", ""),
        },
    )


def _append_jsonl(path: Path, rows: list[dict]) -> None:
    os.makedirs(path.parent, exist_ok=True)
    with open(path, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
