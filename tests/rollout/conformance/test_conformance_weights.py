"""Weight updates in SGLang's own formats, sent by another process as SGLang's callers send them.

Spec: sglang 0.5.10.post1 ``srt/utils/common.py`` (``MultiprocessingSerializer``: base64 of a ForkingPickler
pickle), ``srt/weight_sync/tensor_bucket.py`` (``FlattenedTensorBucket`` / ``FlattenedTensorMetadata``: name,
shape, dtype, start_idx, end_idx, numel over a uint8 buffer), ``srt/managers/io_struct.py``
(UpdateWeightsFromTensorReqInput, UpdateWeightFromDiskReqInput), ``srt/model_executor/model_runner.py``
(``update_weights_from_tensor``: ``load_format`` None or ``flattened_bucket``; entry ``[tp_rank]`` of
``serialized_named_tensors``).
Request shapes: slime ``backends/megatron_utils/update_weight/update_weight_from_tensor.py``
(``_build_flattened_tensor_data``, ``_send_to_colocated_engine``: ``load_format="flattened_bucket"``,
``weight_version`` a string), slime and radixark/miles ``sglang_engine.py`` (``update_weights_from_disk`` with a
checkpoint directory).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import httpx
import pytest
import torch

pytestmark = [pytest.mark.procs, pytest.mark.timeout(120)]  # procs: it starts processes or servers

SENDER = textwrap.dedent(
    """
    import base64, dataclasses, io, json, sys, types
    import httpx, torch
    from multiprocessing.reduction import ForkingPickler

    url, fmt, strategy, spec = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    torch.multiprocessing.set_sharing_strategy(strategy)
    torch.manual_seed(spec["seed"])
    named = [(n, torch.randn(s).to(getattr(torch, d))) for n, (s, d) in spec["weights"].items()]

    # sglang's FlattenedTensorMetadata, importable under its own module path as in a slime process
    mod = types.ModuleType("sglang.srt.weight_sync.tensor_bucket")
    @dataclasses.dataclass
    class FlattenedTensorMetadata:
        name: str
        shape: torch.Size
        dtype: torch.dtype
        start_idx: int
        end_idx: int
        numel: int
    FlattenedTensorMetadata.__module__ = mod.__name__
    mod.FlattenedTensorMetadata = FlattenedTensorMetadata
    for parent in ("sglang", "sglang.srt", "sglang.srt.weight_sync"):
        sys.modules[parent] = types.ModuleType(parent)
    sys.modules[mod.__name__] = mod

    if fmt == "flattened_bucket":  # slime's _build_flattened_tensor_data
        flats, metas, at = [], [], 0
        for n, t in named:
            f = t.flatten().view(torch.uint8)
            metas.append(FlattenedTensorMetadata(n, t.shape, t.dtype, at, at + f.numel(), f.numel()))
            flats.append(f)
            at += f.numel()
        obj = {"flattened_tensor": torch.cat(flats), "metadata": metas}
    else:
        obj = named
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)  # MultiprocessingSerializer.serialize(obj, output_str=True)
    payload = base64.b64encode(buf.getvalue()).decode()
    body = {"serialized_named_tensors": [payload], "load_format": fmt if fmt != "none" else None,
            "flush_cache": False, "weight_version": "7"}
    r = httpx.post(url + "/update_weights_from_tensor", json=body, timeout=60)  # the tensors live until answered
    print(json.dumps({"status": r.status_code, "body": r.json()}))
    """
)


def _send(server, fmt: str, spec: dict, strategy: str = "file_system") -> dict:
    out = subprocess.run(
        [sys.executable, "-c", SENDER, server.url, fmt, strategy, json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _spec(engine, names: list[str], seed: int) -> dict:
    w = engine.named_weights()
    return {"seed": seed, "weights": {n: [list(w[n].shape), str(w[n].dtype).removeprefix("torch.")] for n in names}}


def _expected(spec: dict) -> dict[str, torch.Tensor]:
    torch.manual_seed(spec["seed"])
    return {n: torch.randn(s).to(getattr(torch, d)) for n, (s, d) in spec["weights"].items()}


@pytest.mark.parametrize("fmt", ["none", "flattened_bucket"])
def test_a_multiprocessing_serializer_payload_updates_the_named_weights(servers, fmt):
    s = servers(f"payload-{fmt}")
    engine = s.server.engine
    names = ["model.norm.weight", "model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.q_proj.bias"]
    spec = _spec(engine, names, seed=3)
    answer = _send(s, fmt, spec)
    assert answer["status"] == 200 and answer["body"]["success"] is True, answer
    got = engine.named_weights()
    for n, t in _expected(spec).items():
        assert torch.equal(got[n], t), n
    assert httpx.get(s.url + "/model_info").json()["weight_version"] == "7"
    d = httpx.post(s.url + "/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}).json()
    assert d["meta_info"]["weight_version"] == "7"  # the string sent, not an integer


def test_a_file_descriptor_payload_is_refused_with_the_fix_and_nothing_changes(servers):
    s = servers("payload-fd")
    engine = s.server.engine
    before = {k: v.clone() for k, v in engine.named_weights().items()}
    answer = _send(s, "none", _spec(engine, ["model.norm.weight"], seed=4), strategy="file_descriptor")
    assert answer["status"] == 400 and "set_sharing_strategy('file_system')" in answer["body"]["message"]
    assert all(torch.equal(before[k], v) for k, v in engine.named_weights().items())


def test_update_weights_from_disk_loads_a_hf_checkpoint_directory(servers, tmp_path):
    import copy

    from miles.model.checkpoint import save_hf

    s = servers("disk")
    engine = s.server.engine
    ckpt = copy.deepcopy(engine.model)  # a checkpoint of other weights, written as HF writes one
    with torch.no_grad():
        for p in ckpt.parameters():
            p.add_(0.25)
    save_hf(ckpt, tmp_path)
    src = {k: v.clone() for k, v in ckpt.hf_state_dict().items()}
    body = {"model_path": str(tmp_path), "load_format": None, "weight_version": "disk-1"}
    r = httpx.post(s.url + "/update_weights_from_disk", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["success"] is True and r.json()["num_paused_requests"] == 0
    assert all(torch.equal(engine.named_weights()[k], v) for k, v in src.items())
    assert httpx.get(s.url + "/model_info").json()["weight_version"] == "disk-1"


CUDA_SENDER = textwrap.dedent(
    """
    import base64, io, json, sys
    import httpx, torch
    import torch.multiprocessing.reductions as reductions
    from multiprocessing.reduction import ForkingPickler

    url, uuid_device, spec = sys.argv[1], sys.argv[2] == "uuid", json.loads(sys.argv[3])
    if uuid_device:  # what sglang's monkey_patch_torch_reductions sends: the device's UUID in place of its index
        original = reductions.reduce_tensor
        def reduce_tensor(t):
            fn, args = original(t)
            if fn is reductions.rebuild_cuda_tensor:
                args = args[:6] + (str(torch.cuda.get_device_properties(args[6]).uuid),) + args[7:]
            return fn, args
        ForkingPickler.register(torch.Tensor, reduce_tensor)
    torch.manual_seed(spec["seed"])
    named = [(n, torch.randn(s).to(getattr(torch, d)).cuda()) for n, (s, d) in spec["weights"].items()]
    buf = io.BytesIO()
    ForkingPickler(buf).dump(named)
    body = {"serialized_named_tensors": [base64.b64encode(buf.getvalue()).decode()], "load_format": None,
            "flush_cache": False, "weight_version": "9"}
    r = httpx.post(url + "/update_weights_from_tensor", json=body, timeout=120)
    torch.cuda.synchronize()
    print(json.dumps({"status": r.status_code, "body": r.json()}))
    """
)


@pytest.mark.gpu
@pytest.mark.parametrize("device_as", ["index", "uuid"])
def test_a_cuda_ipc_payload_updates_a_cuda_engine(conf_cfg, device_as):
    """SGLang's and slime's colocated path on a GPU: CUDA IPC handles (with SGLang's device-UUID patch too)."""
    from miles.rollout.engine import EmbeddedEngine
    from miles.rollout.server import EngineServer
    from tests.rollout.conftest import ThreadedServer

    with ThreadedServer(EngineServer(EmbeddedEngine.from_config(conf_cfg, "cuda"))) as s:
        engine = s.server.engine
        spec = _spec(engine, ["model.norm.weight", "model.layers.0.mlp.up_proj.weight"], seed=6)
        out = subprocess.run(
            [sys.executable, "-c", CUDA_SENDER, s.url, device_as, json.dumps(spec)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        answer = json.loads(out.stdout.strip().splitlines()[-1])
        assert answer["status"] == 200, answer
        got = engine.named_weights()
        for n, t in _expected(spec).items():
            assert torch.equal(got[n].cpu(), t), n
