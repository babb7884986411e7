"""The server's batcher over a real engine: a call batched with others is answered when its own requests are done
(SGLang answers each request as it finishes), not when the batch's longest request ends."""

from __future__ import annotations

import asyncio
import threading

import pytest

from miles.protocols.engine import GenerateRequest, SamplingParams
from miles.rollout.batcher import GenerateBatcher
from miles.rollout.engine import EmbeddedEngine
from tests.conftest import tiny_run_cfg

pytestmark = pytest.mark.timeout(120)


class HoldAfterFirstLook:
    """A RowWatch that lets the row's first check pass, then holds the decode loop until ``release`` is set."""

    interval = 1

    def __init__(self):
        self.looks, self.release = 0, threading.Event()

    def seen(self, ids, log_probs):
        self.looks += 1
        if self.looks > 1:
            self.release.wait(60)
        return None


def request(rid: str, n: int, watch=None) -> GenerateRequest:
    sp = SamplingParams(max_new_tokens=n)  # no stop tokens: each runs to its length
    return GenerateRequest(rid=rid, input_ids=[1, 2, 3], sampling=sp, watch=watch)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return EmbeddedEngine.from_config(tiny_run_cfg(tmp_path_factory.mktemp("batcher"), "rollout.max_seq_len=48"), "cpu")


def test_a_short_call_batched_with_a_long_one_is_answered_while_the_long_one_still_runs(engine):
    hold = HoldAfterFirstLook()

    async def run():
        b = GenerateBatcher(engine, wait_s=0.2)  # both calls arrive inside one batch window
        b.start()
        long = asyncio.ensure_future(b.submit([request("long", 30, watch=hold)]))
        short = asyncio.ensure_future(b.submit([request("short", 1)]))
        try:
            (out,) = await asyncio.wait_for(short, 30)  # before the fix: never, the batch waits on the held row
            assert out.rid == "short" and len(out.output_ids) == 1 and not long.done()
            assert b.num_running == 1 and b.rids() == {"long"}  # the answered call left the batch
        finally:
            hold.release.set()
        (out,) = await asyncio.wait_for(long, 60)
        async with b.idle:  # the batch ends just after its last call is answered
            pass
        assert len(out.output_ids) == 30 and b.stats["batches"] == 1  # one batch held both calls
        await b.stop()

    asyncio.run(run())


def test_aborting_one_call_of_a_paused_batch_answers_it_at_once(engine):
    async def run():
        b = GenerateBatcher(engine, wait_s=0.2)
        b.start()
        engine.pause_generation("in_place")
        try:
            first = asyncio.ensure_future(b.submit([request("first", 20)]))
            second = asyncio.ensure_future(b.submit([request("second", 20)]))
            while b.num_running < 2:
                await asyncio.sleep(0.01)
            b.abort(["first"])
            (out,) = await asyncio.wait_for(first, 30)
            assert out.finish_reason == "abort" and not second.done()
        finally:
            engine.continue_generation()
        (out,) = await asyncio.wait_for(second, 60)
        assert out.finish_reason == "length" and len(out.output_ids) == 20
        await b.stop()

    asyncio.run(run())
