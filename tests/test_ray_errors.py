"""Errors from Ray actors reach the terminal as one line with the root cause, and nothing else of Ray's does: a
constructor's KeyError (Ray's ActorDiedError), a method's ValueError (RayTaskError), an actor whose process died;
the worker's coloured creation-task traceback and Ray's start-up warnings are not forwarded, while the actors'
own output is."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.procs  # it starts processes or servers (tests/conftest.py: the tiers)

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import os, sys, threading, time
    import ray
    from miles.cli.errors import explain
    from miles.cluster import start_ray

    @ray.remote(num_cpus=0)
    class Chatty:
        def say(self, text):
            print(text, file=sys.stderr, flush=True)
            return 1

    @ray.remote(num_cpus=0)
    class Boom:
        def __init__(self):
            raise KeyError("checkpoint /x lacks 30 tensors; is it the same architecture?")

        def ping(self):
            return 1

    @ray.remote(num_cpus=0)
    class Method:
        def fail(self):
            raise ValueError("rollout.x = 3 is bad; use 2")

        def die(self):
            os._exit(7)

    def run():
        start_ray(num_cpus=2)
        chatty = Chatty.remote()
        ray.get(chatty.say.remote("a real log line before"))
        calls = (lambda: Boom.remote().ping.remote(), lambda: Method.remote().fail.remote(),
                 lambda: Method.remote().die.remote())
        for call in calls:
            try:
                ray.get(call())
            except Exception as e:
                print("LINE", repr(explain(e)), flush=True)
        time.sleep(3)  # Ray's log monitor forwards the workers' lines about every half second
        ray.get(chatty.say.remote("a real log line after"))
        time.sleep(3)
        ray.shutdown()

    # off the main thread, as a notebook's run panel starts Ray (the thread lives as long as the cluster: Ray's
    # processes die with the thread that started them)
    t = threading.Thread(target=run)
    t.start()
    t.join()
    """
)


def test_actor_errors_are_one_line_with_the_cause_and_no_ray_traceback_or_warning_reaches_the_terminal(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_DEDUP_LOGS": "0"}
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [line.removeprefix("LINE ") for line in r.stdout.splitlines() if line.startswith("LINE ")]
    assert lines[0] == repr(
        (1, "failed: KeyError: checkpoint /x lacks 30 tensors; is it the same architecture? (in Boom.__init__)")
    )
    assert lines[1] == repr((2, "error: rollout.x = 3 is bad; use 2 (in Method.fail)"))
    code, died = eval(lines[2])
    assert code == 1 and died.startswith("failed: ActorDiedError: the Method actor (pid ") and "\n" not in died
    assert "exit" in died.lower()  # Ray's reason: the worker process exited
    assert "a real log line before" in r.stderr and "a real log line after" in r.stderr, r.stderr[-3000:]
    for noise in (
        "Exception raised in creation task",
        "Traceback",
        "lacks 30 tensors",
        "Token authentication",
        "SIGTERM handler",
    ):
        assert noise not in r.stderr, (noise, r.stderr[-3000:])
