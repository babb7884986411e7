"""Run directories for the dashboard tests, written with the same writers the driver uses."""

from __future__ import annotations

import pytest

from miles.dashboard.synthetic import synthetic_run

LONG_TOKENS = 65536


@pytest.fixture(scope="session")
def long_run_dir(tmp_path_factory):
    """Three steps; sample row 1 of step 3 has 65,536 tokens (2,048 of them prompt)."""
    return synthetic_run(tmp_path_factory.mktemp("dash") / "run", num_steps=3, long_tokens=LONG_TOKENS)
