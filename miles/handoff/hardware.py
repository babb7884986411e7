"""HardwareProfile: the memory and link facts the planner checks a plan against.

A node is the unit that shares host RAM: a GB300/GB200 tray (4 GPUs, two Grace CPUs with LPDDR5X behind
NVLink-C2C) or an HGX node (8 GPUs behind PCIe). Budgets are what a job may use: the GB300 tray's job cgroup is
898 GiB although the tray carries about 960 GB. Figures marked ``assumed`` in ``note`` were not measured or
published in our sources; the planner prints the note with every report.

    hw = get_profile("gb300")       # or "cpu": this machine's cgroup memory.max / MemTotal
    hw.nodes_for(32)                # 8 trays for 32 GPUs
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from miles.config_check import did_you_mean

GB, GiB = 10**9, 1 << 30


@dataclass(frozen=True, kw_only=True, slots=True)
class HardwareProfile:
    name: str
    hbm_bytes: int  # usable device memory per GPU
    gpus_per_node: int  # GPUs sharing one host RAM
    host_bytes: int  # host RAM a job may use per node (the cgroup budget)
    host_physical_bytes: int  # installed host RAM per node
    h2d_bytes_per_s: float  # pinned host<->device copy, per GPU per direction
    pageable_bytes_per_s: float  # pageable host copies (never used on the offload path)
    unified: bool = False  # device memory is the host RAM itself (the cpu profile): one pool, one budget
    note: str = ""

    def nodes_for(self, gpus: int) -> int:
        return -(-gpus // self.gpus_per_node)

    def as_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.__slots__}


def _cgroup_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            raw = open(path).read().strip()
        except OSError:
            continue
        if raw != "max" and int(raw) < 1 << 60:
            return int(raw)
    return None


def _mem_total() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def this_cpu() -> HardwareProfile:
    """This machine as one node whose 'device' is its own RAM: budget = cgroup memory.max, else MemTotal."""
    total = _mem_total()
    limit = _cgroup_limit()
    budget = min(limit, total) if limit else total
    return HardwareProfile(
        name="cpu",
        hbm_bytes=budget,
        gpus_per_node=1,
        host_bytes=budget,
        host_physical_bytes=total,
        h2d_bytes_per_s=10 * GB,
        pageable_bytes_per_s=10 * GB,
        unified=True,
        note=f"this machine: {'cgroup memory.max' if limit else 'MemTotal'} = {budget / GiB:.1f} GiB; "
        "device and host share it; copy speed assumed (memcpy)",
    )


PROFILES: dict[str, HardwareProfile] = {
    "gb300": HardwareProfile(
        name="gb300",
        hbm_bytes=279 * GB,
        gpus_per_node=4,
        host_bytes=898 * GiB,
        host_physical_bytes=960 * GB,
        h2d_bytes_per_s=450 * GB,
        pageable_bytes_per_s=450 * GB,
        note="GB300 tray: 4 x 288 GB HBM (279 GB usable), ~960 GB LPDDR5X, 898 GiB job cgroup, "
        "NVLink-C2C ~450 GB/s per direction",
    ),
    "gb200": HardwareProfile(
        name="gb200",
        hbm_bytes=186 * GB,
        gpus_per_node=4,
        host_bytes=898 * GiB,
        host_physical_bytes=960 * GB,
        h2d_bytes_per_s=450 * GB,
        pageable_bytes_per_s=450 * GB,
        note="GB200 tray: 4 x 186 GB HBM, ~960 GB LPDDR5X; job budget assumed equal to GB300's "
        "898 GiB cgroup; C2C speed assumed equal to GB300's",
    ),
    "b300": HardwareProfile(
        name="b300",
        hbm_bytes=270 * GB,
        gpus_per_node=8,
        host_bytes=2000 * GB,
        host_physical_bytes=2048 * GB,
        h2d_bytes_per_s=100 * GB,
        pageable_bytes_per_s=8 * GB,
        note="HGX B300 node: 8 x 288 GB HBM (270 GB usable assumed); host RAM 2 TB and PCIe Gen6 "
        "~100 GB/s pinned assumed",
    ),
    "h200": HardwareProfile(
        name="h200",
        hbm_bytes=141 * GB,
        gpus_per_node=8,
        host_bytes=2000 * GB,
        host_physical_bytes=2048 * GB,
        h2d_bytes_per_s=55 * GB,
        pageable_bytes_per_s=4.1 * GB,
        note="HGX H200 node: 8 x 141 GB HBM, >= 2 TB DDR5, PCIe Gen5: 55 GB/s pinned and "
        "4.1 GB/s pageable measured on one H200 here",
    ),
    "h100": HardwareProfile(
        name="h100",
        hbm_bytes=80 * GB,
        gpus_per_node=8,
        host_bytes=2000 * GB,
        host_physical_bytes=2048 * GB,
        h2d_bytes_per_s=55 * GB,
        pageable_bytes_per_s=4.1 * GB,
        note="HGX H100 node: 8 x 80 GB HBM; host RAM 2 TB and PCIe Gen5 speeds assumed equal to the H200 node's",
    ),
}


def get_profile(name: str) -> HardwareProfile:
    """A named profile, ``cpu`` (this machine), or ``auto`` (the local GPU's profile, else ``cpu``)."""
    name = name.lower()
    if name == "auto":
        name = detect()
    if name == "cpu":
        return this_cpu()
    if name not in PROFILES:
        valid = sorted(PROFILES) + ["cpu", "auto"]
        raise ValueError(f"unknown hardware profile {name!r}{did_you_mean(name, valid)} (valid: {valid})")
    return PROFILES[name]


def detect() -> str:
    """The profile name of the local accelerator (by device name), or ``cpu``."""
    try:
        import torch

        if not torch.cuda.is_available():
            return "cpu"
        gpu = torch.cuda.get_device_name().upper()
    except Exception:  # noqa: BLE001 - no usable CUDA means the CPU profile
        return "cpu"
    import platform

    if "B300" in gpu and platform.machine() == "aarch64":
        return "gb300"  # a Grace-Blackwell tray may report the GPU without the G
    for key in ("GB300", "GB200", "B300", "H200", "H100"):
        if key in gpu:
            return key.lower()
    return "h100"  # an unknown CUDA device: the smallest HBM profile
