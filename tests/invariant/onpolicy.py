"""Test helpers: roll out with the real engine, score the same tokens with the real trainer backend, compare."""

from __future__ import annotations

import torch

from miles.config import TrainerConfig
from miles.model.config import ModelConfig
from miles.protocols.engine import GenerateRequest, SamplingParams
from miles.rollout.engine import EmbeddedEngine
from miles.samples import Sample, TrainBatch, collate
from miles.train.torch_backend import TorchBackend


def model_cfg(dtype: str = "float32", **kw) -> ModelConfig:
    """The quickstart's shape, shrunk (hidden 64, 2 layers, GQA 4/2), in ``dtype``."""
    base = dict(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        dtype=dtype,
    )
    return ModelConfig(**(base | kw))


def prompts(num: int, seed: int = 1, vocab: int = 264) -> list[list[int]]:
    """``num`` prompts of ragged lengths 2..13."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, 14, (num,), generator=g).tolist()
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def rollout(
    engine: EmbeddedEngine, prompt_ids: list[list[int]], n: int, *, seed: int = 3, temperature: float = 1.0
) -> list[Sample]:
    """n samples per prompt, each with its own max_new_tokens (3..11): ragged answers, rows retiring mid-batch."""
    reqs, samples = [], []
    for g, p in enumerate(prompt_ids):
        for j in range(n):
            sp = SamplingParams(max_new_tokens=3 + (5 * g + 3 * j) % 9, temperature=temperature)
            reqs.append(GenerateRequest(rid=f"{g}-{j}", input_ids=p, sampling=sp))
    for i, (r, o) in enumerate(zip(reqs, engine.generate(reqs, seed=seed))):
        samples.append(
            Sample(
                index=i,
                group=i // n,
                prompt="",
                target="",
                prompt_ids=list(r.input_ids),
                response_ids=o.output_ids,
                rollout_log_probs=o.output_log_probs,
                advantage=float((i % 3) - 1),
            )
        )
    return samples


def trainer(cfg: ModelConfig, true_on_policy: bool, temperature: float = 1.0) -> TorchBackend:
    tc = TrainerConfig(lr=0.05, entropy_coef=0.01)
    return TorchBackend(cfg, tc, temperature=temperature, offload_policy="none", true_on_policy=true_on_policy)


def engine(cfg: ModelConfig, true_on_policy: bool, *, slots: int = 7, share_prefix: bool = False) -> EmbeddedEngine:
    return EmbeddedEngine(
        cfg, max_batch_size=slots, max_seq_len=64, true_on_policy=true_on_policy, share_prefix=share_prefix
    )


def compare(backend: TorchBackend, samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor, TrainBatch]:
    """(trainer log-probs, engine log-probs) of every sampled token, flat in sample order, and the batch."""
    batch = collate(samples, pad_id=0)
    ours = backend.forward_logprobs(batch)
    on = batch.loss_mask > 0
    return ours[on], batch.rollout_log_probs[on], batch


def sync(backend: TorchBackend, eng: EmbeddedEngine, version: int) -> None:
    eng.update_weights_from_tensor(((n, t.detach().clone()) for n, t in backend.named_weights()), version)
