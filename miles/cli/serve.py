"""The ``miles serve`` command: parse the arguments, bind the port (a taken one fails at once, with the
address and the fix in one line), build the engine, guard the app (miles.http_guard) and run uvicorn.
``python -m miles.cli.serve`` and ``miles serve`` both land in ``main``.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import os
import socket
import sys
import threading
import time

from miles.config_args import ArgParser, add_config_args, config_from_args, print_config
from miles.http_connections import HEAD_TIMEOUT_S, MAX_PER_CLIENT, guarded_protocol
from miles.http_guard import API_KEY_ENV, allowed_hosts, api_key_from, is_loopback


def _parser() -> argparse.ArgumentParser:
    p = ArgParser(prog="miles serve", description="serve the embedded engine over SGLang's HTTP API")
    add_config_args(p)  # --recipe, --config FILE (a run's config.json too), --set, --print-config
    p.add_argument("--host", default="127.0.0.1", help="interface to bind; the default keeps it on this machine")
    p.add_argument("--port", type=_port, default=30000, help="0 picks a free port (printed on stdout)")
    key = p.add_mutually_exclusive_group()
    key.add_argument(
        "--api-key-file",
        default="",
        help=f"require 'Authorization: Bearer KEY' on every endpoint but /health, KEY read from this file (mode "
        f"600); default: ${API_KEY_ENV}, else no key",
    )
    key.add_argument(
        "--api-key", default=None, help="the key itself (SGLang's flag): visible to every user in `ps`; prefer the file"
    )
    p.add_argument(
        "--head-timeout-s",
        type=float,
        default=HEAD_TIMEOUT_S,
        help="close a connection whose request line and headers have not all arrived after this long (408; 0 = never)",
    )
    p.add_argument(
        "--max-connections-per-client",
        type=int,
        default=MAX_PER_CLIENT,
        help="open connections one remote (not loopback) address may hold; more get 503 and are closed (0 = no cap)",
    )
    p.add_argument(
        "--allowed-hosts",
        default="",
        help="extra names the Host header may carry, comma-separated ('*' = any); loopback and --host always pass",
    )
    p.add_argument(
        "--group-connect-timeout-s",
        type=float,
        default=30.0,
        help="how long /init_weights_update_group waits for the rendezvous before it answers 400",
    )
    p.add_argument(
        "--max-request-mb",
        type=_mib,
        default=2048.0,
        help="largest request body accepted, in MiB (413 above it; 0 = no limit): weights inline in a request "
        "are held in memory whole, large ones belong in files",
    )
    p.add_argument("--owner", default="engine/0", help="owner name in the memory ledger")
    p.add_argument(
        "--batch-wait-ms", type=float, default=5.0, help="how long to collect concurrent requests into a batch"
    )
    p.add_argument("--parent-pid", type=int, default=0, help="exit when this process is gone (set by spawners)")
    p.add_argument("--log-level", default="warning")
    _sglang_flags(p)
    return p


def _sglang_flags(p: argparse.ArgumentParser) -> None:
    """SGLang's launch flags (miles.sglang_flags), so `miles serve` stands in for ``sglang.launch_server``
    (``rollout.sglang_launcher=miles-serve``): --host, --port, --api-key and --log-level act as above; the rest
    are accepted and ignored, the engine being built from --config (--enable-weights-cpu-backup is its
    handoff.engine_host_mirror, release/resume by tag needs no --enable-memory-saver here)."""
    from miles.sglang_flags import KNOWN_FLAGS

    g = p.add_argument_group("SGLang's flags (accepted for the stand-in launcher; ignored)")
    switches = {"--enable-memory-saver", "--skip-server-warmup", "--enable-weights-cpu-backup"}
    for flag, takes_value in {**KNOWN_FLAGS, "--model-path": True, **dict.fromkeys(switches, False)}.items():
        if flag in ("--api-key", "--log-level"):
            continue
        dest = "sglang_" + flag[2:].replace("-", "_")
        g.add_argument(flag, dest=dest, default=None, **({} if takes_value else {"action": "store_true"}))


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port; use 0..65535 (0 = any free port)")
    return port


def _mib(text: str) -> float:
    try:
        mib = float(text)
    except ValueError:
        mib = -1.0
    if not 0 <= mib < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in MiB; use a number >= 0 (0 = no limit)")
    return mib


def api_key_of(args) -> str:
    """The key from --api-key-file, --api-key (with a warning: argv is public) or $MILES_API_KEY; "" for none."""
    from miles.secret_file import read_secret_file

    if args.api_key_file:
        return read_secret_file(args.api_key_file, "--api-key-file")
    if args.api_key is not None:
        print(
            "WARNING miles serve: --api-key puts the key in this process's arguments, which every user of the "
            f"machine can read (ps); use --api-key-file FILE (mode 600) or ${API_KEY_ENV}",
            file=sys.stderr,
            flush=True,
        )
    return api_key_from(args.api_key)


def check_host(host: str) -> None:
    """Refuse (bad input, exit 2) a --host that names no address of this machine, before anything is printed or
    built: a throwaway bind to a free port, so a taken --port is still bind's error (the machine, exit 1)."""
    fix = "use 127.0.0.1 (this machine only), 0.0.0.0 (every interface) or one of this machine's addresses"
    if host.replace(".", "").isdigit():  # no host name is all digits: a malformed IPv4 address, never looked up
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise ValueError(f"--host {host!r} is not an IPv4 address; {fix}") from None
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        try:
            probe.bind((host, 0))
        except OSError as e:
            unknown_name = isinstance(e, socket.gaierror) and e.errno != socket.EAI_AGAIN  # EAI_AGAIN: DNS is down
            if unknown_name or e.errno == errno.EADDRNOTAVAIL:
                raise ValueError(f"--host {host!r} is not an address of this machine ({e.strerror}); {fix}") from None


def bind(host: str, port: int) -> socket.socket:
    """A listening socket; an OSError whose message names the address and the fix when it cannot be had."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(
            e.errno, f"miles serve cannot listen on {host}:{port} ({e.strerror}); pick another --port, or 0 for any"
        ) from None
    sock.listen(2048)
    return sock


def _watch_parent(pid: int) -> None:
    def watch():
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os._exit(0)
            time.sleep(1.0)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    check_host(args.host)
    cfg = config_from_args(args)
    if args.print_config:
        return print_config(cfg, args, "miles serve")
    try:
        api_key = api_key_of(args)
        protocol = guarded_protocol(args.head_timeout_s, args.max_connections_per_client)
    except ValueError as e:
        print(f"miles serve: {e}", file=sys.stderr, flush=True)
        return 2
    if not is_loopback(args.host) and not api_key:  # an engine anyone could drive: refused, not warned about
        print(
            f"miles serve: --host {args.host} listens beyond this machine without an API key: anyone who can reach "
            f"the port could generate and load weights. Set --api-key-file FILE (mode 600) or ${API_KEY_ENV}, or "
            "bind 127.0.0.1",
            file=sys.stderr,
            flush=True,
        )
        return 2
    sock = bind(args.host, args.port)  # before the engine is built: a taken port fails in a moment
    import torch  # the engine's imports (seconds) once the arguments and the config are known to be good
    import uvicorn

    from miles.rollout.engine import EmbeddedEngine
    from miles.rollout.launch import READY_PREFIX
    from miles.rollout.server import EngineServer

    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    engine = EmbeddedEngine.from_config(cfg, device, args.owner)
    server = EngineServer(
        engine,
        batch_wait_ms=args.batch_wait_ms,
        info={"recipe": cfg.recipe, "owner": args.owner},
        api_key=api_key,
        allowed_hosts=allowed_hosts(args.host, args.allowed_hosts),
        group_connect_timeout_s=args.group_connect_timeout_s,
        max_request_bytes=int(args.max_request_mb * 2**20),
    )
    if args.parent_pid:
        _watch_parent(args.parent_pid)
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"{READY_PREFIX}http://{host}:{sock.getsockname()[1]}", flush=True)
    config = uvicorn.Config(
        server.app, log_level=args.log_level, access_log=False, timeout_keep_alive=60, backlog=2048, http=protocol
    )
    uvicorn.Server(config).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
