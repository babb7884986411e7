"""The torch.distributed side of SGLang and slime, for the broadcast tests: what sglang 0.5.10.post1 runs in
``srt/utils/common.py init_custom_process_group`` (slime's ``slime/utils/distributed_utils.init_process_group`` is
the same code) and in ``srt/model_executor/model_runner.py`` (``update_weights_from_distributed``: one
``torch.empty`` + async ``dist.broadcast`` per tensor, then wait; ``_update_bucketed_weights_from_distributed``:
one uint8 broadcast of the tensors back to back), re-written here from that source (sglang cannot be installed
on a CPU machine). Used two ways:

- ``python -m tests.rollout.conformance.sglang_peer server PORT``: an HTTP server answering SGLang's
  /server_info (no ``miles`` section, ``tp_size`` 1), /init_weights_update_group,
  /update_weights_from_distributed, /destroy_weights_update_group and /get_weights_by_name as SGLang's do, the
  received weights kept in a dict: the receiving end of "miles' trainer -> an SGLang-protocol server";
- ``init_process_group`` / ``send_per_tensor`` / ``send_flattened`` below: the sending end of "slime's trainer ->
  miles serve".
"""

from __future__ import annotations

import datetime
import sys

import torch
import torch.distributed as dist


def init_process_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str, timeout_s=60.0):
    """SGLang's init_custom_process_group: rendezvous(init_method) -> PrefixStore(group_name) ->
    _new_process_group_helper (which adds PrefixStore(f"{group_name}/") and the backend's device prefix)."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), store, group_name=group_name, backend_options=None, timeout=timeout
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def receive_per_tensor(pg, names, dtypes, shapes) -> list[tuple[str, torch.Tensor]]:
    weights, handles = [], []
    for name, dtype, shape in zip(names, dtypes, shapes):
        w = torch.empty(shape, dtype=getattr(torch, dtype))
        handles.append(dist.broadcast(w, src=0, group=pg, async_op=True))
        weights.append((name, w))
    for h in handles:
        h.wait()
    return weights


def receive_flattened(pg, names, dtypes, shapes) -> list[tuple[str, torch.Tensor]]:
    tensors = [torch.empty(s, dtype=getattr(torch, d)) for d, s in zip(dtypes, shapes)]
    flat = torch.cat([t.flatten().view(torch.uint8) for t in tensors]) if tensors else torch.empty(0, dtype=torch.uint8)
    dist.broadcast(flat, src=0, group=pg)
    out, off = [], 0
    for n, t in zip(names, tensors):
        nb = t.numel() * t.element_size()
        out.append((n, flat[off : off + nb].view(t.dtype).reshape(t.shape)))
        off += nb
    return out


def send_per_tensor(pg, tensors: list[torch.Tensor]) -> None:
    """slime's update_weights_from_distributed: one async broadcast per tensor from rank 0, then wait."""
    handles = [dist.broadcast(t, 0, group=pg, async_op=True) for t in tensors]
    for h in handles:
        h.wait()


def send_flattened(pg, tensors: list[torch.Tensor]) -> None:
    dist.broadcast(torch.cat([t.flatten().view(torch.uint8) for t in tensors]), 0, group=pg)


def serve(port: int) -> None:
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import ORJSONResponse

    app, groups, weights = FastAPI(), {}, {}

    @app.get("/health")
    async def health():
        return {}

    @app.get("/server_info")
    async def server_info():
        return {"tp_size": 1, "dp_size": 1, "model_path": "peer", "version": "0.5.10.post1"}

    @app.post("/init_weights_update_group")
    def init_group(body: dict):  # a sync route: FastAPI runs it in a thread, as SGLang's scheduler is another process
        init = f"tcp://{body['master_address']}:{body['master_port']}"
        rank = body["rank_offset"]  # + tp_rank 0
        groups[body["group_name"]] = init_process_group(
            body.get("backend", "nccl"), init, body["world_size"], rank, body["group_name"]
        )
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    @app.post("/update_weights_from_distributed")
    def update(body: dict):
        pg = groups[body.get("group_name", "weight_update_group")]
        fn = receive_flattened if body.get("load_format") == "flattened_bucket" else receive_per_tensor
        weights.update(fn(pg, body["names"], body["dtypes"], body["shapes"]))
        return {"success": True, "message": "Succeeded to update parameter online."}

    @app.post("/destroy_weights_update_group")
    def destroy(body: dict):
        pg = groups.pop(body.get("group_name", "weight_update_group"), None)
        if pg is None:
            return ORJSONResponse({"success": False, "message": "The group to be destroyed does not exist."}, 400)
        dist.destroy_process_group(pg)
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    @app.post("/peer/weights")
    async def all_weights():  # the test reads back what arrived, bit for bit
        import base64
        import io

        buf = io.BytesIO()
        torch.save(weights, buf)
        return {"torch_save": base64.b64encode(buf.getvalue()).decode()}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    if sys.argv[1] == "server":
        serve(int(sys.argv[2]))
