"""The real ``miles`` command in a subprocess: help texts, exit codes, one-line errors. Nothing here starts Ray:
every case fails (or finishes) before a cluster would start."""

import errno
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from miles.cli import EXIT_BAD_INPUT, EXIT_FAILED, explain

pytestmark = pytest.mark.procs  # it starts processes or servers (tests/conftest.py: the tiers)

ROOT = Path(__file__).resolve().parents[1]
QWEN3_8B = ROOT / "miles" / "model" / "hf_configs" / "qwen3-8b.json"


def miles(*args: str, cwd=None, env=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MILES_DEBUG": "", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "miles.cli", *args], capture_output=True, text=True, timeout=120, cwd=cwd, env=env
    )


def _one_line_error(r: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    assert r.returncode == code, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr
    line = next(l for l in r.stderr.splitlines() if l.startswith("miles "))
    for needle in needles:
        assert needle in line, line
    return line


def test_miles_version_prints_the_package_version():
    from miles import __version__

    r = miles("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"miles {__version__}"


def test_train_help_lists_every_recipe_and_documents_recipe_and_force():
    from miles.recipes import RECIPES

    out = " ".join(miles("train", "--help").stdout.split())
    assert all(name in out for name in RECIPES)
    assert "--recipe NAME the base config" in out and "--force same as --set overwrite=true" in out


def test_bench_help_lists_every_benchmark_and_a_bare_miles_bench_prints_that_usage_with_exit_2():
    from benchmarks import available

    assert all(name in miles("bench", "--help").stdout for name in available())
    bare = miles("bench")
    assert bare.returncode == EXIT_BAD_INPUT and "usage: miles bench" in bare.stderr and "weight-sync" in bare.stderr


def test_miles_bench_from_a_checkout_subdirectory_finds_the_benchmarks_and_without_a_checkout_says_how_to_get_them(
    tmp_path, monkeypatch
):
    import miles.cli.bench as bench

    assert "weight-sync" in miles("bench", "--help", cwd=ROOT / "notebooks").stdout
    installed = tmp_path / "site-packages" / "miles" / "cli" / "bench.py"  # an installed miles
    monkeypatch.setattr(bench, "__file__", str(installed))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="benchmarks/ is not installed with the package.*git clone"):
        bench.benchmarks()


@pytest.mark.parametrize(
    "args, needles",
    [
        (["bench", "nope"], ["unknown benchmark 'nope' (available:"]),
        (["train", "--recipe", "nope"], ["unknown recipe 'nope'"]),
        (["train", "--set", "trainer.nope=1"], ["unknown config field 'trainer.nope'"]),
        (["train", "--set", "run_dir="], ["run_dir is empty"]),
        (["plan", "--steps", "1000000"], ["--steps 1000000 must be in 0..100"]),
        (["plan", "--hardware", "nonsense"], ["unknown hardware profile 'nonsense'"]),
    ],
    ids=["benchmark", "recipe", "field", "empty-run-dir", "plan-steps", "hardware"],
)
def test_bad_input_exits_2_with_one_line_and_no_traceback(args, needles):
    _one_line_error(miles(*args), EXIT_BAD_INPUT, *needles)


def test_a_run_dir_that_is_a_file_or_a_foreign_directory_exits_2_and_nothing_is_written(tmp_path):
    (tmp_path / "f").write_text("x")
    _one_line_error(miles("train", "--set", f"run_dir={tmp_path / 'f'}"), EXIT_BAD_INPUT, "is a file, not a directory")
    proj = tmp_path / "proj"
    (proj / "rollouts").mkdir(parents=True)
    (proj / "metrics.jsonl").write_text("{}\n")
    _one_line_error(miles("train", "--set", f"run_dir={proj}"), EXIT_BAD_INPUT, "holds no miles run", "--force")
    assert sorted(os.listdir(proj)) == ["metrics.jsonl", "rollouts"]


@pytest.mark.parametrize(
    "content",
    [
        {"hidden_size": 64},  # no vocab_size
        {**json.loads(QWEN3_8B.read_text()), "num_attention_heads": 0},  # a division by zero heads
        [1, 2],  # not an object
    ],
    ids=["missing-field", "zero-heads", "a-list"],
)
def test_a_malformed_plan_model_exits_2_naming_the_file(tmp_path, content):
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps(content))
    line = _one_line_error(
        miles("plan", "--recipe", "gb300_kimi_k2_plan", "--set", f"handoff.plan_model={bad}"), EXIT_BAD_INPUT
    )
    assert f"handoff.plan_model = '{bad}' is not a usable HF config.json" in line


def test_miles_plan_exits_3_when_the_plan_does_not_fit_and_0_when_it_does():
    over = miles("plan", "--recipe", "gb300_kimi_k2_plan", "--mode", "cpu")  # the cpu host peak exceeds 898 GiB
    assert over.returncode == 3 and "DOES NOT FIT" in over.stdout
    fits = miles("plan", "--recipe", "gb300_kimi_k2_plan", "--mode", "gpu")
    assert fits.returncode == 0 and "-> fits" in fits.stdout
    table = fits.stdout
    assert " GB" not in table.split("\nauto ->")[0] and "GiB/GPU" in table and "seconds" in table
    assert "predicted handoff time:" in table


def test_a_port_in_use_is_one_line_with_exit_1(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        r = miles("dashboard", str(tmp_path), "--port", str(port))
    _one_line_error(r, EXIT_FAILED, f"cannot listen on 127.0.0.1:{port}", "pick another --port")


def test_debug_adds_the_traceback_to_the_one_line():
    r = miles("bench", "nope", "--debug")
    assert r.returncode == EXIT_BAD_INPUT and "Traceback" in r.stderr and "unknown benchmark 'nope'" in r.stderr
    assert "Traceback" in miles("bench", "nope", env={"MILES_DEBUG": "1"}).stderr


def test_environmental_errors_map_to_one_line_and_an_exit_code_even_from_inside_a_ray_actor():
    from ray.exceptions import RayTaskError
    from safetensors import SafetensorError

    assert explain(OSError(errno.EROFS, "Read-only file system", "runs/x")) == (
        EXIT_FAILED,
        "failed: OSError: [Errno 30] Read-only file system: 'runs/x'",
    )
    full = RayTaskError("save_checkpoint", "Traceback ...\n  long remote text", OSError(errno.ENOSPC, "No space left"))
    assert explain(full.as_instanceof_cause()) == (EXIT_FAILED, "failed: OSError: [Errno 28] No space left")
    assert explain(SafetensorError("invalid header length")) == (
        EXIT_FAILED,
        "failed: SafetensorError: invalid header length",
    )
    assert explain(OverflowError("bind(): port must be 0-65535."))[0] == EXIT_BAD_INPUT
    assert explain(TypeError("a bug in miles")) == (None, "")  # a bug keeps its traceback


# ---- issue 30: config discoverability, argparse errors before heavy imports, a finished run ----


@pytest.mark.parametrize(
    "args",
    [
        ["train", "--set", "trainr.lr=1e-4"],
        ["train", "--recpie", "quickstart"],
        ["plan", "--set", "num_step=3"],
        ["plan", "--mode", "gppu"],
        ["serve", "--set", "trainer.lrr=1"],
        ["serve", "--hostt", "x"],
    ],
    ids=["train-field", "train-option", "plan-field", "plan-choice", "serve-field", "serve-option"],
)
def test_a_mistyped_argument_or_field_is_refused_before_torch_or_ray_is_imported(args):
    probe = (
        "import sys\nfrom miles.cli import main\ntry:\n    rc = main(sys.argv[1:])\nexcept SystemExit as e:\n"
        "    rc = e.code\nprint(rc, [m for m in ('torch', 'ray') if m in sys.modules])"
    )
    r = subprocess.run(
        [sys.executable, "-c", probe, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert r.stdout.split("\n")[-2] == "2 []", (r.stdout, r.stderr[-2000:])
    assert "did you mean" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_train_help_shows_examples_and_how_to_list_every_field():
    out = miles("train", "--help").stdout
    assert "examples:" in out and "miles train --print-config > run.toml" in out and "--config run.toml" in out
    assert "--config FILE" in out and "--print-config" in out


def test_plan_help_documents_every_option_and_names_the_recipes_and_hardware():
    from miles.recipes import RECIPES

    out = " ".join(miles("plan", "--help").stdout.split())
    for option in ("--recipe", "--config", "--set", "--print-config", "--hardware", "--mode", "--host-allocator"):
        assert re.search(re.escape(option) + r"[ A-Z.=_{},a-z-]* [a-z(]", out), option
    assert all(name in out for name in RECIPES) and "gb300" in out and "(repeatable)" in out
    assert "``" not in miles("--help").stdout


def test_print_config_from_the_command_line_reads_back_with_config(tmp_path):
    printed = miles("train", "--set", "trainer.lr=1e-4", "num_steps=3", "--print-config")
    assert printed.returncode == 0 and "lr = 0.0001" in printed.stdout and "num_steps = 3" in printed.stdout
    (tmp_path / "run.toml").write_text(printed.stdout)
    again = miles("train", "--config", str(tmp_path / "run.toml"), "--print-config")
    body = lambda text: text.split("\nrecipe = ", 1)[1]  # the header names the command line
    assert body(again.stdout) == body(printed.stdout)
    on_top = miles("plan", "--config", str(tmp_path / "run.toml"), "--set", "num_steps=4", "--print-config").stdout
    assert "num_steps = 4" in on_top and "lr = 0.0001" in on_top


def test_a_rerun_of_a_finished_run_says_there_is_nothing_to_do_and_how_to_go_on(tmp_path):
    from tests.test_run_dir import _a_run

    _a_run(tmp_path / "run", steps=(2, 4))
    r = miles("train", "--set", f"run_dir={tmp_path / 'run'}", "num_steps=4")
    assert r.returncode == 0, r.stderr
    assert "already holds 4 RL steps" in r.stdout and "--set num_steps=8" in r.stdout
    assert f"next: miles dashboard {tmp_path / 'run'}" in r.stdout
    other = miles("train", "--set", f"run_dir={tmp_path / 'run'}", "num_steps=4", "model.hidden_size=64")
    _one_line_error(other, EXIT_BAD_INPUT, "holds checkpoints of a different model")  # still refused, not "done"


def test_plan_ends_with_a_line_that_agrees_with_its_exit_status_and_names_where_each_peak_is():
    over = miles("plan", "--recipe", "gb300_kimi_k2_plan", "--mode", "cpu")
    assert over.returncode == 3 and over.stdout.strip().splitlines()[-1] == "on gb300: cpu does NOT fit (exit 3)"
    assert "auto -> gpu (not the order planned above; see --mode gpu)" in over.stdout
    peaks = next(line for line in over.stdout.splitlines() if "peaks:" in line)
    # the peak is a row of the table: the train step's resident bytes and its working set (U10)
    assert "device 197.8 GiB/GPU at train: trainer.train_step" in peaks
    assert re.search(r"train +trainer\.train_step +0\.0 KiB +0\.000 +197\.8 GiB\*", over.stdout)


def test_a_missing_sglang_is_one_line_with_the_install_hint_before_ray_starts(tmp_path):
    from miles.model.checkpoint import save_hf
    from miles.model.decoder import build_decoder
    from miles.recipes import quickstart

    ckpt = tmp_path / "ckpt"
    save_hf(build_decoder(quickstart().model), ckpt)  # the model's own checkpoint: only SGLang is missing
    r = miles(
        "train",
        "--set",
        "rollout.engine=sglang",
        f"model.checkpoint={ckpt}",
        "rollout.sglang_launcher=nosuchpkg.launch_server",
        f"run_dir={tmp_path / 'run'}",
    )
    _one_line_error(r, EXIT_BAD_INPUT, "nosuchpkg is not installed here: pip install 'miles[sglang]'")
    assert "Ray" not in r.stderr and "pid=" not in r.stderr  # refused before a cluster started
