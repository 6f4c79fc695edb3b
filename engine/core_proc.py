"""EngineCoreProc: the EngineCore in its own process - input threads, a small busy loop, an output thread.

Sockets (one pair per frontend, i.e. per client index; the frontend binds, the engine connects):

    frontend ROUTER (input address i)  <->  engine DEALER i   requests in; the handshake out
    frontend PULL   (output address i) <--  engine PUSH i     EngineCoreOutputs out

Frontend -> engine message: [request type (1 byte), *msgpack frames] (the ROUTER adds the
engine's identity in front), with payloads ADD: EngineCoreRequest, ABORT: list of request ids,
UTILITY: (client_index, call_id, method name, args), FAULT_TOLERANCE: (call_id, "status" or an
instruction). Engine -> frontend: frames of one EngineCoreOutputs (a utility's answer rides in
its utility_output). At start-up the engine sends one EngineHandshake on every DEALER: READY,
or FAILED with the traceback, then exits.

Deferred answers: a utility whose work waits on a peer (EngineCore.DEFERRED_UTILITIES, e.g.
init_weight_transfer_engine's rendezvous with a trainer) returns a DeferredResult
(engine/deferred.py); the busy loop keeps it with its call id, polls it between steps (an idle
loop waits for input only POLL_INTERVAL_S meanwhile) and sends the answer once it is known, so
generation and other calls go on while the peer takes its time.

Faults: the busy loop runs under a sentinel. When it raises, every in-flight request ends with
finish reason ERROR and every client hears the new engine status. Without fault tolerance
(or with the executor gone: a worker process or actor died, which the loop checks every
iteration) the status is DEAD and the process exits non-zero; with it, the
status is UNHEALTHY and the loop waits up to engine_recovery_timeout_sec for a `retry`
instruction. The input threads answer FAULT_TOLERANCE messages themselves (the busy loop is
blocked) and, while the engine is not HEALTHY, refuse new requests and utility calls at once.
`retry` resets the core's per-run state and returns the engine to HEALTHY (its answer is sent
after that, so the caller's next request is served); a timeout means DEAD and exit.

The parent's side (addresses, starting and stopping the process) is core_proc_handle.py. An
engine of a lockstep data-parallel group (expert parallelism) runs the subclass DPEngineCoreProc
(engine/dp_core_proc.py): waves, dummy batches and the DP state sync.
"""

from __future__ import annotations

import faulthandler
import gc
import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections import defaultdict
from typing import Any

import msgspec
import zmq

from engine.config import EngineConfig
from engine.deferred import POLL_INTERVAL_S, DeferredResult
from engine.exceptions import EngineDeadError
from engine.parent_watch import watch_parent
from engine.serial_utils import MsgpackDecoder, MsgpackEncoder
from engine.wire import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineStatus,
    FinishReason,
    UtilityOutput,
)
from weight_transfer import sync_trace

logger = logging.getLogger(__name__)

# Lets the engine flush its last outputs (or its FAILED handshake) when it closes sockets.
_CLOSE_LINGER_MS = 1000
_POLL_MS = 100  # how often input threads look at the stop flag
_IDLE_WAIT_S = 1.0


class EngineHandshake(msgspec.Struct, omit_defaults=True):
    """Sent once on every DEALER at start-up."""

    status: str  # "READY" or "FAILED"
    engine_index: int = 0
    num_blocks: int = 0
    max_model_len: int = 0
    error: str | None = None  # FAILED: the traceback text


def engine_identity(engine_index: int) -> bytes:
    """The DEALER identity by which a frontend's ROUTER addresses engine `engine_index`."""
    return engine_index.to_bytes(2, "little")


class EngineRecoveryTimeout(RuntimeError):
    """An unhealthy engine got no `retry` instruction within engine_recovery_timeout_sec."""


class EngineCoreProc:
    """Runs in the child process: owns the EngineCore, its sockets and its IO threads.

    Invariant: only the busy-loop thread touches the EngineCore; the input threads only decode
    and queue, the output thread only encodes and sends, so the core needs no locks.
    """

    def __init__(
        self,
        config: EngineConfig,
        input_addresses: list[str],
        output_addresses: list[str],
        engine_index: int = 0,
    ) -> None:
        if len(input_addresses) != len(output_addresses):
            raise ValueError("one input and one output address per frontend")
        self.engine_index = engine_index
        self.input_queue: queue.Queue = queue.Queue()  # (request type, client index, payload)
        self.output_queue: queue.Queue = queue.Queue()  # (client index, EngineCoreOutputs) | None
        self._stop_inputs = threading.Event()
        self.ctx = zmq.Context()
        # Sockets first, so that a failure to build the core can still be reported.
        self.input_sockets = []
        for address in input_addresses:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, engine_identity(engine_index))
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.connect(address)
            self.input_sockets.append(sock)
        self.output_sockets = []
        for address in output_addresses:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)  # never block the output thread on a slow frontend
            sock.connect(address)
            self.output_sockets.append(sock)
        try:
            from engine.engine_core import EngineCore  # torch enters here

            self.engine_core = EngineCore(config)
            self._init_before_ready()
        except BaseException:
            self._handshake(EngineHandshake("FAILED", engine_index, error=traceback.format_exc()))
            self._close_sockets()
            raise

        self.req_clients: dict[str, int] = {}  # running request -> the client that sent it
        # Utility calls whose answer is still to come (EngineCore.DEFERRED_UTILITIES): (client index,
        # call id, its DeferredResult), polled between steps by _answer_deferred.
        self._deferred: list[tuple[int, int, DeferredResult]] = []
        self._next_deferred_poll = 0.0
        self.running = True
        # Fault tolerance. `status` is written by the busy loop (and read by the input threads)
        # under _status_lock, together with the retry calls waiting for the engine to recover.
        self.fault_tolerance = config.fault_tolerance
        self.status = EngineStatus.HEALTHY
        self._status_lock = threading.Lock()
        self._retry = threading.Event()
        self._retry_calls: list[tuple[int, int]] = []  # (client index, call id), answered once HEALTHY
        self._handshake(
            EngineHandshake(
                "READY", engine_index, self.engine_core.num_blocks, self.engine_core.max_model_len
            )
        )
        # The threads own their sockets from here on (ZMQ sockets are not thread-safe).
        self.input_threads = [
            threading.Thread(target=self._input_loop, args=(i, s), name=f"engine-input-{i}", daemon=True)
            for i, s in enumerate(self.input_sockets)
        ]
        self.output_thread = threading.Thread(target=self._output_loop, name="engine-output", daemon=True)
        for t in [*self.input_threads, self.output_thread]:
            t.start()

    def _init_before_ready(self) -> None:
        """Subclasses set up what must exist before READY is sent (a failure here is reported as FAILED)."""

    # ---- the busy loop (main thread) ---------------------------------------------------------

    def run_busy_loop(self) -> None:
        while self.running:
            try:
                # A worker that dies while the engine idles ends it here, within one idle wait
                # (_IDLE_WAIT_S); mid-step, the executor's own wait sees it.
                self.engine_core.executor.check_alive()
                self._process_input_queue()  # requests, aborts and control calls: all between two steps
                self.engine_core.expire_idle_weight_update()
                if self.running and self.engine_core.has_unfinished_requests():
                    self._step()  # schedule -> execute -> update; the outputs go to the output thread
            except Exception as e:
                self._on_fault(e)  # returns once recovered; raises when the engine must exit

    def _process_input_queue(self) -> None:
        """Handles what has arrived, and answers the deferred utility calls whose answer is known."""
        self._answer_deferred()
        # Block only when idle; otherwise take what has arrived and go back to stepping.
        if self._is_idle():
            try:
                # A timeout, so that SIGTERM's handler runs soon even if a signal lands on
                # another thread and leaves this one asleep (and a deferred answer goes out soon).
                self._handle(*self.input_queue.get(timeout=POLL_INTERVAL_S if self._deferred else _IDLE_WAIT_S))
            except queue.Empty:
                return
        while self.running:
            try:
                item = self.input_queue.get_nowait()
            except queue.Empty:
                return
            self._handle(*item)

    def _is_idle(self) -> bool:
        """Nothing to step: the loop may block waiting for input."""
        return not self.engine_core.has_unfinished_requests()

    def _handle(self, request_type: bytes, client_index: int, payload: Any) -> None:
        if request_type == EngineCoreRequestType.ADD.value:
            self._add_request(client_index, payload)
        elif request_type == EngineCoreRequestType.ABORT.value:
            self._abort_requests(client_index, payload)
        elif request_type == EngineCoreRequestType.UTILITY.value:
            self._call_utility(client_index, *payload)
        else:
            logger.error("EngineCoreProc: unknown request type %r", request_type)

    def _add_request(self, client_index: int, request: EngineCoreRequest) -> None:
        request.client_index = client_index  # the socket it came on is authoritative
        try:
            self.engine_core.add_request(request)
        except Exception as e:  # a bad request must not stop the engine: fail only that request
            # The reason travels in stop_reason, so the frontend can show it.
            logger.warning("EngineCoreProc: request %r refused: %s", request.request_id, e)
            reason = f"EngineDeadError: {e}" if isinstance(e, EngineDeadError) else str(e)  # the frontend raises it as such
            error = EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ERROR, stop_reason=reason)
            self._send(client_index, EngineCoreOutputs(outputs=[error], timestamp=time.time()))
            return
        self.req_clients[request.request_id] = client_index

    def _abort_requests(self, client_index: int, req_ids: list[str]) -> None:
        own = [r for r in req_ids if self.req_clients.get(r) == client_index]  # never another client's
        for req_id in own:
            del self.req_clients[req_id]
        aborted = self.engine_core.abort_requests(own)
        if aborted:
            # Fresh stats ride along: if the engine is now idle no step will report them.
            stats = self.engine_core.scheduler.make_stats()
            self._send(client_index, EngineCoreOutputs(outputs=aborted, timestamp=time.time(), scheduler_stats=stats))

    def _call_utility(self, client_index: int, _sender_index: int, call_id: int, method: str, args: list) -> None:
        try:
            if method == "shutdown":
                self.running = False
                result = None
            else:
                # A utility with a deferred form answers later (see EngineCore.DEFERRED_UTILITIES).
                sync_trace.mark(f"engine: {method} started")
                name = self.engine_core.DEFERRED_UTILITIES.get(method, method)
                fn = getattr(self.engine_core, name, None) if not method.startswith("_") else None
                if not callable(fn):
                    raise AttributeError(f"EngineCore has no method {method!r}")
                result = fn(*args)
                if isinstance(result, DeferredResult):
                    self._deferred.append((client_index, call_id, result))
                    return
        except Exception as e:
            self._answer_utility(client_index, call_id, error=e)
            return
        self._answer_utility(client_index, call_id, result)

    def _answer_deferred(self) -> None:
        """Sends the answers of deferred utility calls that are known (polled every POLL_INTERVAL_S at most)."""
        if not self._deferred or time.monotonic() < self._next_deferred_poll:
            return
        self._next_deferred_poll = time.monotonic() + POLL_INTERVAL_S
        pending = []
        for client_index, call_id, deferred in self._deferred:
            if not deferred.poll():
                pending.append((client_index, call_id, deferred))
                continue
            try:
                result = deferred.result()
            except Exception as e:
                self._answer_utility(client_index, call_id, error=e)
            else:
                self._answer_utility(client_index, call_id, result)
        self._deferred = pending

    def _answer_utility(self, client_index: int, call_id: int, result: Any = None, error: Exception | None = None) -> None:
        if error is not None:
            answer = UtilityOutput(call_id, failure_message=f"{type(error).__name__}: {error}")
        else:
            answer = UtilityOutput(call_id, result=result)
        # Fresh stats ride along (pause/sleep/wake_up change gauges even while the engine idles).
        stats = self.engine_core.make_stats() if error is None else None
        self._send(client_index, EngineCoreOutputs(utility_output=answer, timestamp=time.time(), scheduler_stats=stats))

    def _step(self) -> None:
        step = self.engine_core.step()
        stats = step.scheduler_stats  # made once per step by EngineCore.step (it resets per-step counters)
        by_client: dict[int, list[EngineCoreOutput]] = defaultdict(list)
        for out in step.outputs:
            client = self.req_clients.pop(out.request_id, 0) if out.finished else self.req_clients.get(out.request_id, 0)
            by_client[client].append(out)
        # Clients hear about steps that carry their outputs; when the engine falls idle every
        # client gets one last (possibly empty) message, so its gauges come back to zero.
        idle = not self.engine_core.has_unfinished_requests()
        clients = list(range(len(self.output_sockets))) if idle else list(by_client)
        if not clients and stats is not None:
            # A step without outputs still counts (async scheduling's first step after admission made
            # the prefix-cache lookups): its stats go to client 0 rather than nowhere.
            clients = [0]
        for i, client in enumerate(clients):
            self._send(
                client,
                EngineCoreOutputs(
                    outputs=by_client.get(client, []),
                    timestamp=step.timestamp,
                    # The counts since the last stats go to one client; the others get the gauges.
                    scheduler_stats=stats if i == 0 or stats is None else stats.gauges_only(),
                    engine_index=self.engine_index,
                    weight_version=step.weight_version,
                    lora_weight_versions=step.lora_weight_versions,
                ),
            )

    def _send(self, client_index: int, outputs: EngineCoreOutputs) -> None:
        outputs.engine_index = self.engine_index
        self.output_queue.put((client_index, outputs))

    # ---- faults (busy loop side) -------------------------------------------------------------

    def _on_fault(self, error: Exception) -> None:
        """The sentinel: fail every in-flight request, then exit (raise) or wait for `retry`."""
        recoverable = self.fault_tolerance.enable_fault_tolerance and self.engine_core.executor.is_alive()
        status = EngineStatus.UNHEALTHY if recoverable else EngineStatus.DEAD
        with self._status_lock:
            self._retry.clear()
            self.status = status
        self._fail_in_flight(f"{type(error).__name__}: {error}", status)
        if not recoverable:
            raise error  # run_engine_core logs it and exits non-zero
        logger.exception("EngineCoreProc %d: a step failed; the engine is unhealthy", self.engine_index)
        timeout_s = self.fault_tolerance.engine_recovery_timeout_sec
        deadline = time.monotonic() + timeout_s
        # Short waits, so that SIGTERM's handler runs soon (see _process_input_queue).
        while not self._retry.wait(max(0.0, min(_IDLE_WAIT_S, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                self._set_status(EngineStatus.DEAD)
                raise EngineRecoveryTimeout(f"no retry instruction within {timeout_s:g} s") from error
        if not self.running:  # a "shutdown" call arrived while unhealthy
            return
        logger.info("EngineCoreProc %d: retry: resetting the engine", self.engine_index)
        try:
            self.engine_core.reset_after_fault()
        except BaseException:
            self._set_status(EngineStatus.DEAD)
            raise
        with self._status_lock:
            self.status = EngineStatus.HEALTHY
            retry_calls, self._retry_calls = self._retry_calls, []
        self._broadcast(EngineStatus.HEALTHY, scheduler_stats=self.engine_core.make_stats())
        for client_index, call_id in retry_calls:
            answer = UtilityOutput(call_id, result=str(EngineStatus.HEALTHY))
            self._send(client_index, EngineCoreOutputs(utility_output=answer, timestamp=time.time()))

    def _fail_in_flight(self, reason: str, status: EngineStatus) -> None:
        """Ends every request the core holds with ERROR (the reason in stop_reason); tells every client `status`."""
        by_client: dict[int, list[EngineCoreOutput]] = defaultdict(list)
        for req_id, client_index in self.req_clients.items():
            by_client[client_index].append(
                EngineCoreOutput(req_id, [], finish_reason=FinishReason.ERROR, stop_reason=reason)
            )
        self.req_clients.clear()
        for client_index in range(len(self.output_sockets)):
            self._send(
                client_index,
                EngineCoreOutputs(outputs=by_client.get(client_index, []), timestamp=time.time(), engine_status=status),
            )

    def _set_status(self, status: EngineStatus) -> None:
        with self._status_lock:
            self.status = status
        self._broadcast(status)

    def _broadcast(self, status: EngineStatus, **fields: Any) -> None:
        for client_index in range(len(self.output_sockets)):
            self._send(client_index, EngineCoreOutputs(timestamp=time.time(), engine_status=status, **fields))

    # ---- faults (input thread side) ----------------------------------------------------------

    def _fault_tolerance_call(self, client_index: int, call_id: int, instruction: str) -> None:
        """Answers "status" and "retry" at once, except a retry of an unhealthy engine (see _on_fault)."""
        with self._status_lock:
            status = self.status
            if instruction == "status":
                answer = UtilityOutput(call_id, result=str(status))
            elif instruction == "retry" and status == EngineStatus.UNHEALTHY:
                self._retry_calls.append((client_index, call_id))
                self._retry.set()
                return
            elif instruction == "retry" and status == EngineStatus.DEAD:
                answer = UtilityOutput(call_id, failure_message="EngineDeadError: the engine is dead; it cannot be retried")
            elif instruction == "retry":  # healthy: nothing to recover from
                answer = UtilityOutput(call_id, result=str(status))
            else:
                answer = UtilityOutput(
                    call_id, failure_message=f"ValueError: unknown fault tolerance instruction {instruction!r}"
                )
        self._send(client_index, EngineCoreOutputs(utility_output=answer, timestamp=time.time()))

    def _refuse_while_unhealthy(self, request_type: bytes, client_index: int, payload: Any) -> bool:
        """While the engine is not HEALTHY: fail new requests and utility calls now; True if refused."""
        status = self.status
        if status == EngineStatus.HEALTHY:
            return False
        reason = f"the engine is {status}" + ("; send the retry instruction" if status == EngineStatus.UNHEALTHY else "")
        if request_type == EngineCoreRequestType.ADD.value:
            # A dead engine's refusal carries the EngineDeadError prefix (as _add_request's does), so the
            # frontend raises it as such instead of ending the request with an ordinary error output.
            stop_reason = f"EngineDeadError: {reason}" if status == EngineStatus.DEAD else reason
            error = EngineCoreOutput(payload.request_id, [], finish_reason=FinishReason.ERROR, stop_reason=stop_reason)
            self._send(client_index, EngineCoreOutputs(outputs=[error], timestamp=time.time()))
            return True
        if request_type == EngineCoreRequestType.UTILITY.value:
            _sender_index, call_id, method, _args = payload
            if method == "shutdown":  # wakes the busy loop, which then leaves
                self.running = False
                self._retry.set()
                answer = UtilityOutput(call_id)
            else:
                answer = UtilityOutput(call_id, failure_message=f"EngineUnhealthyError: {reason}")
            self._send(client_index, EngineCoreOutputs(utility_output=answer, timestamp=time.time()))
            return True
        return False  # aborts keep their place in the queue (nothing is in flight anyway)

    # ---- IO threads --------------------------------------------------------------------------

    def _input_loop(self, client_index: int, sock: zmq.Socket) -> None:
        decoders = {
            EngineCoreRequestType.ADD.value: MsgpackDecoder(EngineCoreRequest),
            EngineCoreRequestType.ABORT.value: MsgpackDecoder(list[str]),
            EngineCoreRequestType.UTILITY.value: MsgpackDecoder(tuple[int, int, str, list]),
            EngineCoreRequestType.FAULT_TOLERANCE.value: MsgpackDecoder(tuple[int, str]),
        }
        try:
            while not self._stop_inputs.is_set():
                if not sock.poll(_POLL_MS):
                    continue
                type_frame, *frames = sock.recv_multipart(copy=False)
                request_type = type_frame.bytes
                try:
                    payload = decoders[request_type].decode(frames)
                except Exception as e:  # a malformed message is dropped, the engine keeps serving
                    logger.error("EngineCoreProc: undecodable %r message from client %d: %s", request_type, client_index, e)
                    continue
                if request_type == EngineCoreRequestType.FAULT_TOLERANCE.value:
                    self._fault_tolerance_call(client_index, *payload)
                elif not self._refuse_while_unhealthy(request_type, client_index, payload):
                    if request_type == EngineCoreRequestType.UTILITY.value:
                        sync_trace.mark("engine: call received")
                    self.input_queue.put((request_type, client_index, payload))
        finally:
            sock.close(linger=0)

    def _output_loop(self) -> None:
        encoder = MsgpackEncoder()
        while (item := self.output_queue.get()) is not None:
            client_index, outputs = item
            try:
                encoder.send(self.output_sockets[client_index], outputs)
                if outputs.utility_output is not None:
                    sync_trace.mark("engine: answer sent")
            except Exception as e:
                logger.error("EngineCoreProc: could not send outputs to client %d: %s", client_index, e)
                if outputs.utility_output is not None:  # e.g. a result msgpack cannot encode
                    failed = UtilityOutput(outputs.utility_output.call_id, failure_message=f"{type(e).__name__}: {e}")
                    encoder.send(self.output_sockets[client_index], EngineCoreOutputs(utility_output=failed))
        for sock in self.output_sockets:
            sock.close(linger=_CLOSE_LINGER_MS)

    # ---- start-up and shutdown ---------------------------------------------------------------

    def _handshake(self, message: EngineHandshake) -> None:
        payload = msgspec.msgpack.encode(message)
        for sock in self.input_sockets:
            sock.send(payload)

    def _close_sockets(self) -> None:
        for sock in [*self.input_sockets, *self.output_sockets]:
            sock.close(linger=_CLOSE_LINGER_MS)
        self.ctx.term()

    def close(self) -> None:
        """Stops the IO threads (flushing queued outputs) and the core; the process may then exit."""
        self.running = False
        self.output_queue.put(None)
        self.output_thread.join(timeout=5)
        self._stop_inputs.set()
        for t in self.input_threads:
            t.join(timeout=5)
        self.engine_core.shutdown()
        if not any(t.is_alive() for t in [*self.input_threads, self.output_thread]):
            self.ctx.term()  # would wait forever on a socket a stuck thread still holds

    @staticmethod
    def run_engine_core(
        config: EngineConfig, input_addresses: list[str], output_addresses: list[str], engine_index: int = 0
    ) -> None:
        """The child process's entry point: serve until SIGTERM or a "shutdown" utility call."""

        def on_sigterm(signum, frame):
            raise SystemExit(0)

        signal.signal(signal.SIGTERM, on_sigterm)
        # Ctrl-C reaches the whole process group; the frontend decides what happens, then
        # terminates us. (An engine dying first would turn its clean-up into EngineDeadError.)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # `kill -USR1 <pid>` prints every thread's stack to stderr: where a stuck engine waits.
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        # The parent's death (even by SIGKILL) becomes our SIGTERM, so no engine is orphaned.
        watch_parent(lambda: os.kill(os.getpid(), signal.SIGTERM), "engine-parent-watch")
        proc = None
        exit_code = 0
        try:
            proc_class = EngineCoreProc
            if config.parallel.lockstep:
                from engine.dp_core_proc import DPEngineCoreProc

                proc_class = DPEngineCoreProc
            proc = proc_class(config, input_addresses, output_addresses, engine_index)
            # This process is the engine's own: everything made so far (imported libraries, the model, graphs,
            # caches) lives as long as it does. Moved out of the collector's view, a full collection while
            # serving walks only what steps allocate (on a CPU process with ~330k tracked objects one took
            # 190 ms; GPU processes hold more). Acyclic garbage is still freed by reference counting. Only
            # here: an in-process engine shares its caller's heap, whose garbage must stay collectable.
            gc.collect()
            gc.freeze()
            proc.run_busy_loop()
        except SystemExit:
            pass
        except BaseException:
            logger.exception("EngineCoreProc %d failed", engine_index)
            traceback.print_exc()
            exit_code = 1
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut clean-up short
            if proc is not None:
                proc.close()
        sys.exit(exit_code)
