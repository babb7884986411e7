"""A Python tool: the model's code run in a child process under resource limits, without network.

What it limits: CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS), the size of any file it writes
(RLIMIT_FSIZE), open files (RLIMIT_NOFILE), no core dumps, wall time (the process group is killed), the output
returned (truncated), and the environment (empty but PATH; the run token and keys never reach it). Network: the
child runs in a new network namespace (``unshare -n``, or ``unshare -rn`` without root where unprivileged user
namespaces are on), where only a loopback that is down exists, so no connection leaves it, to this machine's
servers or elsewhere. Where ``unshare`` cannot make one, ``NETWORK_ISOLATED`` is False, the tool's result says
so, and the network is NOT isolated.

What it does NOT isolate: the filesystem (the code reads and writes what this user may; it starts in a fresh
temporary directory that is removed afterwards, nothing more), other processes of this user (signals, /proc),
the number of processes (RLIMIT_NPROC does not bind root), and the kernel (no seccomp). It is a fence against
runaway model code, not a security boundary: run the trainer in a container or VM when the policy or its data is
not trusted.

    out = run_python("print(17 * 23)")          # RunResult(stdout='391\\n', stderr='', exit_code=0, ...)
    env = PythonEnv()                            # the calculator's rows, with a python(code) tool instead
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass

from miles.envs.calculator import NUMBER, _same_number

TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python 3 code and return what it prints (no network, limited time and memory).",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "e.g. print(17 * 23)"}},
            "required": ["code"],
        },
    },
}
MAX_CONCURRENT = max(1, (os.cpu_count() or 2))  # children at once in this process (each is CPU-bound)
_slots = threading.BoundedSemaphore(MAX_CONCURRENT)


@dataclass(frozen=True, slots=True)
class Limits:
    wall_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 512
    file_mb: int = 16
    open_files: int = 64
    output_chars: int = 2000


@dataclass(frozen=True, slots=True)
class RunResult:
    stdout: str
    stderr: str
    exit_code: int  # negative: killed by that signal
    timed_out: bool
    network_isolated: bool


def _unshare_prefix() -> list[str]:
    """The command prefix that gives the child its own network namespace, or [] when none can be made here."""
    exe = shutil.which("unshare")
    if exe is None:
        return []
    for flags in (["-n"], ["-rn"]):
        try:
            if subprocess.run([exe, *flags, "true"], capture_output=True, timeout=10).returncode == 0:
                return [exe, *flags]
        except (OSError, subprocess.TimeoutExpired):
            continue
    return []


UNSHARE = _unshare_prefix()
NETWORK_ISOLATED = bool(UNSHARE)


def _limit(limits: Limits):
    def apply():
        mb = 1 << 20
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mb * mb, limits.memory_mb * mb))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_mb * mb, limits.file_mb * mb))
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def run_python(code: str, limits: Limits = Limits()) -> RunResult:
    """Run ``code`` with ``python -I`` in a fresh temporary directory under ``limits``; never raises for what the code
    does (errors, kills and time-outs come back in the result)."""
    workdir = tempfile.mkdtemp(prefix="miles-python-tool-")
    cmd = [*UNSHARE, sys.executable, "-I", "-c", code]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONDONTWRITEBYTECODE": "1"}
    with _slots:
        try:
            proc = subprocess.Popen(
                cmd, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                preexec_fn=_limit(limits), start_new_session=True,
            )  # fmt: skip
            timed_out = False
            try:
                out, err = proc.communicate(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc.pid)
                out, err = proc.communicate()
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    cut = limits.output_chars
    return RunResult(
        stdout=out.decode(errors="replace")[:cut],
        stderr=err.decode(errors="replace")[-cut:],
        exit_code=proc.returncode,
        timed_out=timed_out,
        network_isolated=NETWORK_ISOLATED,
    )


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def tool_text(r: RunResult) -> str:
    """A run as the tool message the model reads."""
    if r.timed_out:
        return "error: the code ran past its time limit and was stopped"
    if r.exit_code != 0:
        tail = r.stderr.strip().splitlines()[-1:] or [f"exit code {r.exit_code}"]
        return (r.stdout + f"\nerror: {tail[0]}").strip()
    return r.stdout.strip() or "(no output)"


class PythonEnv:
    """Arithmetic rows (miles.envs.calculator's) answered with a ``python(code)`` tool; reward 1 for the right number.
    One instance per episode; ``limits`` as keyword arguments (wall_s, cpu_s, memory_mb, ...)."""

    def __init__(self, max_calls: int = 4, **limits):
        self.limits, self.max_calls = Limits(**limits), max_calls
        self.answer, self.calls = "", 0

    def reset(self, row: dict) -> tuple[list[dict], list[dict]]:
        self.answer, self.calls = str(row["answer"]).strip(), 0
        return [{"role": "user", "content": row["prompt"]}], [TOOL]

    def step(self, message: dict) -> tuple[list[dict], float, bool, dict]:
        calls = message.get("tool_calls") or []
        if calls:
            if self.calls >= self.max_calls:
                return [], 0.0, True, {"passed": False, "tool_calls": self.calls}
            self.calls += len(calls)
            return (
                [self._run(c) for c in calls],
                0.0,
                False,
                {"tool_calls": self.calls, "network_isolated": NETWORK_ISOLATED},
            )
        found = NUMBER.findall(message.get("content") or "")
        passed = bool(found) and _same_number(found[-1], self.answer)
        return [], float(passed), True, {"passed": passed, "tool_calls": self.calls}

    def _run(self, call: dict) -> dict:
        fn = call.get("function") or {}
        code = (fn.get("arguments") or {}).get("code")
        if fn.get("name") != "python" or not isinstance(code, str):
            content = "error: the tool is python(code) with the code as a string"
        else:
            content = tool_text(run_python(code, self.limits))
        return {"role": "tool", "content": content, "name": "python"}

    def expert_reply(self, messages: list[dict], fmt) -> str:
        last = messages[-1]
        if last["role"] == "user":
            expression = last["content"].split("What is ", 1)[1].split("?", 1)[0]
            return fmt.call_text("python", {"code": f"print({expression})"})
        return f"The answer is {last['content']}."
