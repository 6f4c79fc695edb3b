"""What every request passes before a route runs: the API key, a body-size bound, strict JSON, and a JSON answer for every failure.

- AuthMiddleware: with --api-key, every path but the open ones (/health, /metrics, the API
  docs) needs `Authorization: Bearer <key>`; checked first, so no unauthenticated body is read.
- AdmissionMiddleware: while the engine's queue is full, generation requests get their 503
  before their body is read (admission control, engine/async_llm.py, sizes the rest).
- BodyLimitMiddleware: a body over its route's limit is refused with 413 from its
  Content-Length, or as soon as the bytes read pass the limit (chunked bodies), before the
  route parses it.
- StrictJSONRoute: request bodies are parsed so that what reaches pydantic, msgspec and torch
  is bounded: integers fit in 64 bits, floats are finite (no NaN / Infinity literals, no 1e999),
  strings are valid text (no lone surrogates) and nesting is at most MAX_JSON_DEPTH deep. A
  violation is a 400 naming where it is (`max_tokens`, `update_info.weights[0].shape[1]`).
- CatchAllMiddleware: an unexpected exception is answered with the OpenAI-style JSON 500 and the
  connection stays usable (Starlette's own error middleware re-raises, which makes uvicorn drop
  the keep-alive socket without a `Connection: close`).
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import re
from typing import Any, Callable

from fastapi import HTTPException, Request  # fastapi's: errors.py answers it (the router's own 404 keeps FastAPI's body)
from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.exceptions import AdmissionError
from engine.sampling_params import INT64_MAX, INT64_MIN
from rollout.server.errors import admission_response, error_response

logger = logging.getLogger("rollout.server")

MAX_JSON_DEPTH = 64
_LEADING_FIELD = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)[.\[:]")  # "max_tokens: ..." / "update_info.weights[0]: ..."


class BadRequestBody(HTTPException):
    """A JSON body that parsed but holds an unbounded value (HTTP 400; `param`: the top-level field where it
    was sent, "body.max_tokens", as a failed declared type names it)."""

    def __init__(self, message: str) -> None:
        super().__init__(400, message)
        match = _LEADING_FIELD.match(message)
        self.param = f"body.{match.group(1)}" if match else None


class BodyTooLarge(HTTPException):
    """The request body passed its limit while being read (HTTP 413). An HTTPException, so that
    FastAPI's body reading passes it on instead of turning it into a generic 400."""

    def __init__(self, message: str) -> None:
        super().__init__(413, message)


class AuthMiddleware:
    """Refuses every path outside `open_paths` with 401 unless it carries the bearer token."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: set[str]) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):  # constant time: no key prefix leaks by timing
            await self.app(scope, receive, send)
            return
        response = error_response(401, "missing or invalid API key (send `Authorization: Bearer <key>`)")
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


class AdmissionMiddleware:
    """Refuses generation requests (POST to `paths`) with 503 while the engine's queue is full, before their
    body is read or parsed: under overload, refusals are most of the traffic, and each costs a fraction
    of what routing and validating it would (the engine's own check still sizes each admitted request)."""

    def __init__(self, app: ASGIApp, engine, paths: set[str]) -> None:
        self.app = app
        self.engine = engine
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self.paths:
            try:
                self.engine.check_admission(1)  # room for one more request, of any size
            except AdmissionError as e:
                await admission_response(e)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Refuses request bodies over their path's limit (`max_bytes`, or `path_limits[path]`) with 413,
    before the app reads them whole. `path_limits` values are (bytes, the flag that sets them)."""

    def __init__(self, app: ASGIApp, max_bytes: int, path_limits: dict[str, tuple[int, str]] | None = None) -> None:
        self.app = app
        self.default = (max_bytes, "--max-request-body-bytes")
        self.path_limits = path_limits or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        max_bytes, flag = self.path_limits.get(scope["path"], self.default)

        def message(size: str) -> str:
            return f"the request body is {size} bytes, over this server's limit of {max_bytes} ({flag})"

        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            await error_response(413, message(declared.decode()))(scope, receive, send)
            return
        num_read = 0

        async def counting_receive() -> Message:
            nonlocal num_read
            message_ = await receive()
            if message_["type"] == "http.request":
                num_read += len(message_.get("body", b""))
                if num_read > max_bytes:
                    raise BodyTooLarge(message(f"more than {max_bytes}"))
            return message_

        tracked = _TrackedSend(send)
        try:
            await self.app(scope, counting_receive, tracked)
        except BodyTooLarge as e:  # read outside a route's handlers (they answer it themselves)
            if tracked.started:
                raise
            await error_response(413, str(e.detail))(scope, receive, send)


class _TrackedSend:
    """An ASGI `send` that remembers whether the response has started (after which no error answer fits)."""

    def __init__(self, send: Send) -> None:
        self.send = send
        self.started = False

    async def __call__(self, message: Message) -> None:
        self.started = self.started or message["type"] == "http.response.start"
        await self.send(message)


class CatchAllMiddleware:
    """Answers any exception that escaped the routes' handlers with a JSON 500 (logged with its traceback)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        tracked = _TrackedSend(send)
        try:
            await self.app(scope, receive, tracked)
        except Exception as e:
            logger.exception("internal error serving %s", scope.get("path"))
            if tracked.started:  # a stream already sent its headers: nothing to do but end it
                return
            await error_response(500, f"internal error: {type(e).__name__}: {e}")(scope, receive, send)


# ---------------------------------------------------------------------------- strict JSON


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def strict_json_loads(body: bytes) -> Any:
    """json.loads, then a walk that bounds every value; ValueError naming the first bad one."""
    try:
        data = json.loads(body, parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError(f"the JSON body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"the body is not UTF-8 text: {e.reason} at byte {e.start}") from None
    except json.JSONDecodeError:
        raise
    except ValueError as e:  # NaN/Infinity literals, and ints past Python's digit limit
        raise ValueError(f"malformed JSON body: {e}") from None
    check_bounded(data)
    return data


def check_bounded(data: Any, where: str = "") -> None:
    """ValueError unless every int in `data` fits in 64 bits, every float is finite, every string is
    valid text and nesting stays within MAX_JSON_DEPTH. Iterative: no depth reaches Python's stack."""
    stack: list[tuple[Any, str, int]] = [(data, where, 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                _check_text(path, value)
        elif isinstance(value, bool) or value is None:
            continue
        elif isinstance(value, int):
            if not INT64_MIN <= value <= INT64_MAX:
                shown = str(value) if value.bit_length() < 128 else f"a {len(str(value))}-digit integer"
                raise ValueError(f"{path or 'body'}: integers must fit in 64 bits, got {shown}")
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise ValueError(f"{path or 'body'}: numbers must be finite, got {value}")
        elif isinstance(value, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise ValueError(f"{path or 'body'}: nests deeper than {MAX_JSON_DEPTH} levels")
            if isinstance(value, dict):
                for key, item in value.items():
                    if not key.isascii():
                        _check_text(f"{path or 'body'} (an object key)", key)
                    stack.append((item, f"{path}.{key}" if path else key, depth + 1))
            elif value and all(type(item) is int for item in value):  # token ids: one pass, no per-item frames
                if not (INT64_MIN <= min(value) and max(value) <= INT64_MAX):
                    i = next(i for i, item in enumerate(value) if not INT64_MIN <= item <= INT64_MAX)
                    stack.append((value[i], f"{path}[{i}]", depth + 1))
            else:
                stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))


def _check_text(path: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{path or 'body'}: not valid text (a lone surrogate at character {e.start})") from None


class _StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            try:
                self._json = strict_json_loads(await self.body())
            except json.JSONDecodeError:
                raise  # FastAPI reports it as json_invalid ("malformed JSON body")
            except ValueError as e:  # FastAPI would hide any other error behind a generic 400
                raise BadRequestBody(str(e)) from None
        return self._json


class StrictJSONRoute(APIRoute):
    """An APIRoute whose JSON body goes through strict_json_loads (a bad value is a 400 naming it)."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def strict_handler(request: Request):
            return await handler(_StrictJSONRequest(request.scope, request.receive))

        return strict_handler
