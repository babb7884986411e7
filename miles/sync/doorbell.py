"""A doorbell: the trainer asks an engine process on the same host to run one in-place weight update, without Ray.

An in-place sync (miles.sync.in_place) moves no bytes through the call that starts it: the engine already holds
the trainer's tensors, opened once, and only needs "copy version v now" and an answer. Through a Ray actor call
that costs a submit, a schedule and a return through the object store, comparable to the device copy itself on a
GPU host (``miles bench weight-sync`` reports it as ``ray_call_s``; BENCHMARKS.md). The doorbell is a Unix domain
socket served by a thread in the engine process: the trainer writes 24 bytes (the handles' key and the version),
the thread runs the same update the Ray call would (same pause, same receiver lock, same validation) and answers
with a short JSON line. A failure comes back as an error message; a dead engine as a closed socket. The trainer
never waits forever: ``timeout_s`` bounds every answer.

The serving thread runs torch code in the engine process, so it is meant for CUDA engines, where an update is a
few kernel launches. On CPU a copy on a second thread would start a second OpenMP team in the engine process and
slow every later generate (miles.threads); InPlaceSync therefore rings only CUDA engines unless told otherwise.

    bell = Doorbell(lambda key, version: {"copy_s": ...})      # engine side: serves until close()
    ring = DoorbellClient(bell.address); ring.send(key, 7); ring.answer(timeout_s=60)   # trainer side
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import struct
import tempfile
import threading
import weakref
from collections.abc import Callable

log = logging.getLogger(__name__)

_REQUEST = struct.Struct("!16sq")  # the handles' key (16 hex digits), the version
_LENGTH = struct.Struct("!I")


class DoorbellError(RuntimeError):
    """The engine answered with an error, closed the socket, or did not answer in time."""


class Doorbell:
    """Engine side: a thread answering rings with ``handler(key, version) -> dict`` (JSON-able)."""

    def __init__(self, handler: Callable[[str, int], dict]):
        self.handler = handler
        self._dir = tempfile.mkdtemp(prefix="miles-bell-")  # 0700: only this user's processes can ring
        self.address = os.path.join(self._dir, "s")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.address)
        self._sock.listen(4)
        self._closed = False
        self._cleanup = weakref.finalize(self, shutil.rmtree, self._dir, True)  # also at exit (not after SIGKILL)
        self._thread = threading.Thread(target=self._accept, name="miles-doorbell", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), name="miles-doorbell-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    raw = _recv_exact(conn, _REQUEST.size)
                except OSError:
                    return
                if raw is None:
                    return  # the trainer let go
                key, version = _REQUEST.unpack(raw)
                try:
                    answer = {"ok": True, "result": self.handler(key.decode(), version)}
                except Exception as e:  # noqa: BLE001 - every failure goes back to the trainer, the thread lives on
                    answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                body = json.dumps(answer).encode()
                try:
                    conn.sendall(_LENGTH.pack(len(body)) + body)
                except OSError:
                    return

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._cleanup()


class DoorbellClient:
    """Trainer side: one connection to one engine process's doorbell; ``send`` then ``answer`` per update, so the
    trainer can ring every engine before waiting for any."""

    def __init__(self, address: str, connect_timeout_s: float = 10.0):
        self.address = address
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(connect_timeout_s)
        try:
            self._sock.connect(address)
        except OSError as e:
            self._sock.close()
            raise DoorbellError(
                f"cannot reach the engine's doorbell at {address} ({e}); is the engine on this host?"
            ) from e

    def send(self, key: str, version: int) -> None:
        if len(key) != 16:
            raise ValueError(f"doorbell key {key!r} must be 16 hex digits (miles.sync.in_place.storage_key)")
        try:
            self._sock.sendall(_REQUEST.pack(key.encode(), version))
        except OSError as e:
            raise DoorbellError(
                f"the engine's doorbell at {self.address} is gone ({e}): did the engine process die?"
            ) from e

    def answer(self, timeout_s: float | None) -> dict:
        self._sock.settimeout(timeout_s)
        try:
            head = _recv_exact(self._sock, _LENGTH.size)
            body = _recv_exact(self._sock, _LENGTH.unpack(head)[0]) if head is not None else None
        except TimeoutError as e:
            raise DoorbellError(f"no answer from the engine's doorbell at {self.address} in {timeout_s} s") from e
        except ConnectionResetError as e:  # a killed engine's socket: reset rather than closed, as the kernel chose
            raise DoorbellError(
                f"the engine reset its doorbell at {self.address} mid-update ({e}): did the engine process die?"
            ) from e
        except OSError as e:
            raise DoorbellError(f"the engine's doorbell at {self.address} failed ({e})") from e
        if body is None:
            raise DoorbellError(
                f"the engine closed its doorbell at {self.address} mid-update: did the engine process die?"
            )
        answer = json.loads(body)
        if not answer["ok"]:
            raise DoorbellError(f"the engine failed the update: {answer['error']}")
        return answer["result"]

    def close(self) -> None:
        self._sock.close()


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    """Exactly ``n`` bytes, or None if the peer closed before sending any of them."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            if buf:
                raise ConnectionError(f"peer closed after {len(buf)} of {n} bytes")
            return None
        buf += chunk
    return bytes(buf)
