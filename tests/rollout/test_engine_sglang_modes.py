"""The engine behaviours SGLang's API asks for, in-process: min_new_tokens (stop tokens suppressed until then),
a row watch that ends a row where it says (how the server honours stop strings and streams), and the
``retract`` pause (rows back to the queue with their tokens, prefilled again on continue, under new weights when
the weights changed meanwhile)."""

import threading
import time

import pytest
import torch

from miles.protocols.engine import GenerateRequest, SamplingParams
from miles.rollout.engine import EmbeddedEngine

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def engine(tiny_model_cfg):
    return EmbeddedEngine(tiny_model_cfg, max_batch_size=4, max_seq_len=48, seed=0)


def _req(rid, ids, watch=None, **sp):
    return GenerateRequest(rid=rid, input_ids=ids, sampling=SamplingParams(**sp), watch=watch)


def _greedy_by_full_forward(model, prompt, n):
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt) :]


def test_min_new_tokens_keeps_stop_tokens_from_being_sampled_until_then(engine):
    greedy = _greedy_by_full_forward(engine.model, [1, 2, 3], 1)[0]  # the token greedy decoding picks first
    stopped = engine.generate([_req("a", [1, 2, 3], max_new_tokens=6, temperature=0, stop_token_ids=(greedy,))])[0]
    assert stopped.output_ids == [greedy] and stopped.finish_reason == "stop"
    held = engine.generate(
        [_req("b", [1, 2, 3], max_new_tokens=6, temperature=0, stop_token_ids=(greedy,), min_new_tokens=4)]
    )[0]
    assert greedy not in held.output_ids[:4] and len(held.output_ids) >= 4


class CutAt:
    """A watch that ends its row once it has ``n`` tokens, recording what it was shown."""

    interval = 1

    def __init__(self, n):
        self.n, self.shown = n, []

    def seen(self, ids, lps):
        self.shown.append(list(ids))
        return self.n if len(ids) >= self.n else None


def test_a_watch_ends_its_row_at_the_count_it_returns_and_sees_every_token(engine):
    watch = CutAt(3)
    out = engine.generate([_req("w", [4, 5], watch=watch, max_new_tokens=10, temperature=0)])[0]
    full = _greedy_by_full_forward(engine.model, [4, 5], 10)
    assert out.output_ids == full[:3] and out.finish_reason == "stop" and len(out.output_log_probs) == 3
    # interval 1: shown after every decode step (the prefill's token comes with the first step's)
    assert [len(s) for s in watch.shown] == [2, 3] and watch.shown[-1] == full[:3]


def test_a_retracted_row_resumes_from_its_tokens_under_the_new_weights(engine):
    prompt = [1, 2, 3]
    old = _greedy_by_full_forward(engine.model, prompt, 8)
    new = {k: v + 0.5 * torch.randn_like(v) for k, v in engine.named_weights().items()}
    engine.pause_generation("in_place")
    result = {}
    t = threading.Thread(
        target=lambda: result.update(o=engine.generate([_req("a", prompt, max_new_tokens=8, temperature=0)]))
    )
    t.start()
    time.sleep(0.3)  # admitted and prefilled: one token from the old weights, then held before the first step
    engine.pause_generation("retract")
    deadline = time.monotonic() + 10
    while not engine.loop.parked:
        assert time.monotonic() < deadline, "the loop did not park after a retract"
        time.sleep(0.01)
    engine.offload(["kv_cache"])  # nothing holds KV state now: the cache may go
    engine.onload(["kv_cache"])
    engine.update_weights_from_tensor(new.items(), version=1)
    engine.continue_generation()
    t.join(timeout=20)
    out = result["o"][0]
    assert out.retractions == 1 and out.weight_version == 1 and len(out.output_ids) == 8
    # unlike an in-place pause (which keeps the old K/V), the prompt and the first token are prefilled again
    assert out.output_ids == [old[0]] + _greedy_by_full_forward(engine.model, prompt + [old[0]], 7)


def test_a_retract_without_changes_gives_the_uninterrupted_output_and_aborts_reach_parked_requests(engine):
    prompt = [7, 7, 2]
    ref = _greedy_by_full_forward(engine.model, prompt, 6)
    engine.pause_generation("in_place")
    result = {}
    reqs = [
        _req("keep", prompt, max_new_tokens=6, temperature=0),
        _req("drop", [3, 1], max_new_tokens=6, temperature=0),
    ]
    t = threading.Thread(target=lambda: result.update(o=engine.generate(reqs)))
    t.start()
    time.sleep(0.3)
    engine.pause_generation("retract")
    while not engine.loop.parked:
        time.sleep(0.01)
    engine.abort(["drop"])  # answered while parked, with the token it had
    deadline = time.monotonic() + 5
    while t.is_alive() and time.monotonic() < deadline and not engine.loop.stats.get("retracted"):
        time.sleep(0.01)
    engine.continue_generation()
    t.join(timeout=20)
    keep, drop = result["o"]
    assert keep.output_ids == ref and keep.finish_reason == "length" and keep.retractions == 1
    assert drop.finish_reason == "abort" and len(drop.output_ids) == 1
