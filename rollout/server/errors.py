"""OpenAI-style error bodies and the exception handlers that map errors to HTTP statuses.

The `type` and `param` of an error body are vLLM 0.33's for the same kind of error
(vllm/entrypoints/serve/exception_handling): a request that fails its declared types (FastAPI's
validation) is type "Bad Request" with `param` the field's location ("body.token_ids",
"query.mode"); a route's own refusal of its input (an HTTPException) is the status phrase with no
`param`; a ValueError from the serving layer is "BadRequestError" naming the field it is about; an
unknown model "NotFoundError" (param "model"); anything that broke "InternalServerError". A path no
route serves is answered as FastAPI answers it, `{"detail": "Not Found"}`, as vLLM does.
"""

from __future__ import annotations

import re

import pydantic
from http import HTTPStatus

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from engine.exceptions import (
    AdmissionError,
    EngineDeadError,
    EngineNotReadyError,
    InvalidUserInputError,
    LoRAAdapterNotFoundError,
    PeerTimeoutError,
    WeightTransferError,
)
from rollout.server import protocol as P
from rollout.server.streams import ClientDisconnected

# vLLM's error type by status where its create_error_response names the error class; any other
# status is typed with its HTTP phrase, as vLLM types the errors it raises with an explicit status.
ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}
# The phrase type (vLLM's FastAPI validation and HTTPException handlers): "Bad Request", "Not Found", ...
PHRASE = "phrase"


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status) or _phrase(status)


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


class ModelNotFoundError(LookupError):
    """The request named a model this server does not serve (HTTP 404)."""


def error_response(status: int, message: str, param: str | None = None, type: str | None = None) -> JSONResponse:
    """type: the error's type (default: vLLM's for the status); PHRASE: the status phrase."""
    # A message may quote the request; lone surrogates in it must not break the answer itself.
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    kind = _phrase(status) if type == PHRASE else (type or error_type(status))
    body = P.ErrorResponse(error=P.ErrorInfo(message=message, type=kind, param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status)


def admission_response(exc: AdmissionError) -> JSONResponse:
    """503 for a request admission control refused (the queue is at its limit): retry shortly."""
    # vLLM's admission refusals (QueueOverflowError, MaxQueuedTokensError) carry their status: the phrase.
    response = error_response(503, f"server overloaded ({exc.reason}): {exc}; retry later", type=PHRASE)
    response.headers["Retry-After"] = "1"
    return response


_LEADING_NAME = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)")


def _param_of(exc: BaseException) -> str | None:
    """The field a ValueError is about: its `param` when it names one, else the name its message starts
    with (engine messages do: "top_p must be ...", "prompt: ...")."""
    param = getattr(exc, "param", None)
    if isinstance(param, str) and param:
        return param
    match = _LEADING_NAME.match(str(exc))
    return match.group(1) if match else None


def _refused_by_route(request: Request) -> bool:
    """A control route (RL, sleep, cache, fault tolerance, elastic EP): vLLM's routers refuse bad input
    there by hand, with an HTTPException (the status phrase, no param); only the OpenAI serving layer
    answers a ValueError with BadRequestError and the field's name."""
    route = request.scope.get("route")
    module = getattr(getattr(route, "endpoint", None), "__module__", "")
    return module in ("rollout.server.rl_routes", "rollout.server.elastic_routes")


def _validation_error(errors: list[dict]) -> JSONResponse:
    """400 for a request that fails its declared types, as vLLM answers it: type "Bad Request", param
    the first offending field's location ("body.new_version", "query.level"; union members and
    pydantic's wrapper names left out); the message names the field and what is wrong with it."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    kind = first.get("type")
    loc = _body_loc(first)
    if kind == "json_invalid":
        message = f"malformed JSON body: {first.get('ctx', {}).get('error', first['msg'])}"
        return error_response(400, message, type=PHRASE)
    if not loc:  # the body as a whole (vLLM's routers check it by hand: no param)
        if kind == "missing":
            return error_response(400, "the request needs a JSON body", type=PHRASE)
        if isinstance(first.get("input"), (bytes, str)):
            return error_response(400, "the body must be JSON sent with Content-Type: application/json", type=PHRASE)
        return error_response(400, "the body must be a JSON object", type=PHRASE)
    # Union members show up in locs ("prompt.str", "prompt.list[int]"): name the field itself.
    name = loc[0]
    if kind == "extra_forbidden":
        message = f"{'.'.join(loc)}: unknown field"
    elif len(loc) > 1 and sum(1 for e in errors if _body_loc(e)[:1] == [name]) > 1:
        message = f"{name}: invalid value ({'; '.join(sorted({e['msg'] for e in errors}))})"
    else:
        message = f"{'.'.join(loc)}: {first['msg']}{_given(first)}"
    return error_response(400, message, _param_path(first), type=PHRASE)


# pydantic-core's names for the schema wrappers and union branches that show up in an error's loc
# ("function-wrap[...]", "list[int]", "str"): not fields a client sent.
_LOC_WRAPPERS = frozenset({
    "function-wrap", "function-after", "function-before", "function-plain", "json-or-python",
    "lax-or-strict", "chain", "default", "nullable", "tagged-union", "union", "call", "arguments",
    "is-instance", "is-subclass", "callable", "str", "int", "float", "bool", "bytes", "bytearray",
    "list", "tuple", "dict", "set", "frozenset", "complex", "none", "nonetype",
})


def _param_path(error: dict) -> str | None:
    """The dotted location of a validation error as vLLM names it: where it was sent ("body", "query")
    first, then the field path without pydantic's wrapper and union-branch segments."""
    loc = [str(x) for x in error.get("loc", ())]
    kept = [x for x in loc if not re.search(r"[\[\](){}]", x) and x.lower() not in _LOC_WRAPPERS
            and not x.startswith("constrained-")]  # "constrained-str": a union member with its bounds
    return ".".join(kept or loc) or None


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
        if _refused_by_route(request):
            return error_response(400, str(exc), type=PHRASE)
        return error_response(400, str(exc), _param_of(exc))

    @app.exception_handler(InvalidUserInputError)
    async def _invalid_user_input(request: Request, exc: InvalidUserInputError) -> JSONResponse:
        return error_response(400, str(exc), type=exc.error_type)  # vLLM's LoRA route refusals

    @app.exception_handler(LoRAAdapterNotFoundError)
    async def _no_adapter(request: Request, exc: LoRAAdapterNotFoundError) -> JSONResponse:
        return error_response(404, str(exc))

    @app.exception_handler(P.ParamValidationError)
    async def _param_validation(request: Request, exc: P.ParamValidationError) -> JSONResponse:
        return error_response(400, str(exc), exc.parameter)  # vLLM's VLLMValidationError answer

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

    # A route's own refusal (fastapi's HTTPException): the status phrase, as vLLM's routers answer. The
    # router's "no such path" / "method not allowed" (starlette's HTTPException) keep FastAPI's own
    # `{"detail": ...}` body, as vLLM leaves them.
    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        response = error_response(exc.status_code, str(exc.detail), getattr(exc, "param", None), type=PHRASE)
        response.headers.update(exc.headers or {})
        return response

    # Anything else is answered by limits.CatchAllMiddleware (a JSON 500 that keeps the connection).
