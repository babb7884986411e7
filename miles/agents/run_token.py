"""The agent servers' run token: the harness and the session servers answer only requests that carry it
(``Authorization: Bearer <token>``), so that no other local process, and no web page, can start episodes, read
transcripts or flush a live rollout. Whoever starts them (miles.agents.launcher, the agent sample source) makes one
random token per run and hands it over in the environment (``$MILES_AGENT_TOKEN``) or a 0600 file
(``--token-file``), never in argv, where ``ps`` shows it to every user.

    token = new_token()                               # the launcher
    token = server_token("miles harness", args.token_file)   # a server's main: file, env, or a fresh one (printed)
    httpx.Client(headers=token_headers(token))        # miles' own clients
"""

from __future__ import annotations

import os
import secrets
import sys
import tempfile
from pathlib import Path

from miles.secret_file import read_secret_file, write_secret_file

TOKEN_ENV = "MILES_AGENT_TOKEN"
KEY_HINT = f"run token (${TOKEN_ENV} of the run that started this server)"


def new_token() -> str:
    return secrets.token_urlsafe(32)


def token_headers(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def server_token(prog: str, token_file: str = "") -> str:
    """A server's token: ``token_file``, else ``$MILES_AGENT_TOKEN``, else a fresh one written to a new 0600 file
    whose path is printed. The variable is removed from this process's environment either way, so the processes it
    starts (a sandbox's test, which runs the policy's code) do not inherit it."""
    from_env = os.environ.pop(TOKEN_ENV, "")
    if token_file:
        return read_secret_file(token_file, "--token-file")
    if from_env:
        return from_env
    token = new_token()
    path = write_secret_file(Path(tempfile.mkdtemp(prefix="miles-agent-token-")) / "token", token)
    print(
        f"{prog}: no run token given; every request but /health needs 'Authorization: Bearer <token>' with the "
        f"token in {path} (give it to this run's other agent servers and clients as ${TOKEN_ENV} or --token-file)",
        file=sys.stderr,
        flush=True,
    )
    return token
