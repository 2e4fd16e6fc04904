"""Pure-ASGI middleware (cheaper per request than Starlette's BaseHTTPMiddleware)."""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import ApiError, error_body


class BodySizeLimit:
    """413 for a request body over ``max_bytes``: at once from Content-Length, or while a chunked body is read."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    too_big = int(value) > self.max_bytes
                except ValueError:
                    too_big = False
                if too_big:
                    await self._reject(send)
                    return
                break
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise ApiError(413, self._message(), code="request_too_large")
            return message

        await self.app(scope, limited_receive, send)

    def _message(self) -> str:
        return f"request body larger than {self.max_bytes} bytes"

    async def _reject(self, send: Send) -> None:
        body = json.dumps(error_body(self._message(), "invalid_request_error", code="request_too_large")).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})
