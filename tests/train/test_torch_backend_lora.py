"""The torch trainer with LoRA: gradients and optimizer state only on the adapters, the KL reference is the base with
adapters off (no model copy), the trainer's weights (sync, checkpoint) are the adapters, a PEFT-format checkpoint
resumes bit for bit, and a checkpoint of another kind is refused naming both."""

from dataclasses import replace

import pytest
import torch

from miles.config import TrainerConfig
from miles.model.config import ModelConfig
from miles.model.decoder import build_decoder
from miles.model.lora import adapters_disabled, is_adapter
from miles.model.lora_config import LoRAConfig
from miles.policy.logprob import log_probs_and_entropy
from miles.train.backend import read_checkpoint_files, write_checkpoint_files
from miles.train.torch_backend import TorchBackend
from tests.train.test_torch_backend import _batch

CFG = ModelConfig(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
LORA = replace(CFG, lora=LoRAConfig(rank=4))


def test_gradients_and_optimizer_state_live_only_on_the_adapters_and_the_base_never_moves():
    b = TorchBackend(LORA, TrainerConfig(lr=1e-2))
    base = {n: p.detach().clone() for n, p in b.model.named_parameters() if not is_adapter(n)}
    batch = _batch()
    out, _ = b._minibatch_loss(batch, None)
    out.loss.backward()
    with_grad = {n for n, p in b.model.named_parameters() if p.grad is not None}
    assert with_grad and all(is_adapter(n) for n in with_grad)
    b.optimizer.zero_grad(set_to_none=True)
    for step in range(2):  # B moves in step 1, A in step 2 (A's gradient is zero while B is)
        b.train_step(_batch(seed=step), step=step)
    state = {id(p) for p in b.optimizer.state}
    adapters = {id(p) for n, p in b.model.named_parameters() if is_adapter(n)}
    assert state == adapters
    assert all(torch.equal(p, base[n]) for n, p in b.model.named_parameters() if n in base)
    assert [n for n, _ in b.named_weights()] == [n for n, _ in b.model.named_parameters() if is_adapter(n)]
    assert "ref" not in b.memory.tags and b.memory.resident_bytes("base") == sum(t.nbytes for t in base.values())


def _log_probs(model, tokens):
    logits = model(tokens[:, :-1])
    return log_probs_and_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))[0]


def test_the_kl_reference_is_the_base_model_with_the_adapters_off_and_costs_no_model_copy():
    b = TorchBackend(LORA, TrainerConfig(lr=1e-2, kl_coef=0.1))
    assert b.ref_model is None
    for step in range(2):
        metrics = b.train_step(_batch(seed=step), step=step)
    assert metrics["kl"] > 0  # the adapted policy moved away from its base
    tokens = _batch(seed=5).tokens
    ref = b._reference_log_probs(tokens)[:, 1:].reshape(-1)
    with torch.no_grad():
        assert torch.equal(ref, _log_probs(build_decoder(CFG, seed=0), tokens))  # the untouched base, bit for bit
        assert not torch.equal(ref, _log_probs(b.model, tokens))  # and the policy is not


def test_full_fine_tuning_with_kl_keeps_its_reference_copy():
    b = TorchBackend(CFG, TrainerConfig(kl_coef=0.1))
    assert b.ref_model is not None and "ref" in b.memory.tags


def test_a_peft_format_checkpoint_resumes_adapters_and_optimizer_state_bit_for_bit(tmp_path):
    a = TorchBackend(LORA, TrainerConfig(lr=1e-2))
    for step in range(2):
        a.train_step(_batch(seed=step), step=step)
    write_checkpoint_files(str(tmp_path), a.state_dict())
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "optimizer.pt",
    ]
    b = TorchBackend(LORA, TrainerConfig(lr=1e-2))  # the same base (the run's seed), its adapters fresh
    b.load_state_dict(read_checkpoint_files(str(tmp_path)))
    for backend in (a, b):
        backend.train_step(_batch(seed=9), step=2)
    for (n, x), (m, y) in zip(a.named_weights(), b.named_weights()):
        assert n == m and torch.equal(x, y)


def test_resuming_a_lora_run_from_a_full_checkpoint_or_the_reverse_is_refused_naming_both(tmp_path):
    full, lora = TorchBackend(CFG, TrainerConfig()), TorchBackend(LORA, TrainerConfig())
    with pytest.raises(ValueError, match=r"holds full weights .* this run \(LoRA rank 4 .* trains LoRA adapters"):
        lora.load_state_dict(full.state_dict())
    with pytest.raises(ValueError, match=r"holds LoRA adapters .* this run \(full fine-tuning\) trains full weights"):
        full.load_state_dict(lora.state_dict())
    other = TorchBackend(replace(CFG, lora=LoRAConfig(rank=4, target_modules=("q_proj",))), TrainerConfig())
    with pytest.raises(ValueError, match="Resume with the model.lora settings it was saved with"):
        other.load_state_dict(lora.state_dict())


BASE_WARMUP = replace(CFG, lora=LoRAConfig(rank=4, warmup="base"))


def _base_warmed(steps: int = 2) -> TorchBackend:
    b = TorchBackend(BASE_WARMUP, TrainerConfig(lr=1e-2))
    for i in range(steps):
        b.sft_step(_batch(seed=20 + i))
    b.end_warmup()
    return b


def test_a_base_warm_up_trains_every_base_weight_with_adapters_off_then_rl_trains_only_the_adapters():
    b = TorchBackend(BASE_WARMUP, TrainerConfig(lr=1e-2))
    base0 = {n: t.clone() for n, t in b.named_base()}
    adapters0 = {n: t.clone() for n, t in b.named_weights()}
    b.sft_step(_batch(seed=20))
    assert {id(p) for p in b.optimizer.state} == {id(p) for n, p in b.model.named_parameters() if not is_adapter(n)}
    b.sft_step(_batch(seed=21))
    b.end_warmup()
    warmed = {n: t.clone() for n, t in b.named_base()}
    assert all(not torch.equal(base0[n], warmed[n]) for n in base0)  # embeddings and head included
    assert all(torch.equal(adapters0[n], t) for n, t in b.named_weights())  # adapters off: untouched, B still 0
    assert not b.optimizer.state  # the warm-up's optimizer state is dropped; the adapters' has taken no step
    for step in range(2):
        b.train_step(_batch(seed=step), step=step)
    assert {id(p) for p in b.optimizer.state} == {id(p) for n, p in b.model.named_parameters() if is_adapter(n)}
    assert all(torch.equal(warmed[n], t) for n, t in b.named_base())  # frozen from then on
    tokens = _batch(seed=5).tokens  # and the KL reference is that warmed-up base, adapters off
    with torch.no_grad(), adapters_disabled(b.model):
        assert torch.equal(b._reference_log_probs(tokens)[:, 1:].reshape(-1), _log_probs(b.model, tokens))


def test_an_adapters_warm_up_leaves_the_base_as_built():
    b = TorchBackend(LORA, TrainerConfig(lr=1e-2))
    base0 = {n: t.clone() for n, t in b.named_base()}
    b.sft_step(_batch(seed=20))
    b.end_warmup()
    assert all(torch.equal(base0[n], t) for n, t in b.named_base())
    assert not b.base_trained and [n for n, _ in b.weights_to_sync()] == [n for n, _ in b.named_weights()]


def test_the_warmed_up_base_is_synced_once_then_only_the_adapters():
    b = _base_warmed()
    adapters, base = [n for n, _ in b.named_weights()], [n for n, _ in b.named_base()]
    assert [n for n, _ in b.weights_to_sync()] == adapters + base
    assert [n for n, _ in b.weights_to_sync()] == adapters + base  # not sent until the engines hold it
    b.weights_synced()
    b.train_step(_batch(seed=0), step=0)
    assert [n for n, _ in b.weights_to_sync()] == adapters


def test_a_checkpoint_after_a_base_warm_up_holds_the_base_as_a_hf_checkpoint_and_resumes_it(tmp_path):
    a = _base_warmed()
    a.weights_synced()
    a.train_step(_batch(seed=0), step=0)
    write_checkpoint_files(str(tmp_path), a.state_dict())
    assert sorted(p.name for p in (tmp_path / "base").iterdir()) == ["config.json", "model.safetensors"]
    b = TorchBackend(BASE_WARMUP, TrainerConfig(lr=1e-2))  # built from the seed: the base before the warm-up
    b.load_state_dict(read_checkpoint_files(str(tmp_path)))
    assert [n for n, _ in b.weights_to_sync()] == [n for n, _ in a.named_weights()] + [n for n, _ in a.named_base()]
    for backend in (a, b):
        backend.train_step(_batch(seed=9), step=1)
    for (n, x), (m, y) in zip([*a.named_weights(), *a.named_base()], [*b.named_weights(), *b.named_base()]):
        assert n == m and torch.equal(x, y)


def test_resuming_across_the_two_warm_ups_is_refused_with_the_fix(tmp_path):
    warmed, plain = _base_warmed(1), TorchBackend(LORA, TrainerConfig())
    with pytest.raises(ValueError, match="resume with model.lora.warmup=base, or start a new run_dir"):
        TorchBackend(LORA, TrainerConfig()).load_state_dict(warmed.state_dict())
    with pytest.raises(ValueError, match="resume with model.lora.warmup=adapters, or start a new run_dir"):
        TorchBackend(BASE_WARMUP, TrainerConfig()).load_state_dict(plain.state_dict())
