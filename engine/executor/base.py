"""Executor: the engine core's handle on its workers (one per tensor-parallel rank), and how their answers combine."""

from __future__ import annotations

import functools
import inspect
import logging
import pickle
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from engine.config import EngineConfig
from engine.core.sched_output import SchedulerOutput
from engine.exceptions import EngineDeadError
from engine.worker.runner_output import ModelRunnerOutput

if TYPE_CHECKING:
    from engine.worker.worker import Worker

logger = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

# The rank whose step results the engine uses. Every rank samples the same tokens (the logits
# are gathered to all ranks and the seeded generators draw alike), so the others only ack.
OUTPUT_RANK = 0


class WorkerDiedError(EngineDeadError):
    """A worker is gone for good (its process died, its Ray actor failed, or its group fell out of step)."""


@dataclass
class WorkerReply:
    """One rank's answer to one call: its result, or the exception it raised and its traceback text."""

    rank: int
    result: Any = None
    error: bytes | None = None  # the pickled exception (None: the call succeeded)
    error_text: str = ""  # "ExcType: message", used when the exception does not unpickle
    traceback: str = ""

    @staticmethod
    def failed(rank: int, exc: BaseException, traceback_text: str) -> WorkerReply:
        try:
            payload = pickle.dumps(exc)
        except Exception:  # an exception holding something unpicklable travels as text
            payload = None
        return WorkerReply(rank, error=payload, error_text=f"{type(exc).__name__}: {exc}", traceback=traceback_text)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.error_text

    def exception(self) -> BaseException:
        """The worker's exception, of its own type where possible (callers catch ValueError,
        WeightTransferError...), with a note naming the rank and the remote traceback."""
        exc: BaseException
        try:
            exc = pickle.loads(self.error) if self.error is not None else RuntimeError(self.error_text)
        except Exception:
            exc = RuntimeError(self.error_text)
        exc.add_note(f"raised in tensor-parallel worker rank {self.rank}; its traceback:\n{self.traceback}")
        return exc


def call_worker(worker: Any, rank: int, method: str, args: tuple, kwargs: dict, reply_rank: int | None) -> WorkerReply:
    """Runs one call on this rank's worker (the worker side of collective_rpc); never raises."""
    try:
        if method.startswith("_"):
            raise AttributeError(f"Worker method {method!r} is private")
        result = getattr(worker, method)(*args, **kwargs)
        return WorkerReply(rank, result if reply_rank in (None, rank) else None)
    except Exception as e:
        return WorkerReply.failed(rank, e, traceback.format_exc())


def results_or_raise(replies: list[WorkerReply]) -> list[Any]:
    """The per-rank results in rank order; the lowest failing rank's exception if any rank failed."""
    replies = sorted(replies, key=lambda r: r.rank)
    for reply in replies:
        if not reply.ok:
            raise reply.exception()
    return [r.result for r in replies]


class Executor(ABC):
    """Runs one Worker per tensor-parallel rank and hands every call to all of them.

    Subclasses implement collective_rpc (the transport), is_alive and shutdown. The engine core
    calls its workers through rpc(Worker.<method>, ...) and combines the per-rank answers
    itself; only the step (execute_model, launch/finish, the dummy batch) has calls of its own.
    Calls come from one thread (the engine core's loop).
    """

    def __init__(self, config: EngineConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.world_size = config.parallel.tensor_parallel_size
        self.dead_reason: str | None = None  # why the workers are gone, once they are
        self.worker_pids: list[int] = []  # rank -> its worker's pid, once started

    @abstractmethod
    def collective_rpc(
        self, method: str, args: tuple = (), kwargs: dict | None = None, unique_reply_rank: int | None = None
    ) -> list[Any]:
        """Calls Worker.<method>(*args, **kwargs) on every rank and waits for all of them.

        Returns the per-rank results in rank order; with unique_reply_rank only that rank sends
        its result back (the others' entries are None). A worker's exception is re-raised here
        (see WorkerReply.exception); a dead worker raises WorkerDiedError.
        """

    @abstractmethod
    def is_alive(self) -> bool:
        """False once a worker is gone for good; cheap enough to ask every loop iteration."""

    def check_alive(self) -> None:
        """Raises WorkerDiedError (an EngineDeadError) if a worker is gone."""
        if not self.is_alive():
            raise WorkerDiedError(self.dead_reason or "a worker of the engine is gone")

    def _mark_dead(self, reason: str) -> None:
        """Records why the workers are gone (the first reason wins) and stops the others."""
        if self.dead_reason is None:
            self.dead_reason = reason
            logger.error("%s: %s; stopping the other workers", type(self).__name__, reason)
        self.shutdown()

    def _give_up(self, replies: list[WorkerReply], stuck_ranks: list[int]) -> None:
        """A rank failed and the others never answered (stuck in a collective without it): stop
        the group and raise the lowest failed rank's error."""
        self._mark_dead(f"tensor-parallel worker ranks {stuck_ranks} stopped answering after another rank failed")
        failed = min((r for r in replies if not r.ok), key=lambda r: r.rank)
        error = failed.exception()
        error.add_note(f"the engine's workers are stopped: {self.dead_reason}")
        raise error

    @abstractmethod
    def shutdown(self) -> None:
        """Stops the workers; idempotent, and never waits without a limit."""

    # ---- calls -------------------------------------------------------------------------------

    def rpc(self, method: Callable[Concatenate[Worker, P], R], /, *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """Calls `method` (a Worker method, e.g. Worker.sleep) on every rank; returns each rank's result, in rank order.

        The method names the call by reference, so a type checker checks the arguments against
        its signature, and they are bound to that signature here before anything is sent: a
        wrong argument is a TypeError at the call site, seen by no worker. How the ranks'
        answers combine is the caller's to say (e.g. min, all(), rank 0's: OUTPUT_RANK).
        """
        return self.collective_rpc(worker_method_name(method, args, kwargs), args, kwargs)

    # ---- the step: the hot path keeps its own calls (rank 0 alone sends its result back) ------

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.collective_rpc("execute_model", (scheduler_output,), unique_reply_rank=OUTPUT_RANK)[OUTPUT_RANK]

    # Async scheduling: an executor that can leave one step in flight while the engine core
    # schedules the next (the in-process one) sets this and overrides launch/finish.
    supports_async_steps = False

    def launch_model(self, scheduler_output: SchedulerOutput) -> Any:
        """Starts a step; finish_model(handle) collects its output, in launch order. Here the
        step runs whole (executors that cannot leave one in flight)."""
        return self.execute_model(scheduler_output)

    def finish_model(self, handle: Any) -> ModelRunnerOutput:
        return handle

    def execute_dummy_batch(self) -> None:
        """One forward pass of a dummy token on every rank, nothing sampled or returned: a lockstep engine
        (expert parallelism) with no work runs it so its MoE collectives meet the other engines'."""
        self.collective_rpc("execute_dummy_batch", unique_reply_rank=OUTPUT_RANK)


@functools.cache
def _signature(method: Callable) -> inspect.Signature:
    return inspect.signature(method)


def worker_method_name(method: Callable, args: tuple, kwargs: dict) -> str:
    """The name collective_rpc sends for a call of `method` with these arguments.

    TypeError unless `method` is a public method of Worker and the arguments bind to its signature.
    """
    from engine.worker.worker import Worker  # not at the top: worker.py imports this module

    name = getattr(method, "__name__", "")
    if name.startswith("_") or getattr(Worker, name, None) is not method:
        raise TypeError(f"rpc: expected a public Worker method (e.g. Worker.sleep), got {method!r}")
    try:
        _signature(method).bind(None, *args, **kwargs)  # None stands in for the worker (self)
    except TypeError as e:
        raise TypeError(f"rpc(Worker.{name}): {e}") from None
    return name


def combine_rank_dicts(per_rank: list[dict]) -> dict:
    """Rank 0's dict, with "ranks": every rank's when there is more than one rank."""
    combined = dict(per_rank[OUTPUT_RANK])
    if len(per_rank) > 1:
        combined["ranks"] = per_rank
    return combined


def check_rank_baseline(baseline: dict | None, world_size: int) -> None:
    """ValueError unless baseline is None, a {name: checksum} dict, or {"ranks": [world_size dicts]}."""
    if baseline is None:
        return
    if not isinstance(baseline, dict):
        raise ValueError(f"baseline: expected a dict of checksums, got {type(baseline).__name__}")
    if "ranks" in baseline:
        ranks = baseline["ranks"]
        if not isinstance(ranks, list) or len(ranks) != world_size or not all(isinstance(r, dict) for r in ranks):
            raise ValueError(f"baseline: 'ranks' must be a list of {world_size} checksum dicts, one per rank")


def baseline_for_rank(baseline: dict | None, rank: int) -> dict | None:
    """The part of a weight_checker baseline (see EngineCore.weight_checker) that applies to `rank`."""
    if baseline is None or "ranks" not in baseline:
        return baseline
    return baseline["ranks"][rank]
