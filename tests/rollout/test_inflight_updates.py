"""Weight updates between decode steps (partial rollouts): every token carries the version it was sampled under, the
rows in flight continue under the new version, with their KV cache kept (``in_place``) or recomputed under the new
weights (``retract``)."""

import threading

import pytest
import torch

from miles.protocols.engine import GenerateRequest, SamplingParams, token_versions
from miles.rollout.decode_loop import versions_of
from miles.rollout.engine import EmbeddedEngine

pytestmark = pytest.mark.timeout(120)

N, K = 10, 4  # tokens per row; the update lands after the row's K-th token


@pytest.fixture
def engine(tiny_model_cfg):
    return EmbeddedEngine(tiny_model_cfg, max_batch_size=4, max_seq_len=48, seed=0)


def _req(rid, ids, watch=None):
    return GenerateRequest(
        rid=rid, input_ids=ids, sampling=SamplingParams(max_new_tokens=N, temperature=0), watch=watch
    )


class HoldAt:
    """A watch that, once its row has ``k`` tokens, tells the test and holds the loop (between two decode steps, the
    engine's lock free) until the test has made its change."""

    interval = 1

    def __init__(self, k):
        self.k, self.reached, self.go = k, threading.Event(), threading.Event()

    def seen(self, ids, lps):
        if len(ids) == self.k and not self.reached.is_set():
            self.reached.set()
            assert self.go.wait(30), "the test did not release the row"
        return None


def _log_probs_by_full_forward(model, prompt, out_ids):
    """Log-probs of ``out_ids`` after ``prompt`` from one forward of the whole sequence (the KV recomputed)."""
    seq = torch.tensor([list(prompt) + list(out_ids)])
    with torch.no_grad():
        lp = torch.log_softmax(model(seq[:, :-1]).float(), -1)[0]
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(out_ids)]


def _perturbed(engine):
    g = torch.Generator().manual_seed(1)
    return [(k, v + 0.3 * torch.randn(v.shape, generator=g)) for k, v in engine.named_weights().items()]


def _generate_in_thread(engine, reqs):
    result = {}
    t = threading.Thread(target=lambda: result.update(outs=engine.generate(reqs, seed=0)), daemon=True)
    t.start()
    return t, result


def test_every_token_carries_the_version_the_engine_held(engine):
    engine.update_weights_from_tensor(list(engine.named_weights().items()), version=7)
    out = engine.generate([_req("a", [1, 2, 3])], seed=0)[0]
    assert out.output_versions == [7] * len(out.output_ids) == token_versions(out)


def test_an_update_between_decode_steps_reaches_the_rows_in_flight_with_their_kv_kept(engine):
    prompt, watch = [1, 2, 3], HoldAt(K)
    old_ids = engine.generate([_req("ref", prompt)], seed=0)[0].output_ids
    t, result = _generate_in_thread(engine, [_req("a", prompt, watch), _req("b", [4, 5])])
    assert watch.reached.wait(30)
    new = _perturbed(engine)
    engine.update_weights_from_tensor(new, version=1)  # takes the lock between two decode steps
    watch.go.set()
    t.join(30)
    a, b = result["outs"]
    assert a.output_versions == [0] * K + [1] * (N - K)
    assert b.output_versions[:K] == [0] * K and set(b.output_versions[K:]) == {1}  # every row in flight moved
    assert a.output_ids[:K] == old_ids[:K]  # before the boundary: the old weights' greedy tokens
    # after it the new weights read the old weights' KV of the prefix: not what the new policy gives the sequence
    recomputed = _log_probs_by_full_forward(engine.model, prompt, a.output_ids)
    assert max(abs(x - y) for x, y in zip(a.output_log_probs[K:], recomputed[K:])) > 1e-2


def test_a_retract_around_the_update_recomputes_the_kv_under_the_new_weights(engine):
    prompt, watch = [1, 2, 3], HoldAt(K)
    t, result = _generate_in_thread(engine, [_req("a", prompt, watch)])
    assert watch.reached.wait(30)
    engine.pause_generation("retract")  # the row goes back to the queue with its K tokens at the next check
    watch.go.set()
    deadline = threading.Event()
    for _ in range(300):
        if engine.loop.parked:
            break
        deadline.wait(0.05)
    assert engine.loop.parked
    engine.update_weights_from_tensor(_perturbed(engine), version=1)
    engine.continue_generation()
    t.join(30)
    (a,) = result["outs"]
    assert a.retractions == 1 and a.output_versions == [0] * K + [1] * (N - K)
    recomputed = _log_probs_by_full_forward(engine.model, prompt, a.output_ids)
    torch.testing.assert_close(a.output_log_probs[K:], recomputed[K:], atol=1e-4, rtol=0)


def test_versions_of_expands_spans_to_one_version_per_token():
    assert versions_of([(0, 3)], 4) == [3, 3, 3, 3]
    assert versions_of([(0, 3), (2, 4), (3, 6)], 5) == [3, 3, 4, 6, 6]
    assert versions_of([(0, 3), (6, 4)], 2) == [3, 3]  # a row stopped before the boundary
