"""The Python tool's child process: limits on CPU, memory, wall time, file size and output hold; no connection
leaves it (a server listening on this machine's loopback is out of reach); what the code does never raises here."""

from __future__ import annotations

import socket
import time

import pytest

from miles.envs.python_tool import NETWORK_ISOLATED, Limits, PythonEnv, run_python, tool_text

pytestmark = pytest.mark.procs  # it starts processes or servers (tests/conftest.py: the tiers)


def test_code_runs_and_prints():
    r = run_python("print(17 * 23)")
    assert (r.stdout, r.exit_code, r.timed_out) == ("391\n", 0, False)


def test_a_busy_loop_is_stopped_by_the_cpu_or_wall_limit():
    t0 = time.perf_counter()
    r = run_python("while True: pass", Limits(wall_s=3.0, cpu_s=1))
    assert r.exit_code != 0 and time.perf_counter() - t0 < 10
    assert "time limit" in tool_text(r) or "error" in tool_text(r)


def test_a_sleeping_child_is_killed_at_the_wall_limit():
    t0 = time.perf_counter()
    r = run_python("import time; time.sleep(30)", Limits(wall_s=1.0))
    assert r.timed_out and time.perf_counter() - t0 < 8
    assert tool_text(r) == "error: the code ran past its time limit and was stopped"


def test_memory_and_file_size_are_limited():
    r = run_python("x = bytearray(2 << 30)", Limits(memory_mb=256))
    assert r.exit_code != 0 and "MemoryError" in r.stderr
    r = run_python("open('big', 'wb').write(b'x' * (4 << 20))", Limits(file_mb=1))
    assert r.exit_code != 0  # SIGXFSZ or an OSError


def test_output_is_truncated_and_the_environment_is_empty(monkeypatch):
    monkeypatch.setenv("MILES_AGENT_TOKEN", "secret-token")
    r = run_python("import os; print(sorted(os.environ)); print('x' * 100000)", Limits(output_chars=500))
    assert len(r.stdout) == 500 and "MILES_AGENT_TOKEN" not in r.stdout


@pytest.mark.skipif(not NETWORK_ISOLATED, reason="unshare cannot make a network namespace here (documented limitation)")
def test_no_connection_leaves_the_child_not_even_to_this_machines_loopback():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        code = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); print('connected')"
        with socket.create_connection(("127.0.0.1", port), timeout=2):  # reachable from here
            pass
        r = run_python(code)
        assert "connected" not in r.stdout and r.exit_code != 0, r
        assert "unreachable" in r.stderr or "refused" in r.stderr or "OSError" in r.stderr
    finally:
        server.close()


def test_the_python_env_answers_calls_and_scores_the_answer():
    env = PythonEnv()
    env.reset({"prompt": "What is 17 * 23 + 4? Give the final answer as a number.", "answer": "395"})
    call = {"type": "function", "function": {"name": "python", "arguments": {"code": "print(17 * 23 + 4)"}}}
    new, reward, done, info = env.step({"role": "assistant", "content": "", "tool_calls": [call]})
    assert new == [{"role": "tool", "content": "395", "name": "python"}] and not done and reward == 0.0
    bad = {"type": "function", "function": {"name": "python", "arguments": {"code": "1/0"}}}
    new, *_ = env.step({"role": "assistant", "content": "", "tool_calls": [bad]})
    assert new[0]["content"].startswith("error: ZeroDivisionError")
    assert env.step({"role": "assistant", "content": "The answer is 395."})[1:3] == (1.0, True)
