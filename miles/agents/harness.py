"""The local agent harness: a server that runs SWE-style episodes against session servers, CPU side.

Each episode gets a sandbox (a temp directory holding a tiny repository with a failing test), opens a session
on its session-server instance, and loops: the model's reply -> tool calls (list_files, read_file, edit_file,
run_test, submit) executed in the sandbox -> tool results back as messages. After the last turn the test
runs once more; reward = 1 if it passes. Every episode is tagged with the instance id of its session server,
so a flush of that instance cancels exactly its episodes, kills their test processes and removes their
sandboxes before it returns. Every wait is bounded; a malformed call costs a turn, never a hang.
A sandbox is a directory, not an isolation boundary: the model's edits run as this user's Python. Run the
harness in a container or VM when the policy is not trusted.

Who may drive it: the session servers ("the model") are fixed when the harness starts (``--instance ID=URL``); a
request names an instance by id and can never point the harness at a server of its choosing. Every request but
/health needs the run token (miles.agents.run_token), and the HTTP guard refuses foreign Host headers, cross-site
requests and non-JSON bodies (miles.http_guard). An ``episode_id`` is a name, never a path (miles.agents.sandbox).

    MILES_AGENT_TOKEN=... python -m miles.agents.harness --port 8090 --instance agent-8100=http://127.0.0.1:8100
    POST /episodes {"episodes": [EpisodeSpec fields]}   GET /results?cursor=0&wait_s=2 (long poll)
    POST /flush {"instance_id": "agent-8100"}           GET /episodes  GET /sandboxes  GET /health
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from fastapi import Body, FastAPI, HTTPException

from miles.agents.run_token import KEY_HINT, server_token, token_headers
from miles.agents.sandbox import Sandboxes, check_episode_id
from miles.agents.swe_tasks import RepoTask, make_task
from miles.agents.tool_calls import format_tool_call
from miles.http_connections import guarded_protocol
from miles.http_guard import HttpGuard, allowed_hosts

SYSTEM = (
    "You fix bugs in a small repository. Call one tool per turn by writing <tool> then a JSON object, e.g. "
    + format_tool_call("read_file", path="util.py")
    + ". Tools: list_files(), read_file(path), "
    "edit_file(path, old, new), run_test(), submit()."
)


@dataclass(kw_only=True, slots=True)
class EpisodeSpec:
    episode_id: str
    rollout_id: str = ""  # the AgentRollout that started it; with step, it fences late opens after a flush
    step: int = -1  # the rollout step; a session server refuses opens for a step of that rollout it has flushed
    group: int = 0  # prompt group within the rollout step
    task_seed: int = 0
    instance_id: str  # the session-server instance this episode talks to (one the harness was started with)
    max_turns: int = 4
    max_tokens: int = 48
    temperature: float = 1.0
    slow_s: float = 0.0  # the test sleeps this long each run (CPU-side long tail)
    timeout_s: float = 120.0
    test_timeout_s: float = 30.0

    @classmethod
    def parse(cls, d: dict) -> "EpisodeSpec":
        if not isinstance(d, dict):
            raise ValueError(f"an episode is a JSON object of EpisodeSpec fields, not {str(d)[:80]!r}")
        if "session_url" in d:
            raise ValueError(
                "session_url is not accepted: the harness talks only to the session servers it was started with "
                "(--instance ID=URL); name one by instance_id"
            )
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown episode field(s) {sorted(unknown)}; valid: {sorted(names)}")
        spec = cls(**d)
        check_episode_id(spec.episode_id)
        return spec


class Aborted(Exception):
    """The episode's session was flushed on its instance."""


class Harness:
    """Runs episodes as asyncio tasks in one event loop (the server's).

    harness = Harness("/tmp/miles-harness", instances={"agent-8100": "http://127.0.0.1:8100"}, token=token)
    harness.start([EpisodeSpec(...), ...])            # returns at once
    results, cursor = await harness.results(0, wait_s=2.0)
    await harness.flush("agent-8100")                 # cancels that instance's episodes, removes their sandboxes
    harness.close()                                   # at exit: removes what it created, nothing else
    """

    def __init__(self, root: str | os.PathLike | None = None, *, instances: dict[str, str], token: str):
        self.owns_root = not root or not Path(root).exists()
        self.root = Path(root or tempfile.mkdtemp(prefix="miles-harness-"))
        self.root.mkdir(parents=True, exist_ok=True)
        self.boxes = Sandboxes(self.root)
        self.instances = {iid: url.rstrip("/") for iid, url in instances.items()}  # the only servers it talks to
        self.token = token
        self.tasks: dict[str, asyncio.Task] = {}
        self.specs: dict[str, EpisodeSpec] = {}
        self.phase: dict[str, str] = {}
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.finished: list[dict] = []  # results, oldest first; cursors count from the first result ever
        self._dropped = 0  # results trimmed off the front of `finished` (a long run keeps the last ones only)
        self._new_result = asyncio.Event()
        self._client = None

    @property
    def client(self):
        import httpx

        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(300.0, connect=5.0), headers=token_headers(self.token)
            )
        return self._client

    def start(self, specs: list[EpisodeSpec]) -> list[str]:
        ids = [s.episode_id for s in specs]
        dup = [e for e in ids if e in self.tasks] + [e for i, e in enumerate(ids) if e in ids[:i]]
        if dup:
            raise ValueError(f"episode id(s) {dup[:5]} are already running or repeated; use fresh ids")
        for s in specs:
            self.boxes.path(s.episode_id)  # a name whose sandbox would fall outside the root is refused here
        unknown = sorted({s.instance_id for s in specs} - set(self.instances))
        if unknown:
            raise ValueError(
                f"instance_id(s) {unknown[:5]} are not instances of this harness ({sorted(self.instances)}); "
                "start it with --instance ID=URL for each session server"
            )
        for s in specs:
            self.specs[s.episode_id] = s
            self.tasks[s.episode_id] = asyncio.get_running_loop().create_task(self._episode(s))
        return [s.episode_id for s in specs]

    async def results(self, cursor: int, wait_s: float) -> tuple[list[dict], int]:
        if cursor >= self._dropped + len(self.finished) and wait_s > 0:
            self._new_result.clear()
            try:
                await asyncio.wait_for(self._new_result.wait(), timeout=wait_s)
            except asyncio.TimeoutError:
                pass
        return self.finished[max(0, cursor - self._dropped) :], self._dropped + len(self.finished)

    async def flush(self, instance_id: str, timeout_s: float = 5.0) -> dict:
        t0 = time.perf_counter()
        ids = [eid for eid, s in self.specs.items() if s.instance_id == instance_id and eid in self.tasks]
        for eid in ids:
            self._kill(eid)
            self.tasks[eid].cancel()
        pending = [self.tasks[eid] for eid in ids if eid in self.tasks]
        if pending:
            await asyncio.wait(pending, timeout=timeout_s)
        left = [eid for eid in ids if eid in self.tasks]
        sandboxes = [eid for eid in ids if (self.root / eid).exists()]
        return {
            "instance_id": instance_id,
            "cancelled": len(ids),
            "still_running": left,
            "sandboxes_left": sandboxes,
            "seconds": time.perf_counter() - t0,
        }

    def running(self) -> dict:
        return {
            eid: {"instance_id": self.specs[eid].instance_id, "phase": self.phase.get(eid, "")} for eid in self.tasks
        }

    def sandboxes(self) -> list[str]:
        return self.boxes.names()

    def close(self) -> None:
        """Kill the tests still running and remove the sandboxes this harness created (and its root, if it made it
        and it is empty); nothing else is touched."""
        for eid in list(self.procs):
            self._kill(eid)
        self.boxes.remove_all()
        if self.owns_root:
            try:
                self.root.rmdir()
            except OSError:
                pass

    # ---- one episode ----------------------------------------------------------------------------------------
    async def _episode(self, spec: EpisodeSpec) -> None:
        t0 = time.perf_counter()
        out = {
            **asdict(spec),
            "status": "completed",
            "reward": 0.0,
            "passed": False,
            "num_turns": 0,
            "num_tool_calls": 0,
            "num_malformed": 0,
            "error": "",
            "test_output": "",
            "test_seconds": 0.0,
            "transcript": [],
            "record": None,
        }
        box = None
        try:
            task = make_task(spec.task_seed).with_slow_test(spec.slow_s)
            box = self.boxes.create(spec.episode_id, task.files)
            async with asyncio.timeout(spec.timeout_s):
                await self._converse(spec, task, box, out)
                self.phase[spec.episode_id] = "final_test"
                passed, text, secs = await self._run_test(spec, task, box)
                out.update(
                    passed=passed,
                    reward=float(passed),
                    test_output=text[-400:],
                    test_seconds=out["test_seconds"] + secs,
                )
        except asyncio.CancelledError:
            out.update(status="cancelled", reward=0.0, error=f"flushed with instance {spec.instance_id}")
            self._finish(spec, box, out, t0)
            raise
        except TimeoutError:
            out.update(status="timeout", reward=0.0, error=f"episode ran past timeout_s = {spec.timeout_s}")
        except Aborted as e:
            out.update(status="aborted", reward=0.0, error=str(e))
        except Exception as e:  # a crash inside the episode is a zero-reward sample with its reason, never a hang
            out.update(status="error", reward=0.0, error=f"{type(e).__name__}: {e}")
        self._finish(spec, box, out, t0)

    def _finish(self, spec: EpisodeSpec, box: Path | None, out: dict, t0: float) -> None:
        self._kill(spec.episode_id)
        self.boxes.remove(box)
        out["seconds"] = time.perf_counter() - t0
        self.tasks.pop(spec.episode_id, None)
        self.specs.pop(spec.episode_id, None)
        self.phase.pop(spec.episode_id, None)
        self.finished.append(out)
        if len(self.finished) > 20_000:
            del self.finished[:10_000]
            self._dropped += 10_000
        self._new_result.set()

    async def _converse(self, spec: EpisodeSpec, task: RepoTask, box: Path, out: dict) -> None:
        url = self.instances[spec.instance_id]
        sid = (
            await self._post(
                f"{url}/sessions",
                {"metadata": {"episode_id": spec.episode_id, "rollout": spec.rollout_id, "step": spec.step}},
            )
        )["session_id"]
        out["session_id"] = sid
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.description}]
        try:
            for _ in range(spec.max_turns):
                self.phase[spec.episode_id] = f"turn {out['num_turns']}"
                reply = await self._post(
                    f"{url}/sessions/{sid}/v1/chat/completions",
                    {"messages": messages, "max_tokens": spec.max_tokens, "temperature": spec.temperature},
                )
                if reply is None:  # the context is full: the episode ends, the final test decides
                    break
                out["num_turns"] += 1
                msg = reply["choices"][0]["message"]
                calls = msg.get("tool_calls") or []
                messages.append(
                    {
                        "role": "assistant",
                        "content": msg.get("content") or "",
                        **({"tool_calls": calls} if calls else {}),
                    }
                )
                if not calls:
                    out["num_malformed"] += 1
                    errors = reply.get("miles", {}).get("tool_call_errors") or ["no <tool> call in the reply"]
                    messages.append(
                        {
                            "role": "user",
                            "content": f"error: {'; '.join(errors)[:200]}. Call a tool, e.g. "
                            + format_tool_call("list_files"),
                        }
                    )
                    continue
                results, done = [], False
                for call in calls:
                    text, done = await self._tool(spec, task, box, call, out)
                    results.append(text)
                    out["num_tool_calls"] += 1
                    if done:
                        break
                messages.append({"role": "tool", "content": "\n".join(results)[:2000]})
                if done:
                    break
            out["record"] = await self._post(f"{url}/sessions/{sid}", None, method="DELETE")
        finally:
            out["transcript"] = messages

    async def _post(self, url: str, body, method: str = "POST"):
        r = await self.client.request(method, url, json=body)
        if r.status_code == 409:
            raise Aborted(r.json().get("error", {}).get("message", r.text))
        if r.status_code == 400 and r.json().get("error", {}).get("code") == "context_length_exceeded":
            return None
        if r.status_code >= 400:
            raise RuntimeError(f"{method} {url} answered {r.status_code}: {r.text[:300]}")
        return r.json()

    async def _tool(self, spec: EpisodeSpec, task: RepoTask, box: Path, call: dict, out: dict) -> tuple[str, bool]:
        fn = call.get("function", {})
        name = fn.get("name", "")
        try:
            args = json.loads(fn.get("arguments") or "{}")
            if name == "list_files":
                return "\n".join(sorted(p.name for p in box.iterdir())), False
            if name == "read_file":
                return _inside(box, args["path"]).read_text()[:2000], False
            if name == "edit_file":
                path = _inside(box, args["path"])
                text = path.read_text()
                if args["old"] not in text:
                    return f"error: {args['old']!r} is not in {args['path']}", False
                path.write_text(text.replace(args["old"], args["new"], 1))
                return f"edited {args['path']}", False
            if name == "run_test":
                passed, text, secs = await self._run_test(spec, task, box)
                out["test_seconds"] += secs
                return ("PASS\n" if passed else "FAIL\n") + text[-800:], False
            if name == "submit":
                return "submitted", True
            return f"error: unknown tool {name!r}; tools: list_files, read_file, edit_file, run_test, submit", False
        except (KeyError, TypeError, ValueError, OSError) as e:
            return f"error: {name} failed: {type(e).__name__}: {e}", False

    async def _run_test(self, spec: EpisodeSpec, task: RepoTask, box: Path) -> tuple[bool, str, float]:
        t0 = time.perf_counter()
        if not (box / task.test_file).exists():
            raise FileNotFoundError(f"sandbox {box} lost {task.test_file}; the episode cannot be scored")
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-E",
            "-s",
            task.test_file,
            cwd=box,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
        self.procs[spec.episode_id] = proc
        try:
            stdout, _ = await asyncio.wait_for(proc.communicate(), timeout=spec.test_timeout_s)
        except asyncio.TimeoutError:
            return False, f"test ran past test_timeout_s = {spec.test_timeout_s}", time.perf_counter() - t0
        finally:
            self._kill(spec.episode_id)
        return proc.returncode == 0, stdout.decode(errors="replace"), time.perf_counter() - t0

    def _kill(self, eid: str) -> None:
        proc = self.procs.pop(eid, None)
        if proc is not None and proc.returncode is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _inside(box: Path, rel) -> Path:
    path = (box / str(rel)).resolve()
    if box.resolve() not in path.parents:
        raise ValueError(f"path {rel!r} is outside the repository")
    return path


def create_app(harness: Harness, *, host: str = "127.0.0.1") -> FastAPI:
    """The harness's HTTP surface behind the guard: the run token on every path but /health, Host names of
    loopback and ``host`` (the bound address)."""
    if not harness.token:
        raise ValueError("the harness needs a run token (miles.agents.run_token.new_token()); it never serves without")
    app = FastAPI(title="miles agent harness")
    app.add_middleware(HttpGuard, api_key=harness.token, allowed_hosts=allowed_hosts(host), key_hint=KEY_HINT)

    @app.post("/episodes")
    async def start(body: dict = Body(...)):
        try:
            episodes = body.get("episodes", [])
            if not isinstance(episodes, list):
                raise ValueError(f"'episodes' must be a list of episode objects, not {type(episodes).__name__}")
            specs = [EpisodeSpec.parse(d) for d in episodes]
            return {"started": harness.start(specs)}
        except (TypeError, ValueError) as e:
            raise HTTPException(400, f"bad episode spec: {e}") from None

    @app.get("/results")
    async def results(cursor: int = 0, wait_s: float = 0.0):
        out, nxt = await harness.results(max(0, cursor), min(max(0.0, wait_s), 30.0))
        return {"results": out, "cursor": nxt}

    @app.post("/flush")
    async def flush(body: dict = Body(...)):
        if not isinstance(body.get("instance_id"), str):
            raise HTTPException(400, "POST /flush needs {'instance_id': '<id>'}")
        return await harness.flush(body["instance_id"], float(body.get("timeout_s", 5.0)))

    @app.get("/episodes")
    async def episodes():
        return harness.running()

    @app.get("/sandboxes")
    async def sandboxes():
        return {"root": str(harness.root), "sandboxes": harness.sandboxes()}

    @app.get("/health")
    async def health():
        return {
            "running": len(harness.tasks),
            "finished": harness._dropped + len(harness.finished),
            "root": str(harness.root),
        }

    return app


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    p = argparse.ArgumentParser(prog="python -m miles.agents.harness")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--root", default="", help="directory for sandboxes (default: a fresh temp dir)")
    p.add_argument("--parent-pid", type=int, default=0, help="exit (removing its sandboxes) when this process is gone")
    p.add_argument(
        "--instance",
        action="append",
        default=[],
        metavar="ID=URL",
        help="a session server episodes may talk to, e.g. agent-8100=http://127.0.0.1:8100 (repeat per instance)",
    )
    p.add_argument(
        "--token-file",
        default="",
        help="file (mode 600) holding the run token; default $MILES_AGENT_TOKEN, else a fresh one (path printed)",
    )
    a = p.parse_args(argv)
    instances = _instances(p, a.instance)
    harness = Harness(a.root or None, instances=instances, token=server_token("miles harness", a.token_file))
    if a.parent_pid:
        import threading

        threading.Thread(target=_exit_with_parent, args=(a.parent_pid, harness), daemon=True).start()
    app = create_app(harness, host=a.host)
    uvicorn.run(app, host=a.host, port=a.port, log_level="warning", http=guarded_protocol())
    return 0


def _instances(p: argparse.ArgumentParser, pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        iid, sep, url = pair.partition("=")
        if not sep or not iid or not url.startswith(("http://", "https://")):
            p.error(f"--instance {pair!r} should be ID=URL, e.g. agent-8100=http://127.0.0.1:8100")
        out[iid] = url
    return out


def _exit_with_parent(pid: int, harness: Harness) -> None:
    """A harness started for a run must not outlive it (a Ray actor can be killed without running atexit)."""
    while True:
        time.sleep(1.0)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            harness.close()
            os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main())
