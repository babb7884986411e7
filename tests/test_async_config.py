"""The async section: written ``async`` everywhere a user writes it, and refused with the fix where it cannot run
(stale samples without an off-policy correction, memory handed between the sides, per-token versions an engine
does not report)."""

import json

import pytest

from miles.config import RunConfig, apply_overrides
from miles.config_doc import config_toml
from miles.recipes import get_recipe, quickstart

RESIDENT = ["handoff.offload_train=none", "handoff.offload_rollout=false"]


def test_the_section_is_written_async_in_overrides_config_json_and_toml():
    cfg = apply_overrides(quickstart(), ["async.max_staleness=2", "trainer.rollout_correction=decoupled", *RESIDENT])
    assert cfg.async_.max_staleness == 2
    d = json.loads(cfg.to_json())
    assert d["async"]["max_staleness"] == 2 and "async_" not in d
    assert RunConfig.from_dict(d) == cfg
    assert "\n[async]" in config_toml(cfg) and "[async_]" not in config_toml(cfg)


def test_staleness_zero_is_the_default_and_needs_nothing():
    cfg = quickstart()
    assert cfg.async_.max_staleness == 0 and cfg.handoff.offload_train == "host"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["async.max_staleness=1", *RESIDENT], "set trainer.rollout_correction=decoupled (or tis, mis, seq-mis)"),
        (["async.max_staleness=1", "trainer.rollout_correction=tis"], "set handoff.offload_train=none and"),
        (
            [
                "async.max_staleness=1",
                "trainer.rollout_correction=tis",
                "async.partial_rollout=true",
                *RESIDENT,
                "sync.transport=broadcast",
            ],
            "set sync.transport=tensor, or async.partial_rollout=false",
        ),
        (
            [
                "async.max_staleness=1",
                "trainer.rollout_correction=tis",
                "async.partial_rollout=true",
                *RESIDENT,
                "sync.engine_staging=direct",
            ],
            "set sync.engine_staging=shadow",
        ),
        (
            [
                "async.max_staleness=1",
                "trainer.rollout_correction=tis",
                "async.partial_rollout=true",
                *RESIDENT,
                "rollout.engine=http",
            ],
            "set rollout.engine=embedded",
        ),
        (["async.partial_rollout=true"], "set async.max_staleness >= 1, or async.partial_rollout=false"),
        (["async.max_staleness=-1"], "async.max_staleness = -1 must be >= 0"),
    ],
)
def test_what_async_cannot_do_is_refused_with_the_fix(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        apply_overrides(quickstart(), overrides)


def test_training_without_a_correction_is_allowed_when_asked_for():
    cfg = apply_overrides(quickstart(), ["async.max_staleness=1", "async.allow_uncorrected=true", *RESIDENT])
    assert cfg.trainer.rollout_correction == "none"


def test_quickstart_async_is_the_quickstart_at_staleness_2_with_truncated_weights_and_a_cosine_lr():
    cfg = get_recipe("quickstart_async")
    sets = ["async.max_staleness=2", "trainer.rollout_correction=tis", "trainer.lr_schedule=cosine"]
    same = apply_overrides(quickstart(), [*sets, "trainer.lr_min_ratio=0.1", *RESIDENT])
    assert cfg.to_dict() | {"recipe": "", "run_dir": ""} == same.to_dict() | {"recipe": "", "run_dir": ""}
    assert apply_overrides(cfg, ["async.max_staleness=0"]).async_.max_staleness == 0  # the sync arm, same settings


def test_partial_rollouts_on_the_tensor_transport_are_accepted_and_refused_in_one_process(tmp_path):
    from miles.colocated import Colocated

    sets = ["async.max_staleness=1", "trainer.rollout_correction=tis", "async.partial_rollout=true", *RESIDENT]
    cfg = apply_overrides(quickstart(), [*sets, "async.kv_on_update=recompute", f"run_dir={tmp_path}"])
    assert cfg.async_.partial_rollout and cfg.async_.kv_on_update == "recompute"
    with pytest.raises(ValueError, match="run on Ray"):
        Colocated(cfg)
