"""Where does a process's RSS grow around a pinned host arena on a GPU? (issue 18, item 13)

Run on a GPU machine: ``python benchmarks/host_arena_rss_probe.py cold|warm``. It repeats the steps of
tests/handoff/test_host_arena_gpu.py (300 MiB pinned arena, randint on the device, D2H, H2D, torch.equal, del) and
prints one JSON line: per step, the change of VmRSS / RssAnon / RssFile / RssShmem and the mappings that grew by
more than 1 MiB. ``warm`` first runs each kernel once on one page, as the test now does.
"""

import collections
import json
import sys

import torch

from miles.memory.host_arena import host_arena


def status():
    d = {}
    for line in open("/proc/self/status"):
        k, _, v = line.partition(":")
        if k in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            d[k] = int(v.split()[0]) * 1024
    return d


def smaps():
    out = collections.Counter()
    name = None
    for line in open("/proc/self/smaps"):
        parts = line.split()
        if not parts[0].endswith(":") or len(parts) >= 5 and "-" in parts[0]:
            name = parts[5] if len(parts) > 5 else "[anon]"
        elif parts[0] == "Rss:":
            out[name] += int(parts[1]) * 1024
    return out


warm = sys.argv[1] == "warm"
log = []
prev_s, prev_m = status(), smaps()


def mark(stage):
    global prev_s, prev_m
    s, m = status(), smaps()
    delta = {k: s[k] - prev_s[k] for k in s}
    md = {k: m[k] - prev_m.get(k, 0) for k in m if abs(m[k] - prev_m.get(k, 0)) > 1 << 20}
    log.append(
        {
            "stage": stage,
            "delta_MB": {k: round(v / 2**20, 1) for k, v in delta.items()},
            "maps_MB": {k: round(v / 2**20, 1) for k, v in sorted(md.items(), key=lambda kv: -abs(kv[1]))[:6]},
        }
    )
    prev_s, prev_m = s, m


torch.zeros(1, device="cuda")
mark("context")
if warm:
    x = torch.randint(0, 255, (4096,), dtype=torch.uint8, device="cuda")
    mark("warm randint")
    small = host_arena(4096, pin=True)
    small.copy_(x, non_blocking=True)
    torch.cuda.synchronize()
    mark("warm d2h")
    y = small.cuda()
    mark("warm h2d")
    torch.equal(y, x)
    mark("warm equal")
    del small, y, x
    mark("warm del")
base = status()
n = 300 * 2**20 + 5
buf = host_arena(n, pin=True)
mark("arena")
src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
mark("randint")
buf.copy_(src, non_blocking=True)
torch.cuda.synchronize()
mark("d2h")
back = buf.cuda()
mark("h2d")
eq = torch.equal(back, src)
mark("equal")
del back
del buf
mark("del buf")
end = status()
print(
    json.dumps(
        {
            "mode": sys.argv[1],
            "equal": eq,
            "n": n,
            "after_del_minus_base_MB": {k: round((end[k] - base[k]) / 2**20, 1) for k in end},
            "frac_of_n": {k: round((end[k] - base[k]) / n, 4) for k in end},
            "log": log,
        }
    )
)
