"""How a request body becomes a typed model: one path for every endpoint. ``BodyRoute`` reads the body (so
the 413 of ``BodySizeLimit`` stays a 413), refuses a body that is not declared JSON (415), and hands FastAPI a
request whose ``json()`` is strict; FastAPI then validates the endpoint's pydantic body model, and
``api.errors`` answers any failure in OpenAI's error format.

The strict parser is pydantic's (``jiter``): it refuses NaN/Infinity, invalid UTF-8, lone UTF-16 surrogates
(``"\\ud800"``: no tokenizer, Redis client or JSON encoder downstream can take one) and nesting deeper than
200 levels, each as a ``JSONDecodeError`` that FastAPI reports as ``json_invalid``."""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

import pydantic_core
from fastapi import FastAPI, Request, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel

from api.errors import ApiError


def parse_json(body: bytes) -> Any:
    """The JSON value of ``body``; ``json.JSONDecodeError`` with jiter's reason when it is not strict JSON."""
    try:
        return pydantic_core.from_json(body, allow_inf_nan=False)
    except ValueError as exc:
        reason = str(exc)
        if "surrogate" in reason or "hex escape" in reason:
            reason = f"a string holds a lone UTF-16 surrogate (\\ud800-\\udfff): {reason}"
        raise json.JSONDecodeError(reason, "", 0) from None


class StrictJSONRequest(Request):
    """A request whose ``json()`` is ``parse_json`` (FastAPI calls it for a JSON body)."""

    async def json(self) -> Any:
        if not hasattr(self, "_strict_json"):
            self._strict_json = parse_json(await self.body())
        return self._strict_json


def is_json_content_type(value: str | None) -> bool:
    """None (no header: parsed as JSON, as before bodies were typed), application/json or application/*+json."""
    if value is None:
        return True
    media = value.partition(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class BodyRoute(APIRoute):
    """The route class of the API's endpoints (``APIRouter(route_class=BodyRoute)``)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if self.body_field is None:
            return handler

        async def route(request: Request) -> Response:
            strict = StrictJSONRequest(request.scope, request.receive)
            await strict.body()  # here, not inside FastAPI's body parsing: that turns any error into a 400
            content_type = strict.headers.get("content-type")
            if not is_json_content_type(content_type):
                message = f"the request body must be JSON (Content-Type: application/json), got {content_type}"
                raise ApiError(415, message, code="unsupported_media_type")
            return await handler(strict)

        return route


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body, what every 4xx and 5xx of the API carries."""

    error: ErrorDetail


def install_openapi(app: FastAPI) -> None:
    """FastAPI's schema, with OpenAI's 400 in place of the 422 FastAPI documents for validation errors
    (``api.errors`` answers those as 400s)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        for model in (ErrorDetail, ErrorResponse):
            model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            model_schema.pop("$defs", None)  # ErrorDetail: its own component
            components[model.__name__] = model_schema
        error = {
            "description": "invalid request (OpenAI's error format)",
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
        }
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                if operation.get("responses", {}).pop("422", None) is not None:
                    operation["responses"]["400"] = error
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
