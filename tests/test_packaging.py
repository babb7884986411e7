"""The install paths agree: README's two commands, what .ci/install and .ci/run take from them (a fresh venv with
only the README's install), pyproject extras, environment.yml."""

import re
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_starts_with_the_install_run_and_test_commands_that_ci_runs():
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1).strip().splitlines()
    assert len(block) == 2 and block[0].endswith("&& miles train --recipe quickstart"), block
    readme = lambda which: subprocess.run(
        [str(ROOT / ".ci" / "readme"), which], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert readme("install") == block[0].removesuffix(" && miles train --recipe quickstart")  # what CI installs
    assert readme("test") == block[1] == "python -m pytest"  # what CI runs
    ci_install, ci_run = (ROOT / ".ci" / "install").read_text(), (ROOT / ".ci" / "run").read_text()
    assert "python3 -m venv .ci-venv" in ci_install and 'eval "$install"' in ci_install  # a fresh environment
    assert ".ci/install" in ci_run and "source .ci-venv/bin/activate" in ci_run and 'eval "$test_command"' in ci_run
    assert ".ci-venv/" in (ROOT / ".gitignore").read_text().splitlines()
    torch_pin = re.search(r"torch==([\d.]+)", block[0]).group(1)
    assert f"torch=={torch_pin}" in (ROOT / "environment.yml").read_text()


def test_extras_and_environment_yml_install_the_same_things():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["miles"] == "miles.cli:main"
    assert {"gpu", "sglang", "te", "nixl", "notebooks", "dev"} <= set(project["optional-dependencies"])
    assert any(d.startswith("torch>=") for d in project["dependencies"]), (
        "keep torch open (>=), a pin pulls CUDA builds"
    )
    env = (ROOT / "environment.yml").read_text()
    readme = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    assert "-e .[dev,notebooks]" in env and "-e '.[dev,notebooks]'" in readme
