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
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from abc import ABC, abstractmethod
from typing import Any, Callable


class WeightSyncError(RuntimeError):
    """An engine refused or failed a weight-sync call; the message is the engine's."""


class WeightSyncClient(ABC):
    """The engine-side calls a trainer needs for one weight sync; one engine or a fan-out to several."""

    @abstractmethod
    def _call(self, method: str, *args: Any) -> Any:
        """Runs `method` on every engine; returns the first engine's result (per-engine list where noted)."""

    def num_engines(self) -> int:
        return 1

    def engine_world_sizes(self) -> list[int]:
        """Workers per engine (tensor x pipeline parallel size), in engine order."""
        return [int(self._call("get_world_size"))]

    def get_world_size(self) -> int:
        """Engine workers in all, i.e. the receivers a transport must reach."""
        return sum(self.engine_world_sizes())

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info: dict) -> None:
        self._call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update", weight_version)

    def abort_weight_update(self) -> None:
        """Ends an update in progress and restores the weights the engine had when it started."""
        self._call("abort_weight_update")

    def shutdown_weight_transfer_engine(self) -> None:
        self._call("shutdown_weight_transfer_engine")

    def get_weight_version(self) -> str | None:
        return self._call("get_weight_version")

    def weight_info(self, model: str | None = None) -> dict:
        """model: "target" or "draft" (speculative decoding's draft model); None: the engine's default, the target."""
        return self._call("weight_info", *_model_arg(model))

    def weight_checker(self, baseline: dict | None = None, model: str | None = None) -> dict:
        return self._call("weight_checker", baseline, *_model_arg(model))

    def for_model(self, model: str) -> WeightSyncClient:
        """This client aimed at one of the engine's models ("target" or "draft"): see ModelWeightSyncClient."""
        return ModelWeightSyncClient(self, model)

    def pause(self, mode: str = "abort") -> None:
        self._call("pause", mode)

    def resume(self) -> None:
        self._call("resume")

    def close(self) -> None:
        """Releases the client's own resources (connections); the engines keep running."""


# ---------------------------------------------------------------------------------------


_POST = {
    "init_weight_transfer_engine": ("/init_weight_transfer_engine", lambda a: {"init_info": a[0]}),
    "start_weight_update": ("/start_weight_update", lambda a: None),
    "update_weights": ("/update_weights", lambda a: {"update_info": a[0]}),
    "finish_weight_update": ("/finish_weight_update", lambda a: {"weight_version": a[0]}),
    "abort_weight_update": ("/abort_weight_update", lambda a: None),
    "shutdown_weight_transfer_engine": ("/shutdown_weight_transfer_engine", lambda a: None),
    "weight_checker": ("/weight_checker", lambda a: {"baseline": a[0], **({"model": a[1]} if len(a) > 1 else {})}),
    "resume": ("/resume", lambda a: None),
}


class HTTPWeightSyncClient(WeightSyncClient):
    """Speaks the RL routes of one server. `timeout` (seconds) bounds every call; None waits forever."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float | None = 600.0) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        # One connection pool, safe to share between the trainer thread and background calls.
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)

    def _call(self, method: str, *args: Any) -> Any:
        if method == "get_world_size":
            return self._get("/get_world_size")["world_size"]
        if method == "get_weight_version":
            return self._get("/weight_info")["weight_version"]
        if method == "weight_info":
            return self._get("/weight_info", params={"model": args[0]} if args else None)
        if method == "pause":
            return self._post("/pause", None, params={"mode": args[0]})
        path, body = _POST[method]
        return self._post(path, body(args))

    def _get(self, path: str, params: dict | None = None) -> Any:
        return self._check(self._http.get(path, params=params), path)

    def _post(self, path: str, body: dict | None, params: dict | None = None) -> Any:
        return self._check(self._http.post(path, json=body, params=params), path)

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


class LocalWeightSyncClient(WeightSyncClient):
    """A RolloutWorker (or anything with its methods) in this process."""

    def __init__(self, worker) -> None:
        self.worker = worker

    def _call(self, method: str, *args: Any) -> Any:
        return getattr(self.worker, method)(*args)


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
            self._world_sizes = [int(w) for w in self._gather("get_world_size")]
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
        if method == "init_weight_transfer_engine" and "rank_offset" in args[0]:
            offsets, next_offset = [], int(args[0]["rank_offset"])
            for size in self.engine_world_sizes():
                offsets.append(({**args[0], "rank_offset": next_offset},))
                next_offset += size
            return self._gather(method, per_engine=offsets)[0]
        results = self._gather(method, *args)
        if method == "get_weight_version" and len(set(results)) > 1:
            raise WeightSyncError(f"get_weight_version: engines disagree: {results}")
        return results[0]


class ModelWeightSyncClient(WeightSyncClient):
    """Another client's calls aimed at one model of the engine: init_info and update_info gain
    {"model": model}, weight_info and weight_checker report that model; the rest pass unchanged.

    The engine has one update lifecycle for its models (start and finish act on every model with a
    transfer engine), so a sync through this client moves only this model's tensors.
    """

    def __init__(self, client: WeightSyncClient, model: str) -> None:
        if not isinstance(model, str) or not model:
            raise ValueError(f"model: expected a model name such as 'draft', got {model!r}")
        self.client = client
        self.model = model

    def num_engines(self) -> int:
        return self.client.num_engines()

    def engine_world_sizes(self) -> list[int]:
        return self.client.engine_world_sizes()

    def _call(self, method: str, *args: Any) -> Any:
        if method in ("init_weight_transfer_engine", "update_weights"):
            args = ({**args[0], "model": self.model}, *args[1:])
        elif method == "weight_info":
            args = (self.model,)
        elif method == "weight_checker":
            args = (args[0], self.model)
        return self.client._call(method, *args)


def _model_arg(model: str | None) -> tuple:
    """The model argument of weight_info / weight_checker, left out when not given (an engine of before it takes none)."""
    return () if model is None else (model,)


# ---------------------------------------------------------------------------------------


def call_in_background(fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
    """Runs fn(*args) in a fresh daemon thread; the Future carries its result or exception.

    For client calls that return only once the trainer has moved the data (an engine's init or
    update waits on the transport), so the trainer thread can move it meanwhile.
    """
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # delivered to whoever waits on the future
            future.set_exception(e)

    threading.Thread(target=run, name=f"weight-sync-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return future
