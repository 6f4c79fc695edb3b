"""OpenAI-style error bodies and the exception handlers that map errors to HTTP statuses."""

from __future__ import annotations

import logging
import re

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.exceptions import AdmissionError, EngineDeadError, EngineNotReadyError, WeightTransferError
from rollout.server import protocol as P
from rollout.server.streams import ClientDisconnected

logger = logging.getLogger("rollout.server")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class ModelNotFoundError(LookupError):
    """The request named a model this server does not serve (HTTP 404)."""


class AuthError(PermissionError):
    """Missing or wrong bearer token (HTTP 401)."""


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    body = P.ErrorResponse(
        error=P.ErrorInfo(message=message, type=ERROR_TYPES.get(status, "error"), param=param, code=status)
    )
    return JSONResponse(body.model_dump(), status_code=status)


_LEADING_NAME = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)")


def _param_of(message: str) -> str | None:
    """The field a ValueError names: engine messages start with it ("top_p must be ...", "prompt: ...")."""
    match = _LEADING_NAME.match(message)
    return match.group(1) if match else None


def _validation_error(errors: list[dict]) -> JSONResponse:
    """400 for pydantic errors, naming the first offending field (its path without "body"/"query")."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    kind = first.get("type")
    loc = _body_loc(first)
    if kind == "json_invalid":
        return error_response(400, f"malformed JSON body: {first.get('ctx', {}).get('error', first['msg'])}")
    if not loc:  # the body as a whole
        if kind == "missing":
            return error_response(400, "the request needs a JSON body")
        if isinstance(first.get("input"), (bytes, str)):
            return error_response(400, "the body must be JSON sent with Content-Type: application/json")
        return error_response(400, "the body must be a JSON object")
    # Union members show up in locs ("prompt.str", "prompt.list[int]"): name the field itself.
    param = loc[0]
    if kind == "extra_forbidden":
        message = f"{'.'.join(loc)}: unknown field"
    elif len(loc) > 1 and sum(1 for e in errors if _body_loc(e)[:1] == [param]) > 1:
        message = f"{param}: invalid value ({'; '.join(sorted({e['msg'] for e in errors}))})"
    else:
        message = f"{'.'.join(loc)}: {first['msg']}"
    return error_response(400, message, param)


def _body_loc(error: dict) -> list[str]:
    return [str(x) for x in error.get("loc", ()) if x not in ("body", "query")]


def add_exception_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(list(exc.errors()))

    @app.exception_handler(pydantic.ValidationError)
    async def _pydantic_validation(request: Request, exc: pydantic.ValidationError) -> JSONResponse:
        return _validation_error(exc.errors())

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, exc: ValueError) -> JSONResponse:
        return error_response(400, str(exc), _param_of(str(exc)))

    @app.exception_handler(ModelNotFoundError)
    async def _not_found(request: Request, exc: ModelNotFoundError) -> JSONResponse:
        return error_response(404, str(exc), "model")

    @app.exception_handler(AuthError)
    async def _auth(request: Request, exc: AuthError) -> JSONResponse:
        response = error_response(401, str(exc))
        response.headers["WWW-Authenticate"] = "Bearer"
        return response

    @app.exception_handler(AdmissionError)
    async def _admission(request: Request, exc: AdmissionError) -> JSONResponse:
        return error_response(503, f"server overloaded ({exc.reason}): {exc}; retry later")

    @app.exception_handler(EngineNotReadyError)
    async def _not_ready(request: Request, exc: EngineNotReadyError) -> JSONResponse:
        # Paused or asleep: retryable once the trainer resumes / wakes the engine.
        response = error_response(503, f"{exc}; retry later")
        response.headers["Retry-After"] = "1"
        return response

    @app.exception_handler(WeightTransferError)
    async def _transfer_failed(request: Request, exc: WeightTransferError) -> JSONResponse:
        # The trainer side of a transfer failed or stalled; the engine restored its previous weights.
        return error_response(500, f"weight transfer failed: {exc}")

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, str(exc))

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        # Nobody reads this; the request was already aborted in the engine.
        return Response(status_code=499)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error serving %s", request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
