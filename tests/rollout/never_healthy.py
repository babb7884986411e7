"""A stand-in for an SGLang server that never comes up: it logs a line, records its pid, and sleeps.
(rollout.sglang_launcher=tests.rollout.never_healthy in tests/rollout/test_sglang_engine.py)"""

import os
import sys
import time

if __name__ == "__main__":
    with open(os.environ["MILES_TEST_PID_DIR"] + f"/{os.getpid()}", "w") as f:
        f.write(" ".join(sys.argv))
    print("loading the model: stuck on purpose", flush=True)
    time.sleep(600)
