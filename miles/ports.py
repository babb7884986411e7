"""Ports for servers miles starts itself (stand-in SGLang servers, torch.distributed stores, weight-sync groups,
agent harnesses), chosen outside the OS's ephemeral range.

A port the OS hands out for ``bind(0)`` comes from the ephemeral range, the same range outgoing connections take
their local ports from: between choosing such a port and the server binding it, a connection (Ray's, an HTTP
client's) can take it, and the server fails with "Address already in use". A port below that range is never
given to an outgoing connection, so only another server binding it explicitly can race us; each is checked by
binding it before it is returned.

    port = free_port()                 # one port
    first = free_ports(3)              # first, first + 1, first + 2 all free
    port_range("8100-8103", "agents.session_ports", "8100")   # [8100, 8101, 8102, 8103]
"""

from __future__ import annotations

import os
import random
import socket

LOWEST = 10000  # below this sit well-known and commonly configured ports


def ephemeral_range() -> tuple[int, int]:
    """The OS's ephemeral port range (Linux's default where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def free_ports(n: int = 1, host: str = "127.0.0.1", tries: int = 200) -> int:
    """The first of ``n`` consecutive ports free on ``host`` a moment ago, all below the ephemeral range."""
    lo, _ = ephemeral_range()
    top = max(lo, LOWEST + 1000) - n
    rng = random.Random(os.getpid() ^ int.from_bytes(os.urandom(4), "little"))
    for _ in range(tries):
        p = rng.randrange(LOWEST, top)
        if all(is_free(p + i, host) for i in range(n)):
            return p
    raise RuntimeError(f"no {n} consecutive free ports in [{LOWEST}, {top}) after {tries} tries")


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)


def port_range(spec: str, field: str, example: str) -> list[int]:
    """A config's ports: ``"8100"`` -> [8100]; ``"8100-8103"`` -> [8100, ..., 8103]; ``""`` -> [] (free ports).
    ``field`` and ``example`` (one port) name the setting in the error."""
    spec = spec.strip()
    if not spec:
        return []
    lo, sep, hi = spec.partition("-")
    try:
        first, last = int(lo), int(hi) if sep else int(lo)
    except ValueError:
        raise ValueError(
            f"{field} = {spec!r} should be one port ('{example}') or a range ('{example}-{int(example) + 3}')"
        ) from None
    if not 1 <= first <= last <= 65535:
        raise ValueError(f"{field} = {spec!r}: need 1 <= first <= last <= 65535")
    return list(range(first, last + 1))
