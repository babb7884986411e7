"""``miles train --recipe quickstart --model PATH``, the real command in a child process, on a tiny Qwen3 and a tiny
Llama 3 (rope_type llama3, untied head) that transformers saved with their tokenizer: nothing about the model is
set by hand, and the run is the checkpoint's model with the checkpoint's tokenizer. A few RL steps of a small batch
here; the full quickstart on the same checkpoints is quoted in BENCHMARKS.md."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

pytestmark = pytest.mark.procs  # it starts processes or servers (tests/conftest.py: the tiers)

SMALL_RUN = [
    "num_steps=2",
    "checkpoint_every=0",
    "trainer.warmup_sft_steps=0",
    "rollout.num_prompts_per_step=4",
    "rollout.n_samples_per_prompt=4",
]


def miles(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "miles.cli", *args], capture_output=True, text=True, timeout=600, cwd=cwd
    )


@pytest.mark.parametrize("family, arch", [("qwen3", "qwen3"), ("llama3", "llama")])
def test_the_quickstart_trains_a_transformers_checkpoint_given_by_model_alone(tmp_path, family, arch):
    from tests.model.tiny_checkpoints import save_checkpoint

    ckpt = tmp_path / family  # given relative to the working directory, as a user types it
    theirs = save_checkpoint(ckpt, family)
    r = miles("train", "--recipe", "quickstart", "--model", family, "--no-progress", "--set", *SMALL_RUN, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 RL steps in runs/quickstart" in r.stdout
    assert f"model from {ckpt / 'config.json'}:" in r.stderr and f"tokenizer 'bytes' -> 'hf:{ckpt}'" in r.stderr
    run = tmp_path / "runs" / "quickstart"
    model = json.loads((run / "config.json").read_text())["model"]
    hf = theirs.config
    assert model["architecture"] == arch and model["tokenizer"] == f"hf:{ckpt}" and model["checkpoint"] == str(ckpt)
    assert (model["hidden_size"], model["num_hidden_layers"], model["vocab_size"]) == (64, 2, hf.vocab_size)
    assert model["tie_word_embeddings"] == hf.tie_word_embeddings and model["rms_norm_eps"] == hf.rms_norm_eps
    assert model["rope_type"] == ("llama3" if family == "llama3" else "default")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("phase", "rl") == "rl"] == [0, 1]


def test_a_checkpoint_with_a_bad_config_field_stops_in_one_line_before_ray_starts(tmp_path):
    from tests.model.tiny_checkpoints import save_checkpoint

    save_checkpoint(tmp_path / "ckpt", "qwen3", tokenizer=False)
    hf = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({**hf, "hidden_size": "64"}))
    r = miles("train", "--model", str(tmp_path / "ckpt"), "--set", *SMALL_RUN, cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "config.json: hidden_size = '64' must be a positive integer" in lines[0]
    assert not (tmp_path / "runs").exists()  # nothing written, no Ray started
