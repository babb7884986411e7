import pytest

from miles.config import RunConfig, apply_overrides
from miles.recipes import get_recipe, quickstart


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
        ("rollout.engine=vllm", "rollout.engine = 'vllm' is not one of ['embedded', 'http']"),
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
    with pytest.raises(ValueError, match="unknown recipe 'nope'; available recipes: .*quickstart"):
        get_recipe("nope")


def test_config_round_trips_through_json():
    cfg = quickstart()
    import json

    assert RunConfig.from_dict(json.loads(cfg.to_json())) == cfg


def test_misspelt_field_in_code_is_an_error():
    from miles.config import TrainerConfig

    with pytest.raises(TypeError):
        TrainerConfig(learning_rate=1e-3)
