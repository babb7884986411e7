"""The install paths agree: README's two commands, .ci/run, pyproject extras, environment.yml."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_starts_with_the_install_run_and_test_commands_that_ci_runs():
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1).strip().splitlines()
    assert len(block) == 2 and block[0].endswith("miles train --recipe quickstart"), block
    ci = (ROOT / ".ci" / "run").read_text()
    assert block[1] == "python -m pytest" and re.search(r"^python3? -m pytest$", ci, re.M), (
        "CI runs the README's test command"
    )
    torch_pin = re.search(r"torch==([\d.]+)", block[0]).group(1)
    assert f"torch=={torch_pin}" in ci and f"torch=={torch_pin}" in (ROOT / "environment.yml").read_text()


def test_extras_and_environment_yml_install_the_same_things():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["miles"] == "miles.cli:main"
    assert {"gpu", "sglang", "te", "nixl", "notebooks", "dev"} <= set(project["optional-dependencies"])
    assert any(d.startswith("torch>=") for d in project["dependencies"]), (
        "keep torch open (>=), a pin pulls CUDA builds"
    )
    env = (ROOT / "environment.yml").read_text()
    assert "-e .[dev,notebooks]" in env and "-e '.[dev,notebooks]'" in (ROOT / ".ci" / "run").read_text()
