"""The broadcast weight group with an SGLang-protocol peer, both directions, gloo on CPU, weights bit-equal.

Spec: sglang 0.5.10.post1 ``srt/utils/common.py init_custom_process_group`` (rendezvous, then
``PrefixStore(group_name)``, then torch's ``_new_process_group_helper``: a second ``PrefixStore(f"{group_name}/")``
and the backend's), ``srt/model_executor/model_runner.py`` (``init_weights_update_group`` at rank
``rank_offset + tp_rank``; ``update_weights_from_distributed``: one broadcast per tensor, or with
``load_format="flattened_bucket"`` one of the tensors back to back), ``io_struct.py`` (InitWeightsUpdateGroupReqInput,
UpdateWeightsFromDistributedReqInput: dtypes as names like "bfloat16", ``weight_version`` a string).
Request shapes: slime ``backends/megatron_utils/update_weight/update_weight_from_distributed.py``
(``connect_rollout_engines_from_distributed``: engines join while rank 0 runs ``init_process_group``;
``update_weights_from_distributed``: the engines are called, then rank 0 broadcasts each tensor).
The SGLang side is tests/rollout/conformance/sglang_peer.py (that source, re-written: sglang needs CUDA).
"""

from __future__ import annotations

import base64
import datetime
import io
import json
import os
import subprocess
import sys
import textwrap
import time

import httpx
import pytest
import torch

from miles.ports import free_port

pytestmark = [pytest.mark.procs, pytest.mark.timeout(180)]  # procs: it starts processes or servers
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

SLIME_TRAINER = textwrap.dedent(
    """
    import json, sys, threading
    import httpx, torch
    from tests.rollout.conformance.sglang_peer import init_process_group, send_flattened, send_per_tensor

    url, port, fmt, spec = sys.argv[1], int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
    torch.manual_seed(spec["seed"])
    named = [(n, torch.randn(s).to(getattr(torch, d))) for n, (s, d) in spec["weights"].items()]
    answers = {}

    def call(path, body):
        answers[path] = httpx.post(url + path, json=body, timeout=120)

    join = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "slime-pp_0", "backend": "gloo"}
    t = threading.Thread(target=call, args=("/init_weights_update_group", join)); t.start()
    pg = init_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, "slime-pp_0")
    t.join()
    body = {"names": [n for n, _ in named], "dtypes": [str(x.dtype).replace("torch.", "") for _, x in named],
            "shapes": [list(x.shape) for _, x in named], "group_name": "slime-pp_0", "flush_cache": False,
            "weight_version": "3"}
    if fmt == "flattened_bucket":
        body["load_format"] = fmt
    t = threading.Thread(target=call, args=("/update_weights_from_distributed", body)); t.start()
    (send_flattened if fmt == "flattened_bucket" else send_per_tensor)(pg, [x for _, x in named])
    t.join()
    call("/destroy_weights_update_group", {"group_name": "slime-pp_0"})
    print(json.dumps({p: [r.status_code, r.json()] for p, r in answers.items()}))
    """
)


@pytest.mark.parametrize("fmt", ["per_tensor", "flattened_bucket"])
def test_slimes_trainer_forms_the_group_with_miles_serve_and_its_broadcasts_land_bit_equal(servers, fmt):
    s = servers(f"from-slime-{fmt}")
    engine = s.server.engine
    w = engine.named_weights()
    names = ["model.embed_tokens.weight", "model.norm.weight", "model.layers.1.mlp.gate_proj.weight"]
    spec = {"seed": 5, "weights": {n: [list(w[n].shape), str(w[n].dtype).removeprefix("torch.")] for n in names}}
    out = subprocess.run(
        [sys.executable, "-c", SLIME_TRAINER, s.url, str(free_port()), fmt, json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    answers = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(code == 200 and body["success"] for code, body in answers.values()), answers
    torch.manual_seed(5)
    got = engine.named_weights()
    for n, (shape, dtype) in spec["weights"].items():
        assert torch.equal(got[n], torch.randn(shape).to(getattr(torch, dtype))), n
    assert httpx.get(s.url + "/model_info").json()["weight_version"] == "3"


def test_a_join_whose_rank_0_never_forms_its_group_is_answered_within_group_connect_timeout_s(conf_cfg):
    """The review's run: slime's rank 0 reached the rendezvous, the group never formed, and the engine's
    /init_weights_update_group stayed pending 40 s under --group-connect-timeout-s 8 (gloo's connect waited out
    the 300 s collective timeout). Here rank 0 hosts the store and never creates its group."""
    import torch.distributed as dist

    from miles.rollout.engine import EmbeddedEngine
    from miles.rollout.server import EngineServer
    from tests.rollout.conftest import ThreadedServer

    port = free_port()
    store = dist.TCPStore(  # noqa: F841 - rank 0's store, kept open for the whole join
        "127.0.0.1", port, 2, is_master=True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False
    )
    with ThreadedServer(EngineServer(EmbeddedEngine.from_config(conf_cfg, "cpu"), group_connect_timeout_s=3)) as s:
        join = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                "group_name": "slime-pp_0", "backend": "gloo"}  # fmt: skip
        t0 = time.monotonic()
        r = httpx.post(s.url + "/init_weights_update_group", json=join, timeout=120)
        took = time.monotonic() - t0
        assert r.status_code == 400 and f"127.0.0.1:{port} within 3 s" in r.json()["message"], r.text
        assert took < 12, f"answered after {took:.1f} s for a 3 s bound"  # margin for a loaded machine
        assert "pending_group_join" not in httpx.get(s.url + "/health").json()  # the next join is taken


@pytest.fixture
def sglang_peer():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.rollout.conformance.sglang_peer", "server", str(port)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "the SGLang-protocol peer did not start"
        time.sleep(0.1)
    yield url
    proc.terminate()
    proc.wait(timeout=20)


class ClientActor:
    """The endpoint side of miles' BroadcastSync as the RolloutManager actor holds it: an SGLangClient in another
    process (the sync calls its methods through Ray while rank 0 forms the group and broadcasts)."""

    def __init__(self, url: str):
        from miles.rollout.sglang_client import SGLangClient

        self.client = SGLangClient(url, flavor="sglang")

    def broadcast_formats(self):
        return self.client.broadcast_formats()

    def group_ranks(self):
        return self.client.group_ranks()

    def init_weights_update_group(self, *args):
        return self.client.init_weights_update_group(*args)

    def update_weights_from_distributed(self, *args):
        return self.client.update_weights_from_distributed(*args)

    def destroy_weights_update_group(self, name):
        return self.client.destroy_weights_update_group(name)


def test_miles_trainer_forms_the_group_with_an_sglang_protocol_server_and_sends_per_tensor(
    sglang_peer, tmp_path, ray_session
):
    from miles.sync.broadcast import BroadcastSync
    from miles.sync.bucket_sync import SyncTimer
    from miles.sync.buckets import plan_buckets
    from tests.conftest import tiny_run_cfg

    cfg = tiny_run_cfg(tmp_path, "sync.transport=broadcast")
    actor = ray_session.remote(ClientActor).remote(sglang_peer)
    sync = BroadcastSync(cfg.sync, "cpu", timeout_s=60)
    sync.engines = [actor]  # BucketSync.connect's part (the bucket sequence's pause/flush/commit are not SGLang's)
    torch.manual_seed(9)
    named = [("a.weight", torch.randn(4, 8)), ("b.bias", torch.randn(8).to(torch.bfloat16)), ("c", torch.randn(()))]
    try:
        sync._form_group()
        assert sync.format == "per_tensor"  # the peer lists no miles formats: SGLang's default is what it receives
        for i, bucket in enumerate(plan_buckets(named, 1 << 20)):
            sync._send(i, bucket, SyncTimer())
    finally:
        sync.close()
    answer = httpx.post(sglang_peer + "/peer/weights", timeout=30).json()
    assert "torch_save" in answer, answer
    got = torch.load(io.BytesIO(base64.b64decode(answer["torch_save"])))
    assert set(got) == {n for n, _ in named}
    assert all(torch.equal(got[n], t) for n, t in named)
