"""The control-plane contract: every layer exposes exactly the controls declared in engine/control.py, with the declared signatures."""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from typing import Any

import pytest

from engine.async_llm import AsyncLLM
from engine.control import CONTROLS, Combine, Control, Route, Where, forward_controls
from engine.engine_core import EngineCore
from engine.llm import LLM
from engine.worker.worker import Worker
from rollout.group import RolloutGroup
from rollout.server.elastic_routes import elastic_router
from rollout.server.rl_routes import control_routers
from rollout.worker import RolloutWorker
from trainers.engines import HTTPRolloutEngine, RayRolloutEngine
from weight_transfer.clients import (
    HTTPWeightSyncClient,
    LocalWeightSyncClient,
    ModelWeightSyncClient,
    RayWeightSyncClient,
    WeightSyncClient,
)

# What each layer has besides its controls: its own API (generation, health, lifecycle...). A public
# method of a layer that is neither a control nor listed here is an undeclared control.
NOT_CONTROLS = {
    AsyncLLM: {"from_engine_args", "generate", "admit", "check_admission", "admission_refusal", "abort",
               "is_dead", "check_health", "prometheus_text", "get_metrics_snapshot", "shutdown",
               "get_dp_state", "reconfigure_elastic_ep"},  # the last two: a lockstep group's engine protocol
    RolloutGroup: {"set_engines", "from_engine_args", "lockstep", "num_engines", "generate", "abort", "dp_states",
                   "elastic_ep_state", "engine_world_sizes", "admit", "check_admission", "is_dead", "check_health",
                   "prometheus_text", "get_metrics_snapshot", "shutdown"},
    RolloutWorker: {"as_ray_actor", "generate", "agenerate", "astream", "session", "get_metrics_snapshot", "shutdown"},
    WeightSyncClient: {"num_engines", "engine_world_sizes", "for_model", "for_lora", "submit", "close"},
    HTTPRolloutEngine: {"generate", "agenerate", "weight_sync_client", "shutdown"},
    RayRolloutEngine: {"start", "generate", "agenerate", "weight_sync_client", "shutdown"},
}


@dataclasses.dataclass
class Layer:
    cls: type
    asynchronous: bool
    wants: typing.Callable[[Control], bool]  # which declared controls it must have
    check_returns: bool = True
    exact: bool = True  # no undeclared control besides NOT_CONTROLS


LAYERS = [
    # EngineCore implements what runs in the engine; it has many other methods (step, add_request...),
    # and its answers are the raw ones the frontend turns into the declared results (pause: the ids).
    Layer(EngineCore, False, lambda c: c.where in (Where.ENGINE, Where.WORKER), check_returns=False, exact=False),
    # What the workers implement, EngineCore forwards (forward_controls); the answer is a rank's.
    Layer(Worker, False, lambda c: c.where is Where.WORKER, check_returns=False, exact=False),
    # The offline LLM: what the engine implements (vLLM's LLM has sleep, wake_up, the weight lifecycle...).
    Layer(LLM, False, lambda c: c.where in (Where.ENGINE, Where.WORKER), exact=False),
    Layer(AsyncLLM, True, lambda c: True),
    Layer(RolloutGroup, True, lambda c: True),
    Layer(RolloutWorker, False, lambda c: True),
    Layer(WeightSyncClient, False, lambda c: c.weight_sync),
    Layer(HTTPRolloutEngine, False, lambda c: c.route is not None),
    Layer(RayRolloutEngine, False, lambda c: True),
]


def _base(annotation: Any) -> Any:
    if typing.get_origin(annotation) is typing.Annotated:
        return typing.get_args(annotation)[0]
    return annotation


def _normal(annotation: Any) -> Any:
    """A type in one spelling (Optional[X], X | None and Union[X, None] compare equal)."""
    annotation = _base(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return frozenset(_normal(a) for a in typing.get_args(annotation))
    return annotation


def _shape(fn: Any) -> tuple[list[tuple], Any]:
    """([(name, kind, default, type)], return type) of a method, string annotations resolved."""
    signature = inspect.signature(fn)
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception:  # a generated method: its __signature__ carries the resolved types
        hints = {}
    params = [
        (p.name, p.kind, p.default, _normal(hints.get(p.name, p.annotation)))
        for p in list(signature.parameters.values())[1:]
        # Ray's tracing hook: ray.remote(RolloutWorker) (as_ray_actor) sets a __signature__ with this keyword on
        # the class's own functions, so it is there in a process that made an actor of it before this test ran.
        if not (p.name == "_ray_trace_ctx" and p.kind is inspect.Parameter.KEYWORD_ONLY)
    ]
    return params, _normal(hints.get("return", signature.return_annotation))


def contract_problems(controls: dict[str, Control], layers: list[Layer] = LAYERS) -> list[str]:
    """Every way the layers differ from the declaration `controls`."""
    problems = []
    for layer in layers:
        name = layer.cls.__name__
        wanted = {n: c for n, c in controls.items() if layer.wants(c)}
        for control_name, declared in wanted.items():
            fn = getattr(layer.cls, control_name, None)
            if not callable(fn):
                problems.append(f"{name} lacks the control {control_name}")
                continue
            if inspect.iscoroutinefunction(fn) != layer.asynchronous:
                problems.append(f"{name}.{control_name} should be {'async' if layer.asynchronous else 'blocking'}")
            params, returns = _shape(fn)
            want_params, want_returns = _shape_of_declared(declared)
            if [p[:3] for p in params] != [p[:3] for p in want_params]:
                problems.append(f"{name}.{control_name}{inspect.signature(fn)} takes other arguments than "
                                f"declared {declared.signature}")
            elif params != want_params:
                problems.append(f"{name}.{control_name}: argument types {params} differ from declared {want_params}")
            if layer.check_returns and returns != want_returns:
                problems.append(f"{name}.{control_name} returns {returns}, declared {want_returns}")
        if layer.exact:
            extra = _public(layer.cls) - set(wanted) - NOT_CONTROLS[layer.cls]
            problems += [f"{name}.{extra_name} is not a declared control" for extra_name in sorted(extra)]
    return problems


def _shape_of_declared(declared: Control) -> tuple[list[tuple], Any]:
    params = [(p.name, p.kind, p.default, _normal(p.annotation)) for p in declared.params]
    return params, _normal(declared.signature.return_annotation)


def _public(cls: type) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_") and (callable(getattr(cls, n)) or isinstance(
        inspect.getattr_static(cls, n), property))}


def test_every_layer_exposes_exactly_the_declared_controls():
    assert contract_problems(CONTROLS) == []


def test_every_client_is_a_weight_sync_client_with_the_declared_methods():
    for cls in (HTTPWeightSyncClient, RayWeightSyncClient, LocalWeightSyncClient, ModelWeightSyncClient):
        assert issubclass(cls, WeightSyncClient)
        assert contract_problems(CONTROLS, [Layer(cls, False, lambda c: c.weight_sync, exact=False)]) == []


def _with(controls: dict[str, Control], name: str, **changes) -> dict[str, Control]:
    """The declaration with `name` added (a copy of get_weight_version) or changed."""
    base = controls.get(name) or dataclasses.replace(controls["get_weight_version"], name=name)
    return {**controls, name: dataclasses.replace(base, **changes)}


def test_a_control_added_only_to_the_declaration_fails_the_contract():
    problems = contract_problems(_with(CONTROLS, "get_draft_version"))
    assert "EngineCore lacks the control get_draft_version" in problems


def test_a_control_whose_layer_takes_other_arguments_fails_the_contract():
    declared = CONTROLS["sleep"]
    int_level = inspect.Parameter("level", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=2, annotation=int)
    changed = declared.signature.replace(parameters=[*list(declared.signature.parameters.values())[:1], int_level])
    problems = contract_problems(_with(CONTROLS, "sleep", signature=changed))
    assert any(p.startswith("EngineCore.sleep") and "takes other arguments" for p in problems)
    assert any(p.startswith("AsyncLLM.sleep") for p in problems)


def test_a_worker_control_added_only_to_the_declaration_fails_the_contract():
    problems = contract_problems(_with(CONTROLS, "get_device_name", where=Where.WORKER))
    assert "Worker lacks the control get_device_name" in problems


def test_engine_core_runs_a_worker_control_on_every_rank_and_combines_by_its_rule():
    """EngineCore's forwarding of Where.WORKER controls, over a stand-in executor of three ranks."""
    calls = []

    class Executor:
        def rpc(self, method, *args):
            calls.append((method, args))
            return answers

    declared = dataclasses.replace(CONTROLS["get_weight_version"], name="num_parameters", where=Where.WORKER,
                                   combine=Combine.SUM)
    core = object.__new__(EngineCore)
    core.executor = Executor()
    answers = [10, 10, 12]
    assert core._forward_control(declared, ()) == 32  # the sum
    assert calls == [(Worker.num_parameters, ())]
    answers = ["a", "b", "a"]
    with pytest.raises(RuntimeError, match="ranks disagree"):
        core._forward_control(dataclasses.replace(declared, combine=Combine.AGREE), ())
    answers = [{"tp0:w": "a"}, {"tp1:w": "b"}]  # CONCAT: one item per rank (compute_weight_checksums)
    assert core._forward_control(dataclasses.replace(declared, combine=Combine.CONCAT), ()) == answers


def test_a_mistyped_or_undeclared_method_fails_the_contract():
    class Mistyped(AsyncLLM):
        async def resume_generation(self, now: bool = True) -> None: ...

        async def is_paused(self) -> str: ...

        async def frobnicate(self) -> None: ...

    NOT_CONTROLS[Mistyped] = NOT_CONTROLS[AsyncLLM]
    try:
        problems = contract_problems(CONTROLS, [Layer(Mistyped, True, lambda c: True)])
    finally:
        del NOT_CONTROLS[Mistyped]
    assert any(p.startswith("Mistyped.resume_generation") and "other arguments" in p for p in problems)
    assert any(p.startswith("Mistyped.is_paused returns") for p in problems)
    assert "Mistyped.frobnicate is not a declared control" in problems


def test_a_class_that_must_implement_a_control_itself_is_refused():
    with pytest.raises(TypeError, match="must implement the control 'pause_generation' itself"):
        @forward_controls(asynchronous=True)
        class Group:
            _OWN_CONTROLS = staticmethod(lambda c: c.combine is Combine.OWN)

            async def _forward_control(self, declared, args): ...


# ---- the HTTP routes -------------------------------------------------------------------------------


def _routes() -> dict[tuple[str, str], Any]:
    engine = types.SimpleNamespace()
    return {
        (method, route.path): route
        for router in control_routers(engine).values()
        for route in router.routes
        for method in route.methods
    }


def _route_args(route) -> tuple[set[str], set[str]]:
    query = {p.alias or p.name for p in route.dependant.query_params}  # the name a client sends
    body = set()
    for p in route.dependant.body_params:
        annotation = p.field_info.annotation
        models = typing.get_args(annotation) or (annotation,)
        body |= {name for m in models if m is not type(None) for name in m.model_fields}
    return query, body


def test_the_routes_are_exactly_the_declared_ones_with_the_declared_arguments():
    routes = _routes()
    declared_routes = {}
    for declared in CONTROLS.values():
        if declared.route is None:
            continue
        key = (declared.route.verb, declared.route.path or f"/{declared.name}")
        declared_routes[key] = declared
        assert key in routes, f"{declared.name}: no route {key}"
        query, body = _route_args(routes[key])
        wire = declared.route.wire_name  # vLLM's name of an argument over HTTP (init_info for `request`...)
        in_query = {n for n in declared.arg_names() if declared.route.verb == "GET" or n in declared.route.query}
        assert query == {wire(n) for n in in_query}, declared.name
        assert body == {wire(n) for n in declared.arg_names() if n not in in_query}, declared.name
        assert routes[key].status_code == declared.route.status_code
    assert set(routes) == set(declared_routes)


def test_the_group_only_controls_have_their_routes_under_elastic_ep():
    routes = {route.path: route for route in elastic_router(types.SimpleNamespace()).routes}
    for path, name in (("/elastic_ep/prepare", "prepare_elastic_ep"), ("/elastic_ep/commit", "commit_elastic_ep")):
        assert CONTROLS[name].where is Where.GROUP and CONTROLS[name].route is None
        assert _route_args(routes[path]) == (set(), set(CONTROLS[name].arg_names()))


def test_vllms_elastic_ep_routes_run_the_declared_controls():
    """vLLM's /scale_elastic_ep and /is_scaling_elastic_ep (POST both, as vLLM's) over the declared controls."""
    from rollout.server.elastic_routes import vllm_elastic_router

    routes = {(method, route.path) for route in vllm_elastic_router(types.SimpleNamespace()).routes
              for method in route.methods}
    assert routes == {("POST", "/scale_elastic_ep"), ("POST", "/is_scaling_elastic_ep")}
    assert CONTROLS["scale_elastic_ep"].arg_names() == ["new_data_parallel_size", "drain_timeout"]
    assert CONTROLS["is_scaling_elastic_ep"].where is Where.FRONTEND  # every engine answers (idle)


def test_a_route_declared_later_is_served_without_touching_the_router(monkeypatch):
    """What adding a control takes on the HTTP side: nothing but the declaration."""
    import engine.control as control

    extra = dataclasses.replace(CONTROLS["get_weight_version"], name="get_draft_version",
                                route=Route("GET", field="draft_version"))
    monkeypatch.setitem(control.CONTROLS, "get_draft_version", extra)
    monkeypatch.setattr("rollout.server.rl_routes.CONTROLS", control.CONTROLS)
    assert ("GET", "/get_draft_version") in _routes()
