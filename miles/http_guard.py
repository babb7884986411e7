"""Who may drive miles' local HTTP servers (``miles serve``, ``miles dashboard``): a web page the user happens to
visit must not, and neither must anyone without the API key when one is set.

A browser can send a cross-site "simple" request (``Content-Type: text/plain``, no preflight) to a loopback
port, and a DNS name re-pointed at 127.0.0.1 (DNS rebinding) even lets the page read the answer. The guard, an
ASGI middleware in front of the whole app, refuses:
- a ``Host`` header outside the allow-list (loopback names plus the bound host by default; 400),
- a request a browser marks as cross-site (``Sec-Fetch-Site: cross-site``, or an ``Origin`` outside the
  allow-list; 403),
- a request body that is not declared ``application/json`` (415; SGLang's clients always declare it),
- with an API key set (``--api-key-file``, ``MILES_API_KEY`` or SGLang's ``--api-key``): a request without
  ``Authorization: Bearer <key>`` (401; the scheme in any case, RFC 7235), except the liveness probe ``/health``,
- a GET (or HEAD) of an endpoint that changes state (``state_changing_gets``; SGLang accepts GET there too) from
  a browser, with no API key set and no sign that it came from the same origin (405): an ``<img>`` on any page, in a
  browser too old to send ``Sec-Fetch-Site``, sends exactly such a GET. Same-origin signs: ``Sec-Fetch-Site:
  same-origin`` or ``none`` (typed by the user), or an ``Origin`` equal to the Host. A program's GET passes (slime
  polls ``GET /flush_cache`` with requests): it carries no ``Sec-Fetch-*`` or ``Origin`` header and a User-Agent no
  browser sends (every browser's starts with ``Mozilla/`` or ``Opera/``; a page cannot change it cross-origin
  without a CORS preflight, which this server never grants),
- with a body limit set (``max_body_bytes``): a body larger than it (413), by its Content-Length before any byte
  is read, or, sent chunked, as soon as the bytes read pass the limit (a client cannot fill the server's memory).

    app.add_middleware(HttpGuard, api_key=key, allowed_hosts=allowed_hosts("127.0.0.1"))
"""

from __future__ import annotations

import hmac
import json
import os

API_KEY_ENV = "MILES_API_KEY"
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
WILDCARD_BINDS = ("0.0.0.0", "::", "")
BODY_METHODS = (b"POST", b"PUT", b"PATCH")
BROWSER_AGENTS = ("Mozilla/", "Opera/")  # how every browser's User-Agent starts


def api_key_from(cli_value: str | None) -> str:
    """The key given on the command line, else ``$MILES_API_KEY``, else "" (no key)."""
    return cli_value if cli_value is not None else os.environ.get(API_KEY_ENV, "")


def bearer_headers(api_key: str | None = None) -> dict[str, str]:
    """What a client of these servers sends: the Authorization header when a key is given or in the environment."""
    key = api_key_from(api_key)
    return {"Authorization": f"Bearer {key}"} if key else {}


def allowed_hosts(bind_host: str, extra: str = "") -> tuple[str, ...]:
    """Host names a request may name: loopback and the bound host, plus ``extra`` (comma-separated; "*" = any).
    A wildcard bind (0.0.0.0, ::) is reached under names this process cannot know: any host then."""
    names = [h.strip().lower().strip("[]") for h in extra.split(",") if h.strip()]
    if bind_host in WILDCARD_BINDS or "*" in names:
        return ("*",)
    return tuple(dict.fromkeys([*LOOPBACK_HOSTS, bind_host.lower().strip("[]"), *names]))


def is_loopback(bind_host: str) -> bool:
    return bind_host.strip("[]") in LOOPBACK_HOSTS


def exposure_warning(prog: str, bind_host: str, api_key: str) -> str:
    """The loud line printed when a server listens beyond loopback without a key ("" when there is nothing to say)."""
    if is_loopback(bind_host) or api_key:
        return ""
    return (
        f"WARNING {prog}: listening on {bind_host or '*'} without an API key: anyone who can reach this port can "
        f"drive it. Set --api-key or ${API_KEY_ENV}, or bind 127.0.0.1"
    )


def host_of(value: str) -> str:
    """The host part of a Host header or an Origin's authority, lower-case, IPv6 brackets removed. Anything after the
    host other than a numeric port (``127.0.0.1:80@evil.com``) keeps the whole value, which no allow-list holds."""
    value = value.strip().lower()
    if "://" in value:
        value = value.split("://", 1)[1].split("/", 1)[0]
    if value.startswith("[") and "]" in value:
        host, rest = value[1:].split("]", 1)
    elif value.count(":") == 1:
        host, port = value.split(":")
        rest = ":" + port
    else:
        return value
    port = rest[1:]
    return host if rest == "" or (rest[0] == ":" and port.isascii() and port.isdigit()) else value


class HttpGuard:
    """ASGI middleware; see the module docstring for what it refuses and with which status."""

    def __init__(
        self,
        app,
        *,
        api_key: str = "",
        allowed_hosts: tuple[str, ...] = LOOPBACK_HOSTS,
        open_paths: tuple[str, ...] = ("/health",),
        max_body_bytes: int = 0,
        state_changing_gets: tuple[str, ...] = (),
        key_hint: str = "API key",
    ):
        self.app, self.api_key, self.open_paths = app, api_key, open_paths
        self.state_changing_gets, self.key_hint = frozenset(state_changing_gets), key_hint
        self.max_body_bytes = max_body_bytes  # 0 = no limit
        self.any_host = "*" in allowed_hosts
        self.hosts = {host_of(h) for h in allowed_hosts}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        problem = self.check(scope)
        if problem is not None:
            return await _refuse(send, *problem)
        if not self.max_body_bytes:
            return await self.app(scope, receive, send)
        seen, started = 0, False

        async def counted_receive():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body_bytes:
                raise _BodyTooLarge()
            return message

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except _BodyTooLarge:
            if started:
                raise
            await _refuse(send, 413, self._too_large(f"more than {self.max_body_bytes}"), [])

    def check(self, scope) -> tuple[int, str, list] | None:
        """None when the request may pass, else (status, message naming the fix, extra headers)."""
        headers = {}
        for k, v in scope.get("headers", ()):
            headers.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))
        host = host_of(headers.get("host", ""))
        if not self.any_host and host not in self.hosts:
            return 400, f"Invalid host header {host!r}: this server answers only to {sorted(self.hosts)}", []
        origin = headers.get("origin")
        if headers.get("sec-fetch-site") == "cross-site" or (
            origin is not None and not self.any_host and host_of(origin) not in self.hosts
        ):
            return 403, f"cross-site request refused (Origin {origin!r}); call this API from a program, not a page", []
        if self.api_key and scope["path"] not in self.open_paths:
            if not bearer_matches(headers.get("authorization", ""), self.api_key):
                return (
                    401,
                    f"missing or wrong {self.key_hint}: send 'Authorization: Bearer <key>'",
                    [(b"www-authenticate", b"Bearer")],
                )
        if scope["method"] in ("GET", "HEAD") and scope["path"] in self.state_changing_gets and not self.api_key:
            if not _same_origin(headers) and not _from_a_program(headers):
                return (
                    405,
                    f"GET {scope['path']} changes this server's state and the request shows no sign of coming from "
                    "this origin (a link or <img> on any page sends such a GET); send it as POST",
                    [(b"allow", b"POST")],
                )
        if scope["method"].encode() in BODY_METHODS and _has_body(headers):
            ctype = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if ctype != "application/json":
                return 415, f"Content-Type {ctype!r} is not accepted; send the body as 'application/json'", []
        length = headers.get("content-length", "").strip()
        if self.max_body_bytes and length.isdigit() and int(length) > self.max_body_bytes:
            return 413, self._too_large(length), []
        return None

    def _too_large(self, size: str) -> str:
        return (
            f"request body of {size} bytes exceeds this server's limit of {self.max_body_bytes} bytes; send large "
            "weights by file (update_weights_from_disk, flattened_bucket handles) or raise the limit "
            "(miles serve --max-request-mb)"
        )


def bearer_matches(header: str, key: str) -> bool:
    """``Authorization: Bearer <key>``: the scheme in any case (RFC 7235), the key compared in constant time."""
    scheme, _, given = header.strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())


def _same_origin(headers: dict[str, str]) -> bool:
    """The browser says the request is same-origin (or typed by the user), or its Origin is the Host it asks."""
    if headers.get("sec-fetch-site") in ("same-origin", "none"):
        return True
    origin = headers.get("origin", "")
    return "://" in origin and origin.split("://", 1)[1].rstrip("/").lower() == headers.get("host", "").lower()


def _from_a_program(headers: dict[str, str]) -> bool:
    """No browser sent it: no ``Sec-Fetch-*`` or ``Origin`` header and a User-Agent that is no browser's."""
    if "origin" in headers or any(k.startswith("sec-fetch-") for k in headers):
        return False
    return not headers.get("user-agent", "").lstrip().startswith(BROWSER_AGENTS)


class _BodyTooLarge(Exception):
    pass


async def _refuse(send, status: int, message: str, extra: list) -> None:
    body = json.dumps({"success": False, "message": message, "error": {"message": message, "code": status}})
    headers = [(b"content-type", b"application/json"), *extra]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body.encode()})


def _has_body(headers: dict[str, str]) -> bool:
    return headers.get("content-length", "0").strip() not in ("0", "") or "transfer-encoding" in headers
