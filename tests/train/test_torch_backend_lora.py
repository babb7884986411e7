"""The torch trainer with LoRA: gradients and optimizer state only on the adapters, the KL reference is the base with
adapters off (no model copy), the trainer's weights (sync, checkpoint) are the adapters, a PEFT-format checkpoint
resumes bit for bit, and a checkpoint of another kind is refused naming both."""

from dataclasses import replace

import pytest
import torch

from miles.config import TrainerConfig
from miles.model.config import ModelConfig
from miles.model.decoder import build_decoder
from miles.model.lora import is_adapter
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
