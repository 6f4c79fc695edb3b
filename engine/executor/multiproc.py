"""MultiprocExecutor: one worker process per tensor-parallel rank; every call is broadcast to all of them over pipes.

Transport: one duplex pipe per worker. A call is pickled once and written to every pipe; each
worker answers with a WorkerReply (rank 0 with the result, the others with an ack unless the
call wants every rank's result). Pipes over a shared-memory ring because a SchedulerOutput is a
few kilobytes of ids and diffs, so one pickle and N small writes cost microseconds next to a
forward pass, and a pipe reports a dead peer (EOF) by itself; a ring would save a copy but bring
its own synchronisation, sizing and overflow handling.

Failures: an exception in a worker comes back as a reply and is re-raised here with the rank and
the remote traceback. Every wait is a loop of short waits on the pipes and the processes'
sentinels, so a worker that dies is seen within _POLL_S: the executor is then dead
(is_alive() is False), the other workers are stopped and the call raises WorkerDiedError.
Pickle, not multiprocessing's ForkingPickler: tensors travel by value, never as shared-memory
handles whose lifetime the sender would have to manage.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import sys
import time
import traceback
import weakref
from typing import Any

from engine.config import EngineConfig
from engine.executor.base import Executor, WorkerDiedError, WorkerReply, call_worker, results_or_raise
from engine.parent_watch import watch_parent

_POLL_S = 1.0  # longest a wait for workers goes without checking that they are all alive
# After one rank fails a call, how long the others get to answer: a rank still busy after that
# is presumably stuck in a collective the failed rank never joined, so the group is unusable.
_ERROR_GRACE_S = 30.0
_STOP_GRACE_S = 5.0  # shutdown: how long workers get to leave on their own before SIGTERM / SIGKILL


class MultiprocExecutor(Executor):
    """Starts tensor_parallel_size worker processes (spawn) and waits until each has built its Worker."""

    def __init__(self, config: EngineConfig, max_model_len: int) -> None:
        super().__init__(config, max_model_len)
        _allow_children()
        ctx = multiprocessing.get_context("spawn")
        # A port that was free a moment ago; another process could take it first, in which case
        # rank 0 fails to bind and start-up fails with that error (rare, and never silent).
        init_method = f"tcp://127.0.0.1:{_free_port()}" if self.world_size > 1 else None
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.conns: list[multiprocessing.connection.Connection] = []
        for rank in range(self.world_size):
            conn, child_conn = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_worker_main,
                args=(config, max_model_len, rank, self.world_size, init_method, child_conn),
                name=f"EngineWorker_TP{rank}",
                daemon=True,  # the engine's exit (multiprocessing's atexit) takes them along
            )
            proc.start()
            child_conn.close()  # only the worker holds its end now, so its death reads as EOF here
            self.procs.append(proc)
            self.conns.append(conn)
        self._finalizer = weakref.finalize(self, _stop_workers, self.procs, self.conns)
        try:
            # Each worker's first reply: its pid once its Worker is built, or its start-up error.
            # No grace: a rank that failed leaves the others waiting for it in the group's rendezvous.
            self.worker_pids = results_or_raise(self._gather(error_grace_s=0.0))
        except BaseException:
            self.shutdown()
            raise

    # ---- calls -------------------------------------------------------------------------------

    def collective_rpc(
        self, method: str, args: tuple = (), kwargs: dict | None = None, unique_reply_rank: int | None = None
    ) -> list[Any]:
        self.check_alive()
        message = pickle.dumps((method, args, kwargs or {}, unique_reply_rank), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(message)
            except OSError:  # BrokenPipeError and friends: the worker is gone
                self._raise_dead(rank)
        return results_or_raise(self._gather(_ERROR_GRACE_S))

    def _gather(self, error_grace_s: float) -> list[WorkerReply]:
        """Every rank's next reply; raises WorkerDiedError when a worker dies or the group is stuck."""
        pending = dict(enumerate(self.conns))  # rank -> its pipe, until it answers
        replies: list[WorkerReply] = []
        give_up_at: float | None = None  # set by the first failed reply
        while pending:
            wait_s = _POLL_S if give_up_at is None else max(0.0, min(_POLL_S, give_up_at - time.monotonic()))
            ready = multiprocessing.connection.wait([*pending.values(), *(p.sentinel for p in self.procs)], wait_s)
            for rank, conn in list(pending.items()):
                if conn not in ready:
                    continue
                try:
                    reply = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    self._raise_dead(rank)
                del pending[rank]
                replies.append(reply)
                if not reply.ok and give_up_at is None:
                    give_up_at = time.monotonic() + error_grace_s
            failed = {r.rank for r in replies if not r.ok}  # (a rank whose start-up failed exits)
            for rank, proc in enumerate(self.procs):
                if proc.exitcode is not None and rank not in failed:  # even one that answered: the group cannot go on
                    self._raise_dead(rank)
            if pending and give_up_at is not None and time.monotonic() >= give_up_at:
                self._give_up(replies, sorted(pending))
        return replies

    def _raise_dead(self, rank: int) -> None:
        proc = self.procs[rank]
        proc.join(timeout=1.0)  # its exit code, if it is on its way out
        self._mark_dead(self._describe_death(rank))
        raise WorkerDiedError(self.dead_reason)

    def _describe_death(self, rank: int) -> str:
        proc = self.procs[rank]
        return f"tensor-parallel worker rank {rank} (pid {proc.pid}) {_describe_exit(proc.exitcode)}"

    # ---- liveness and shutdown ---------------------------------------------------------------

    def is_alive(self) -> bool:
        if self.dead_reason is None:
            for rank, proc in enumerate(self.procs):
                if proc.exitcode is not None:  # a non-blocking waitpid: cheap enough for every loop
                    self._mark_dead(self._describe_death(rank))
                    break
        return self.dead_reason is None

    def shutdown(self) -> None:
        """Closes the pipes (workers leave on EOF), then SIGTERM and SIGKILL for any that do not."""
        if self.dead_reason is None:
            self.dead_reason = "the executor was shut down"
        self._finalizer()


def _stop_workers(procs: list, conns: list) -> None:
    for conn in conns:
        conn.close()
    deadline = time.monotonic() + _STOP_GRACE_S
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.exitcode is None:
            proc.terminate()
            proc.join(timeout=1.0)
        if proc.exitcode is None:
            proc.kill()
            proc.join(timeout=1.0)


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "is unreachable (its pipe closed)"
    if exitcode < 0:
        return f"died (killed by {signal.Signals(-exitcode).name})"
    return f"died (exit code {exitcode})"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _allow_children() -> None:
    """Lets a daemonic process start worker processes.

    The engine process is daemonic (so that it ends with its frontend), and multiprocessing
    refuses children of daemons because terminating the daemon would orphan them. Our workers
    exit when their parent does (watch_parent), so nothing is orphaned and the flag may go.
    """
    current = multiprocessing.current_process()
    if current.daemon:
        current.daemon = False


# ---- the worker process ------------------------------------------------------------------------


def _worker_main(
    config: EngineConfig,
    max_model_len: int,
    rank: int,
    world_size: int,
    init_method: str | None,
    conn: multiprocessing.connection.Connection,
) -> None:
    """A worker process: builds the Worker, then runs calls from the pipe until it closes."""
    watch_parent(lambda: os._exit(1), "worker-parent-watch")  # even mid-call or mid-collective
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the frontend's to handle, not ours
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: every thread's stack to stderr
    from engine.executor.cpu_threads import apply_cpu_threads
    from engine.worker.worker import Worker  # after the signal set-up: importing torch takes a while

    if config.device.resolve() == "cpu":
        # The ranks share the host's cores: a slice each, pinned, one left to the front end.
        apply_cpu_threads(world_size, rank, pin=True)
    try:
        worker = Worker(config, max_model_len, rank, world_size, init_method)
    except BaseException as e:
        _send(conn, WorkerReply.failed(rank, e, traceback.format_exc()))
        return
    _send(conn, WorkerReply(rank, os.getpid()))
    while True:
        try:
            method, args, kwargs, reply_rank = pickle.loads(conn.recv_bytes())
        except EOFError:  # the executor closed the pipe (shutdown), or the engine is gone
            break
        try:
            _send(conn, call_worker(worker, rank, method, args, kwargs, reply_rank))
        except OSError:  # the engine went away while this call ran
            break
    worker.shutdown()
    # Nothing of ours is left to clean up; skipping the interpreter's teardown (torch's modules,
    # a second or so) makes an engine's shutdown that much quicker.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _send(conn: multiprocessing.connection.Connection, reply: WorkerReply) -> None:
    try:
        payload = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # e.g. a result pickle cannot handle
        payload = pickle.dumps(WorkerReply.failed(reply.rank, e, traceback.format_exc()))
    conn.send_bytes(payload)
