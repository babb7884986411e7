"""``miles bench weight-sync``: seconds per weight sync for every transport side by side, vs model size.

A trainer stand-in actor (a real decoder's bf16 weights and the sync) and an engine actor (the embedded
engine) run in separate Ray actor processes, on the same device: on CUDA both share one GPU. Each transport
is timed on the same weights after one warm-up sync (buffers allocated, handles opened, groups formed); the
median of ``--repeats`` syncs is reported with its GB/s, and the engine's weights are checked against the
trainer's after the last one (bit-equal below ``--check-max-mib``, per-tensor fingerprints above).

Ceilings measured in the same run on the same bytes: ``copy`` (one flat device copy in one process: on CPU
memcpy, on CUDA a device-to-device copy) and, on CUDA, ``host-staged`` (the ``tensor`` transport with its
staging buffers in shared host memory: device -> host -> device). ``tensor`` and ``rdt`` copy every byte
twice (into the staging bucket, out of it into the engine), ``tensor:in-place`` once (the engine reads the
trainer's tensors through handles opened at the warm-up sync), ``:shadow`` staging once more at commit.
``tensor:in-place`` asks the engine by ringing its doorbell on CUDA (miles.sync.doorbell) and by a Ray call on
CPU; ``:ray`` and ``:doorbell`` force one or the other.

    miles bench weight-sync --json                                     # CPU: 8/32/128 MiB, all transports
    miles bench weight-sync --json                                     # CUDA: 256 MiB / 1 / 4 GiB on one shared GPU
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time

import torch

from miles.model.config import ModelConfig

log = logging.getLogger(__name__)

WIDTH = {  # decoder width per device; the layer count is chosen to reach the target size
    "cpu": dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_attention_heads=8, num_key_value_heads=4),
    "cuda": dict(
        vocab_size=32768, hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=8
    ),
}
TRANSPORTS = {  # variant -> (transport, engine staging, extra)
    "tensor": ("tensor", "direct", {}),
    "tensor:shadow": ("tensor", "shadow", {}),
    "tensor:in-place": ("tensor", "direct", {"source": "in_place"}),
    "tensor:in-place:shadow": ("tensor", "shadow", {"source": "in_place"}),
    "tensor:in-place:ray": ("tensor", "direct", {"source": "in_place", "doorbell": False}),  # a Ray call per sync
    "tensor:in-place:doorbell": ("tensor", "direct", {"source": "in_place", "doorbell": True}),  # (CUDA's default)
    "broadcast": ("broadcast", "direct", {}),
    "rdt": ("rdt", "direct", {}),
    "rdt:shadow": ("rdt", "shadow", {}),
    "rdt:in-place": ("rdt", "direct", {"source": "in_place"}),
    "host-staged": ("tensor", "direct", {"staging_device": "cpu"}),
    "disk-delta": ("disk-delta", "direct", {}),
}
# rdt over gloo comes last: its Ray collective group makes the trainer process a torch.distributed world of 2,
# which a transport that gathers over the default group (disk-delta) would then wait on forever.
DEFAULTS = {
    "cpu": [
        "tensor",
        "tensor:shadow",
        "tensor:in-place",
        "tensor:in-place:doorbell",
        "tensor:in-place:shadow",
        "broadcast",
        "disk-delta",
        "rdt",
        "rdt:shadow",
        "rdt:in-place",
    ],
    "cuda": [
        "tensor",
        "tensor:shadow",
        "tensor:in-place",
        "tensor:in-place:ray",
        "tensor:in-place:shadow",
        "rdt",
        "rdt:shadow",
        "rdt:in-place",
        "host-staged",
    ],
}  # NCCL cannot pair two ranks on one GPU


def _parse(argv: list[str], cuda: bool) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="miles bench weight-sync")
    p.add_argument("--json", action="store_true", help="accepted for the CLI; the result is always JSON")
    p.add_argument("--sizes-mib", type=float, nargs="+", default=[256, 1024, 4096] if cuda else [8, 32, 128])
    p.add_argument("--transports", nargs="+", choices=list(TRANSPORTS), default=DEFAULTS["cuda" if cuda else "cpu"])
    p.add_argument("--bucket-mib", type=float, default=512, help="sync.update_weight_buffer_size")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--check-max-mib", type=float, default=512, help="bit-equal check up to this size, fingerprints above"
    )
    p.add_argument("--cpu", action="store_true", help="run on CPU even when CUDA is present")
    return p.parse_args(argv)


def model_for(target_bytes: int, device: str) -> ModelConfig:
    """A bf16 decoder of the device's width with as many layers as it takes to reach ``target_bytes``."""
    w = WIDTH[device]
    h, inter, v = w["hidden_size"], w["intermediate_size"], w["vocab_size"]
    kv = h // w["num_attention_heads"] * w["num_key_value_heads"]
    per_layer = 2 * (h * h + h + 2 * (kv * h + kv) + h * h + 3 * h * inter + 2 * h)
    layers = max(1, round((target_bytes - 2 * (v * h + h)) / per_layer))
    return ModelConfig(**w, num_hidden_layers=layers, dtype="bfloat16", max_position_embeddings=64)


class Trainer:
    """The trainer side of the benchmark (a Ray actor): one model's weights and one sync per transport."""

    def __init__(self, model_cfg: ModelConfig, device: str, threads: int):
        from miles.model.decoder import build_decoder

        torch.set_num_threads(threads)
        self.device = device
        self.named = list(build_decoder(model_cfg, seed=1, device=device).hf_state_dict().items())
        self.named = [(n, t.detach().contiguous()) for n, t in self.named]
        self.syncs: dict = {}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.named)

    def connect(self, variant: str, bucket_bytes: int, engines: list, workdir: str) -> None:
        from miles.config import SyncConfig

        transport, staging, extra = TRANSPORTS[variant]
        extra = dict(extra)
        source = extra.pop("source", "bucket")
        doorbell = extra.pop("doorbell", None)  # None: the transport's default (rung on CUDA, called on CPU)
        rdt = "cuda_ipc" if self.device == "cuda" else "gloo"  # what auto picks without NIXL, named for in_place
        cfg = SyncConfig(
            transport=transport,
            update_weight_buffer_size=bucket_bytes,
            engine_staging=staging,
            source=source,
            rdt_transport=rdt if transport == "rdt" else "auto",
        )
        if cfg.source == "in_place" and transport == "tensor":
            from miles.sync.in_place import InPlaceSync

            sync = InPlaceSync(cfg, self.device, doorbell=doorbell)
        elif transport == "tensor":
            from miles.sync.tensor import TensorSync

            sync = TensorSync(cfg, self.device, **extra)
        elif transport == "broadcast":
            from miles.sync.broadcast import BroadcastSync

            sync = BroadcastSync(cfg, self.device)
        elif transport == "rdt":
            from miles.sync.rdt import RDTSync

            sync = RDTSync(cfg, self.device)
        else:
            sync = _disk_delta(engines, workdir)
        sync.connect(engines)
        self.syncs[variant] = sync

    def perturb(self, seed: int) -> None:
        """A dense update (every element moves, as after an RL step with a large learning rate); not timed."""
        gen = torch.Generator(device=self.device).manual_seed(seed)
        with torch.no_grad():
            for _, t in self.named:
                t.add_(torch.randn(t.shape, generator=gen, device=self.device, dtype=t.dtype), alpha=1e-3)

    def sync(self, variant: str, version: int) -> tuple[float, dict]:
        if self.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        self.syncs[variant].update(self.named, version)
        return time.perf_counter() - t0, self.syncs[variant].metrics()

    def rdt_floor_seconds(self, variant: str, engine, calls: int) -> float:
        """One RDT transfer of one 1 KiB tensor from this actor to ``engine`` through the sync's transport (the
        same self-call publish and engine-side pull a round of weights takes): what an rdt sync costs at least."""
        import ray

        sync = self.syncs[variant]
        times = []
        for _ in range(calls + 1):
            t0 = time.perf_counter()
            ref = sync.me.__ray_call__.options(tensor_transport=sync.transport).remote(_tiny, self.device)
            ray.get(engine.__ray_call__.remote(_numel, ref))
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    def copy_seconds(self, repeats: int) -> float:
        """One flat copy of the same bytes in this process (memcpy on CPU, device-to-device on CUDA)."""
        src = torch.empty(self.nbytes(), dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)
        times = []
        for _ in range(repeats + 1):
            if self.device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src)
            if self.device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    def weights(self, fingerprint: bool) -> dict:
        return {n: _fingerprint(t) if fingerprint else t.cpu() for n, t in self.named}

    def close(self) -> None:
        for s in self.syncs.values():
            if hasattr(s, "close"):
                s.close()


def _tiny(actor, device: str) -> list[torch.Tensor]:
    return [torch.zeros(256, device=device)]


def _numel(actor, tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() for t in tensors)


def _fingerprint(t: torch.Tensor) -> tuple[int, int]:
    x = t.reshape(-1).view(torch.int16).to(torch.int64)
    return int(x.sum()), int((x * torch.arange(1, x.numel() + 1, device=x.device) % 65521).sum())


def _engine_weights(engine, fingerprint: bool) -> dict:
    return {n: _fingerprint(t) if fingerprint else t.cpu() for n, t in engine.named_weights().items()}


def _disk_delta(engines, workdir: str):
    import ray

    from miles.sync.disk_delta.baseline import save_baseline
    from miles.sync.disk_delta.transport import DiskDeltaConfig, DiskDeltaSync

    root = os.path.join(workdir, "weights")
    baseline = os.path.join(workdir, "baseline.safetensors")
    save_baseline(ray.get(engines[0].named_weights.remote()), baseline)  # what the engine holds now
    version = ray.get(engines[0].__ray_call__.remote(lambda e: e.weight_version))
    return DiskDeltaSync(DiskDeltaConfig(root=root, baseline=baseline, baseline_version=version))


def _round_trip(ray, actor, calls: int = 20) -> float:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        ray.get(actor.__ray_call__.remote(_noop))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _noop(actor) -> None:
    return None


def _one_size(ray, target_bytes: int, device: str, args, num_gpus: float) -> dict:
    from miles.rollout.engine import EmbeddedEngine

    model_cfg = model_for(target_bytes, device)
    threads = max(1, (os.cpu_count() or 2) // 2)
    opts = dict(num_cpus=0, num_gpus=num_gpus, enable_tensor_transport=True)
    trainer = ray.remote(Trainer).options(max_concurrency=2, **opts).remote(model_cfg, device, threads)
    engine = (
        ray.remote(EmbeddedEngine)
        .options(max_concurrency=2, **opts)
        .remote(model_cfg, max_batch_size=1, max_seq_len=8, device=device, seed=0)
    )
    nbytes = ray.get(trainer.nbytes.remote())
    ray.get(engine.named_weights.remote())
    fingerprint = nbytes > args.check_max_mib * 2**20
    row = {
        "target_mib": target_bytes / 2**20,
        "bytes": nbytes,
        "layers": model_cfg.num_hidden_layers,
        "copy_s": ray.get(trainer.copy_seconds.remote(args.repeats)),
        "transports": {},
    }
    row["copy_gbps"] = nbytes / row["copy_s"] / 1e9
    row["ray_call_s"] = _round_trip(ray, engine)  # the floor of any sync that asks the engine by Ray call
    version = 0
    with tempfile.TemporaryDirectory(prefix="miles-bench-sync-") as workdir:
        for variant in args.transports:
            try:
                ray.get(trainer.connect.remote(variant, int(args.bucket_mib * 2**20), [engine], workdir))
                times, phases = [], []
                for _ in range(args.repeats + 1):
                    version += 1
                    ray.get(trainer.perturb.remote(version))
                    t, m = ray.get(trainer.sync.remote(variant, version))
                    times.append(t)
                    phases.append(
                        {k.split("/", 1)[1]: v for k, v in m.items() if k.endswith("_s") or k.endswith("buckets")}
                    )
                expected = ray.get(trainer.weights.remote(fingerprint))
                got = ray.get(engine.__ray_call__.remote(_engine_weights, fingerprint))
                bad = [
                    n
                    for n in expected
                    if (got[n] != expected[n] if fingerprint else not torch.equal(got[n], expected[n]))
                ]
                s = statistics.median(times[1:])
                row["transports"][variant] = {
                    "median_s": s,
                    "gbps": nbytes / s / 1e9,
                    "first_s": times[0],
                    "x_copy": s / row["copy_s"],
                    "check": "fingerprint" if fingerprint else "bit-equal",
                    "check_ok": not bad,
                    "last_phases": phases[-1],
                }
                if TRANSPORTS[variant][0] == "rdt":
                    row["transports"][variant]["rdt_floor_s"] = ray.get(
                        trainer.rdt_floor_seconds.remote(variant, engine, args.repeats)
                    )
            except Exception as e:  # one transport failing must not hide the others' figures
                log.exception("weight-sync bench: %s failed", variant)
                row["transports"][variant] = {"error": f"{type(e).__name__}: {e}"[:500]}
    ray.get(trainer.close.remote())
    for a in (trainer, engine):
        ray.kill(a)
    staged = row["transports"].get("host-staged", {}).get("median_s")
    for v in row["transports"].values():
        if staged and "median_s" in v:
            v["speedup_vs_host_staged"] = staged / v["median_s"]
    return row


def run(argv: list[str]) -> dict:
    import ray

    from miles.cluster import start_ray

    cuda = torch.cuda.is_available() and "--cpu" not in argv
    args = _parse(argv, cuda)
    device = "cuda" if cuda else "cpu"
    own = not ray.is_initialized()
    if own:
        start_ray(num_cpus=max(2, os.cpu_count() or 2), threads=max(1, (os.cpu_count() or 2) // 2))
    try:
        rows = [_one_size(ray, int(m * 2**20), device, args, 0.5 if cuda else 0) for m in args.sizes_mib]
    finally:
        if own:
            ray.shutdown()
    return {
        "device": device,
        "bucket_mib": args.bucket_mib,
        "repeats": args.repeats,
        "ray": ray.__version__,
        "note": "median seconds per sync after one warm-up; copy = one flat copy of the same bytes in one process",
        "sizes": rows,
    }
