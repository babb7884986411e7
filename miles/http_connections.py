"""Connection limits for miles' uvicorn servers, which uvicorn itself does not have: a bound on how long a request's
head (request line and headers) may take to arrive, and a cap on the open connections of one client address.

Without the first, a client that sends half a request and stops holds its connection, and a file descriptor,
forever (uvicorn's ``timeout_keep_alive`` covers only the idle time between requests): 20,000 of them exhaust the
server's descriptors, and the HTTP guard (Host, API key) never runs because it needs the headers. Here the clock
starts when the connection opens, or when the first byte of a later request arrives, and stops when the head is
complete; a connection still waiting then gets ``408`` and is closed. The body is not bounded here (a 2 GiB
weight upload may be slow) and neither is a connection idle between requests (``timeout_keep_alive``).

The per-address cap (``503`` and closed above it) applies to remote addresses only: any local process can choose
any 127.x.y.z source address, so on loopback a cap stops no one, and it would turn away the run's own clients
(measured: 1,024 half-sent connections from 127.0.0.1 made the next normal request there a 503 for 10 s).

    config = uvicorn.Config(app, http=guarded_protocol(head_timeout_s=10, max_per_client=1024))
"""

from __future__ import annotations

import asyncio
import ipaddress

HEAD_TIMEOUT_S = 10.0  # a request head is a few hundred bytes: seconds are plenty on any network
MAX_PER_CLIENT = 1024  # open connections per remote address; clients pool far fewer (httpx: 100, aiohttp: 100)
LINGER_S = 1.0  # a refused or timed-out connection is closed this long after its answer


def guarded_protocol(head_timeout_s: float = HEAD_TIMEOUT_S, max_per_client: int = MAX_PER_CLIENT) -> type:
    """uvicorn's HTTP protocol class (httptools when installed, else h11) with the two limits; 0 turns one off.
    Each call returns a class with its own per-address counts: give each server its own."""
    from uvicorn.config import HTTP_PROTOCOLS
    from uvicorn.importer import import_from_string

    if not head_timeout_s >= 0 or not max_per_client >= 0:
        raise ValueError(
            f"head_timeout_s = {head_timeout_s} and max_per_client = {max_per_client} must be >= 0 (0 = no limit)"
        )
    base = import_from_string(HTTP_PROTOCOLS["auto"])
    open_per_client: dict[str, int] = {}

    class Guarded(base):
        _deadline: asyncio.TimerHandle | None = None
        _counted: str | None = None
        _closing = False

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            address = self.client[0] if self.client else ""
            if max_per_client and not _is_local(address):
                if open_per_client.get(address, 0) >= max_per_client:
                    self._closing = True
                    _answer_and_close(transport, 503, f"more than {max_per_client} open connections from {address}")
                    return
                self._counted = address
                open_per_client[address] = open_per_client.get(address, 0) + 1
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._closing:  # refused or timed out: input is dropped while the answer drains
                return
            before = self.cycle
            super().data_received(data)
            if self.cycle is not before:  # a request's head is complete: the app has it now
                self._disarm()
            elif self.cycle is None or self.cycle.response_complete:  # bytes of a next request's head
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            if self._counted is not None:
                left = open_per_client.pop(self._counted) - 1
                if left:
                    open_per_client[self._counted] = left
                self._counted = None
            super().connection_lost(exc)

        def _arm(self) -> None:
            if head_timeout_s and self._deadline is None:
                self._deadline = self.loop.call_later(head_timeout_s, self._head_timed_out)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _head_timed_out(self) -> None:
            self._deadline = None
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._closing = True
                _answer_and_close(self.transport, 408, f"the request head did not arrive within {head_timeout_s} s")

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    return Guarded


def _is_local(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:  # a Unix socket: local
        return True
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def _answer_and_close(transport, status: int, message: str) -> None:
    """Answer, end the sending side, and close a moment later: closing a socket with unread input makes the kernel
    send a reset, which can destroy the answer before the client reads it."""
    reason = {408: "Request Timeout", 503: "Service Unavailable"}[status]
    body = message.encode()
    transport.write(
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: {len(body)}\r\n"
        f"connection: close\r\n\r\n".encode()
        + body
    )
    if transport.can_write_eof():
        transport.write_eof()
        asyncio.get_running_loop().call_later(LINGER_S, transport.close)
    else:
        transport.close()
