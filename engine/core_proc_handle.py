"""EngineCoreProcHandle: the frontend's side of one engine process - its addresses, the process, its death."""

from __future__ import annotations

import logging
import multiprocessing
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable

from engine.config import EngineConfig
from engine.core_proc import EngineCoreProc

logger = logging.getLogger(__name__)


class EngineCoreProcHandle:
    """The frontend side of one engine process: its addresses, the process, and its death.

    Holds `num_clients` address pairs (ipc:// paths in a private temp dir); client i binds pair
    i, so several frontends may share one engine. `start()` is idempotent (every client calls
    it after binding); the process stops when the last attached client detaches, on
    `shutdown()`, or at interpreter exit (weakref.finalize), so no engine outlives its parent.
    """

    def __init__(self, config: EngineConfig, num_clients: int = 1, engine_index: int = 0) -> None:
        if num_clients < 1:
            raise ValueError(f"num_clients must be >= 1, got {num_clients}")
        self.config = config
        self.engine_index = engine_index
        self.num_clients = num_clients
        self._tmpdir = tempfile.mkdtemp(prefix="engine-core-")
        self.input_addresses = [f"ipc://{self._tmpdir}/in-{i}" for i in range(num_clients)]
        self.output_addresses = [f"ipc://{self._tmpdir}/out-{i}" for i in range(num_clients)]
        self.proc: multiprocessing.process.BaseProcess | None = None
        self._lock = threading.Lock()
        self._clients: dict[int, Callable[[str], None]] = {}  # client index -> its on-death callback
        self._dead_message: str | None = None
        self._shutting_down = False
        self._finalizer = weakref.finalize(self, _stop_process, None, self._tmpdir)

    def start(self) -> None:
        with self._lock:
            if self.proc is not None:
                return
            ctx = multiprocessing.get_context("spawn")
            # daemon: multiprocessing also terminates it at exit. (Daemons may not have children;
            # the multi-process executor lifts that in the engine process: its workers watch
            # their parent and exit with it, see engine/executor/multiproc.py.)
            self.proc = ctx.Process(
                target=EngineCoreProc.run_engine_core,
                args=(self.config, self.input_addresses, self.output_addresses, self.engine_index),
                name=f"EngineCore_{self.engine_index}",
                daemon=True,
            )
            self.proc.start()
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _stop_process, self.proc, self._tmpdir)
            threading.Thread(target=self._monitor, args=(self.proc,), name="engine-monitor", daemon=True).start()

    def attach(self, client_index: int, on_death: Callable[[str], None]) -> None:
        if not 0 <= client_index < self.num_clients:
            raise ValueError(f"client_index must be in [0, {self.num_clients}), got {client_index}")
        with self._lock:
            if client_index in self._clients:
                raise ValueError(f"client_index {client_index} is already attached")
            self._clients[client_index] = on_death
            dead = self._dead_message
        if dead is not None:
            on_death(dead)

    def detach(self, client_index: int) -> None:
        with self._lock:
            self._clients.pop(client_index, None)
            last = not self._clients
        if last:
            self.shutdown()

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    @property
    def exitcode(self) -> int | None:
        return None if self.proc is None else self.proc.exitcode

    def shutdown(self) -> None:
        """SIGTERM, then SIGKILL after a grace period; removes the ipc files. Idempotent."""
        self._shutting_down = True
        self._finalizer()

    def _monitor(self, proc) -> None:
        multiprocessing.connection.wait([proc.sentinel])
        proc.join()
        why = "was shut down" if self._shutting_down else f"died (exit code {proc.exitcode})"
        message = f"the engine process {proc.name} {why}"
        if not self._shutting_down:
            logger.error(message)
        with self._lock:
            self._dead_message = message
            callbacks = list(self._clients.values())
        for callback in callbacks:
            try:
                callback(message)
            except Exception:  # e.g. its event loop is closed
                logger.debug("engine death callback failed", exc_info=True)


def _stop_process(proc, tmpdir: str, grace_s: float = 5.0) -> None:
    if proc is not None and proc.is_alive():
        proc.terminate()
        proc.join(grace_s)
        if proc.is_alive():
            proc.kill()
            proc.join()
    shutil.rmtree(tmpdir, ignore_errors=True)
