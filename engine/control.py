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
    Protocol,
    TypedDict,
    get_args,
    get_origin,
    get_type_hints,
)

from engine.lora.request import LoRARequest

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

WeightCheckerAction = Literal["checksum", "reset", "compare"]
"""vLLM's /weight_checker actions (see EngineControls.weight_checker)."""

RPC_METHODS = frozenset(
    {"compute_weight_checksums", "reset_weights", "weights_consistent", "num_parameters", "cpu_threads"}
)
"""The worker methods collective_rpc runs: vLLM's checker's, and read-only reports."""


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
    CONCAT = "concat"  # list answers joined in order (ranks: each rank's answer is one item)
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
    http: Any = None  # the type over HTTP when the Python type is wider (a vLLM request object or its dict)


@dataclasses.dataclass(frozen=True)
class Route:
    """A control's HTTP route: `verb path`, the arguments as query parameters or a JSON body, the answer.

    The answer is built in this order: the `constant` keys, the `echo`ed arguments, the result (under
    `field`, or a dict result's keys), then each `then` control's answer; `answer`, when given, builds
    it instead from (result, the arguments by wire name)."""

    verb: Literal["GET", "POST"] = "POST"
    path: str | None = None  # default "/<name>"
    query: tuple[str, ...] = ()  # arguments sent as query parameters; the others form the JSON body (GET: all)
    field: str | None = None  # the answer's key for the result; None: a dict result is the answer, None is {}
    then: tuple[str, ...] = ()  # controls called afterwards whose answers join this one's
    echo: tuple[str, ...] = ()  # arguments repeated in the answer (under their wire names)
    constant: tuple[tuple[str, Any], ...] = ()  # fixed keys of the answer, e.g. vLLM's {"status": "paused"}
    wire: tuple[tuple[str, str], ...] = ()  # (argument, its name over HTTP) where vLLM's name differs from Python's
    answer: Callable[[Any, dict[str, Any]], dict[str, Any]] | None = None
    text: Callable[[Any, dict[str, Any]], str] | None = None  # the answer is this plain-text body instead of JSON,
    # built from (result, the arguments by wire name): vLLM's LoRA routes answer a sentence
    read: Callable[[dict[str, Any]], Any] | None = None  # a client's result from an `answer`-built answer
    background: bool = False  # validate, answer at once (vLLM's 202 {"message", "request_id"}), run the call after
    metric: tuple[Literal["weight", "sleep_mode"], str] | None = None  # vLLM's operation family and label the
    # route's call is timed under (engine/metrics/rl.py), failed calls included, as vLLM's routes do
    status_code: int = 200
    errors: tuple[int, ...] = ()  # statuses beyond 400/401/503 the route may answer (documented in OpenAPI)
    router: Literal["rl", "fault_tolerance", "fault_injection", "lora"] = "rl"  # which flag mounts it

    def wire_name(self, argument: str) -> str:
        return dict(self.wire).get(argument, argument)


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
    """What fault_tolerance_status answers: vLLM's schema, plus our "status" and "enabled"."""

    schema_version: int  # 1
    total_engines: int
    engines: list[dict[str, Any]]  # {"id": engine index, "status", "fault_info"?, "last_ft_request_id"?, "ft_error"?}
    status: str  # ours: the worst engine's: "healthy", "unhealthy" (a step failed; waiting for "retry") or "dead"
    enabled: bool  # ours: whether the engine runs with fault tolerance (--enable-fault-tolerance)


def fault_tolerance_report(engines: list[dict[str, Any]], enabled: bool) -> FaultToleranceStatus:
    """vLLM's /fault_tolerance/status body of these engines' entries, with our worst "status" and "enabled"."""
    worst = max((e["status"] for e in engines), key=lambda s: _HEALTH_ORDER.get(s, 0))
    return {"schema_version": 1, "total_engines": len(engines), "engines": engines, "status": worst, "enabled": enabled}


_HEALTH_ORDER = {"healthy": 0, "unhealthy": 1, "dead": 2}


def idle_elastic_ep_status() -> dict[str, Any]:
    """vLLM's /is_scaling_elastic_ep answer of an engine that is not scaling."""
    return {"is_scaling_elastic_ep": False, "phase": "idle", "epoch": None, "error": None,
            "requested_data_parallel_size": None}


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

    @control(Combine.OWN, route=Route(path="/pause", query=("mode", "clear_cache"), constant=(("status", "paused"),)),
             weight_sync=True)
    async def pause_generation(
        self,
        mode: Annotated[PauseMode, Arg("abort, wait or keep (see PauseMode)")] = "abort",
        clear_cache: Annotated[bool, Arg("reset the prefix cache once paused (abort and wait mode)")] = True,
    ) -> None:
        """Stops generation. "abort" ends in-flight requests (finish reason "abort"), "wait" returns
        once they finish, "keep" freezes them until resume_generation(). In abort and wait mode new
        requests are refused (EngineNotReadyError) until resume_generation(), and with clear_cache the
        prefix cache is reset once paused; in keep mode they queue (clear_cache is ignored: the frozen
        requests' blocks are in use). A group pauses all of its engines or, if one fails, none."""

    @control(Combine.ALL, route=Route(path="/resume", constant=(("status", "resumed"),)), weight_sync=True)
    async def resume_generation(self) -> None:
        """Ends a pause: frozen requests continue, queued ones start."""

    @control(Combine.ANY, route=Route("GET", field="is_paused"))
    async def is_paused(self) -> bool:
        """True while paused (a group: while any engine is)."""

    # ---- sleep and wake up

    @control(Combine.OWN, route=Route(query=("level", "mode"), constant=(("status", "sleeping"),), echo=("level",),
                                      metric=("sleep_mode", "sleep")))
    async def sleep(
        self,
        level: Annotated[SleepLevel, Arg("0, 1 or 2 (see SleepLevel)", ge=0, le=2)] = 1,
        mode: Annotated[PauseMode, Arg("what happens to in-flight requests first (see PauseMode)")] = "abort",
    ) -> None:
        """Frees what `level` says (SleepLevel). In-flight requests are first handled as pause_generation's
        `mode` says: "abort" ends them, "wait" lets them finish; "keep" freezes them at level 0 (at level
        >= 1 their KV cache is freed, so they are aborted). New requests are refused until wake_up().
        Sleeping at another level while asleep is a ValueError. A lockstep group pauses ("keep") first,
        so that no engine sleeps mid-wave."""

    @control(Combine.OWN, route=Route(query=("tags", "reload_weights"), answer=lambda awake, args: {
        "status": "awake" if awake else "sleeping", "tags": args["tags"] or None},
        read=lambda answer: answer["status"] == "awake", metric=("sleep_mode", "wake")))
    async def wake_up(
        self,
        tags: Annotated[list[str] | None, Arg(
            "what to restore: some of weights, kv_cache, scheduling (WakeUpTag); all when left out")] = None,
        reload_weights: Annotated[bool, Arg(
            "after sleep(2): read the checkpoint from disk into the weights (ours; vLLM never reloads)")] = False,
    ) -> bool:
        """Restores what sleep() freed (only `tags` when given); True once nothing sleeps. sleep(2) discarded
        the weights: woken, they are zeros and the engine refuses to generate (EngineNotReadyError, reason
        "weights_discarded", HTTP 503) until a finished weight update has written every one of them, which
        then serve under its version; with reload_weights the checkpoint's are read again instead, under
        the checkpoint's version."""

    @control(Combine.ALL, route=Route(constant=(("status", "kv_cache_released"),),
                                      metric=("sleep_mode", "release_kv_cache_memory")))
    async def release_kv_cache_memory(self) -> None:
        """Frees the KV cache's memory, the weights staying resident: needs a completed pause
        (pause_generation "abort" or "wait") and every part awake (ValueError otherwise).
        The engine then sleeps until wake_up(["kv_cache"]) brings the cache back, empty."""

    @control(Combine.ANY, route=Route("GET", field="is_sleeping"))
    async def is_sleeping(self) -> bool:
        """True while anything is asleep (a group: on any engine)."""

    # ---- requests and caches

    # vLLM's count: of the ids sent (running or not), or with none sent, of the requests that were in flight.
    @control(Combine.OWN, where=Where.FRONTEND, route=Route(answer=lambda ids, args: {
        "status": "aborted", "aborted": len(args["request_ids"] or ids)}, read=lambda answer: answer["aborted"]))
    async def abort_requests(self, request_ids: Annotated[list[str] | None, Arg(
            "request ids to abort: a response's `id` (the i-th prompt of a batched completion is `id-i`); "
            "left out or empty: every request in flight")] = None) -> list[str]:
        """Aborts requests by id (none given: all in flight); their streams end with finish reason "abort".
        Returns the ids that were running (unknown or finished ones are left out), in the given order."""

    @control(Combine.OWN, route=Route(query=("reset_running_requests", "reset_connector"), field="success",
                                      wire=(("reset_connector", "reset_external"),)))
    async def reset_prefix_cache(
        self,
        reset_running_requests: Annotated[bool, Arg(
            "also reset while requests run: they drop their KV and recompute it when next scheduled")] = False,
        reset_connector: Annotated[bool, Arg(
            "also reset an external (connector) prefix cache; this engine has none, so nothing more")] = False,
    ) -> bool:
        """Drops every cached prefix block; False if blocks in use kept it from resetting."""

    # ---- LoRA adapters (LoRAConfig.enable_lora): vLLM's LLM.add_lora, remove_lora, pin_lora, list_loras

    @control(Combine.ALL, route=None)
    async def add_lora(self, lora_request: Annotated[LoRARequest, Arg(
            "the adapter: LoRARequest(lora_name, lora_int_id, lora_path) or its dict", http=dict[str, Any])]) -> bool:
        """Reads and validates a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) into
        host memory, so requests naming its lora_int_id start without reading it; True (also when it was
        loaded already). ValueError naming the problem, and nothing changes: not a PEFT LoRA directory, an
        option beyond plain LoRA (DoRA, bias...), a rank above max_lora_rank, a target module the model lacks
        or LoRA does not support, a shape mismatch, the id loaded as another adapter, or LoRA off."""

    @control(Combine.ANY, route=None)
    async def remove_lora(self, lora_id: Annotated[int, Arg("the adapter's lora_int_id", ge=1)]) -> bool:
        """Forgets the adapter (host copy and device slot); False if the engine did not hold it. Requests
        running with it still finish with it (it is read again from its directory if they need it paged in)."""

    @control(Combine.ALL, route=None)
    async def pin_lora(self, lora_id: Annotated[int, Arg("the adapter's lora_int_id", ge=1)]) -> bool:
        """Keeps a loaded adapter in host memory until remove_lora, outside max_cpu_loras' count, and its
        device slot as long as another slot can be reused; True. ValueError if it is not loaded."""

    @control(Combine.FIRST, route=None)
    async def list_loras(self) -> list[int]:
        """The lora_int_ids of the adapters held, ascending (a group: engine 0's; add_lora loads on every engine)."""

    # vLLM's server routes over the same adapters, by name (engine/lora/names.py); mounted with
    # --allow-runtime-lora-updating (or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=1), answers as vLLM's.

    @control(Combine.OWN, where=Where.FRONTEND, route=Route(
        path="/v1/load_lora_adapter", router="lora", errors=(404,),
        text=lambda _, args: f"Success: LoRA adapter '{args['lora_name']}' added successfully."))
    async def load_lora_adapter(
        self,
        lora_name: Annotated[str, Arg("the name requests select the adapter by (their `model`)")],
        lora_path: Annotated[str, Arg(
            "its PEFT adapter directory (over HTTP: inside the server's --allowed-lora-paths)")],
        load_inplace: Annotated[bool, Arg("replace the adapter already loaded under lora_name")] = False,
        is_3d_lora_weight: Annotated[bool, Arg("vLLM's MoE adapter layout; only false (no MoE LoRA here)")] = False,
    ) -> None:
        """Reads and validates the adapter (add_lora, under the next free lora_int_id) and serves it under
        lora_name: /v1/models lists it, and a request whose `model` is lora_name runs with it. ValueError
        naming the problem, and nothing changes: as add_lora's, and (InvalidUserInputError) a name already
        loaded without load_inplace or the base model's name. A reload takes a new id: running requests
        finish with the old adapter."""

    @control(Combine.OWN, where=Where.FRONTEND, route=Route(
        path="/v1/unload_lora_adapter", router="lora", errors=(404,),
        text=lambda _, args: f"Success: LoRA adapter '{args['lora_name']}' removed successfully."))
    async def unload_lora_adapter(
        self,
        lora_name: Annotated[str, Arg("the adapter's name, as load_lora_adapter was given it")],
        lora_int_id: Annotated[int | None, Arg("accepted as vLLM's body has it; the name decides")] = None,
    ) -> None:
        """Stops serving the adapter by that name and forgets it (remove_lora); running requests finish with it.
        LoRAAdapterNotFoundError (HTTP 404) when no adapter has the name."""

    # ---- weight updates (the lifecycle: init, start, update..., finish or abort, shutdown)

    @control(Combine.OWN, route=Route(wire=(("request", "init_info"),),
                                      constant=(("message", "Weight transfer initialized"),), errors=(504,),
                                      metric=("weight", "init")),
             weight_sync=True)
    async def init_weight_transfer_engine(self, request: Annotated[Any, Arg(
            'vLLM\'s WeightTransferInitRequest (anything with .init_info), {"init_info": {...}}, or the init_info '
            'itself: backend settings for the engine-side receiver; with "model": "draft" the receiver of '
            "speculative decoding's draft model (default target)", http=dict[str, Any])]) -> None:
        """Sets up a receiver for the weight transfer backend (weight_transfer/). The rendezvous with the
        trainer runs off the engine's loop, bounded by init_info's timeout_s (PeerTimeoutError, HTTP 504,
        naming the peer); its address must be in weight_transfer_allowed_hosts. A group gives engine i's
        workers consecutive ranks from init_info's rank_offset."""

    @control(Combine.ALL, route=Route(constant=(("message", "Weight update started"),), errors=(502,), metric=("weight", "start")),
             weight_sync=True)
    async def start_weight_update(self) -> None:
        """Begins an update: from now on no step runs on half-updated weights, until finish or abort."""

    @control(Combine.ALL, route=Route(constant=(("message", "Draft weight update started"),), errors=(502,),
                                      metric=("weight", "start_draft")),
             weight_sync=True)
    async def start_draft_weight_update(self) -> None:
        """Begins an update of speculative decoding's draft model: update_weights calls whose update_info
        names no "model" land in the draft, until finish or abort. ValueError without a draft model."""

    @control(Combine.ALL, route=Route(wire=(("request", "update_info"),),
                                      constant=(("message", "Weights updated"),), errors=(502,), metric=("weight", "update")),
             weight_sync=True)
    async def update_weights(self, request: Annotated[Any, Arg(
            'vLLM\'s WeightTransferUpdateRequest (anything with .update_info), {"update_info": {...}}, or the '
            'update_info itself: one update for the receiver; for the local backend {"weights": [{"name", '
            '"dtype", "shape", "data_b64"}]}; with "model": "draft" it lands in the draft model; a list: one '
            "update_info per worker, in global rank order (vLLM's); with \"lora_name\" (ours) the tensors are that "
            "loaded adapter's, PEFT-named", http=dict[str, Any] | list[dict[str, Any]])]) -> None:
        """Receives and lands one batch of tensors, each checked (name, dtype, shape, finite) before any
        weight changes; an adapter's (update_info "lora_name") are checked against the adapter as loaded
        and serve from finish_weight_update on. A failed transfer (WeightTransferError, HTTP 502) ends the
        update and restores the weights of before it. A group runs it on every engine at once (collective
        transports)."""

    @control(Combine.OWN, route=Route(constant=(("message", "Weight update finished"),), errors=(502,), metric=("weight", "finish")),
             weight_sync=True)
    async def finish_weight_update(self, weight_version: Annotated[str | None, Arg(
            "the version the new weights serve under; None keeps the engine's own numbering")] = None) -> None:
        """Ends the update: the prefix cache is reset and the new weights serve under `weight_version`. An update
        of adapters only keeps the base model's cache and version: each synced adapter serves its new tensors
        under `weight_version` (its own) with a fresh prefix-cache key."""

    @control(Combine.OWN, route=Route(wire=(("request", "update_info"),), constant=(("message", "Weights updated"),),
                                      errors=(502,)),
             weight_sync=True)
    async def apply_weight_update(
        self,
        request: Annotated[Any, Arg(
            "one update_weights call's request (see update_weights): every tensor of the update",
            http=dict[str, Any] | list[dict[str, Any]])],
        weight_version: Annotated[str | None, Arg(
            "the version the new weights serve under (as finish_weight_update's)")] = None,
    ) -> None:
        """start_weight_update, update_weights(request) and finish_weight_update(weight_version) as one call (ours:
        a small update, such as a LoRA adapter's, in one round trip). Same guarantees: everything is checked
        before any weight changes, and a rejected call (ValueError, HTTP 400) or a failed transfer
        (WeightTransferError, HTTP 502) leaves the previous weights (and adapters, and versions) serving.
        Between two steps: requests are served before and after it, never on half-updated weights. Refused
        while an update is in progress (WeightUpdateStateError). A group starts the update on every engine,
        lands it on all, and finishes it on all only once every engine took it; else it aborts it on all."""

    @control(Combine.ANY, route=Route(field="aborted", then=("get_weight_version",)), weight_sync=True)
    async def abort_weight_update(self) -> bool:
        """Ends an update in progress and restores the weights of before it; False if none was in progress.
        (Ours: vLLM has no abort.)"""

    @control(Combine.ALL, route=Route(constant=(("message", "Weight transfer shut down"),), metric=("weight", "shutdown")),
             weight_sync=True)
    async def shutdown_weight_transfer_engine(self) -> None:
        """Closes the receiver (its connections to the trainer)."""

    @control(Combine.ALL, route=Route(constant=(("success", True),), echo=("new_version",)))
    async def update_weight_version(self, new_version: Annotated[str, Arg(
            "the version label outputs are tagged with from now on")]) -> None:
        """Relabels the serving weights."""

    @control(Combine.AGREE, route=Route("GET", field="weight_version"), weight_sync=True)
    async def get_weight_version(self, lora_name: Annotated[str | None, Arg(
            "an adapter's lora_name: its version instead (set by the finish_weight_update of a sync of it; "
            '"default" until one)')] = None) -> str | None:
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
            "without action: checksums computed trainer-side (weight_transfer.hf_state_checksums) to compare "
            "against; with action \"compare\": compute_weight_checksums()' keys and digests")] = None,
        model: Annotated[str, Arg('which model: "target" or "draft" (without action)')] = "target",
        action: Annotated[WeightCheckerAction | None, Arg(
            'vLLM\'s checker: "checksum" (compute_weight_checksums, merged), "reset" (zero every weight), '
            '"compare" (with baseline); left out: our HF-named report')] = None,
    ) -> dict[str, Any]:
        """With `action`, vLLM's weight checker: {"checksums": {key: sha256}}, {"status": "reset"}, or
        {"match", "mismatches"} (keys whose digests differ or that only one side has). Without it, our
        HF-named report: the engine's per-tensor checksums and, with a baseline, whether they match
        ("match", "mismatches", "missing", "unexpected"); a group adds "consistent" and every engine's."""

    @control(Combine.CONCAT, where=Where.WORKER, route=None)
    async def compute_weight_checksums(self) -> list[dict[str, str]]:
        """One {"dp<i>:pp0:pcp0:tp<r>:<parameter name>": sha256 hex of its raw bytes} per worker, in engine
        then rank order: vLLM's keys and digests (weight_transfer.checksums.engine_weight_digests)."""

    @control(Combine.OWN, route=Route("GET", query=("include_dp",), field="world_size"), weight_sync=True)
    async def get_world_size(self, include_dp: Annotated[bool, Arg(
            "count every data-parallel engine's workers (False: one engine's)")] = True) -> int:
        """Engine workers (one per tensor-parallel rank; with include_dp, of all engines): the receivers a
        weight transport must reach."""

    @control(Combine.CONCAT, route=Route(answer=lambda results, args: {"results": [
        r if r is None or isinstance(r, (dict, list)) else str(r) for r in results]},
        read=lambda answer: answer["results"]))
    async def collective_rpc(
        self,
        method: Annotated[str, Arg(f"the worker method to run on every rank, one of {sorted(RPC_METHODS)}")],
        timeout: Annotated[float | None, Arg("seconds each rank may take (None: no limit)", gt=0)] = None,
        args: Annotated[tuple, Arg("its positional arguments", http=list[Any])] = (),
        kwargs: Annotated[dict[str, Any] | None, Arg("its keyword arguments")] = None,
    ) -> list[Any]:
        """Every worker's answer to `method`, in engine then rank order. Only the methods in RPC_METHODS
        run (ValueError naming the method for any other): a name from the network never reaches getattr."""

    # ---- elastic expert parallelism (rollout/elastic_ep.py; routes in rollout/server/elastic_routes.py)

    @control(Combine.OWN, where=Where.GROUP, route=None)
    async def scale_elastic_ep(
        self,
        new_data_parallel_size: Annotated[int, Arg("the group's engine count afterwards", ge=1, le=1024)],
        drain_timeout: Annotated[int, Arg("scale down: seconds the leaving engines' requests may take", gt=0)] = 300,
    ) -> None:
        """vLLM's one-call scale: prepare_elastic_ep then commit_elastic_ep. TimeoutError when the drain
        (or the new engines) take too long."""

    @control(Combine.OWN, where=Where.FRONTEND, route=None)
    async def is_scaling_elastic_ep(self) -> dict[str, Any]:
        """{"is_scaling_elastic_ep", "phase": "idle" | "preparing" | "committing", "epoch", "error",
        "requested_data_parallel_size"} (vLLM's); an engine that is not a lockstep group is always idle."""

    @control(Combine.OWN, where=Where.GROUP, route=None)
    async def prepare_elastic_ep(
        self,
        new_data_parallel_size: Annotated[int, Arg("the group's engine count after commit", ge=1, le=1024)],
        drain_timeout_s: Annotated[float | None, Arg(
            "scale down: how long the leaving engines' requests may take (None: the group's default)", gt=0)] = None,
    ) -> dict[str, Any]:
        """Reconfigures the group for the new engine count without routing to added engines yet. (Ours.)"""

    @control(Combine.OWN, where=Where.GROUP, route=None)
    async def commit_elastic_ep(self, ready_timeout_s: Annotated[float | None, Arg(
            "how long to wait for every engine of the new size (None: the group's default)", gt=0)] = None,
            ) -> dict[str, Any]:
        """Finalizes the prepared change: every engine of the new size serves, the group resumes. (Ours.)"""

    # ---- fault tolerance (FaultToleranceConfig)

    @control(Combine.OWN, where=Where.FRONTEND,
             route=Route("GET", path="/fault_tolerance/status", router="fault_tolerance"))
    async def fault_tolerance_status(self) -> FaultToleranceStatus:
        """vLLM's status: {"schema_version": 1, "total_engines", "engines": [{"id", "status", ...}]}, plus
        ours: the worst engine's "status" and whether fault tolerance is "enabled"."""

    @control(Combine.ALL, where=Where.FRONTEND, route=Route(
        path="/fault_tolerance/apply", background=True, status_code=202, router="fault_tolerance",
        constant=(("message", "Request accepted; poll /fault_tolerance/status for updates."),)))
    async def apply_fault_tolerance_instruction(
        self,
        instruction: Annotated[str, Arg('what the engine should do now: "retry" brings an unhealthy engine back')],
        params: Annotated[dict[str, Any] | None, Arg("the instruction's parameters (retry takes none)")] = None,
    ) -> None:
        """Applies the instruction; returns once an unhealthy engine serves again. Unknown ones are a
        ValueError. Over HTTP it runs in the background (vLLM's): 202 at once with a "request_id", and
        /fault_tolerance/status tells the outcome."""

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


def vllm_weight_checker(action: object, baseline: object, checksums: Callable[[], list[dict[str, str]]],
                        reset: Callable[[], None]) -> dict[str, Any]:
    """vLLM's /weight_checker answer for `action` over per-worker checksums (compute_weight_checksums):
    {"checksums": merged}, {"status": "reset"}, or {"match", "mismatches": keys that differ or that one side lacks}.
    ValueError for an unknown action or a compare without a baseline; RuntimeError for a key two workers report."""
    if action not in get_args(WeightCheckerAction):
        raise ValueError(f"action: expected one of {get_args(WeightCheckerAction)}, got {action!r}")
    if action == "reset":
        reset()
        return {"status": "reset"}
    if action == "compare" and not isinstance(baseline, dict):
        raise ValueError("baseline: action='compare' requires a 'baseline' object")
    merged: dict[str, str] = {}
    for worker in checksums():
        if duplicates := merged.keys() & worker.keys():
            raise RuntimeError(f"Duplicate weight checksum keys: {sorted(duplicates)}")
        merged.update(worker)
    if action == "checksum":
        return {"checksums": merged}
    mismatches = sorted(k for k in merged.keys() | baseline.keys() if merged.get(k) != baseline.get(k))
    return {"match": not mismatches, "mismatches": mismatches}


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
    if rule is Combine.CONCAT:  # each engine's answer is already its list
        return [item for answer in answers for item in answer]
    raise TypeError(f"{declared.name}: its combine rule is the group's own ({rule}); call the group's method")


# ---- the HTTP form of a call, for clients (weight_transfer/clients.py, trainers/engines.py) -------


def http_request(declared: Control, args: tuple) -> tuple[str, str, dict[str, Any], dict[str, Any] | None]:
    """(verb, path, query parameters, JSON body or None) of a call of `declared` with `args` (declared order),
    under the route's wire names; a vLLM request object travels as its init_info / update_info."""
    route = declared.route
    if route is None:
        raise ValueError(f"{declared.name}: this control has no HTTP route")
    arguments = dict(zip(declared.arg_names(), args))
    for name, unwrap in _REQUEST_ARGS.get(declared.name, {}).items():
        arguments[name] = unwrap(arguments[name])
    in_query = [name for name in arguments if route.verb == "GET" or name in route.query]
    query = {route.wire_name(name): arguments[name] for name in in_query if arguments[name] is not None}
    body = {route.wire_name(name): value for name, value in arguments.items() if name not in in_query}
    return route.verb, route.path or f"/{declared.name}", query, body or None


def http_result(declared: Control, answer: dict[str, Any] | None) -> Any:
    """The control's result from its route's JSON answer (the inverse of rollout/server/rl_routes.py)."""
    route = declared.route
    if route.field is not None:
        return (answer or {})[route.field]
    if declared.signature.return_annotation is type(None):
        return None
    if route.read is not None:
        return route.read(answer or {})
    return answer


# ---- vLLM's request objects ------------------------------------------------------------------------


def _unwrap(key: str, per_rank: bool = False) -> Callable[[Any], Any]:
    def unwrap(request: Any) -> Any:
        """The `key` dict of vLLM's request object (anything with that attribute), of {key: ...}, or the dict
        itself; with per_rank also vLLM's list of such dicts, one per worker across the data-parallel engines."""
        if hasattr(request, key) and not isinstance(request, (dict, list)):
            request = getattr(request, key)
        elif isinstance(request, dict) and set(request) == {key}:
            request = request[key]
        if per_rank and isinstance(request, list):
            if not request or not all(isinstance(entry, dict) for entry in request):
                raise ValueError(f"{key}: a list must hold one dict per worker (global rank order)")
            return request
        if not isinstance(request, dict):
            raise ValueError(f"{key}: expected a dict (or a request with .{key}), got {type(request).__name__}")
        return request

    return unwrap


init_info_of = _unwrap("init_info")
"""init_weight_transfer_engine's `request` as its init_info dict (ValueError naming init_info otherwise)."""
update_info_of = _unwrap("update_info", per_rank=True)
"""update_weights' `request` as its update_info: a dict, or vLLM's list of one dict per worker (indexed by
data_parallel_rank * tensor_parallel_size + rank)."""

_REQUEST_ARGS = {"init_weight_transfer_engine": {"request": init_info_of},
                 "update_weights": {"request": update_info_of}, "apply_weight_update": {"request": update_info_of}}


def plain_arguments(declared: Control, args: tuple) -> tuple:
    """`args` with vLLM's request objects turned into their dicts: what crosses a process boundary."""
    unwrap = _REQUEST_ARGS.get(declared.name)
    if not unwrap:
        return args
    return tuple(unwrap[name](value) if name in unwrap else value
                 for name, value in zip(declared.arg_names(), args))
