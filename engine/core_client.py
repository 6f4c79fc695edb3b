"""EngineCoreClient: one interface to an EngineCore, in this process or in its own over ZMQ.

    InprocClient   the EngineCore in this process, direct calls (LLM; tests). Sync and async.
    SyncMPClient   the EngineCore in a child process; a thread reads its outputs (engine/mp_client.py).
    AsyncMPClient  the same for asyncio; a task reads its outputs (engine/mp_client.py).

Fault tolerance (FaultToleranceConfig): `fault_tolerance_status()` says "healthy", "unhealthy"
or "dead"; `apply_fault_tolerance_instruction("retry")` brings an unhealthy engine back and
returns once it serves again. Status changes also arrive in EngineCoreOutputs.engine_status.
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig
from engine.exceptions import EngineDeadError
from engine.wire import (
    FAULT_TOLERANCE_INSTRUCTIONS,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStatus,
    FinishReason,
)

if TYPE_CHECKING:
    from engine.core_proc_handle import EngineCoreProcHandle

logger = logging.getLogger(__name__)

DEFAULT_READY_TIMEOUT_S = 600.0  # loading a large model may take minutes
_POLL_MS = 100
_DRAIN_MS = 50  # after the engine exits: read until its socket has been quiet this long


class EngineUtilityError(RuntimeError):
    """A UTILITY call failed in the engine (unknown method, or the method raised)."""


class EngineCoreClient(ABC):
    """What every client has: construction, liveness and shutdown. The requests themselves
    go through SyncEngineCoreClient or AsyncEngineCoreClient (InprocClient is both)."""

    @staticmethod
    def make_client(
        config: EngineConfig,
        multiprocess: bool,
        asyncio_mode: bool,
        client_index: int = 0,
        engine: EngineCoreProcHandle | None = None,
    ) -> EngineCoreClient:
        """multiprocess=False: InprocClient; else AsyncMPClient or SyncMPClient per asyncio_mode.

        `engine` (with `client_index`) attaches the client to a shared engine process; without
        it a multiprocess client starts its own engine process.
        """
        if not multiprocess:
            return InprocClient(config)
        from engine.mp_client import AsyncMPClient, SyncMPClient  # zmq enters here

        cls = AsyncMPClient if asyncio_mode else SyncMPClient
        return cls(config, client_index=client_index, engine=engine)

    @property
    def is_dead(self) -> bool:
        return False

    @abstractmethod
    def shutdown(self) -> None: ...


class SyncEngineCoreClient(EngineCoreClient):
    """Blocking calls: add_request / abort_requests / get_output / call_utility."""

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, req_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs: ...

    @abstractmethod
    def call_utility(self, method: str, *args: Any) -> Any: ...

    @abstractmethod
    def fault_tolerance_status(self) -> str:
        """"healthy", "unhealthy" (a step failed; waiting for `retry`) or "dead"."""

    @abstractmethod
    def apply_fault_tolerance_instruction(self, instruction: str) -> str:
        """Sends an instruction ("retry"); returns the status after it. Unknown ones raise ValueError."""


class AsyncEngineCoreClient(EngineCoreClient):
    """The same calls for asyncio callers."""

    @abstractmethod
    async def add_request_async(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    async def abort_requests_async(self, req_ids: list[str]) -> None: ...

    @abstractmethod
    async def get_output_async(self) -> EngineCoreOutputs: ...

    @abstractmethod
    async def call_utility_async(self, method: str, *args: Any) -> Any: ...

    async def outputs_taken(self) -> None:
        """Returns once the output consumer has taken every message queued so far (a client without an
        output queue has nothing to wait for)."""

    def outputs_pending(self) -> bool:
        """Whether outputs_taken() would wait: messages queued for the output consumer are still untaken
        (a client without an output queue has none)."""
        return False

    @abstractmethod
    async def fault_tolerance_status_async(self) -> str: ...

    @abstractmethod
    async def apply_fault_tolerance_instruction_async(self, instruction: str) -> str: ...


def check_fault_tolerance_instruction(instruction: str) -> None:
    if instruction not in FAULT_TOLERANCE_INSTRUCTIONS:
        raise ValueError(
            f"instruction: unknown fault tolerance instruction {instruction!r}; "
            f"expected one of {list(FAULT_TOLERANCE_INSTRUCTIONS)}"
        )


# ---- in-process ------------------------------------------------------------------------------


class InprocClient(SyncEngineCoreClient, AsyncEngineCoreClient):
    """The EngineCore in this process. get_output runs one step (abort outputs come with the next).

    add_request raises ValueError for a bad request (the MP clients get an ERROR output instead).
    Not thread-safe; async methods run the step on the event loop. A utility with a deferred form
    in the engine process (EngineCore.DEFERRED_UTILITIES: init_weight_transfer_engine) waits here
    for its answer, so nothing steps meanwhile (its wait is bounded by the call's timeout_s).

    Fault tolerance in-process: without it a failed step raises to the caller of get_output;
    with it the step's requests end with ERROR and the engine is unhealthy (add_request raises
    RuntimeError) until `retry`. There is no recovery timeout here: no process to end.
    """

    def __init__(self, config: EngineConfig, log_stats: bool = True) -> None:
        from engine.engine_core import EngineCore

        self.engine_core = EngineCore(config)
        self.num_blocks = self.engine_core.num_blocks  # KV blocks, as the MP clients' handshake says
        self.enable_fault_tolerance = config.fault_tolerance.enable_fault_tolerance
        self.status = EngineStatus.HEALTHY
        self.log_stats = log_stats
        self._pending = []  # abort outputs for the next get_output
        self._has_work: asyncio.Event | None = None

    def add_request(self, request: EngineCoreRequest) -> None:
        if self.status != EngineStatus.HEALTHY:
            raise RuntimeError(f"the engine is {self.status}; apply the retry instruction")
        self.engine_core.add_request(request)
        self._wake()

    def abort_requests(self, req_ids: list[str]) -> None:
        self._pending += self.engine_core.abort_requests(req_ids)
        self._wake()

    def _can_step(self) -> bool:
        return self.status == EngineStatus.HEALTHY and self.engine_core.has_unfinished_requests()

    def get_output(self) -> EngineCoreOutputs:
        if self._can_step():
            try:
                outputs = self.engine_core.step()
            except Exception as e:
                if not self.enable_fault_tolerance:
                    raise
                logger.exception("InprocClient: a step failed; the engine is unhealthy")
                outputs = self._fail_in_flight(f"{type(e).__name__}: {e}")
                if isinstance(e, EngineDeadError) or not self.engine_core.executor.is_alive():
                    # A worker is gone: no retry can bring it back.
                    self.status = outputs.engine_status = EngineStatus.DEAD
        else:
            outputs = EngineCoreOutputs(timestamp=time.time())
        if self._pending:
            outputs.outputs = self._pending + outputs.outputs
            self._pending = []
        if not self.log_stats:
            outputs.scheduler_stats = None
        return outputs

    def call_utility(self, method: str, *args: Any) -> Any:
        fn = getattr(self.engine_core, method, None) if not method.startswith("_") else None
        if not callable(fn):
            raise EngineUtilityError(f"AttributeError: EngineCore has no method {method!r}")
        try:
            return fn(*args)
        finally:
            self._wake()  # resume(), wake_up(), pause("abort")... may give the engine work to do

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self.add_request(request)

    async def abort_requests_async(self, req_ids: list[str]) -> None:
        self.abort_requests(req_ids)

    async def get_output_async(self) -> EngineCoreOutputs:
        if self._has_work is None:
            self._has_work = asyncio.Event()
        while not (self._can_step() or self._pending):
            self._has_work.clear()
            await self._has_work.wait()
        await asyncio.sleep(0)  # the step blocks the loop: let other tasks run between steps
        return self.get_output()

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        return self.call_utility(method, *args)

    def _fail_in_flight(self, reason: str) -> EngineCoreOutputs:
        self.status = EngineStatus.UNHEALTHY
        errors = [
            EngineCoreOutput(req_id, [], finish_reason=FinishReason.ERROR, stop_reason=reason)
            for req_id in self.engine_core.scheduler.requests
        ]
        return EngineCoreOutputs(outputs=errors, timestamp=time.time(), engine_status=self.status)

    def fault_tolerance_status(self) -> str:
        return str(self.status)

    def apply_fault_tolerance_instruction(self, instruction: str) -> str:
        check_fault_tolerance_instruction(instruction)
        if self.status == EngineStatus.UNHEALTHY:  # "retry"
            self.engine_core.reset_after_fault()
            self.status = EngineStatus.HEALTHY
            self._wake()
        return str(self.status)

    async def fault_tolerance_status_async(self) -> str:
        return self.fault_tolerance_status()

    async def apply_fault_tolerance_instruction_async(self, instruction: str) -> str:
        return self.apply_fault_tolerance_instruction(instruction)

    def _wake(self) -> None:
        if self._has_work is not None:
            self._has_work.set()

    @property
    def is_dead(self) -> bool:
        return not self.engine_core.executor.is_alive()  # shut down (or, with tensor parallelism, a worker died)

    def shutdown(self) -> None:
        """Shuts the EngineCore down: its device memory is given back before this returns. Idempotent."""
        self.engine_core.shutdown()
        self._pending = []
