"""PendingInit: one init_weight_transfer_engine's rendezvous with its peer, in a daemon thread under a deadline.

A backend's init_transfer may wait on the trainer (nccl: its TCPStore, then its group) for up to
the init's timeout_s. The worker never waits with it: it validates init_info, checks the peer's
address against weight_transfer_allowed_hosts, starts the rendezvous here and goes back to
serving steps; the engine core polls (Executor.poll_weight_transfer_init) and, once every rank
is ready, every rank installs its new transfer engine at once - or, when one failed, every rank
drops its own (cancel), so a failed init changes nothing anywhere.

    PendingInit(...)   the thread starts: the peer's name resolves (and is checked), then init_transfer
    poll()             False while it runs; True once the transfer engine is ready to install;
                       raises its error (a TimeoutError as PeerTimeoutError), or PeerTimeoutError
                       once the deadline passes while the thread still waits
    cancel()           the transfer engine it built, or builds later, is shut down, never installed

A rendezvous stuck past its deadline (a TCPStore client facing a silent listener waits forever)
is abandoned: its thread is a daemon, and whatever it finishes with later is shut down.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from engine.allowed_hosts import AllowedHosts
from engine.exceptions import PeerTimeoutError
from weight_transfer.base import Rendezvous, WeightTransferEngine

logger = logging.getLogger(__name__)

# Past the peer's timeout_s before the worker gives up by itself: the backend's own bounded
# waits (which say more about what failed) report first.
_GRACE_S = 1.0


class PendingInit:
    """The rendezvous of `engine` (a new transfer engine, bound and with init_info parsed) with its peer."""

    def __init__(self, engine: WeightTransferEngine, init_info: Any, backend: str, allowed_hosts: AllowedHosts,
                 device: torch.device) -> None:
        self.engine, self.backend = engine, backend
        self.rendezvous: Rendezvous = engine.rendezvous(init_info)
        if self.rendezvous.host is not None:  # before any thread or connection: a refusal costs nothing
            allowed_hosts.check(self.rendezvous.host, self.rendezvous.where)
        self.deadline = time.monotonic() + self.rendezvous.timeout_s + _GRACE_S
        self._lock = threading.Lock()  # guards the three fields below against the thread
        self._finished = False
        self._error: BaseException | None = None
        self._dropped = False  # cancelled or given up on: the engine is shut down, never installed
        threading.Thread(
            target=self._run, args=(init_info, allowed_hosts, device), name=f"weight-transfer-init-{backend}", daemon=True
        ).start()

    def _run(self, init_info: Any, allowed_hosts: AllowedHosts, device: torch.device) -> None:
        error = None
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)  # the current device is per thread
            if self.rendezvous.host is not None:
                allowed_hosts.check_resolved(self.rendezvous.host, self.rendezvous.where)  # may wait on DNS
            self.engine.init_transfer(init_info)
        except BaseException as e:  # noqa: BLE001 - handed to poll()
            error = e
        with self._lock:
            self._finished, self._error = True, error
            dropped = self._dropped
        if dropped:  # given up on while it ran: its late result is discarded
            logger.info("weight transfer init (%s) finished after it was given up on; discarded", self.backend)
            self._shut_down()

    def poll(self) -> bool:
        """True once ready to install; raises the init's error (the engine is then already shut down)."""
        with self._lock:
            if self._finished and self._error is None:
                return True
            error = self._error
            if error is None and time.monotonic() < self.deadline:
                return False
        self.cancel()
        if error is None:
            raise PeerTimeoutError(self._timeout_message("the rendezvous was given up on"))
        if isinstance(error, TimeoutError) and not isinstance(error, PeerTimeoutError):
            raise PeerTimeoutError(self._timeout_message(str(error).strip().split("\n", 1)[0])) from error
        raise error

    def wait(self) -> None:
        """Polls until ready (callers without a loop to get back to); raises as poll() does."""
        while not self.poll():
            time.sleep(0.01)

    def cancel(self) -> None:
        """Drops the transfer engine: shut down now if the thread is done, else when it finishes. Idempotent."""
        with self._lock:
            if self._dropped:
                return
            self._dropped = True
            finished = self._finished
        if finished:
            self._shut_down()

    def _timeout_message(self, detail: str) -> str:
        return (f"init_weight_transfer_engine: {self.rendezvous.peer} did not answer within "
                f"timeout_s={self.rendezvous.timeout_s:g}; nothing changed in the engine ({detail})")

    def _shut_down(self) -> None:
        try:
            self.engine.shutdown()
        except Exception as e:  # a half-initialized transport: nothing else to do with it
            logger.warning("shutting down a dropped %s transfer engine: %s", self.backend, e)
