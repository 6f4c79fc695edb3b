"""The control routes (pause/resume, sleep/wake_up, aborts, weight updates, fault tolerance, LoRA adapters), built from the control declaration.

Every control of engine/control.py with a `Route` becomes one route over the engine's method
of the same name: its arguments as query parameters or as a JSON body (a typed model, unknown
fields refused), its answer the result under the route's `field`, joined by the answers of the
route's `then` controls. Nothing from the network is unpickled; bad values are a 400 naming the
field, and the engine validates before it changes any state. Bodies, query flags and answers are
vLLM 0.33's (its rl, dev, fault-tolerance and LoRA routers); our additions only add keys and routes. build_app mounts each router only
when enabled (--enable-rl-routes, --enable-fault-tolerance, --enable-fault-injection, --allow-runtime-lora-updating), behind the
API key like the OpenAI routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import json
import logging
import os
import types
import uuid
import typing
from typing import Any, Callable, Literal, Union, get_args, get_origin

import pydantic
from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse, PlainTextResponse

from engine.control import CONTROLS, Control, arg_info
from engine.core_client import check_fault_tolerance_instruction
from engine.metrics.rl import sleep_mode_operation_metrics, weight_operation_metrics
from rollout.server.middleware import StrictJSONRoute
from rollout.server.openapi import error_responses
from rollout.server.protocol import RequestModel, ResponseModel

logger = logging.getLogger(__name__)

# The engine answers 503 when it is dead (and, for some calls, asleep or paused).
_ENGINE_ERRORS = (503,)
_ROUTERS = {
    "rl": dict(tags=["rl"]),
    "fault_tolerance": dict(tags=["fault_tolerance"]),
    "fault_injection": dict(tags=["fault_tolerance"]),
    "lora": dict(tags=["lora"]),
}

# A check the server adds before a control runs (e.g. the backend --weight-transfer-backend allows),
# given the control's arguments by name; it raises ValueError (400) to refuse.
Check = Callable[[dict[str, Any]], None]


def _check_instruction(arguments: dict[str, Any]) -> None:
    """The fault-tolerance apply route answers 202 before the call runs: its instruction is checked first."""
    check_fault_tolerance_instruction(arguments["instruction"])


# Checks every server makes; a route that answers before its call runs (background) needs one.
_CHECKS: dict[str, Check] = {"apply_fault_tolerance_instruction": _check_instruction}


def control_routers(engine, *, checks: dict[str, Check] | None = None) -> dict[str, APIRouter]:
    """{router name: APIRouter} of every declared control's route over `engine` (an AsyncLLM or RolloutGroup).

    checks: {control name: Check}; a check gets the arguments by their wire (vLLM) names."""
    routers = {name: APIRouter(route_class=StrictJSONRoute, **options) for name, options in _ROUTERS.items()}
    all_checks = {**_CHECKS, **(checks or {})}
    for declared in CONTROLS.values():
        if declared.route is not None:
            _add_route(routers[declared.route.router], engine, declared, all_checks.get(declared.name))
    return routers


def _add_route(router: APIRouter, engine, declared: Control, check: Check | None) -> None:
    route = declared.route
    wire = route.wire_name
    query = [p for p in declared.params if route.verb == "GET" or p.name in route.query]
    body = [p for p in declared.params if p not in query]
    body_model = _body_model(declared, body) if body else None
    body_optional = all(p.default is not inspect.Parameter.empty for p in body)
    answer_model = _answer_model(declared)

    async def endpoint(**given: Any) -> Any:
        arguments = {wire(p.name): given[p.name] for p in query}  # by wire name (vLLM's), as checks see them
        if body_model is not None:
            sent = given["body"]
            arguments.update({wire(p.name): getattr(sent, wire(p.name)) if sent is not None else p.default
                              for p in body})
        if check is not None:
            check(arguments)
        args = tuple(arguments[wire(name)] for name in declared.arg_names())
        if route.background:
            return _in_background(engine, declared, args, route)
        if route.text is not None:
            return PlainTextResponse(route.text(await getattr(engine, declared.name)(*args), arguments))
        return await _answer(engine, declared, args, arguments)

    parameters = [
        inspect.Parameter(p.name, inspect.Parameter.KEYWORD_ONLY, annotation=_http_type(p.annotation),
                          default=_query_default(p, wire(p.name)))
        for p in query
    ]
    if body_model is not None:
        parameters.append(inspect.Parameter(
            "body", inspect.Parameter.KEYWORD_ONLY, annotation=body_model | None if body_optional else body_model,
            default=None if body_optional else inspect.Parameter.empty))
    endpoint.__signature__ = inspect.Signature(parameters, return_annotation=answer_model)
    endpoint.__name__ = declared.name
    endpoint.__doc__ = declared.doc
    responses = error_responses(*_ENGINE_ERRORS, *route.errors)
    if route.text is not None:
        responses[route.status_code] = {"description": "Success (a sentence)", "content": _TEXT}
    router.add_api_route(
        route.path or f"/{declared.name}", endpoint, methods=[route.verb], status_code=route.status_code,
        response_model=answer_model, response_model_exclude_unset=True,  # an absent NotRequired key stays absent
        response_class=PlainTextResponse if route.text is not None else JSONResponse, responses=responses,
        summary=declared.name.replace("_", " ").capitalize(),
    )


_TEXT = {"text/plain": {"schema": {"type": "string"}}}


_BACKGROUND: set[asyncio.Task] = set()  # running background calls (a task nobody holds may be collected)


def _in_background(engine, declared: Control, args: tuple, route) -> dict[str, Any]:
    """Starts the call and answers at once with the route's constant keys and a request_id (vLLM's
    fault-tolerance apply); the call's failure is logged under that id."""
    request_id = str(uuid.uuid4())

    async def run() -> None:
        try:
            await getattr(engine, declared.name)(*args)
        except Exception as e:
            logger.error("%s (request %s) failed: %s: %s", declared.name, request_id, type(e).__name__, e)

    task = asyncio.get_running_loop().create_task(run())
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)
    return {**dict(route.constant), "request_id": request_id}


async def _answer(engine, declared: Control, args: tuple, arguments: dict[str, Any]) -> dict[str, Any]:
    """The JSON answer: the route's `answer` of the result, or the constant keys, the echoed arguments,
    the result under the route's field (or a dict result as is), then each `then` control's answer."""
    route = declared.route
    with _timed(route):
        result = await getattr(engine, declared.name)(*args)
    if route.answer is not None:
        return route.answer(result, arguments)
    answer = dict(route.constant)
    for name in route.echo:
        answer[route.wire_name(name)] = arguments[route.wire_name(name)]
    _join(answer, route.field, result)
    for name in route.then:
        _join(answer, CONTROLS[name].route.field, await getattr(engine, name)())
    return answer


def _timed(route):
    """vLLM's operation metrics around the call (engine/metrics/rl.py), or nothing for an untimed route."""
    if route.metric is None:
        return contextlib.nullcontext()
    family, operation = route.metric
    metrics = weight_operation_metrics() if family == "weight" else sleep_mode_operation_metrics()
    return metrics.record(operation)


def _join(answer: dict[str, Any], field: str | None, result: Any) -> None:
    if field is not None:
        answer[field] = result
    elif isinstance(result, dict):
        answer.update(result)


# ---- types: the declaration's types as FastAPI/pydantic take them --------------------------------


def _http_type(annotation: Any) -> Any:
    """The declared type over HTTP (its Arg's `http` type when given). A Literal is sent as its values'
    type, so that the engine's own check names the choices (as in Python) instead of a generic message."""
    base, arg = arg_info(annotation)
    if arg is not None and arg.http is not None:
        return arg.http
    if base is tuple:
        return list[Any]
    if get_origin(base) is Literal and not all(isinstance(v, str) for v in get_args(base)):  # str choices: checked here, as vLLM's routes do
        return type(get_args(base)[0])
    if get_origin(base) in (Union, types.UnionType):
        return Union[tuple(_http_type(a) for a in get_args(base))]
    return base


def _constraints(annotation: Any) -> dict[str, Any]:
    _, arg = arg_info(annotation)
    if arg is None:
        return {}
    bounds = {"ge": arg.ge, "gt": arg.gt, "le": arg.le}
    return {"description": arg.doc, **{k: v for k, v in bounds.items() if v is not None}}


def _query_default(param: inspect.Parameter, name: str) -> Any:
    default = ... if param.default is inspect.Parameter.empty else param.default
    return Query(default, alias=None if name == param.name else name, **_constraints(param.annotation))


def _body_model(declared: Control, params: list[inspect.Parameter]) -> type[RequestModel]:
    wire = declared.route.wire_name
    fields = {
        wire(p.name): (_http_type(p.annotation), pydantic.Field(
            ... if p.default is inspect.Parameter.empty else p.default, **_constraints(p.annotation)))
        for p in params
    }
    return pydantic.create_model(_camel(declared.name) + "Request", __base__=RequestModel, **fields)


def _answer_model(declared: Control) -> Any:
    """A typed model of the answer's keys, or dict[str, Any] when a dict result is part of it."""
    route = declared.route
    if route.text is not None:
        return None
    if route.answer is not None:
        return dict[str, Any]
    if route.background:
        return pydantic.create_model(_camel(declared.name) + "Response", __base__=ResponseModel,
                                     **{key: (type(value), ...) for key, value in route.constant}, request_id=(str, ...))
    parts = [(route.field, declared)] + [(CONTROLS[name].route.field, CONTROLS[name]) for name in route.then]
    fields: dict[str, Any] = {key: (type(value), ...) for key, value in route.constant}
    fields.update({route.wire_name(name): (_http_type(_param(declared, name).annotation), ...) for name in route.echo})
    for field, source in parts:
        returns = source.signature.return_annotation
        if field is not None:
            fields[field] = (_http_type(returns), ...)
        elif typing.is_typeddict(returns):  # its keys join the answer
            for key, value in typing.get_type_hints(returns, include_extras=True).items():
                if typing.get_origin(value) is typing.NotRequired:  # left out of the answer when absent
                    fields[key] = (typing.get_args(value)[0] | None, None)
                else:
                    fields[key] = (value, ...)
        elif returns is not type(None):  # a dict result joins the answer: its keys are the engine's
            return dict[str, Any]
    return pydantic.create_model(_camel(declared.name) + "Response", __base__=ResponseModel, **fields)


def _param(declared: Control, name: str) -> inspect.Parameter:
    return next(p for p in declared.params if p.name == name)


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


# ---- vLLM's /server_info (its dev router): what this server runs with ----------------------------


def server_info_router(engine) -> APIRouter:
    """GET /server_info?config_format=text|json -> {"vllm_config", "vllm_env", "system_env"}, vLLM's keys:
    the engine's config (its dataclasses' repr, or as JSON), the environment settings (none: every setting is
    a flag here, so the dict is empty) and the system's versions. Mounted with the RL routes."""
    router = APIRouter(route_class=StrictJSONRoute, tags=["rl"])

    @router.get("/server_info")
    async def server_info(config_format: Literal["text", "json"] = Query("text")) -> dict[str, Any]:
        config = engine.config
        shown = str(config) if config_format == "text" else json.loads(json.dumps(dataclasses.asdict(config),
                                                                                   default=str))
        return {"vllm_config": shown, "vllm_env": {}, "system_env": await asyncio.to_thread(_system_env)}

    return router


def _system_env() -> dict[str, Any]:
    import platform

    import torch

    return {"torch_version": torch.__version__, "python_version": platform.python_version(),
            "os": platform.platform(), "is_cuda_available": torch.cuda.is_available(),
            "cuda_runtime_version": torch.version.cuda, "cpu_count": os.cpu_count()}
