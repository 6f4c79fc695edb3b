"""The RL control plane, declared once: its vocabulary (pause modes, sleep levels, wake-up tags) and every control.

Plain Python (no torch), shared by the scheduler, the EngineCore and every layer above it; the
Literal types are the one source of truth for what is valid (validation reads them with get_args),
and EngineControls is the one source of truth for what the controls are.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
from typing import (
    Annotated,
    Any,
    Callable,
    Literal,
    NotRequired,
    Protocol,
    TypedDict,
    get_args,
    get_origin,
    get_type_hints,
)

PauseMode = Literal["abort", "wait", "keep"]
"""abort: end in-flight requests (finish reason abort) and refuse new ones; wait: refuse new
requests, let in-flight ones finish; keep: freeze in-flight requests with their KV cache and queue
new ones, until resume()."""

WakeUpTag = Literal["weights", "kv_cache", "scheduling"]
"""The parts that sleep() puts to sleep and wake_up(tags) brings back."""

SleepLevel = Literal[0, 1, 2]
"""0: scheduling stops; 1: also weights offloaded to host memory and KV cache freed;
2: also weights discarded (re-loaded from the checkpoint on wake-up)."""

MEMORY_TAGS = frozenset({"weights", "kv_cache"})


class PauseState(enum.IntEnum):
    """What the scheduler may do; also the value of the `rollout:engine_paused` gauge."""

    UNPAUSED = 0
    PAUSED_NEW = 1  # new requests are refused; everything already admitted is scheduled as usual
    PAUSED_ALL = 2  # nothing is scheduled; new requests queue and run after the pause ends


def check_pause_mode(mode: object) -> PauseMode:
    choices = get_args(PauseMode)
    if mode not in choices:
        raise ValueError(f"mode must be one of {choices}, got {mode!r}")
    return mode  # type: ignore[return-value]


def check_sleep_level(level: object) -> int:
    choices = get_args(SleepLevel)
    if isinstance(level, bool) or level not in choices:
        raise ValueError(f"level must be one of {choices}, got {level!r}")
    return int(level)  # type: ignore[arg-type]


def check_wake_up_tags(tags: object) -> set[str]:
    """None means every tag; a single string is one tag."""
    choices = get_args(WakeUpTag)
    if tags is None:
        return set(choices)
    if isinstance(tags, str):
        tags = [tags]
    if not isinstance(tags, (list, tuple, set, frozenset)):
        raise ValueError(f"tags must be a list of {choices} or None, got {tags!r}")  # noqa: TRY004 (bad input is ValueError here)
    unknown = [t for t in tags if t not in choices]
    if unknown:
        raise ValueError(f"tags: unknown wake-up tag(s) {unknown}; expected some of {choices}")
    return set(tags)


def tags_put_to_sleep(level: int) -> set[str]:
    return {"scheduling"} if level == 0 else {"scheduling", *MEMORY_TAGS}


# ---- the control surface, declared once ---------------------------------------------------------
# Every RL control is one method of EngineControls below: its arguments (with their docs and
# ranges), what it returns and raises, and through `@control(...)` how a data-parallel group
# combines its engines' answers, who implements it, and its HTTP route. AsyncLLM, RolloutGroup,
# RolloutWorker, the HTTP routes, the weight-sync clients and the trainers' engine handles are
# built from CONTROLS (`forward_controls`, rollout/server/rl_routes.py); tests/control/
# test_control_contract.py checks every layer against it.


class Combine(enum.Enum):
    """How a data-parallel group turns its engines' answers into one (every engine always runs the call)."""

    ALL = "all"  # a bool answer is True only if every engine's is; a None answer stays None
    ANY = "any"  # True if any engine's answer is
    AGREE = "agree"  # every engine must give the same answer, else WeightVersionMismatchError
    FIRST = "first"  # engine 0's answer
    SUM = "sum"  # the sum of the answers
    OWN = "own"  # the group has its own rule: a RolloutGroup method of the same name, documented there


class Where(enum.Enum):
    """Who implements a control; every layer above forwards it."""

    ENGINE = "engine"  # EngineCore (in its process): AsyncLLM forwards it as a utility call
    FRONTEND = "frontend"  # AsyncLLM itself (it owns the state, e.g. the request streams)
    GROUP = "group"  # only a lockstep RolloutGroup; a single AsyncLLM refuses it with ValueError
    WORKER = "worker"  # each Worker (one per tensor-parallel rank): EngineCore runs it on every rank with one
    # rpc and combines the ranks' answers by the control's rule, so nothing but the Worker method is written


@dataclasses.dataclass(frozen=True)
class Arg:
    """An argument's doc and, for numbers, its range; read by the HTTP routes (OpenAPI and checks)."""

    doc: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None


@dataclasses.dataclass(frozen=True)
class Route:
    """A control's HTTP route: `verb path`, the arguments as query parameters or a JSON body, the answer."""

    verb: Literal["GET", "POST"] = "POST"
    path: str | None = None  # default "/<name>"
    query: tuple[str, ...] = ()  # arguments sent as query parameters; the others form the JSON body (GET: all)
    field: str | None = None  # the answer's key for the result; None: a dict result is the answer, None is {}
    then: tuple[str, ...] = ()  # controls called afterwards whose answers join this one's (pause -> is_paused)
    echo: tuple[str, ...] = ()  # arguments repeated in the answer
    constant: tuple[tuple[str, Any], ...] = ()  # fixed keys of the answer
    status_code: int = 200
    errors: tuple[int, ...] = ()  # statuses beyond 400/401/503 the route may answer (documented in OpenAPI)
    router: Literal["rl", "fault_tolerance", "fault_injection"] = "rl"  # which flag mounts it


@dataclasses.dataclass(frozen=True)
class Control:
    """One declared control: its name, signature (with `self`), doc and rules."""

    name: str
    signature: inspect.Signature
    doc: str
    combine: Combine
    where: Where
    route: Route | None
    weight_sync: bool  # one of a trainer's weight-sync calls (weight_transfer/clients.py)

    @property
    def params(self) -> list[inspect.Parameter]:
        """The arguments, without `self`."""
        return list(self.signature.parameters.values())[1:]

    def bind(self, args: tuple, kwargs: dict) -> tuple:
        """The call's arguments in declared order with the defaults filled in; TypeError for a wrong call."""
        bound = self.signature.bind(None, *args, **kwargs)
        bound.apply_defaults()
        return tuple(bound.arguments.values())[1:]

    def arg_names(self) -> list[str]:
        return [p.name for p in self.params]


def control(combine: Combine, *, where: Where = Where.ENGINE, route: Route | None = Route(),
            weight_sync: bool = False) -> Callable[[Callable], Callable]:
    """Marks a method of EngineControls as a control with these rules."""

    def mark(fn: Callable) -> Callable:
        fn.__control_rules__ = (combine, where, route, weight_sync)
        return fn

    return mark


class FaultToleranceStatus(TypedDict):
    """What fault_tolerance_status answers."""

    status: str  # "healthy", "unhealthy" (a step failed; waiting for "retry") or "dead"
    enabled: bool  # whether the engine runs with fault tolerance (--enable-fault-tolerance)
    engines: NotRequired[list[dict[str, Any]]]  # a group: every engine's status, in engine order


_GROUP_ONLY = ("needs a lockstep data-parallel group: launch with --data-parallel-size > 1 and "
               "--enable-expert-parallel (RolloutGroup with enable_expert_parallel)")


class EngineControls(Protocol):
    """The RL control surface of an engine, a data-parallel group of them, or anything that drives one.

    Written here in its asyncio form (AsyncLLM, RolloutGroup); the blocking forms (EngineCore,
    RolloutWorker, the weight-sync clients and engine handles) take the same arguments. Bad input
    is a ValueError naming the argument (HTTP 400) and changes nothing; a paused, asleep or dead
    engine raises EngineNotReadyError / EngineDeadError (HTTP 503).
    """

    # ---- pause and resume

    @control(Combine.OWN, route=Route(query=("mode",), then=("is_paused",)), weight_sync=True)
    async def pause(self, mode: Annotated[PauseMode, Arg("abort, wait or keep (see PauseMode)")] = "abort") -> None:
        """Stops generation. "abort" ends in-flight requests (finish reason "abort"), "wait" returns
        once they finish, "keep" freezes them until resume(). In abort and wait mode new requests are
        refused (EngineNotReadyError) until resume(); in keep mode they queue. A group pauses all of
        its engines or, if one fails, none."""

    @control(Combine.ALL, route=Route(then=("is_paused",)), weight_sync=True)
    async def resume(self) -> None:
        """Ends a pause: frozen requests continue, queued ones start."""

    @control(Combine.ANY, route=Route("GET", field="is_paused"))
    async def is_paused(self) -> bool:
        """True while paused (a group: while any engine is)."""

    # ---- sleep and wake up

    @control(Combine.OWN, route=Route(query=("level",), then=("is_sleeping",)))
    async def sleep(self, level: Annotated[SleepLevel, Arg("0, 1 or 2 (see SleepLevel)", ge=0, le=2)] = 1) -> None:
        """Frees what `level` says (SleepLevel); level >= 1 aborts in-flight requests, and new ones are
        refused until wake_up(). Sleeping at another level while asleep is a ValueError. A lockstep
        group pauses ("keep") first, so that no engine sleeps mid-wave."""

    @control(Combine.OWN, route=Route(query=("tags",), then=("is_sleeping",)))
    async def wake_up(self, tags: Annotated[list[str] | None, Arg(
            "what to restore: some of weights, kv_cache, scheduling (WakeUpTag); all when left out")] = None) -> None:
        """Restores what sleep() freed (only `tags` when given). After sleep(2) the weights are the
        checkpoint's again, and so is the weight version."""

    @control(Combine.ANY, route=Route("GET", field="is_sleeping"))
    async def is_sleeping(self) -> bool:
        """True while anything is asleep (a group: on any engine)."""

    # ---- requests and caches

    @control(Combine.OWN, where=Where.FRONTEND, route=Route(field="aborted"))
    async def abort_requests(self, request_ids: Annotated[list[str], Arg(
            "request ids to abort: a response's `id` (the i-th prompt of a batched completion is `id-i`)")]) -> list[str]:
        """Aborts requests by id; their streams end with finish reason "abort". Returns the ids that
        were running (unknown or finished ones are left out), in the given order."""

    @control(Combine.OWN, route=Route(field="reset"))
    async def reset_prefix_cache(self) -> bool:
        """Drops every cached prefix block; False if blocks in use kept it from resetting."""

    # ---- weight updates (the lifecycle: init, start, update..., finish or abort, shutdown)

    @control(Combine.OWN, route=Route(errors=(504,)), weight_sync=True)
    async def init_weight_transfer_engine(self, init_info: Annotated[dict[str, Any], Arg(
            'backend settings for the engine-side receiver, e.g. {"backend": "local"}; with "model": "draft" '
            "the receiver of speculative decoding's draft model (default target)")]) -> None:
        """Sets up a receiver for the backend `init_info` names (weight_transfer/). The rendezvous with the
        trainer runs off the engine's loop, bounded by init_info's timeout_s (PeerTimeoutError, HTTP 504,
        naming the peer); its address must be in weight_transfer_allowed_hosts. A group gives engine i's
        workers consecutive ranks from init_info's rank_offset."""

    @control(Combine.ALL, route=Route(errors=(502,)), weight_sync=True)
    async def start_weight_update(self) -> None:
        """Begins an update: from now on no step runs on half-updated weights, until finish or abort."""

    @control(Combine.ALL, route=Route(errors=(502,)), weight_sync=True)
    async def update_weights(self, update_info: Annotated[dict[str, Any], Arg(
            'one update for the receiver; for the local backend {"weights": [{"name", "dtype", "shape", '
            '"data_b64"}]}; with "model": "draft" it lands in the draft model (default target)')]) -> None:
        """Receives and lands one batch of tensors, each checked (name, dtype, shape, finite) before any
        weight changes. A failed transfer (WeightTransferError, HTTP 502) ends the update and restores
        the weights of before it. A group runs it on every engine at once (collective transports)."""

    @control(Combine.OWN, route=Route(then=("get_weight_version",), errors=(502,)), weight_sync=True)
    async def finish_weight_update(self, weight_version: Annotated[str | None, Arg(
            "the version the new weights serve under; None keeps the engine's own numbering")] = None) -> None:
        """Ends the update: the prefix cache is reset and the new weights serve under `weight_version`."""

    @control(Combine.ANY, route=Route(field="aborted", then=("get_weight_version",)), weight_sync=True)
    async def abort_weight_update(self) -> bool:
        """Ends an update in progress and restores the weights of before it; False if none was in progress."""

    @control(Combine.ALL, weight_sync=True)
    async def shutdown_weight_transfer_engine(self) -> None:
        """Closes the receiver (its connections to the trainer)."""

    @control(Combine.ALL, route=Route(then=("get_weight_version",)))
    async def update_weight_version(self, new_version: Annotated[str, Arg(
            "the version label outputs are tagged with from now on")]) -> None:
        """Relabels the serving weights."""

    @control(Combine.AGREE, route=Route("GET", field="weight_version"), weight_sync=True)
    async def get_weight_version(self) -> str | None:
        """The version the serving weights have; a group's engines must agree (else WeightVersionMismatchError)."""

    @control(Combine.OWN, route=Route("GET"), weight_sync=True)
    async def weight_info(self, model: Annotated[str, Arg(
            'which model: "target" (the served model) or "draft" (speculative decoding\'s draft model)')] = "target",
            ) -> dict[str, Any]:
        """{"weight_version", "weights": {hf_name: {"dtype", "shape"}}, ...} of `model`, with each
        tensor-parallel rank's slices under "ranks"; a group adds every engine's under "engines"."""

    @control(Combine.OWN, weight_sync=True)
    async def weight_checker(
        self,
        baseline: Annotated[dict[str, Any] | None, Arg(
            "checksums computed trainer-side (weight_transfer.hf_state_checksums) to compare against; "
            "None just reports the engine's")] = None,
        model: Annotated[str, Arg('which model: "target" or "draft"')] = "target",
    ) -> dict[str, Any]:
        """The engine's per-tensor checksums and, with a baseline, whether they match ("match",
        "mismatches", "missing", "unexpected"); a group adds "consistent" and every engine's report."""

    @control(Combine.SUM, route=Route("GET", field="world_size"), weight_sync=True)
    async def get_world_size(self) -> int:
        """Engine workers (one per tensor-parallel rank; a group: of all engines): the receivers a
        weight transport must reach."""

    # ---- elastic expert parallelism (rollout/elastic_ep.py; routes in rollout/server/elastic_routes.py)

    @control(Combine.OWN, where=Where.GROUP, route=None)
    async def prepare_elastic_ep(
        self,
        new_data_parallel_size: Annotated[int, Arg("the group's engine count after commit", ge=1, le=1024)],
        drain_timeout_s: Annotated[float | None, Arg(
            "scale down: how long the leaving engines' requests may take (None: the group's default)", gt=0)] = None,
    ) -> dict[str, Any]:
        """Reconfigures the group for the new engine count without routing to added engines yet."""

    @control(Combine.OWN, where=Where.GROUP, route=None)
    async def commit_elastic_ep(self, ready_timeout_s: Annotated[float | None, Arg(
            "how long to wait for every engine of the new size (None: the group's default)", gt=0)] = None,
            ) -> dict[str, Any]:
        """Finalizes the prepared change: every engine of the new size serves, the group resumes."""

    # ---- fault tolerance (FaultToleranceConfig)

    @control(Combine.OWN, where=Where.FRONTEND,
             route=Route("GET", path="/fault_tolerance/status", router="fault_tolerance"))
    async def fault_tolerance_status(self) -> FaultToleranceStatus:
        """The engine's status and whether fault tolerance is on; a group: the worst engine's status,
        with every engine's under "engines"."""

    @control(Combine.ALL, where=Where.FRONTEND, route=Route(
        path="/fault_tolerance/apply", echo=("instruction",), then=("fault_tolerance_status",), status_code=202,
        router="fault_tolerance"))
    async def apply_fault_tolerance_instruction(self, instruction: Annotated[str, Arg(
            'what the engine should do now: "retry" brings an unhealthy engine back')]) -> None:
        """Applies the instruction; returns once an unhealthy engine serves again. Unknown ones are a ValueError."""

    @control(Combine.ALL, route=Route(path="/fault_tolerance/inject", query=("kind",), constant=(("injected", True),),
                                      status_code=202, router="fault_injection"))
    async def inject_fault(self, kind: Annotated[str, Arg('what fails: "step", the next engine step')] = "step") -> None:
        """Tests only: the engine's next step raises (refused unless enable_fault_injection is set)."""


def _collect(protocol: type) -> dict[str, Control]:
    hints_of = functools.partial(get_type_hints, include_extras=True)
    controls = {}
    for name, fn in vars(protocol).items():
        rules = getattr(fn, "__control_rules__", None)
        if rules is None:
            continue
        hints = hints_of(fn)
        signature = inspect.signature(fn)
        params = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in signature.parameters.values()]
        signature = signature.replace(parameters=params, return_annotation=hints.get("return"))
        controls[name] = Control(name, signature, inspect.getdoc(fn) or "", *rules)
    return controls


CONTROLS: dict[str, Control] = _collect(EngineControls)
"""Every control, in declaration order."""


def arg_info(annotation: Any) -> tuple[Any, Arg | None]:
    """(the type, its Arg) of a declared argument's annotation."""
    if get_origin(annotation) is Annotated:
        base, *extras = get_args(annotation)
        return base, next((e for e in extras if isinstance(e, Arg)), None)
    return annotation, None


def forward_controls(*, asynchronous: bool, include: Callable[[Control], bool] = lambda c: True):
    """Class decorator: every declared control (that `include` accepts) the class does not define
    itself becomes a method with the declared signature and doc that calls
    `self._forward_control(control, args)` (args bound in declared order, defaults filled in).

    A control the class must implement itself - Combine.OWN on a group, Where.FRONTEND on the
    frontend - is the class's to define; the decorator refuses a class that lacks it (see `own`)."""

    def decorate(cls: type) -> type:
        own = getattr(cls, "_OWN_CONTROLS", lambda c: False)
        for name, declared in CONTROLS.items():
            if not include(declared) or name in vars(cls):
                continue
            if own(declared):
                raise TypeError(f"{cls.__name__} must implement the control {name!r} itself ({declared.combine}, "
                                f"{declared.where})")
            setattr(cls, name, _forwarder(declared, asynchronous))
        return cls

    return decorate


def _forwarder(declared: Control, asynchronous: bool) -> Callable:
    if asynchronous:
        async def method(self, *args, **kwargs):
            return await self._forward_control(declared, declared.bind(args, kwargs))
    else:
        def method(self, *args, **kwargs):
            return self._forward_control(declared, declared.bind(args, kwargs))
    method.__name__ = method.__qualname__ = declared.name
    method.__doc__ = declared.doc
    method.__signature__ = declared.signature
    method.__control__ = declared
    return method


def group_only_error(name: str) -> ValueError:
    return ValueError(f"{name}: {_GROUP_ONLY}")


def combine_answers(declared: Control, answers: list, disagree: Callable[[list], Exception]) -> Any:
    """A group's one answer from its engines' `answers` (engine order) under the control's rule;
    `disagree(answers)` is raised when AGREE answers differ."""
    rule = declared.combine
    if rule is Combine.ALL:
        return all(answers) if declared.signature.return_annotation is bool else None
    if rule is Combine.ANY:
        return any(answers)
    if rule is Combine.AGREE:
        if len(set(answers)) > 1:
            raise disagree(answers)
        return answers[0]
    if rule is Combine.FIRST:
        return answers[0]
    if rule is Combine.SUM:
        return sum(answers)
    raise TypeError(f"{declared.name}: its combine rule is the group's own ({rule}); call the group's method")


# ---- the HTTP form of a call, for clients (weight_transfer/clients.py, trainers/engines.py) -------


def http_request(declared: Control, args: tuple) -> tuple[str, str, dict[str, Any], dict[str, Any] | None]:
    """(verb, path, query parameters, JSON body or None) of a call of `declared` with `args` (declared order)."""
    route = declared.route
    if route is None:
        raise ValueError(f"{declared.name}: this control has no HTTP route")
    arguments = dict(zip(declared.arg_names(), args))
    in_query = [name for name in arguments if route.verb == "GET" or name in route.query]
    query = {name: arguments[name] for name in in_query if arguments[name] is not None}
    body = {name: value for name, value in arguments.items() if name not in in_query}
    return route.verb, route.path or f"/{declared.name}", query, body or None


def http_result(declared: Control, answer: dict[str, Any] | None) -> Any:
    """The control's result from its route's JSON answer (the inverse of rollout/server/rl_routes.py)."""
    field = declared.route.field
    if field is not None:
        return (answer or {})[field]
    return None if declared.signature.return_annotation is type(None) else answer
