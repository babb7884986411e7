"""Environments for the tests: a short two-turn conversation, and one that fails the way a row's metadata says."""

from __future__ import annotations

import time


class TwoTurnEnv:
    """Asks twice; each reply earns 0.25, the second one ends the episode."""

    def __init__(self, turns: int = 2):
        self.turns, self.n = turns, 0

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}], []

    def step(self, message):
        self.n += 1
        if self.n >= self.turns:
            return [], 0.25, True, {"passed": False}
        return [{"role": "user", "content": "again"}], 0.25, False, {}


class FaultyEnv(TwoTurnEnv):
    """row metadata 'fault': raise | hang | garbage | nan | reset_raises | none."""

    def reset(self, row):
        self.fault = row["metadata"].get("fault", "none")
        if self.fault == "reset_raises":
            raise RuntimeError("the environment server is down")
        return super().reset(row)

    def step(self, message):
        if self.fault == "raise":
            raise KeyError("tool")
        if self.fault == "hang":
            time.sleep(60)
        if self.fault == "garbage":
            return "nonsense"
        if self.fault == "nan":
            return [], float("nan"), True, {}
        return super().step(message)
