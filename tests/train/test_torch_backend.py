import copy

import pytest
import torch

from miles.config import TrainerConfig
from miles.samples import Sample, collate
from miles.train.torch_backend import TorchBackend


def _batch(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        prompt = torch.randint(0, 256, (4,), generator=g).tolist()
        resp = torch.randint(0, 256, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        samples.append(
            Sample(
                index=i,
                group=i // 4,
                prompt="",
                target="",
                prompt_ids=prompt,
                response_ids=resp,
                rollout_log_probs=[-5.0] * len(resp),
                advantage=float(i % 4) - 1.5,
            )
        )
    return collate(samples, pad_id=256)


def test_sleep_and_wake_keep_weights_and_optimizer_state_bit_exact(tiny_model_cfg):
    b = TorchBackend(tiny_model_cfg, TrainerConfig())
    b.train_step(_batch())
    w = {k: v.clone() for k, v in b.named_weights()}
    opt = {k: v.clone() for k, v in enumerate(t for t in b.optimizer.state[next(iter(b.optimizer.state))].values())}
    assert b.offload() > 0 and b.memory.is_offloaded("params") and b.memory.is_offloaded("optimizer")
    assert all(torch.equal(w[k], v) for k, v in b.named_weights())  # readable while asleep (from the host backup)
    b.onload()
    assert all(torch.equal(w[k], v) for k, v in b.named_weights())
    assert all(torch.equal(opt[k], v) for k, v in enumerate(b.optimizer.state[next(iter(b.optimizer.state))].values()))


def test_a_step_after_sleep_and_wake_equals_a_step_without(tiny_model_cfg):
    a, b = TorchBackend(tiny_model_cfg, TrainerConfig()), TorchBackend(tiny_model_cfg, TrainerConfig())
    for backend in (a, b):
        backend.train_step(_batch(seed=1))
    b.offload()
    b.onload()
    a.train_step(_batch(seed=2))
    b.train_step(_batch(seed=2))
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(a.named_weights(), b.named_weights()))


def test_named_weights_use_hf_names_and_skip_a_tied_head(tiny_model_cfg):
    names = [k for k, _ in TorchBackend(tiny_model_cfg, TrainerConfig()).named_weights()]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert "model.layers.1.self_attn.q_proj.bias" in names and "model.layers.0.mlp.gate_proj.weight" in names


def test_positive_advantage_raises_the_probability_of_its_tokens(tiny_model_cfg):
    b = TorchBackend(tiny_model_cfg, TrainerConfig(lr=1e-2))
    batch = _batch()
    batch.advantages = torch.tensor([1.0, -1.0] * 4)
    before = b.forward_logprobs(batch)
    for _ in range(3):
        b.train_step(batch)
    after = b.forward_logprobs(batch)
    gain = ((after - before) * batch.loss_mask).sum(-1) / batch.loss_mask.sum(-1)
    assert (gain[0::2] > 0).all() and (gain[1::2] < 0).all()


def test_kl_to_the_reference_is_zero_at_the_start_and_grows(tiny_model_cfg):
    b = TorchBackend(tiny_model_cfg, TrainerConfig(kl_coef=0.1, lr=1e-2))
    m0 = b.train_step(_batch())
    m1 = b.train_step(_batch())
    assert m0["kl"] == pytest.approx(0.0, abs=1e-7) and m1["kl"] > 0


def test_state_dict_round_trip_resumes_identically(tiny_model_cfg):
    a = TorchBackend(tiny_model_cfg, TrainerConfig())
    a.train_step(_batch(seed=3))
    state = copy.deepcopy(a.state_dict())  # as if read back from disk: no tensor shared with `a`
    b = TorchBackend(tiny_model_cfg, TrainerConfig(), seed=7)
    b.load_state_dict(state)
    a.train_step(_batch(seed=4))
    b.train_step(_batch(seed=4))
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(a.named_weights(), b.named_weights()))


def test_a_nan_gradient_stops_the_step_naming_it_and_leaves_the_weights_unchanged(tiny_model_cfg):
    from miles.train.torch_backend import NonFiniteTrainingError

    b, twin = TorchBackend(tiny_model_cfg, TrainerConfig()), TorchBackend(tiny_model_cfg, TrainerConfig())
    for backend in (b, twin):
        backend.train_step(_batch(seed=1), step=0)
    before = {k: v.clone() for k, v in b.named_weights()}
    poisoned = _batch(seed=3)
    poisoned.advantages[0] = float("nan")  # e.g. a reward function that returned NaN
    with pytest.raises(NonFiniteTrainingError, match=r"RL step 3: grad_norm = nan \(loss = nan\) is not finite"):
        b.train_step(poisoned, step=3)
    assert all(torch.equal(before[k], v) for k, v in b.named_weights())
    # nothing of the refused step is left behind: the next finite step equals one that never saw the NaN batch
    b.train_step(_batch(seed=2), step=1)
    twin.train_step(_batch(seed=2), step=1)
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(b.named_weights(), twin.named_weights()))


def test_a_nan_gradient_in_the_supervised_warm_up_is_named_too(tiny_model_cfg):
    from miles.train.torch_backend import NonFiniteTrainingError

    b = TorchBackend(tiny_model_cfg, TrainerConfig())
    b.set_lr(float("inf"))  # the first step's update is infinite, so the second step's loss and gradients are NaN
    b.sft_step(_batch())
    with pytest.raises(NonFiniteTrainingError, match="a supervised warm-up step: grad_norm = nan"):
        b.sft_step(_batch())
