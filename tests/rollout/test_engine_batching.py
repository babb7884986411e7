"""The engine's scheduling and fast paths on CPU: continuous batching, prefix sharing, device-side finish
flags, mixed sampling parameters, weight updates mid-generation, and each fast path against its reference."""

import importlib.util
import os
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from miles.protocols.engine import GenerateRequest, SamplingParams
from miles.rollout.decode_attention import decode_attention_reference
from miles.rollout.engine import EmbeddedEngine
from miles.rollout.sampling import sample_reference


@pytest.fixture
def engine(tiny_model_cfg):
    return EmbeddedEngine(tiny_model_cfg, max_batch_size=4, max_seq_len=48, seed=0)


def _req(rid, ids, **sp):
    return GenerateRequest(rid=rid, input_ids=ids, sampling=SamplingParams(**sp))


def _greedy_by_full_forward(model, prompt, n):
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt) :]


def test_requests_beyond_the_slots_wait_and_each_equals_its_own_greedy_decode(engine):
    prompts = [[1 + i, 7, 3 + (i % 3)] for i in range(10)]  # 10 requests, 4 slots
    lengths = [3 + (i * 5) % 9 for i in range(10)]  # rows finish at different steps and free their slot
    outs = engine.generate(
        [_req(str(i), p, max_new_tokens=n, temperature=0) for i, (p, n) in enumerate(zip(prompts, lengths))]
    )
    for p, n, o in zip(prompts, lengths, outs):
        assert o.output_ids == _greedy_by_full_forward(engine.model, p, n) and o.finish_reason == "length"
    assert engine.loop.stats["admitted"] == 10 and engine.loop.stats["steps"] < sum(lengths)


def test_a_groups_samples_prefill_their_prompt_once_and_match_unshared_decoding(engine):
    group = [_req(f"g{i}", [4, 5, 6, 7], max_new_tokens=5, temperature=0) for i in range(4)]
    before = engine.loop.stats["prefills"]
    outs = engine.generate(group)
    assert engine.loop.stats["prefills"] - before == 1
    alone = _greedy_by_full_forward(engine.model, [4, 5, 6, 7], 5)
    assert all(o.output_ids == alone for o in outs)


def test_a_groups_prompt_kv_is_held_once_and_its_slot_is_not_reused_while_the_group_runs(engine):
    group = [_req(f"g{i}", [4, 5, 6, 7], max_new_tokens=n, temperature=0) for i, n in enumerate((2, 9, 9))]
    others = [_req(f"o{i}", [9 - i, 3, 2 + i], max_new_tokens=3, temperature=0) for i in range(3)]
    outs = {}
    for share in (False, True):  # the GPU engine shares; this runs the same scheduling on the reference path
        engine.loop.share_prefix = share
        outs[share] = engine.generate(group + others)  # the group's KV holder (slot 0) finishes first; others wait
    for r, a, b in zip(group + others, outs[False], outs[True]):
        assert a.output_ids == b.output_ids == _greedy_by_full_forward(engine.model, r.input_ids, len(a.output_ids))
        torch.testing.assert_close(b.output_log_probs, a.output_log_probs)  # every position read as if copied


def test_the_reference_attention_reads_a_shared_prefix_from_its_slot_as_if_copied():
    torch.manual_seed(4)
    q, k, v = torch.randn(4, 4, 16), torch.randn(4, 2, 30, 16), torch.randn(4, 2, 30, 16)
    lens, slot, n = torch.tensor([9, 20, 30, 12]), torch.tensor([0, 0, 0, 3]), torch.tensor([7, 7, 7, 0])
    copied_k, copied_v = k.clone(), v.clone()
    copied_k[1:3, :, :7], copied_v[1:3, :, :7] = k[0, :, :7], v[0, :, :7]
    torch.testing.assert_close(
        decode_attention_reference(q, k, v, lens, prefix=(slot, n)),
        decode_attention_reference(q, copied_k, copied_v, lens),
    )


def test_the_host_reads_the_finish_flags_once_when_no_row_can_stop_early(engine):
    reads = engine.loop.stats["flag_reads"]
    engine.generate([_req(str(i), [i + 1, 2], max_new_tokens=30, temperature=1.0) for i in range(4)], seed=0)
    assert engine.loop.stats["flag_reads"] - reads == 1
    reads = engine.loop.stats["flag_reads"]
    engine.generate([_req("s", [1, 2], max_new_tokens=40, temperature=1.0, stop_token_ids=(300,))], seed=0)
    assert engine.loop.stats["flag_reads"] - reads == 40 // engine.loop.check_every + 1  # every check_every steps


def test_rows_with_different_sampling_parameters_share_a_batch(engine):
    reqs = [
        _req("greedy", [3, 1, 4], max_new_tokens=6, temperature=0),
        _req("hot", [3, 1, 4], max_new_tokens=6, temperature=2.0),
        _req("topk", [2, 7], max_new_tokens=6, temperature=1.0, top_k=1),
        _req("short", [2, 7], max_new_tokens=2, temperature=0.5),
    ]
    outs = engine.generate(reqs, seed=0)
    assert outs[0].output_ids == _greedy_by_full_forward(engine.model, [3, 1, 4], 6)
    assert outs[2].output_ids == _greedy_by_full_forward(engine.model, [2, 7], 6)  # top-1 is greedy
    assert [len(o.output_ids) for o in outs] == [6, 6, 6, 2]


def test_top_k_keeps_only_the_k_most_likely_tokens(engine):
    outs = engine.generate([_req(str(i), [9, 9], max_new_tokens=1, temperature=5.0, top_k=3) for i in range(40)])
    with torch.no_grad():
        top3 = engine.model(torch.tensor([[9, 9]]))[0, -1].topk(3).indices.tolist()
    assert {o.output_ids[0] for o in outs} <= set(top3)


def test_a_weight_update_while_generation_is_paused_applies_to_the_remaining_tokens(engine):
    old = _greedy_by_full_forward(engine.model, [1, 2, 3], 8)
    new = {k: v + 0.5 * torch.randn_like(v) for k, v in engine.named_weights().items()}
    engine.pause_generation("in_place")
    result = {}
    t = threading.Thread(
        target=lambda: result.update(o=engine.generate([_req("a", [1, 2, 3], max_new_tokens=8, temperature=0)]))
    )
    t.start()
    time.sleep(0.3)  # prefill done (first token from the old weights), the loop waits before the first step
    engine.update_weights_from_tensor(new.items(), version=1)
    engine.continue_generation()
    t.join(timeout=10)
    out = result["o"][0]
    assert out.weight_version == 1 and len(out.output_ids) == 8
    # the first token came from the old weights; the rest from the new ones (over the prompt's old K/V, as SGLang)
    assert out.output_ids[0] == old[0] and out.output_ids[1:] != old[1:]


def test_aborting_waiting_requests_returns_them_empty_and_running_ones_partial(engine):
    engine.pause_generation("in_place")
    result = {}
    reqs = [_req(str(i), [1, i + 1], max_new_tokens=30, temperature=0) for i in range(6)]  # 2 wait for a slot
    t = threading.Thread(target=lambda: result.update(o=engine.generate(reqs)))
    t.start()
    time.sleep(0.3)
    engine.abort(["0", "5"])
    engine.continue_generation()
    t.join(timeout=20)
    o = {x.rid: x for x in result["o"]}
    assert o["0"].finish_reason == "abort" and 0 < len(o["0"].output_ids) < 30
    assert o["5"].finish_reason == "abort" and o["5"].output_ids == []
    assert all(o[r].finish_reason == "length" and len(o[r].output_ids) == 30 for r in "1234")


def test_decode_attention_reference_matches_full_attention_row_by_row():
    torch.manual_seed(0)
    R, H, KVH, S, D = 5, 6, 2, 40, 8
    q, k, v = torch.randn(R, H, D), torch.randn(R + 2, KVH, S, D), torch.randn(R + 2, KVH, S, D)
    lens = torch.tensor([1, 9, 40, 17, 33])
    out = decode_attention_reference(q, k, v, lens, bound=40)
    for r in range(R):
        n = int(lens[r])
        kk, vv = k[r, :, :n].repeat_interleave(H // KVH, 0), v[r, :, :n].repeat_interleave(H // KVH, 0)
        ref = F.softmax(q[r, :, None] @ kk.transpose(1, 2) / D**0.5, -1) @ vv
        torch.testing.assert_close(out[r], ref[:, 0], atol=1e-5, rtol=1e-5)


def test_reference_sampler_log_probs_are_the_temperature_log_softmax_and_greedy_rows_take_the_argmax():
    torch.manual_seed(1)
    logits = torch.randn(6, 50) * 3
    t = torch.tensor([0.0, 1.0, 0.7, 0.0, 2.0, 1.0])
    tok, lp = sample_reference(logits, t, torch.Generator().manual_seed(0))
    ref = torch.log_softmax(logits / torch.where(t > 0, t, 1)[:, None], -1).gather(-1, tok[:, None])[:, 0]
    torch.testing.assert_close(lp, ref)
    assert tok[0] == logits[0].argmax() and tok[3] == logits[3].argmax()


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernels run on CPU only under TRITON_INTERPRET=1 (and on the GPU in test_engine_gpu)",
)
def test_triton_kernels_match_their_references_in_the_interpreter():
    from miles.rollout.kernels import decode_attention_triton, fused_sample

    torch.manual_seed(2)
    q, k, v = torch.randn(3, 4, 16), torch.randn(4, 2, 200, 16), torch.randn(4, 2, 200, 16)
    lens = torch.tensor([1, 77, 200])
    slot, n = torch.tensor([0, 0, 2]), torch.tensor([40, 40, 0])  # rows 0 and 1 share slot 0's first 40 positions
    for splits in (1, 4):
        out = decode_attention_triton(q, k, v, lens, splits)
        torch.testing.assert_close(out, decode_attention_reference(q, k, v, lens), atol=1e-5, rtol=1e-5)
        out = decode_attention_triton(q, k, v, lens, splits, (slot, n), block_n=16)
        ref = decode_attention_reference(q, k, v, lens, prefix=(slot, n))
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    logits, t = torch.randn(4, 5000) * 3, torch.tensor([0.0, 1.0, 0.7, 2.0])  # 5 vocabulary tiles
    tok, lp = fused_sample(logits, t, torch.tensor([7]))
    ref = torch.log_softmax(logits / torch.where(t > 0, t, 1)[:, None], -1).gather(-1, tok[:, None])[:, 0]
    torch.testing.assert_close(lp, ref, atol=1e-5, rtol=0)
    assert tok[0] == logits[0].argmax()


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernels run on CPU only under TRITON_INTERPRET=1 (and on the GPU in test_engine_gpu)",
)
def test_fused_decode_step_matches_the_reference_step_in_the_interpreter(tiny_model_cfg):
    from miles.model.decoder import KVCache, build_decoder
    from miles.rollout.forward import RopeTable, decode_step, decode_step_fused, fuse_projections

    torch.manual_seed(3)
    model, rope = build_decoder(tiny_model_cfg, seed=0), RopeTable(tiny_model_cfg, 64, "cpu", torch.float32)
    caches = [KVCache.allocate(tiny_model_cfg, 4, 64, "cpu", torch.float32) for _ in range(2)]
    for src, dst in zip(caches[0].tensors(), caches[1].tensors()):
        dst.copy_(src.normal_())
    tok, lens = torch.tensor([5, 17, 250]), torch.tensor([0, 10, 40])
    ref = decode_step(model, caches[0], rope, tok, lens, torch.empty(3, tiny_model_cfg.vocab_size))
    fused = fuse_projections(model)
    out = decode_step_fused(model, fused, caches[1], rope, tok, lens, torch.empty_like(ref), num_splits=2)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(caches[0].tensors(), caches[1].tensors()):
        torch.testing.assert_close(a, b)  # the same K/V written at each row's position


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_decoding_of_other_families_equals_the_full_forward(tiny_model_cfg, arch):
    from dataclasses import replace

    cfg = replace(tiny_model_cfg, architecture=arch, attention_bias=False)
    engine = EmbeddedEngine(cfg, max_batch_size=2, max_seq_len=32, seed=0)
    outs = engine.generate([_req(str(i), [3, 5 + i, 8], max_new_tokens=8, temperature=0) for i in range(3)])
    assert [o.output_ids for o in outs] == [_greedy_by_full_forward(engine.model, [3, 5 + i, 8], 8) for i in range(3)]


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernels run on CPU only under TRITON_INTERPRET=1 (and on the GPU in test_engine_gpu)",
)
def test_the_fused_engine_path_decodes_greedily_and_follows_weight_updates_in_the_interpreter(engine):
    from miles.rollout.forward import fuse_projections

    engine.fused = fuse_projections(engine.model)  # what a CUDA engine does at construction
    reqs = [_req(str(i), [3, 5 + i, 8], max_new_tokens=6 + i, temperature=0) for i in range(5)]
    for version in (0, 1):
        if version:
            new = {k: v + 0.3 * torch.randn_like(v) for k, v in engine.named_weights().items()}
            engine.update_weights_from_tensor(new.items(), version=1)
            assert torch.equal(engine.fused.qkv[0][:32], new["model.layers.0.self_attn.q_proj.weight"])
        outs = engine.generate(reqs)
        for r, o in zip(reqs, outs):
            assert o.output_ids == _greedy_by_full_forward(engine.model, r.input_ids, r.sampling.max_new_tokens)


def test_a_call_made_while_another_runs_joins_its_loop_and_gets_its_own_outputs(engine):
    engine.pause_generation("in_place")  # hold the first call's loop so the second arrives while it runs
    first = [_req(f"a{i}", [1, 2, i + 3], max_new_tokens=12, temperature=0) for i in range(3)]
    second = [_req(f"b{i}", [4, i + 5], max_new_tokens=5 + i, temperature=0) for i in range(3)]
    got = {}
    threads = [threading.Thread(target=lambda: got.update(a=engine.generate(first)))]
    threads[0].start()
    time.sleep(0.3)
    threads.append(threading.Thread(target=lambda: got.update(b=engine.generate(second))))
    threads[1].start()
    time.sleep(0.3)
    engine.continue_generation()
    for t in threads:
        t.join(timeout=20)
    assert engine.loop.stats["joined"] == 3  # 6 requests on 4 slots: the joiners wait for free slots
    for reqs, key in ((first, "a"), (second, "b")):
        assert [o.rid for o in got[key]] == [r.rid for r in reqs]
        for r, o in zip(reqs, got[key]):
            assert o.output_ids == _greedy_by_full_forward(engine.model, r.input_ids, r.sampling.max_new_tokens)
    assert len(engine.generate(second)) == 3  # and the loop is free again
