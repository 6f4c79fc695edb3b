"""The OpenAPI document as the server really answers: 400 (never 422) with the OpenAI error body, 401 and 413 where they can happen, and each route's declared error statuses.

Client generators and fuzzers read /openapi.json, so it must not promise what the server never
sends. FastAPI documents a 422 for every operation with input, but our handlers answer a
validation failure with 400 and the OpenAI error body (rollout/server/errors.py); the API key
and the body-size limit are checked by middleware (rollout/server/middleware.py), which FastAPI
cannot see. install_openapi rewrites the generated document once, on first request.
"""

from __future__ import annotations

from typing import Callable

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from rollout.server.protocol import ErrorResponse

_DESCRIPTIONS = {
    400: "Bad request: a field is missing, unknown or out of range (`error.param` names it)",
    401: "Missing or invalid API key",
    404: "Unknown model",
    409: "Conflicts with a change in progress",
    413: "Request body over the server's limit",
    502: "The trainer's side of a weight transfer failed; the previous weights serve again",
    503: "The engine cannot take this now (dead, asleep, paused or overloaded); retry later",
    504: "A peer the engine waited on did not answer within its timeout",
}
_ERROR_REF = "#/components/schemas/ErrorResponse"


def error_responses(*statuses: int) -> dict:
    """FastAPI `responses=` entries documenting these error statuses with the OpenAI error body."""
    return {status: {"model": ErrorResponse, "description": _DESCRIPTIONS[status]} for status in statuses}


def _error_entry(status: int) -> dict:
    return {"description": _DESCRIPTIONS[status], "content": {"application/json": {"schema": {"$ref": _ERROR_REF}}}}


def install_openapi(app: FastAPI, is_protected: Callable[[str], bool]) -> None:
    """Replaces app.openapi with the generated document corrected as the module docstring says."""

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        error_schema = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(error_schema.pop("$defs", {}))
        schemas["ErrorResponse"] = error_schema
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        for path, operations in schema.get("paths", {}).items():
            for method, operation in operations.items():
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)
                if method != "get" or operation.get("parameters"):
                    responses.setdefault("400", _error_entry(400))
                if "requestBody" in operation:
                    responses.setdefault("413", _error_entry(413))
                if is_protected(path):
                    responses.setdefault("401", _error_entry(401))
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
