"""``rollout.engine = "sglang"``: the SGLang server flags miles accepts, the argv each engine is launched with,
and the config-time check of what SGLang can and cannot do with the rest of the run config.

Kept free of miles imports so that miles.config can call ``check_sglang`` while it validates (no cycle), and
``miles serve`` (the stand-in launcher, ``rollout.sglang_launcher = "miles-serve"``) can accept the same flags.

The argv of engine ``i`` (``sglang_server_flags``; the launcher module goes in front of it):

    python -m sglang.launch_server --model-path <model.checkpoint> --host 127.0.0.1 --port <port>
        --mem-fraction-static 0.5 --enable-memory-saver --skip-server-warmup
        [--enable-weights-cpu-backup]          # when handoff.engine_host_mirror keeps a host copy of the weights
        <rollout.sglang_args>                  # only flags of KNOWN_FLAGS; --mem-fraction-static there wins

``--enable-memory-saver`` is what lets SGLang release and resume memory by tag (``weights``, ``kv_cache``,
``cuda_graph``), which every handoff plan's engine steps need.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from urllib.parse import urlparse

from miles.ports import port_range

STANDIN = "miles-serve"  # rollout.sglang_launcher value: `miles serve` accepting SGLang's argv (CPU, CI)
DEFAULT_MEM_FRACTION = "0.5"  # colocated with a trainer: half the device for weights + KV cache


def _integer(minimum: int | None = None):
    def check(value: str) -> str:
        try:
            number = int(value)
        except ValueError:
            return f"an integer{'' if minimum is None else f' >= {minimum}'}"
        return "" if minimum is None or number >= minimum else f"an integer >= {minimum}"

    return check


def _token_count(value: str) -> str:
    """SGLang's human_readable_int: 4096, 128k, 1.5M, 2Gi."""
    return "" if re.fullmatch(r"\d+(\.\d+)?(Ki|Mi|Gi|Ti|[kKmMgGtT])?", value) else "a token count (4096, 128k, 2Mi)"


def _fraction(value: str) -> str:
    try:
        ok = 0 < float(value) <= 1
    except ValueError:
        ok = False
    return "" if ok else "a fraction in (0, 1]"


def _text(value: str) -> str:
    return "" if value.strip() else "a non-empty value"


# The extra flags rollout.sglang_args may carry (SGLang's server_args spelling) with the check of each one's value
# ('' = fine, else what the value should be), or None for a switch. Anything else is refused at config time: a typo
# or a value of the wrong type would otherwise surface minutes later as a dead server.
KNOWN_FLAGS: dict[str, Callable[[str], str] | None] = {
    "--tp-size": _integer(1),  # tensor-parallel GPUs per engine
    "--dp-size": _integer(1),
    "--ep-size": _integer(1),
    "--pp-size": _integer(1),
    "--nnodes": _integer(1),  # an engine over several nodes (GB300 trays): with --node-rank and --dist-init-addr
    "--node-rank": _integer(0),
    "--dist-init-addr": _text,
    "--mem-fraction-static": _fraction,
    "--context-length": _integer(1),
    "--max-running-requests": _integer(1),
    "--max-total-tokens": _token_count,
    "--chunked-prefill-size": _integer(),  # -1 turns chunked prefill off
    "--cuda-graph-max-bs": _integer(1),
    "--dtype": _text,
    "--kv-cache-dtype": _text,
    "--quantization": _text,
    "--attention-backend": _text,
    "--moe-a2a-backend": _text,
    "--tokenizer-path": _text,
    "--served-model-name": _text,
    "--random-seed": _integer(),
    "--log-level": _text,
    "--api-key": _text,
    "--trust-remote-code": None,
    "--enable-dp-attention": None,
    "--disable-cuda-graph": None,
    "--disable-radix-cache": None,
}
# Flags miles sets itself; in rollout.sglang_args they are refused with where they come from.
MANAGED_FLAGS = {
    "--model-path": "model.checkpoint",
    "--host": "the manager (loopback; attach to other hosts with rollout.engine_urls)",
    "--port": "rollout.sglang_ports",
    "--enable-memory-saver": "the manager (always on: the handoff releases memory by tag)",
    "--skip-server-warmup": "the manager (always on)",
    "--enable-weights-cpu-backup": "handoff.engine_host_mirror",
}
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def parse_flags(args) -> dict[str, str | None]:
    """``["--tp-size", "2", "--disable-cuda-graph", "--dtype=bfloat16"]`` -> {flag: value or None}; raises a
    ValueError naming unknown or managed flags, a value-taking flag without its value, and a value of the wrong
    type for its flag or one that looks like a flag (``--tp-size=--trust-remote-code``)."""
    out: dict[str, str | None] = {}
    unknown, managed, items, i = [], [], list(args), 0
    while i < len(items):
        tok = str(items[i])
        flag, eq, value = tok.partition("=")
        i += 1
        if flag not in KNOWN_FLAGS:
            if flag in MANAGED_FLAGS:
                managed.append(f"{flag} (set from {MANAGED_FLAGS[flag]})")
            else:
                unknown.append(flag)
            while tok.startswith("--") and i < len(items) and not str(items[i]).startswith("--"):
                i += 1  # its value(s)
            continue
        if KNOWN_FLAGS[flag] and not eq:
            if i >= len(items) or str(items[i]).startswith("--"):
                raise ValueError(f"rollout.sglang_args: {flag} needs a value, e.g. {flag}=2 or '{flag},2'")
            value, i = str(items[i]), i + 1
        elif not KNOWN_FLAGS[flag] and eq:
            raise ValueError(f"rollout.sglang_args: {flag} is a switch and takes no value; drop '={value}'")
        if KNOWN_FLAGS[flag]:
            _check_value(flag, value)
        out[flag] = value if KNOWN_FLAGS[flag] else None
    if unknown:
        raise ValueError(
            f"rollout.sglang_args has flag(s) miles does not know: {unknown}; the accepted ones are "
            f"{sorted(KNOWN_FLAGS)} (miles.sglang_flags.KNOWN_FLAGS; add one there with a test)"
        )
    if managed:
        raise ValueError(f"rollout.sglang_args sets flag(s) miles manages: {managed}; drop them from sglang_args")
    return out


def _check_value(flag: str, value: str) -> None:
    if value.startswith("-") and not _is_number(value):  # -1 is a value, -x a flag to SGLang's argparse
        raise ValueError(
            f"rollout.sglang_args: the value of {flag} is {value!r}, which looks like a flag; give {flag} its value "
            f"(e.g. '{flag},2') and the other flag as an item of its own"
        )
    if want := KNOWN_FLAGS[flag](value):
        raise ValueError(f"rollout.sglang_args: {flag} takes {want}, got {value!r}")


def _is_number(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


def parse_port_range(spec: str) -> list[int]:
    """``"30000-30003"`` -> [30000, ..., 30003]; ``"30000"`` -> [30000]; ``""`` -> [] (free ports)."""
    return port_range(spec, "rollout.sglang_ports", "30000")


def sglang_server_flags(rollout, handoff, model_checkpoint: str, port: int, host: str = "127.0.0.1") -> list[str]:
    """The SGLang flags of one engine (without the launcher in front); see the module docstring."""
    extra = parse_flags(rollout.sglang_args)
    argv = ["--model-path", model_checkpoint] if model_checkpoint else []
    argv += ["--host", host, "--port", str(port)]
    argv += ["--mem-fraction-static", extra.pop("--mem-fraction-static", None) or DEFAULT_MEM_FRACTION]
    argv += ["--enable-memory-saver", "--skip-server-warmup"]
    if handoff.engine_host_mirror:
        argv.append("--enable-weights-cpu-backup")
    for flag, value in extra.items():
        argv += [flag] if value is None else [flag, value]
    return argv


def check_sglang(cfg) -> None:
    """Config-time refusals for ``rollout.engine = "sglang"`` (a RunConfig), each with the reason and the fix."""
    r = cfg.rollout
    if r.engine != "sglang":
        if r.engine_urls or r.sglang_args or r.sglang_ports:
            raise ValueError(
                f"rollout.engine_urls / sglang_args / sglang_ports apply to rollout.engine = 'sglang', not "
                f"{r.engine!r}; set rollout.engine=sglang or clear them"
            )
        return
    parse_flags(r.sglang_args)
    ports = parse_port_range(r.sglang_ports)
    standin = r.sglang_launcher == STANDIN
    if not standin and not r.sglang_launcher.replace(".", "").replace("_", "").isalnum():
        raise ValueError(
            f"rollout.sglang_launcher = {r.sglang_launcher!r} should be a Python module run with -m (default "
            f"sglang.launch_server) or {STANDIN!r} (the CPU stand-in)"
        )
    for url in r.engine_urls:
        u = urlparse(url)
        if u.scheme not in ("http", "https") or not u.hostname or u.port is None:
            raise ValueError(f"rollout.engine_urls entry {url!r} should look like http://host:30000")
    if r.engine_urls and len(r.engine_urls) != r.num_engines:
        raise ValueError(
            f"rollout.engine_urls has {len(r.engine_urls)} server(s) but rollout.num_engines = {r.num_engines}; "
            f"set rollout.num_engines={len(r.engine_urls)}"
        )
    if ports and len(ports) < r.num_engines and not r.engine_urls:
        raise ValueError(
            f"rollout.sglang_ports = {r.sglang_ports!r} has {len(ports)} port(s) for rollout.num_engines = "
            f"{r.num_engines}; widen the range or leave it empty (free ports)"
        )
    if not standin and not r.engine_urls and not cfg.model.checkpoint:
        raise ValueError(
            "rollout.engine = 'sglang' launches `sglang.launch_server --model-path <model.checkpoint>`, and "
            "model.checkpoint is empty; set model.checkpoint to a HF checkpoint directory, or attach to running "
            "servers with rollout.engine_urls"
        )
    if cfg.model.checkpoint.startswith("-"):
        raise ValueError(
            f"model.checkpoint = {cfg.model.checkpoint!r} starts with '-', so the server would read it as a flag "
            f"after --model-path; name the directory as ./{cfg.model.checkpoint} or by its absolute path"
        )
    why = _transport_refusal(cfg, standin)
    if why:
        raise ValueError(f"rollout.engine = 'sglang' with {why}")


def _transport_refusal(cfg, standin: bool) -> str:
    """Why the weight sync cannot reach SGLang servers as configured ('' if it can)."""
    r, s = cfg.rollout, cfg.sync
    if s.transport == "rdt":
        return (
            "sync.transport = 'rdt': Ray Direct Transport delivers into a Ray actor's process, and an SGLang "
            "server is a separate HTTP process; use sync.transport=tensor (same machine), broadcast or disk-delta"
        )
    if s.source == "in_place":
        return "sync.source = 'in_place': servers take buckets, not the trainer's tensors; use sync.source=bucket"
    if standin:
        return ""  # `miles serve` takes every remaining transport and check_weights
    if s.transport == "disk-delta":
        return (
            "sync.transport = 'disk-delta': SGLang's /update_weights_from_disk loads a whole HF checkpoint, not a "
            "miles delta version; use sync.transport=tensor (same machine) or broadcast"
        )
    if s.check_weights:
        return (
            "sync.check_weights = true: SGLang returns only truncated tensors (/get_weights_by_name), so the "
            "bit-for-bit check cannot run; set sync.check_weights=false"
        )
    remote = [u for u in r.engine_urls if urlparse(u).hostname not in LOOPBACK]
    if s.transport == "tensor" and remote:
        return (
            f"sync.transport = 'tensor' and remote rollout.engine_urls {remote}: tensors go to SGLang as CUDA IPC "
            "handles, which open only on the same machine; use sync.transport=broadcast"
        )
    return ""


def engine_gpus(rollout, index: int) -> list[int]:
    """The node-local GPU ids engine ``index`` is launched on: ``tp * pp * dp / nnodes`` GPUs each, engines side by
    side (the launching actor's CUDA_VISIBLE_DEVICES, one GPU under Ray, is replaced for the server)."""
    flags = parse_flags(rollout.sglang_args)
    size = 1
    for flag in ("--tp-size", "--pp-size", "--dp-size"):
        size *= int(flags.get(flag) or 1)
    per_engine = max(1, size // int(flags.get("--nnodes") or 1))
    return list(range(index * per_engine, (index + 1) * per_engine))
