"""The RL control routes (pause/resume, sleep/wake_up, aborts, weight updates, fault tolerance), built from the control declaration.

Every control of engine/control.py with a `Route` becomes one route over the engine's method
of the same name: its arguments as query parameters or as a JSON body (a typed model, unknown
fields refused), its answer the result under the route's `field`, joined by the answers of the
route's `then` controls. Nothing from the network is unpickled; bad values are a 400 naming the
field, and the engine validates before it changes any state. build_app mounts each router only
when enabled (--enable-rl-routes, --enable-fault-tolerance, --enable-fault-injection), behind the
API key like the OpenAI routes.
"""

from __future__ import annotations

import inspect
import types
import typing
from typing import Any, Callable, Literal, Union, get_args, get_origin

import pydantic
from fastapi import APIRouter, Query

from engine.control import CONTROLS, Control, arg_info
from rollout.server.middleware import StrictJSONRoute
from rollout.server.openapi import error_responses
from rollout.server.protocol import RequestModel, ResponseModel

# The engine answers 503 when it is dead (and, for some calls, asleep or paused).
_ENGINE_ERRORS = (503,)
_ROUTERS = {
    "rl": dict(tags=["rl"]),
    "fault_tolerance": dict(tags=["fault_tolerance"]),
    "fault_injection": dict(tags=["fault_tolerance"]),
}

# A check the server adds before a control runs (e.g. the backend --weight-transfer-backend allows),
# given the control's arguments by name; it raises ValueError (400) to refuse.
Check = Callable[[dict[str, Any]], None]


def control_routers(engine, *, checks: dict[str, Check] | None = None) -> dict[str, APIRouter]:
    """{router name: APIRouter} of every declared control's route over `engine` (an AsyncLLM or RolloutGroup)."""
    routers = {name: APIRouter(route_class=StrictJSONRoute, **options) for name, options in _ROUTERS.items()}
    for declared in CONTROLS.values():
        if declared.route is not None:
            _add_route(routers[declared.route.router], engine, declared, (checks or {}).get(declared.name))
    return routers


def _add_route(router: APIRouter, engine, declared: Control, check: Check | None) -> None:
    route = declared.route
    query = [p for p in declared.params if route.verb == "GET" or p.name in route.query]
    body = [p for p in declared.params if p not in query]
    body_model = _body_model(declared, body) if body else None
    body_optional = all(p.default is not inspect.Parameter.empty for p in body)
    answer_model = _answer_model(declared)

    async def endpoint(**given: Any) -> Any:
        arguments = {p.name: given[p.name] for p in query}
        if body_model is not None:
            sent = given["body"]
            arguments.update({p.name: getattr(sent, p.name) if sent is not None else p.default for p in body})
        if check is not None:
            check(arguments)
        args = tuple(arguments[name] for name in declared.arg_names())
        return await _answer(engine, declared, args, arguments)

    parameters = [
        inspect.Parameter(p.name, inspect.Parameter.KEYWORD_ONLY, annotation=_http_type(p.annotation),
                          default=_query_default(p))
        for p in query
    ]
    if body_model is not None:
        parameters.append(inspect.Parameter(
            "body", inspect.Parameter.KEYWORD_ONLY, annotation=body_model | None if body_optional else body_model,
            default=None if body_optional else inspect.Parameter.empty))
    endpoint.__signature__ = inspect.Signature(parameters, return_annotation=answer_model)
    endpoint.__name__ = declared.name
    endpoint.__doc__ = declared.doc
    router.add_api_route(
        route.path or f"/{declared.name}", endpoint, methods=[route.verb], status_code=route.status_code,
        response_model=answer_model, response_model_exclude_unset=True,  # an absent NotRequired key stays absent
        responses=error_responses(*_ENGINE_ERRORS, *route.errors),
        summary=declared.name.replace("_", " ").capitalize(),
    )


async def _answer(engine, declared: Control, args: tuple, arguments: dict[str, Any]) -> dict[str, Any]:
    """The JSON answer: the result under the route's field (or a dict result as is), then each `then`
    control's answer, the echoed arguments and the constant keys."""
    route = declared.route
    answer = dict(route.constant)
    for name in route.echo:
        answer[name] = arguments[name]
    result = await getattr(engine, declared.name)(*args)
    _join(answer, route.field, result)
    for name in route.then:
        _join(answer, CONTROLS[name].route.field, await getattr(engine, name)())
    return answer


def _join(answer: dict[str, Any], field: str | None, result: Any) -> None:
    if field is not None:
        answer[field] = result
    elif isinstance(result, dict):
        answer.update(result)


# ---- types: the declaration's types as FastAPI/pydantic take them --------------------------------


def _http_type(annotation: Any) -> Any:
    """The declared type over HTTP. A Literal is sent as its values' type, so that the engine's own
    check names the choices (as in Python) instead of a generic validation message."""
    base, _ = arg_info(annotation)
    if get_origin(base) is Literal:
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


def _query_default(param: inspect.Parameter) -> Any:
    default = ... if param.default is inspect.Parameter.empty else param.default
    return Query(default, **_constraints(param.annotation))


def _body_model(declared: Control, params: list[inspect.Parameter]) -> type[RequestModel]:
    fields = {
        p.name: (_http_type(p.annotation), pydantic.Field(
            ... if p.default is inspect.Parameter.empty else p.default, **_constraints(p.annotation)))
        for p in params
    }
    return pydantic.create_model(_camel(declared.name) + "Request", __base__=RequestModel, **fields)


def _answer_model(declared: Control) -> Any:
    """A typed model of the answer's keys, or dict[str, Any] when a dict result is part of it."""
    route = declared.route
    parts = [(route.field, declared)] + [(CONTROLS[name].route.field, CONTROLS[name]) for name in route.then]
    fields: dict[str, Any] = {key: (type(value), ...) for key, value in route.constant}
    fields.update({name: (_http_type(_param(declared, name).annotation), ...) for name in route.echo})
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
