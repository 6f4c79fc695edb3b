"""OpenAI-style error bodies and the exception handlers that map errors to HTTP statuses."""

from __future__ import annotations

import re

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.exceptions import (
    AdmissionError,
    EngineDeadError,
    EngineNotReadyError,
    PeerTimeoutError,
    WeightTransferError,
)
from rollout.server import protocol as P
from rollout.server.streams import ClientDisconnected

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "request_too_large",
    500: "internal_server_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "gateway_timeout",
}


class ModelNotFoundError(LookupError):
    """The request named a model this server does not serve (HTTP 404)."""


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    # A message may quote the request; lone surrogates in it must not break the answer itself.
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    body = P.ErrorResponse(
        error=P.ErrorInfo(message=message, type=ERROR_TYPES.get(status, "error"), param=param, code=status)
    )
    return JSONResponse(body.model_dump(), status_code=status)


def admission_response(exc: AdmissionError) -> JSONResponse:
    """503 for a request admission control refused (the queue is at its limit): retry shortly."""
    response = error_response(503, f"server overloaded ({exc.reason}): {exc}; retry later")
    response.headers["Retry-After"] = "1"
    return response


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
        message = f"{'.'.join(loc)}: {first['msg']}{_given(first)}"
    return error_response(400, message, param)


def _given(error: dict) -> str:
    """ ", got <value>" for a scalar input short enough to quote; nothing otherwise."""
    value = error.get("input")
    if isinstance(value, (bool, int, float)) or (isinstance(value, str) and len(value) <= 64):
        return f", got {value!r}"
    return ""


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

    @app.exception_handler(AdmissionError)
    async def _admission(request: Request, exc: AdmissionError) -> JSONResponse:
        return admission_response(exc)

    @app.exception_handler(EngineNotReadyError)
    async def _not_ready(request: Request, exc: EngineNotReadyError) -> JSONResponse:
        # Paused or asleep: retryable once the trainer resumes / wakes the engine.
        response = error_response(503, f"{exc}; retry later")
        response.headers["Retry-After"] = "1"
        return response

    @app.exception_handler(WeightTransferError)
    async def _transfer_failed(request: Request, exc: WeightTransferError) -> JSONResponse:
        # The trainer side of a transfer failed or stalled (a bad gateway, not a server bug); the
        # engine restored its previous weights.
        return error_response(502, f"weight transfer failed: {exc}")

    @app.exception_handler(PeerTimeoutError)
    async def _peer_timeout(request: Request, exc: PeerTimeoutError) -> JSONResponse:
        # A weight-transfer peer did not answer in time; nothing changed in the engine.
        return error_response(504, str(exc))

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, str(exc))

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        # Nobody reads this; the request was already aborted in the engine.
        return Response(status_code=499)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), getattr(exc, "param", None))

    # Anything else is answered by limits.CatchAllMiddleware (a JSON 500 that keeps the connection).
