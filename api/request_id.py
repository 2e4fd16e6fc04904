"""vLLM's ``X-Request-Id``: a client's id comes back on the response (one is generated when it sends none or
one that no log line should carry), and the per-request log line (``--disable-log-requests`` turns it off)."""

from __future__ import annotations

import logging
import re
import uuid

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"x-request-id"
MAX_LEN = 128
_PRINTABLE = re.compile(r"[\x21-\x7e]+")  # visible ASCII: no spaces or control characters in logs
logger = logging.getLogger("pagedserve.requests")


def client_request_id(request: Request) -> str:
    """The id the middleware settled on for this request ("" outside it)."""
    value: str = request.scope.get("state", {}).get("x_request_id", "")
    return value


class RequestIdHeader:
    """Echoes ``X-Request-Id`` (the client's, else a fresh uuid4 hex) on every HTTP response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == HEADER), b"").decode("latin-1")
        request_id = given if len(given) <= MAX_LEN and _PRINTABLE.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["x_request_id"] = request_id
        raw = request_id.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
                message["headers"] = [*headers, (HEADER, raw)]
            await send(message)

        await self.app(scope, receive, send_with_id)


def log_request(request: Request, job_id: str, kind: str, num_prompt_tokens: int, params: object) -> None:
    """One INFO line per request, as vLLM's request log (sizes and parameters, not the prompt's text)."""
    logger.info(
        "request %s (X-Request-Id %s): %s, %d prompt tokens, %s",
        job_id,
        client_request_id(request),
        kind,
        num_prompt_tokens,
        params,
    )
