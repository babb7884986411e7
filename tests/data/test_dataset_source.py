"""The dataset sample source and the evaluator inside a RolloutManager, in process (no Ray): the step's prompts
come from data.train in the seeded order, rewards from the row's verifier, and the eval figures are consistent."""

import json

import pytest

from miles.config import apply_overrides
from miles.data.dataset import BadRowError, PromptDataset, load_rows
from miles.data.generate import generated_train, split_path
from miles.recipes import quickstart
from miles.rollout.manager import RolloutManager
from miles.sources import make_sources

pytestmark = pytest.mark.procs  # it starts processes or servers (tests/conftest.py: the tiers)


def small_cfg(tmp_path, *overrides):
    base = [
        "model.hidden_size=32",
        "model.intermediate_size=64",
        "model.num_hidden_layers=2",
        "model.max_position_embeddings=160",
        "rollout.max_seq_len=160",
        "rollout.num_prompts_per_step=3",
        "rollout.n_samples_per_prompt=2",
        "rollout.max_new_tokens=4",
        "num_threads=1",
        f"data.train={generated_train('mixed', 50, out_dir=tmp_path)}",
        f"data.eval={split_path('mixed')}",
        "eval.k=3",
        "eval.max_problems=5",
    ]
    return apply_overrides(quickstart(), base + list(overrides))


def test_the_source_draws_the_seeded_order_and_restores_a_position(tmp_path):
    cfg = small_cfg(tmp_path)
    m = RolloutManager(cfg, device="cpu", sources=make_sources)
    batches, metrics = m.generate(0)
    rows, _ = load_rows("t", cfg.data.train, cfg.data)
    order = [r.prompt for r in PromptDataset(rows, seed=cfg.seed).take(6)]
    assert [s.prompt for s in m.last_samples[::2]] == order[:3]
    assert [s.group for s in m.last_samples] == [0, 0, 1, 1, 2, 2] and metrics["data/skipped_rows"] == 0
    assert batches[0].tokens.shape[0] == 6
    m.save_data_state(str(tmp_path), 1)
    assert json.loads((tmp_path / "data_state.json").read_text())["index"] == 3
    m2 = RolloutManager(cfg, device="cpu", sources=make_sources)
    m2.load_data_state(str(tmp_path))
    m2.generate(1)
    assert [s.prompt for s in m2.last_samples[::2]] == order[3:]


def test_a_position_saved_while_later_steps_were_drawn_ahead_resumes_at_the_step_after_it(tmp_path):
    """An async run draws steps ahead of training; its checkpoint at step 1 still resumes with step 1's prompts."""
    cfg = small_cfg(tmp_path)
    m = RolloutManager(cfg, device="cpu", sources=make_sources)
    ahead = [[s.prompt for s in m.source.prompts(step)] for step in range(3)]  # steps 0, 1, 2 drawn
    m.save_data_state(str(tmp_path), 1)
    m2 = RolloutManager(cfg, device="cpu", sources=make_sources)
    m2.load_data_state(str(tmp_path))
    assert [s.prompt for s in m2.source.prompts(1)] == ahead[1]


def test_the_evaluator_reports_consistent_figures_per_dataset_and_overall(tmp_path):
    m = RolloutManager(small_cfg(tmp_path), device="cpu", sources=make_sources)
    out = m.evaluate(0)
    for name in ("mixed_test", "all"):
        assert out[f"eval/{name}/num_problems"] == 5
        assert 0 <= out[f"eval/{name}/pass@1"] <= out[f"eval/{name}/pass@2"] <= out[f"eval/{name}/pass@3"] <= 1
    assert out["eval/tokens"] > 0 and out["time/eval"] > 0


def test_a_prompt_longer_than_the_engine_allows_is_a_bad_row(tmp_path):
    with pytest.raises(BadRowError, match=r"row \d+ field 'prompt': the prompt is \d+ tokens, over the 20"):
        RolloutManager(small_cfg(tmp_path, "data.max_prompt_tokens=20"), device="cpu", sources=make_sources).generate(0)
    m = RolloutManager(
        small_cfg(tmp_path, "data.max_prompt_tokens=20", "data.skip_bad_rows=true", "data.eval="),
        "cpu",
        sources=make_sources,
    )
    with pytest.raises(ValueError, match="every row of data.train is too long"):
        m.generate(0)
