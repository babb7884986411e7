import threading
import time

import pytest
import torch

from miles.model.tokenizer import ByteTokenizer
from miles.protocols.engine import EngineError, GenerateRequest, SamplingParams
from miles.rollout.engine import EmbeddedEngine


@pytest.fixture
def engine(tiny_model_cfg):
    return EmbeddedEngine(tiny_model_cfg, max_batch_size=8, max_seq_len=48, seed=0)


def _req(rid, ids, **sp):
    return GenerateRequest(rid=rid, input_ids=ids, sampling=SamplingParams(**sp))


def test_greedy_decoding_equals_argmax_of_the_full_sequence_forward(engine):
    tok = ByteTokenizer()
    prompts = [tok.encode(p, add_bos=True) for p in ["rev ab=", "rev abcde=", "x"]]  # ragged: left padding
    outs = engine.generate([_req(str(i), p, max_new_tokens=10, temperature=0) for i, p in enumerate(prompts)])
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            logits = engine.model(torch.tensor([p + o.output_ids]))[0]
        assert logits[len(p) - 1 : -1].argmax(-1).tolist() == o.output_ids


def test_rollout_log_probs_equal_the_trainer_convention(engine):
    from miles.policy.logprob import log_probs_and_entropy

    out = engine.generate([_req("0", [1, 2, 3], max_new_tokens=6, temperature=0.7)], seed=5)[0]
    seq = torch.tensor([[1, 2, 3] + out.output_ids])
    with torch.no_grad():
        logits = engine.model(seq)[0, 2:-1]
    lp, _ = log_probs_and_entropy(logits, seq[0, 3:], temperature=0.7)
    torch.testing.assert_close(torch.tensor(out.output_log_probs), lp, atol=1e-5, rtol=0)


def test_sampling_is_reproducible_with_a_seed_and_stops_at_stop_tokens(engine):
    reqs = [_req(str(i), [5, 6, 7], max_new_tokens=12, temperature=1.0, stop_token_ids=(40, 41, 42)) for i in range(8)]
    a, b = engine.generate(reqs, seed=3), engine.generate(reqs, seed=3)
    assert [o.output_ids for o in a] == [o.output_ids for o in b]
    for o in a:
        if o.finish_reason == "stop":
            assert o.output_ids[-1] in (40, 41, 42) and not set(o.output_ids[:-1]) & {40, 41, 42}
        else:
            assert len(o.output_ids) == 12


def test_top_p_keeps_only_the_nucleus(engine):
    outs = engine.generate(
        [_req(str(i), [9, 9], max_new_tokens=1, temperature=1.0, top_p=1e-6) for i in range(6)], seed=1
    )
    greedy = engine.generate([_req("g", [9, 9], max_new_tokens=1, temperature=0)])[0].output_ids
    assert all(o.output_ids == greedy for o in outs)


def test_release_and_resume_free_and_restore_memory(engine):
    ids = [_req("0", [1, 2], max_new_tokens=4, temperature=0)]
    engine.generate(ids)
    engine.offload(["kv_cache", "weights"])
    assert engine.cache.k[0].untyped_storage().nbytes() == 0
    with pytest.raises(EngineError, match="memory is released"):
        engine.generate(ids)
    engine.onload(["kv_cache", "weights"])
    # weights were discarded (policy 'discard'): they come back only through a weight update
    assert engine.weight_version == 0


def test_a_kv_cache_resumed_with_garbage_generates_as_a_clean_one(engine, monkeypatch):
    # kv_cache is 'discard': after release/resume its bytes are whatever the allocator hands back, NaN included,
    # and ragged rows leave positions past a row's length inside the reference attention's window.
    reqs = [_req(str(i), [1, 2, 3][: 1 + i % 3], max_new_tokens=8, temperature=1.0) for i in range(6)]
    clean = engine.generate(reqs, seed=7)
    engine.offload(["kv_cache"])
    resume = engine.memory.onload

    def resume_with_garbage(tags, phase=None):
        moved = resume(tags, phase)
        for t in engine.cache.tensors():
            t.fill_(float("nan"))  # what a reused allocation may hold
        return moved

    monkeypatch.setattr(engine.memory, "onload", resume_with_garbage)
    engine.onload(["kv_cache"])
    poisoned = engine.generate(reqs, seed=7)
    assert [o.output_ids for o in poisoned] == [o.output_ids for o in clean]
    assert [o.output_log_probs for o in poisoned] == [o.output_log_probs for o in clean]


def test_weight_update_is_validated_before_anything_is_written(engine):
    named = engine.named_weights()
    w = {k: v.clone() for k, v in named.items()}
    bad = [
        ("model.norm.weight", torch.zeros_like(w["model.norm.weight"])),
        ("model.embed_tokens.weight", torch.zeros(3, 3)),
    ]
    with pytest.raises(EngineError, match="model.embed_tokens.weight: got torch.float32 \\(3, 3\\)"):
        engine.update_weights_from_tensor(bad, version=1)
    assert (
        torch.equal(engine.named_weights()["model.norm.weight"], w["model.norm.weight"]) and engine.weight_version == 0
    )
    with pytest.raises(EngineError, match="not a parameter"):
        engine.update_weights_from_tensor([("nope", torch.zeros(1))])


def test_abort_finishes_in_flight_requests(engine):
    engine.pause_generation("in_place")  # hold the decode loop so the abort lands mid-generation
    result = {}
    t = threading.Thread(
        target=lambda: result.update(o=engine.generate([_req("a", [1], max_new_tokens=40, temperature=0)]))
    )
    t.start()
    time.sleep(0.3)
    engine.abort(["a"])
    engine.continue_generation()
    t.join(timeout=10)
    assert result["o"][0].finish_reason == "abort" and len(result["o"][0].output_ids) < 40


@pytest.mark.parametrize(
    "req, message",
    [
        (_req("e", []), "input_ids is empty"),
        (_req("v", [1, 99999]), "outside the vocabulary"),
        (_req("l", [1] * 40, max_new_tokens=20), "exceeds the engine's max_seq_len 48"),
    ],
)
def test_bad_requests_get_clear_errors(engine, req, message):
    with pytest.raises(EngineError, match=message):
        engine.generate([req])


def test_unknown_memory_tag_lists_the_valid_ones(engine):
    with pytest.raises(EngineError, match="valid tags: \\['weights', 'kv_cache', 'cuda_graph'\\]"):
        engine.offload(["kv"])
