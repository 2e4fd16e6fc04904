"""OpenAI's error JSON for everything a client can get wrong, and the handlers that make sure no client
input turns into a 500: FastAPI's body validation errors become 400s naming the parameter, 405s carry
``Allow``, and ``CatchAll`` answers anything unexpected with a JSON 500 that keeps the connection usable."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.protocol import FIELD_NAMES, REQUEST_ERROR

logger = logging.getLogger(__name__)


class ApiError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


def _param(loc: Sequence[int | str], keep_last: bool = False) -> str | None:
    """OpenAI's ``param`` (``messages.[0].content``) from a pydantic error location: field names and list
    indices; union member tags (``str``, ``list[int]``, ``chat``) and dict keys are left out."""
    parts = [f"[{p}]" if isinstance(p, int) else p for p in loc if isinstance(p, int) or p in FIELD_NAMES]
    if keep_last and loc and isinstance(loc[-1], str) and loc[-1] not in FIELD_NAMES:
        parts.append(loc[-1])  # an unknown field's own name
    return ".".join(parts) or None


def _most_specific(errors: Sequence[Any]) -> dict[str, Any]:
    """The first error's field, and of its errors the deepest: a union (``content: str | list[part]``) reports
    each member's failure, and the deepest says what is wrong inside the member the client meant."""
    field = tuple(errors[0].get("loc", ()))[:2]
    same_field = [e for e in errors if tuple(e.get("loc", ()))[:2] == field]
    deepest: dict[str, Any] = max(same_field, key=lambda e: len(e.get("loc", ())))  # the first of the deepest
    return deepest


def validation_error(exc: RequestValidationError) -> ApiError:
    """The 400 for FastAPI's body validation: the first error, its parameter named."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request")
    first = _most_specific(errors)
    kind = str(first.get("type"))
    ctx: dict[str, Any] = first.get("ctx") or {}
    loc = list(first.get("loc", ()))
    loc = loc[1:] if loc[:1] == ["body"] else loc
    param = _param(loc, keep_last=kind == "extra_forbidden")
    if kind == REQUEST_ERROR:
        return bad_request(str(ctx["message"]), ctx.get("param") or param, ctx.get("code"))
    if kind == "json_invalid":
        return bad_request(f"request body is not valid JSON: {ctx.get('error', 'decode error')}", code="invalid_json")
    if kind == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param, "unknown_parameter")
    if param is None and kind == "missing":
        return bad_request("the request body is missing: send a JSON object")
    if param is None and kind in ("model_type", "model_attributes_type", "dict_type"):
        return bad_request("the request body must be a JSON object")
    msg = "field required" if kind == "missing" else str(first.get("msg", "invalid value"))
    return bad_request(f"{param}: {msg}" if param else msg, param)


_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")


def _allowed_methods(request: Request) -> str:
    """Every method some route takes at this path (Starlette's 405 names only the first route's): each is
    tried against the routes, so routers included in routers count too."""
    routes = request.app.router.routes
    allowed = [m for m in _METHODS if any(r.matches({**request.scope, "method": m})[0] == Match.FULL for r in routes)]
    return ", ".join(allowed)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(exc.headers or {})
        message = str(exc.detail)
        if exc.status_code == 405:
            headers["Allow"] = _allowed_methods(request) or headers.get("Allow", "")
            message = f"method {request.method} is not allowed on {request.url.path}; allowed: {headers['Allow']}"
        elif exc.status_code == 404 and message == "Not Found":
            message = f"no endpoint {request.method} {request.url.path}"
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(message, kind), status_code=exc.status_code, headers=headers)

    @app.exception_handler(RedisConnectionError)
    @app.exception_handler(RedisTimeoutError)
    async def _redis_down(_: Request, exc: Exception) -> JSONResponse:
        logger.warning("redis unavailable: %s", exc)
        body = error_body("the job queue (Redis) is unavailable; try again shortly", "service_unavailable")
        return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # only for errors raised outside CatchAll (in the middlewares around it): Starlette re-raises after this
        logger.exception("unhandled error")
        return JSONResponse(error_body("internal server error", "server_error"), status_code=500)


_SERVER_ERROR = json.dumps(error_body("internal server error", "server_error")).encode()


class CatchAll:
    """Pure ASGI, just outside the routes' exception handlers: an exception none of them took becomes OpenAI's
    JSON 500 and is not raised further, so uvicorn keeps the keep-alive connection (Starlette's
    ServerErrorMiddleware answers too, but re-raises, and uvicorn then drops the connection unannounced). An
    exception after the response started is raised on: only dropping the connection can tell the client."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except Exception:
            if started:
                raise
            logger.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(_SERVER_ERROR)).encode())]
            await send({"type": "http.response.start", "status": 500, "headers": headers})
            await send({"type": "http.response.body", "body": _SERVER_ERROR})
