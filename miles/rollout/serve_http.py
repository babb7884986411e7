"""The HTTP plumbing every ``miles serve`` route shares: the JSON body read with its checks, the 4xx body, and
the exception a valid request gets when the engine's state forbids it now (409)."""

from __future__ import annotations

import json

from fastapi import Request
from fastapi.responses import JSONResponse

from miles.rollout.sglang_api import WireError


class Conflict(RuntimeError):
    """The request is valid but the engine's state forbids it now (HTTP 409)."""


def error(status: int, message: str) -> JSONResponse:
    """A 4xx body: SGLang's ``{"error": {"message"}}`` plus its update endpoints' ``success`` / ``message``."""
    return JSONResponse(
        {"success": False, "message": message, "error": {"message": message, "code": status}}, status_code=status
    )


async def read_body(request: Request) -> dict:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise WireError(f"malformed JSON body: {e}; send a JSON object") from None
    except RecursionError:
        raise WireError("JSON body nested too deeply to parse; send a flat JSON object") from None
    if not isinstance(body, dict):
        raise WireError(f"expected a JSON object, got {type(body).__name__}")
    return body
