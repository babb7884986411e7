"""true_on_policy is refused, with the fix, where one side would run kernels miles does not own."""

import pytest

from miles.config import apply_overrides
from miles.recipes import quickstart


@pytest.mark.parametrize(
    "override, named",
    [
        ("rollout.engine=sglang", "rollout.engine = 'sglang'"),
        ("trainer.backend=megatron", "trainer.backend = 'megatron'"),
        ("trainer.precision=fp8", "trainer.precision = 'fp8'"),
    ],
)
def test_true_on_policy_is_refused_with_a_side_that_runs_other_kernels(override, named):
    extra = ["device=cuda"] if "megatron" in override else []
    with pytest.raises(ValueError, match=f"true_on_policy = true needs {named}"):
        apply_overrides(quickstart(), ["true_on_policy=true", override, *extra])


def test_true_on_policy_is_a_run_config_switch_that_defaults_off():
    assert quickstart().true_on_policy is False
    assert apply_overrides(quickstart(), ["true_on_policy=true", "rollout.engine=http"]).true_on_policy is True


def test_the_megatron_backend_refuses_true_on_policy_itself_with_the_reason():
    from miles.config import TrainerConfig
    from miles.train.megatron_backend import MegatronBackend
    from tests.conftest import tiny_model

    with pytest.raises(ValueError, match="RowParallelLinear adds the ranks' partial sums in NCCL's all-reduce order"):
        MegatronBackend(tiny_model(), TrainerConfig(), device="cpu", true_on_policy=True)
