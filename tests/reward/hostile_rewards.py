"""Reward functions that misbehave, for the reward pool's tests (imported by the reward workers as
'hostile_rewards:NAME': the tests put this folder on the path)."""

import os
import re
import signal
import sys
import time
import uuid
import zlib

OLD_UNIT_TAIL = re.compile(r"^(-?[\d.,/]+)\s*(?:[a-zA-Z%°]+\.?\s*)+$")  # the pattern that hung the H200 run


def echo(prompt, response, target):
    return float(response)


def sleepy(prompt, response, target):
    """Sleeps ``response`` seconds, then returns it."""
    time.sleep(float(response))
    return float(response)


def hang(prompt, response, target):
    time.sleep(3600)


def boom(prompt, response, target):
    raise KeyError("boom")


def exits(prompt, response, target):
    os._exit(3)


def killed(prompt, response, target):
    os.kill(os.getpid(), signal.SIGKILL)


def redos(prompt, response, target):
    """The old unit-tail pattern in C code holding the GIL (never returns on 40 letters)."""
    return float(OLD_UNIT_TAIL.match(response) is not None)


def memory_hog(prompt, response, target):
    """Asks for ``response`` GiB at once."""
    return float(len(b"x" * (int(response) << 30)))


def nan(prompt, response, target):
    return float("nan")


def text(prompt, response, target):
    return "one"


def chatty(prompt, response, target):
    print("a reward that prints to stdout", flush=True)
    sys.stdout.buffer.write(b"\x00\x00\x00\x10garbage bytes on fd 1\n")
    sys.stdout.flush()
    return 1.0


def slow_to_load(prompt, response, target):
    return 1.0


slow_to_load.warm_up = lambda: time.sleep(2.0)


def planted(prompt, response, target):
    """One sample in ten sleeps forever and one in ten raises (by a hash of prompt and response); each writes a
    marker file into $MILES_TEST_MARKERS first, so the test knows how many it planted."""
    pick = zlib.crc32(f"{prompt}\0{response}".encode()) % 10
    if pick in (0, 1):
        kind = "hang" if pick == 0 else "raise"
        with open(os.path.join(os.environ["MILES_TEST_MARKERS"], f"{kind}-{uuid.uuid4().hex}"), "w") as f:
            f.write(f"{prompt}\n{response}")
        if kind == "hang":
            time.sleep(10**6)
        raise RuntimeError("planted error")
    return float(response.strip() == target)
