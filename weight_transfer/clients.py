"""Weight sync clients: how a trainer's sender (rank 0) drives an engine's weight lifecycle - over HTTP, Ray or in-process.

Every client has the same methods, named like the RL routes; a TrainerWeightTransferEngine
calls them, often from a background thread (`call_in_background`) while it moves the bytes
itself, because an engine's init/update call returns only once the data has arrived.

    HTTPWeightSyncClient("http://127.0.0.1:8000")     a `rollout launch --enable-rl-routes` server
    RayWeightSyncClient([actor, ...])                  RolloutWorker Ray actors; calls fan out
    LocalWeightSyncClient(worker)                      a RolloutWorker in this process

An engine that runs speculative decoding with a draft model holds two models; client.for_model("draft")
is the same client aimed at the draft (its init_info and update_info carry "model": "draft"), so any
backend syncs the draft: trainer_init(init_info, client=client.for_model("draft"), source=draft_module).
Likewise client.for_lora(name) aims update_weights at one loaded LoRA adapter (update_info "lora_name"),
which send_weights does by itself for a source that names its adapter (weight_transfer.lora.adapter_source).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import threading
import time
from abc import ABC, abstractmethod
from typing import Any, Callable

from engine.control import (
    CONTROLS,
    Combine,
    Control,
    combine_answers,
    forward_controls,
    http_request,
    http_result,
    plain_arguments,
)

logger = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """An engine refused or failed a weight-sync call; the message is the engine's."""


@forward_controls(asynchronous=False, include=lambda declared: declared.weight_sync)
class WeightSyncClient(ABC):
    """The engine-side calls a trainer needs for one weight sync; one engine or a fan-out to several.

    Its control methods are those of engine/control.py marked weight_sync (pause, resume, the weight
    lifecycle, versions, weight_info, weight_checker, get_world_size), with the declared signatures;
    each becomes `_call(name, *args)` with every argument in declared order.
    """

    @abstractmethod
    def _call(self, method: str, *args: Any) -> Any:
        """Runs `method` on every engine; returns the combined result (see each client)."""

    def _forward_control(self, declared: Control, args: tuple) -> Any:
        return self._call(declared.name, *plain_arguments(declared, args))

    def submit(self, method: str, *args: Any) -> concurrent.futures.Future:
        """Starts the control `method` (its arguments as its method takes them) and returns its Future at once:
        for a sender that moves the data while the engine's call runs (an init or update call returns only
        once the data has arrived). TypeError for arguments the control does not take."""
        declared = CONTROLS[method]
        return self._submit(method, *plain_arguments(declared, declared.bind(args, {})))

    def _submit(self, method: str, *args: Any) -> concurrent.futures.Future:
        """`_call(method, *args)` started: in a background thread (call_in_background), unless the client can
        start the call without one."""
        def call(*plain: Any) -> Any:
            return self._call(method, *plain)

        call.__name__ = method  # the thread is named after the call while it runs (call_in_background)
        return call_in_background(call, *args)

    def num_engines(self) -> int:
        return 1

    def engine_world_sizes(self) -> list[int]:
        """Workers per engine (tensor x pipeline parallel size), in engine order."""
        return [int(self._call("get_world_size", True))]

    def get_world_size(self, include_dp: bool = True) -> int:
        """Engine workers in all (include_dp), i.e. the receivers a transport must reach; else one engine's."""
        sizes = self.engine_world_sizes()
        return sum(sizes) if include_dp else sizes[0]

    def for_model(self, model: str) -> WeightSyncClient:
        """This client aimed at one of the engine's models ("target" or "draft"): see ModelWeightSyncClient."""
        return ModelWeightSyncClient(self, model)

    def for_lora(self, lora_name: str) -> WeightSyncClient:
        """This client aimed at one loaded LoRA adapter of the engine: see LoRAWeightSyncClient."""
        return LoRAWeightSyncClient(self, lora_name)

    def close(self) -> None:
        """Releases the client's own resources (connections); the engines keep running."""


# ---------------------------------------------------------------------------------------


class HTTPWeightSyncClient(WeightSyncClient):
    """Speaks the RL routes of one server. `timeout` (seconds) bounds every call; None waits forever."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float | None = 600.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        # One connection pool, safe to share between the trainer thread and background calls.
        self._http = HTTPPool(self.base_url, headers=headers, timeout=timeout)

    def _call(self, method: str, *args: Any) -> Any:
        """The control's route (engine/control.py: its Route says verb, path, query and answer)."""
        if method == "get_weight_version" and all(a is None for a in args):
            # A vLLM server has no /get_weight_version (ours has it as an extra); both answer GET /weight_info
            # with the same weight_version (a group's engines must agree there too). An adapter's version
            # (lora_name) is only on ours.
            return self._call("weight_info", "target")["weight_version"]
        declared = CONTROLS[method]
        verb, path, query, body = http_request(declared, args)
        response = self._http.request(verb, path, params=query or None, json=body)
        return http_result(declared, self._check(response, path))

    @staticmethod
    def _check(response, path: str) -> Any:
        if response.status_code >= 400:
            try:
                detail = response.json()
                message = detail.get("error", {}).get("message") or detail.get("detail") or response.text
            except ValueError:
                message = response.text
            raise WeightSyncError(f"{path}: HTTP {response.status_code}: {message}")
        return response.json() if response.content else None

    def close(self) -> None:
        self._http.close()


class HTTPPool:
    """An httpx.Client's kept-alive connections to one server, safe across threads, fresh after a 5xx.

    A uvicorn server (vLLM's, ours) closes a connection whose handler raised, once its 500 is out; a next
    request on that kept-alive connection can be written before the close arrives and fail with
    "connection reset by peer". So a 5xx answer sets the pool aside: later requests open new connections,
    and requests still running on the old pool finish there (it is closed in close()).
    """

    def __init__(self, base_url: str, **client_kwargs: Any) -> None:
        import httpx

        self._new = lambda: httpx.Client(base_url=base_url, **client_kwargs)
        self._client = self._new()
        self._retired: list = []
        self._lock = threading.Lock()

    def request(self, method: str, path: str, **kwargs: Any):
        response = self._client.request(method, path, **kwargs)
        if response.status_code >= 500:
            with self._lock:
                self._retired.append(self._client)
                self._client = self._new()
        return response

    def get(self, path: str, **kwargs: Any):
        return self.request("GET", path, **kwargs)

    def post(self, path: str, **kwargs: Any):
        return self.request("POST", path, **kwargs)

    def close(self) -> None:
        with self._lock:
            for client in [*self._retired, self._client]:
                client.close()
            self._retired.clear()


class LocalWeightSyncClient(WeightSyncClient):
    """A RolloutWorker (or anything with its methods) in this process."""

    def __init__(self, worker) -> None:
        self.worker = worker

    def _call(self, method: str, *args: Any) -> Any:
        return getattr(self.worker, method)(*args)

    def _submit(self, method: str, *args: Any) -> concurrent.futures.Future:
        start = getattr(self.worker, "_start_control", None)  # a RolloutWorker: straight onto its loop
        return start(method, args) if start is not None else super()._submit(method, *args)


class RayWeightSyncClient(WeightSyncClient):
    """RolloutWorker Ray actors, one per engine: every call fans out to all and waits for all.

    init_info with a "rank_offset" is rewritten per engine so that their workers take
    consecutive ranks: engine i gets rank_offset + the world sizes of engines 0..i-1.
    `timeout` (seconds, None: no limit) bounds each fan-out; a dead actor fails the call with a
    WeightSyncError naming its index as soon as Ray reports it, never a hang.
    """

    def __init__(self, actors: list, timeout: float | None = 600.0) -> None:
        if not actors:
            raise ValueError("actors: expected at least one RolloutWorker actor handle")
        self.actors = list(actors)
        self.timeout = timeout
        self._world_sizes: list[int] | None = None

    def num_engines(self) -> int:
        return len(self.actors)

    def engine_world_sizes(self) -> list[int]:
        if self._world_sizes is None:
            self._world_sizes = [int(w) for w in self._gather("get_world_size", True)]
        return list(self._world_sizes)

    def _gather(self, method: str, *args: Any, per_engine: list[tuple] | None = None) -> list[Any]:
        """Calls `method` on every actor at once and waits (at most `timeout` s in all) for every answer.

        The first failure to arrive is raised at once, naming the actor's index: a dead actor
        or a failed call is a WeightSyncError, no answer in time a TimeoutError.
        """
        import ray

        refs = [
            getattr(actor, method).remote(*(per_engine[i] if per_engine is not None else args))
            for i, actor in enumerate(self.actors)
        ]
        index_of = {ref: i for i, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        pending = list(refs)
        while pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, pending = ray.wait(pending, num_returns=1, timeout=remaining)
            if not done:
                late = sorted(index_of[ref] for ref in pending)
                raise TimeoutError(f"{method}: no answer from engine actor(s) {late} within {self.timeout} s")
            i = index_of[done[0]]
            try:
                results[i] = ray.get(done[0])
            except ray.exceptions.RayActorError as e:  # killed, crashed, or its node is gone
                raise WeightSyncError(
                    f"{method}: engine actor {i} of {len(refs)} is dead or unreachable ({type(e).__name__})"
                ) from e
            except ray.exceptions.RayTaskError as e:
                cause = e.cause if getattr(e, "cause", None) else e
                raise WeightSyncError(f"{method}: engine actor {i}: {cause}") from e
        return results

    def _call(self, method: str, *args: Any) -> Any:
        """Every actor's answer, combined by the control's rule (engine/control.py); engine 0's for the
        controls a group combines its own way."""
        if method == "init_weight_transfer_engine" and "rank_offset" in args[0]:
            offsets, next_offset = [], int(args[0]["rank_offset"])
            for size in self.engine_world_sizes():
                offsets.append(({**args[0], "rank_offset": next_offset},))
                next_offset += size
            return self._gather(method, per_engine=offsets)[0]
        if method == "apply_weight_update" and len(self.actors) > 1:
            return self._apply_in_phases(*args)
        results = self._gather(method, *args)
        declared = CONTROLS[method]
        if declared.combine is Combine.OWN:
            return results[0]
        return combine_answers(declared, results,
                               lambda answers: WeightSyncError(f"{method}: engines disagree: {answers}"))

    def _apply_in_phases(self, request: Any, weight_version: str | None) -> None:
        """apply_weight_update over several engines: start, update_weights and finish, each on every actor at once,
        and finish only once every actor landed the update (else it is aborted on all): all of them serve it or none.
        (Each actor's own one call could finish on some engines and fail on others.)"""
        try:
            self._gather("start_weight_update")
            self._gather("update_weights", request)
        except BaseException:
            try:
                self._gather("abort_weight_update")
            except Exception as e:  # e.g. a dead actor: the first failure is the one to report
                logger.warning("apply_weight_update: aborting the update on every engine after a failure: %s", e)
            raise
        self._gather("finish_weight_update", weight_version)


class _AimedClient(WeightSyncClient):
    """Another client's calls, their arguments aimed (_aim) at one part of the engine; its engines are that client's."""

    def __init__(self, client: WeightSyncClient) -> None:
        self.client = client

    def num_engines(self) -> int:
        return self.client.num_engines()

    def engine_world_sizes(self) -> list[int]:
        return self.client.engine_world_sizes()

    def _call(self, method: str, *args: Any) -> Any:
        return self.client._call(method, *self._aim(method, args))

    def _submit(self, method: str, *args: Any) -> concurrent.futures.Future:
        return self.client._submit(method, *self._aim(method, args))

    @abstractmethod
    def _aim(self, method: str, args: tuple) -> tuple:
        """The call's (plain) arguments as this client sends them."""


def _tag_request(request: dict | list[dict], key: str, value: str) -> dict | list[dict]:
    """An init_info or update_info (plain: a dict, or vLLM's list of one per worker) with key=value in each."""
    return [{**v, key: value} for v in request] if isinstance(request, list) else {**request, key: value}


class ModelWeightSyncClient(_AimedClient):
    """Another client's calls aimed at one model of the engine: init_info and update_info gain
    {"model": model}, weight_info and weight_checker report that model; the rest pass unchanged.

    The engine has one update lifecycle for its models (start and finish act on every model with a
    transfer engine), so a sync through this client moves only this model's tensors.
    """

    def __init__(self, client: WeightSyncClient, model: str) -> None:
        if not isinstance(model, str) or not model:
            raise ValueError(f"model: expected a model name such as 'draft', got {model!r}")
        super().__init__(client)
        self.model = model

    def _aim(self, method: str, args: tuple) -> tuple:
        names = CONTROLS[method].arg_names() if method in CONTROLS else []
        aimed = []
        for name, value in zip(names, args):
            if name == "model":
                value = self.model
            elif name == "request" and method in ("init_weight_transfer_engine", "update_weights",
                                                  "apply_weight_update"):
                value = _tag_request(value, "model", self.model)  # plain here: _forward_control unwrapped vLLM's
            aimed.append(value)
        return (*aimed, *args[len(aimed):])


class LoRAWeightSyncClient(_AimedClient):
    """Another client's calls aimed at one LoRA adapter the engine has loaded: update_weights' (and
    apply_weight_update's) update_info gains {"lora_name": lora_name}, so every backend's calls carry that adapter's
    PEFT-named tensors into it (staged until the update finishes; engine/worker/lora_weight_update.py); the rest
    pass unchanged.

    A trainer rarely builds one itself: send_weights aims its client at the adapter of a source that names
    one (weight_transfer.lora.adapter_source). The transport is the model's: no init of its own.
    """

    def __init__(self, client: WeightSyncClient, lora_name: str) -> None:
        if not isinstance(lora_name, str) or not lora_name:
            raise ValueError(f"lora_name: expected a loaded adapter's lora_name, got {lora_name!r}")
        super().__init__(client)
        self.lora_name = lora_name

    def _aim(self, method: str, args: tuple) -> tuple:
        if method in ("update_weights", "apply_weight_update"):
            request, *rest = args
            return (_tag_request(request, "lora_name", self.lora_name), *rest)
        return args


# ---------------------------------------------------------------------------------------


def call_in_background(fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
    """Runs fn(*args) in a daemon thread of its own; the Future carries its result or exception.

    For client calls that return only once the trainer has moved the data (an engine's init or
    update waits on the transport), so the trainer thread can move it meanwhile. The call never
    waits behind another: it runs at once on an idle thread kept from an earlier call, or on a
    fresh one (a thread costs ~0.1-0.8 ms to start, several per sync). The thread is named after
    fn while it runs (weight-sync-<name>), so a stack dump of a stuck sync says which call waits.
    A call that never returns keeps only its own thread; daemon threads never hold up the exit.
    """
    return _BACKGROUND.submit(fn, args)


class _BackgroundThreads:
    """Daemon threads for call_in_background: an idle one takes the next call, none idle means a new one.

    Under `_lock`: every queued call has a thread that will take it (`_idle` counts the waiting threads
    not yet promised a call; submit promises one or starts one), so no call waits behind a running one.
    A thread idle for `idle_s` leaves; at most `max_idle` wait at a time (the rest leave after their call).
    """

    def __init__(self, idle_s: float = 60.0, max_idle: int = 8) -> None:
        self.idle_s = idle_s
        self.max_idle = max_idle
        self._reset()
        # A forked child has none of the parent's threads: it starts with an empty pool.
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = 0
        self.num_started = 0  # threads started so far (tests: reuse means this stays put)

    def submit(self, fn: Callable[..., Any], args: tuple) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        name = f"weight-sync-{getattr(fn, '__name__', 'call')}"
        with self._lock:
            self._calls.put((future, fn, args, name))
            if self._idle > 0:
                self._idle -= 1  # that thread takes it
                return future
            self.num_started += 1
        thread = threading.Thread(target=self._serve, args=(self._calls,), name=name, daemon=True)
        try:
            thread.start()
        except BaseException as e:  # no thread for it (e.g. at interpreter exit): the call fails, nothing hangs
            if future.set_running_or_notify_cancel():
                future.set_exception(e)
        return future

    def _serve(self, calls: queue.SimpleQueue) -> None:
        thread = threading.current_thread()
        while True:
            try:
                future, fn, args, name = calls.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:
                    if calls is not self._calls:
                        return
                    try:  # a call queued just now was promised to some waiting thread: this one takes it
                        future, fn, args, name = calls.get_nowait()
                    except queue.Empty:
                        self._idle -= 1
                        return
            thread.name = name
            _run_call(future, fn, args)
            del future, fn, args  # the result is the caller's now; an idle thread holds nothing of it
            thread.name = "weight-sync-idle"
            with self._lock:
                if calls is not self._calls or self._idle >= self.max_idle:
                    return
                self._idle += 1


def _run_call(future: concurrent.futures.Future, fn: Callable[..., Any], args: tuple) -> None:
    if not future.set_running_or_notify_cancel():  # cancelled before it ran
        return
    try:
        future.set_result(fn(*args))
    except BaseException as e:  # delivered to whoever waits on the future
        future.set_exception(e)


_BACKGROUND = _BackgroundThreads()
