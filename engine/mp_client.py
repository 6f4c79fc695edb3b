"""The ZMQ clients of an EngineCore process: SyncMPClient (a thread reads outputs) and AsyncMPClient (a task does).

Several frontends on one engine process: build an EngineCoreProcHandle with num_clients=N and
give it, with client_index 0..N-1, to N clients (or call `make_mp_clients`). Each client gets
only the outputs of its own requests, its own utility answers and the step stats.

A dead engine process turns into EngineDeadError in every waiting and later call as soon as
its process sentinel fires (a monitor thread waits on it); what the engine sent before it
exited (e.g. the ERROR outputs of the requests a failed step ended) is delivered first.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from abc import abstractmethod
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from engine.config import EngineConfig
from engine.core_client import (
    AsyncEngineCoreClient,
    EngineCoreClient,
    EngineUtilityError,
    SyncEngineCoreClient,
    check_fault_tolerance_instruction,
)
from engine.core_proc import EngineHandshake, engine_identity
from engine.core_proc_handle import EngineCoreProcHandle
from engine.exceptions import EngineDeadError, EngineStartupError
from engine.serial_utils import MsgpackDecoder, MsgpackEncoder
from engine.wire import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineStatus,
)

logger = logging.getLogger(__name__)

DEFAULT_READY_TIMEOUT_S = 600.0  # loading a large model may take minutes
_POLL_MS = 100
_DRAIN_MS = 50  # after the engine exits: read until its socket has been quiet this long


class _MPClient(EngineCoreClient):
    """What both ZMQ clients share: binding, the READY handshake, sending, death and shutdown."""

    def __init__(
        self,
        config: EngineConfig,
        client_index: int = 0,
        engine: EngineCoreProcHandle | None = None,
        ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
    ) -> None:
        self.client_index = client_index
        self.engine = engine if engine is not None else EngineCoreProcHandle(config, num_clients=1)
        self._dead: EngineDeadError | None = None
        self.engine_status = EngineStatus.HEALTHY  # the last status the engine pushed
        self._closed = False
        self._attached = False
        self._call_ids = itertools.count()
        self._encoder = MsgpackEncoder()
        self._decoder = MsgpackDecoder(EngineCoreOutputs)  # used by the reader only
        self.ctx = self._make_context()
        # The ROUTER is a plain socket in both clients: with no HWM a send never blocks, so the
        # async client sends directly. ROUTER_MANDATORY: a send to an engine that went away
        # raises instead of vanishing.
        self.input_socket = zmq.Socket(self.ctx, zmq.ROUTER)
        self.input_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.input_socket.setsockopt(zmq.SNDHWM, 0)
        self.output_socket = self.ctx.socket(zmq.PULL)  # an asyncio socket in AsyncMPClient
        self.output_socket.setsockopt(zmq.RCVHWM, 0)
        try:
            self.input_socket.bind(self.engine.input_addresses[client_index])
            self.output_socket.bind(self.engine.output_addresses[client_index])
            self.engine.attach(client_index, self._on_engine_death)
            self._attached = True
            self.engine.start()
            self.ready = self._wait_ready(ready_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self.engine_identity = engine_identity(self.ready.engine_index)
        self.num_blocks = self.ready.num_blocks
        self.max_model_len = self.ready.max_model_len

    def _make_context(self) -> zmq.Context:
        return zmq.Context()

    def _wait_ready(self, timeout_s: float) -> EngineHandshake:
        """Waits for this client's handshake while watching the process; raises EngineStartupError."""
        deadline = time.monotonic() + timeout_s
        exited_at = None
        while True:
            if self.input_socket.poll(_POLL_MS):
                _identity, payload = self.input_socket.recv_multipart()
                handshake = msgspec.msgpack.decode(payload, type=EngineHandshake)
                if handshake.status == "READY":
                    return handshake
                raise EngineStartupError(f"the engine process failed to start:\n{handshake.error}")
            if not self.engine.is_alive():
                # Its FAILED handshake may still be on its way: give it a moment.
                exited_at = exited_at or time.monotonic()
                if time.monotonic() - exited_at > 1.0:
                    raise EngineStartupError(
                        f"the engine process exited with code {self.engine.exitcode} before it was ready"
                    )
            elif time.monotonic() > deadline:
                raise EngineStartupError(f"the engine process was not ready after {timeout_s:.0f} s")

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    def _send(self, request_type: EngineCoreRequestType, payload: Any) -> None:
        if self._dead is not None:
            raise self._dead
        try:
            self._encoder.send(self.input_socket, payload, prefix=(self.engine_identity, request_type.value))
        except zmq.ZMQError as e:  # EHOSTUNREACH: the engine's DEALER is gone
            raise EngineDeadError(f"cannot reach the engine process: {e}") from e

    def _call_payload(self, request_type: EngineCoreRequestType, args: tuple) -> tuple[int, tuple]:
        """A new call id and the payload of a UTILITY (method, *args) or FAULT_TOLERANCE (instruction) call."""
        call_id = next(self._call_ids)
        if request_type == EngineCoreRequestType.UTILITY:
            method, *rest = args
            return call_id, (self.client_index, call_id, method, rest)
        return call_id, (call_id, *args)

    def _note_status(self, outputs: EngineCoreOutputs) -> None:
        if outputs.engine_status is not None:
            self.engine_status = outputs.engine_status
            if outputs.engine_status != EngineStatus.HEALTHY:
                logger.warning("engine %d is %s", outputs.engine_index, outputs.engine_status)

    @staticmethod
    def _utility_result(outputs: EngineCoreOutputs) -> Any:
        answer = outputs.utility_output
        if answer.failure_message is not None:
            raise EngineUtilityError(answer.failure_message)
        return answer.result

    @staticmethod
    def _utility_stats(outputs: EngineCoreOutputs) -> EngineCoreOutputs | None:
        """The stats a utility answer carries, as a plain message for the frontend's stat loggers."""
        if outputs.scheduler_stats is None:
            return None
        return EngineCoreOutputs(
            timestamp=outputs.timestamp, scheduler_stats=outputs.scheduler_stats, engine_index=outputs.engine_index
        )

    def _on_engine_death(self, message: str) -> None:
        """Called from the engine monitor thread: mark dead, then (after the engine's last outputs) wake every waiter."""
        self._dead = EngineDeadError(message)
        self.engine_status = EngineStatus.DEAD
        self._wake_waiters(drain=True)

    @abstractmethod
    def _wake_waiters(self, drain: bool) -> None:
        """Fails every waiter with self._dead; drain: first deliver what the engine already sent."""

    def shutdown(self) -> None:
        """Stops the engine process if this was its last client, and closes this client's sockets."""
        if self._closed:
            return
        self._closed = True
        if self._attached:
            self.engine.detach(self.client_index)
        if self._dead is None:
            self._dead = EngineDeadError("the engine client was shut down")
        self._wake_waiters(drain=False)
        self.input_socket.close(linger=0)
        if self._close_output_socket():
            self.ctx.term()

    def _close_output_socket(self) -> bool:
        """Stops the reader and closes the PULL socket; False if that is left to another thread."""
        self.output_socket.close(linger=0)
        return True


_DEAD = object()  # queue sentinel: the engine is dead (re-queued so that every waiter sees it)


class _Taken:
    """Queue marker of AsyncMPClient.outputs_taken: its future is set when the consumer reaches it."""

    def __init__(self, future: asyncio.Future) -> None:
        self.future = future


class SyncMPClient(_MPClient, SyncEngineCoreClient):
    """The EngineCore in a child process, for blocking callers (thread-safe)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._outputs: queue.Queue = queue.Queue()
        self._utility_futures: dict[int, concurrent.futures.Future] = {}
        self._lock = threading.Lock()  # the ROUTER socket and the encoder are not thread-safe
        self._reader: threading.Thread | None = None
        self._stop = threading.Event()
        self._engine_gone = threading.Event()  # set by the monitor: drain, then fail the waiters
        super().__init__(*args, **kwargs)
        self._reader = threading.Thread(target=self._read_outputs, name="engine-client-output", daemon=True)
        self._reader.start()

    def _read_outputs(self) -> None:
        try:
            while not self._stop.is_set():
                if self._engine_gone.is_set():
                    while self.output_socket.poll(_DRAIN_MS):  # what the engine sent before it exited
                        self._dispatch(self.output_socket.recv_multipart(copy=False))
                    return
                if self.output_socket.poll(_POLL_MS):
                    self._dispatch(self.output_socket.recv_multipart(copy=False))
        finally:
            if self._dead is not None:  # whoever marked us dead may have left the waking to us
                self._fail_waiters()

    def _dispatch(self, frames: list) -> None:
        try:
            outputs = self._decoder.decode(frames)
        except Exception:
            logger.exception("SyncMPClient: dropped an undecodable message from the engine")
            return
        if outputs.utility_output is not None:
            future = self._utility_futures.pop(outputs.utility_output.call_id, None)
            if future is not None:
                future.set_result(outputs)
            if (stats := self._utility_stats(outputs)) is not None:
                self._outputs.put(stats)
        else:
            self._note_status(outputs)
            self._outputs.put(outputs)

    def add_request(self, request: EngineCoreRequest) -> None:
        with self._lock:
            self._send(EngineCoreRequestType.ADD, request)

    def abort_requests(self, req_ids: list[str]) -> None:
        with self._lock:
            self._send(EngineCoreRequestType.ABORT, list(req_ids))

    def get_output(self) -> EngineCoreOutputs:
        outputs = self._outputs.get()
        if outputs is _DEAD:
            self._outputs.put(_DEAD)
            raise self._dead
        return outputs

    def call_utility(self, method: str, *args: Any) -> Any:
        return self._call(EngineCoreRequestType.UTILITY, method, *args)

    def fault_tolerance_status(self) -> str:
        if self._dead is None:
            try:
                return self._call(EngineCoreRequestType.FAULT_TOLERANCE, "status")
            except EngineDeadError:
                pass
        return str(EngineStatus.DEAD)

    def apply_fault_tolerance_instruction(self, instruction: str) -> str:
        check_fault_tolerance_instruction(instruction)
        return self._call(EngineCoreRequestType.FAULT_TOLERANCE, instruction)

    def _call(self, request_type: EngineCoreRequestType, *args: Any) -> Any:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            call_id, payload = self._call_payload(request_type, args)
            self._utility_futures[call_id] = future
            try:
                self._send(request_type, payload)
            except BaseException:
                self._utility_futures.pop(call_id, None)
                raise
        return self._utility_result(future.result())

    def _wake_waiters(self, drain: bool) -> None:
        reader = self._reader
        if drain and reader is not None and reader.is_alive() and threading.current_thread() is not reader:
            self._engine_gone.set()  # the reader drains, then fails the waiters on its way out
        else:
            self._fail_waiters()

    def _fail_waiters(self) -> None:
        self._outputs.put(_DEAD)
        for call_id in list(self._utility_futures):
            future = self._utility_futures.pop(call_id, None)
            if future is not None and not future.done():
                future.set_exception(self._dead)

    def _close_output_socket(self) -> bool:
        self._stop.set()
        if self._reader is not None:
            self._reader.join(timeout=5)
        return super()._close_output_socket()


class AsyncMPClient(_MPClient, AsyncEngineCoreClient):
    """The EngineCore in a child process, for asyncio callers (one event loop at a time).

    Requests go out on the ROUTER directly; a task reads the zmq.asyncio PULL socket into an
    asyncio.Queue and resolves utility futures (keyed by call_id). The task starts on the first
    async call, and again on a new event loop if the old one ended. Call shutdown() from the
    loop's thread, or after the loop has ended.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outputs: asyncio.Queue | None = None
        self._utility_futures: dict[int, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None
        self._engine_gone = threading.Event()  # set by the monitor: the reader drains, then fails the waiters
        super().__init__(*args, **kwargs)

    def _make_context(self) -> zmq.Context:
        return zmq.asyncio.Context()

    def _ensure_reader(self) -> asyncio.Queue:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            old = self._outputs
            self._loop, self._outputs = loop, asyncio.Queue()
            while old is not None and not old.empty():  # outputs read on the previous loop
                self._outputs.put_nowait(old.get_nowait())
            if self._dead is not None:
                self._outputs.put_nowait(_DEAD)
            else:
                self._reader = loop.create_task(self._read_outputs(self._outputs))
        return self._outputs

    async def _read_outputs(self, outputs_queue: asyncio.Queue) -> None:
        # Polls rather than awaiting recv forever, so that it notices the engine's exit itself:
        # cancelling a task whose recv has just completed would drop that message.
        sock = self.output_socket
        while not self._engine_gone.is_set():
            if await sock.poll(_POLL_MS):
                self._dispatch(await sock.recv_multipart(copy=False), outputs_queue)
        while await sock.poll(_DRAIN_MS):  # what the engine sent before it exited
            self._dispatch(await sock.recv_multipart(copy=False), outputs_queue)
        self._fail_waiters()

    def _dispatch(self, frames: list, outputs_queue: asyncio.Queue) -> None:
        try:
            outputs = self._decoder.decode(frames)
        except Exception:
            logger.exception("AsyncMPClient: dropped an undecodable message from the engine")
            return
        if outputs.utility_output is not None:
            # The stats first: a consumer waiting on the queue then resumes before the caller does, so the
            # caller usually finds them taken already (outputs_pending() False) and need not wait for that.
            if (stats := self._utility_stats(outputs)) is not None:
                outputs_queue.put_nowait(stats)
            future = self._utility_futures.pop(outputs.utility_output.call_id, None)
            if future is not None and not future.done():
                future.set_result(outputs)
        else:
            self._note_status(outputs)
            outputs_queue.put_nowait(outputs)

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._ensure_reader()
        self._send(EngineCoreRequestType.ADD, request)

    async def abort_requests_async(self, req_ids: list[str]) -> None:
        self._ensure_reader()
        self._send(EngineCoreRequestType.ABORT, list(req_ids))

    async def get_output_async(self) -> EngineCoreOutputs:
        outputs_queue = self._ensure_reader()
        while True:
            outputs = outputs_queue.get_nowait() if not outputs_queue.empty() else await outputs_queue.get()
            if outputs is _DEAD:
                outputs_queue.put_nowait(_DEAD)
                raise self._dead
            if not isinstance(outputs, _Taken):
                return outputs
            if not outputs.future.done():
                outputs.future.set_result(None)

    def outputs_pending(self) -> bool:
        """Whether messages queued for the consumer of get_output_async are still untaken, i.e. whether
        outputs_taken() would wait. False means the consumer has taken (and, being on this loop and
        back at its next get, handled) everything queued so far."""
        return self._outputs is not None and not self._outputs.empty()

    async def outputs_taken(self) -> None:
        """Returns once the consumer of get_output_async has taken every message queued before this
        call, e.g. the stats a utility answer carried (they are queued before its caller resumes).
        The consumer must be running: AsyncLLM's output handler is."""
        if not self.outputs_pending():
            return
        future = self._loop.create_future()
        self._ensure_reader().put_nowait(_Taken(future))
        await future

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        return await self._call(EngineCoreRequestType.UTILITY, method, *args)

    async def fault_tolerance_status_async(self) -> str:
        if self._dead is None:
            try:
                return await self._call(EngineCoreRequestType.FAULT_TOLERANCE, "status")
            except EngineDeadError:
                pass
        return str(EngineStatus.DEAD)

    async def apply_fault_tolerance_instruction_async(self, instruction: str) -> str:
        check_fault_tolerance_instruction(instruction)
        return await self._call(EngineCoreRequestType.FAULT_TOLERANCE, instruction)

    async def _call(self, request_type: EngineCoreRequestType, *args: Any) -> Any:
        self._ensure_reader()
        call_id, payload = self._call_payload(request_type, args)
        future = self._loop.create_future()
        self._utility_futures[call_id] = future
        try:
            self._send(request_type, payload)
            return self._utility_result(await future)
        finally:
            self._utility_futures.pop(call_id, None)

    def _wake_waiters(self, drain: bool) -> None:
        if drain:
            self._engine_gone.set()
        loop = self._loop
        if loop is None or loop.is_closed():
            return  # the next async call sees self._dead
        if _in_loop_thread(loop):
            self._wake_unless_reader_will(drain)
        else:
            loop.call_soon_threadsafe(self._wake_unless_reader_will, drain)

    def _wake_unless_reader_will(self, drain: bool) -> None:
        if not (drain and self._reader is not None and not self._reader.done()):
            self._fail_waiters()

    def _fail_waiters(self) -> None:
        if self._outputs is not None:
            self._outputs.put_nowait(_DEAD)
        for future in list(self._utility_futures.values()):
            if not future.done():
                future.set_exception(self._dead)
        self._utility_futures.clear()

    def _close_output_socket(self) -> bool:
        loop = self._loop
        if loop is not None and loop.is_running() and not _in_loop_thread(loop):
            # The socket is in use by a loop running in another thread: close it there.
            loop.call_soon_threadsafe(self._cancel_reader_and_close)
            return False
        self._cancel_reader_and_close()
        return True

    def _cancel_reader_and_close(self) -> None:
        if self._reader is not None and not self._reader.done():
            self._reader.cancel()
        self.output_socket.close(linger=0)  # also cancels its pending recv


def _in_loop_thread(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def make_mp_clients(
    config: EngineConfig, num_clients: int, asyncio_mode: bool = True, engine_index: int = 0
) -> list[_MPClient]:
    """Starts one engine process and attaches `num_clients` clients (client_index 0..N-1) to it.

    The engine process stops when the last of them shuts down.
    """
    engine = EngineCoreProcHandle(config, num_clients=num_clients, engine_index=engine_index)
    cls = AsyncMPClient if asyncio_mode else SyncMPClient
    clients: list[_MPClient] = []
    try:
        for i in range(num_clients):
            clients.append(cls(config, client_index=i, engine=engine))
    except BaseException:
        for client in clients:
            client.shutdown()
        engine.shutdown()
        raise
    return clients
