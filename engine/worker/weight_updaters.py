"""WeightUpdaters: a worker's weight-update calls over its models (the target's WeightUpdater, and the draft model's), one lifecycle for both."""

from __future__ import annotations

import time

from engine.exceptions import WeightTransferError, WeightUpdateStateError
from engine.lora.request import LoRARequest
from engine.worker.lora_weight_update import LoRAWeightUpdater
from engine.worker.transfer_init import PendingInit
from engine.worker.weight_update import DRAFT_MODEL, TARGET_MODEL, WEIGHT_MODELS, WeightUpdater


class WeightUpdaters:
    """A worker's WeightUpdaters by model (the target's, and the draft model's when speculative
    decoding runs one) behind the worker's weight-update calls: one lifecycle for both.

    Each model has its own transfer engine: init_weight_transfer_engine with init_info "model"
    names it ("target" when absent). start_update, finish_update and abort_update act on every
    model that has one, so one update may land tensors in either model (update_info "model")
    and no step ever sees a half-done update of either. A transfer that fails in one model
    ends the update and restores both. The "model" key is removed before a backend sees the dict.

    With LoRA serving, the same lifecycle carries adapter syncs (update_lora: the EngineCore took
    update_info's "lora_name" off and resolved it): staged through the target's transfer engine,
    committed at finish, dropped at abort or when any transfer of the update fails.
    """

    def __init__(self, target: WeightUpdater, draft: WeightUpdater | None = None,
                 loras: LoRAWeightUpdater | None = None) -> None:
        self.target = target
        self.draft = draft  # None: the engine runs no draft model
        self.loras = loras  # None: LoRA is off
        # An init_weight_transfer_engine whose rendezvous runs (begin_init .. commit_init or its failure),
        # and the updater it is for. While it runs, every other weight-update call is refused.
        self._pending: tuple[WeightUpdater, PendingInit] | None = None

    def all(self) -> list[WeightUpdater]:
        return [self.target] if self.draft is None else [self.target, self.draft]

    def select(self, model: str, where: str = "model") -> WeightUpdater:
        """The updater of `model` ("target" or "draft"); ValueError naming `where` when there is no such model."""
        if model == TARGET_MODEL:
            return self.target
        if model == DRAFT_MODEL:
            if self.draft is None:
                raise ValueError(f"{where}: 'draft' names the draft model, but this engine has none (speculative "
                                 "decoding with method 'draft_model' loads one); nothing was changed")
            return self.draft
        raise ValueError(f"{where}: expected one of {list(WEIGHT_MODELS)}, got {model!r}")

    def _split(self, info, where: str) -> tuple[WeightUpdater, dict]:
        """(the updater `info` names, info without its "model" key); a non-dict goes to the target
        unchanged, whose backend says what is wrong with it."""
        if not isinstance(info, dict) or "model" not in info:
            return self.target, info
        rest = dict(info)
        return self.select(rest.pop("model"), f"{where}.model"), rest

    # ---- init: begin_init, then poll_init until True, then commit_init (or cancel_init) -------------
    # The engine core drives these across every rank, so that all of them install their new transfer
    # engine together, or none does (a failed or timed-out init changes nothing).

    def begin_init(self, init_info: dict) -> None:
        """Validates init_info and starts its rendezvous in the background; ValueError: nothing started."""
        self._refuse_while_init_pending("init_weight_transfer_engine")
        updater, init_info = self._split(init_info, "init_info")
        if any(u.updating for u in self.all()):  # a model joining mid-update would miss its start
            raise WeightUpdateStateError("init_weight_transfer_engine: a weight update is in progress; finish it first")
        self._pending = (updater, updater.begin_transfer_engine(init_info))

    def poll_init(self) -> bool:
        """True once the pending init is ready to commit; raises its error (it is then dropped)."""
        if self._pending is None:
            raise WeightUpdateStateError("poll_weight_transfer_init: no init_weight_transfer_engine in progress")
        try:
            return self._pending[1].poll()
        except BaseException:
            self._pending = None
            raise

    def commit_init(self) -> None:
        """Installs the ready pending init's transfer engine (the previous one is shut down)."""
        if not self.poll_init():
            raise WeightUpdateStateError("commit_weight_transfer_init: the init's rendezvous is still running")
        updater, pending = self._pending
        self._pending = None
        updater.install_transfer_engine(pending)

    def cancel_init(self) -> None:
        """Drops a pending init (its transfer engine is shut down, now or when its rendezvous ends); a no-op without one."""
        if self._pending is not None:
            self._pending[1].cancel()
            self._pending = None

    def init_transfer_engine(self, init_info: dict) -> None:
        """begin_init, wait, commit_init: for callers that can block (a worker used directly)."""
        self.begin_init(init_info)
        while not self.poll_init():
            time.sleep(0.01)
        self.commit_init()

    def _refuse_while_init_pending(self, method: str) -> None:
        if self._pending is not None:
            rendezvous = self._pending[1].rendezvous
            raise WeightUpdateStateError(
                f"{method}: init_weight_transfer_engine is still waiting for {rendezvous.peer} (up to timeout_s="
                f"{rendezvous.timeout_s:g}); call again once it has answered"
            )

    # ---- one update ----------------------------------------------------------------------------

    def start_update(self) -> None:
        self._refuse_while_init_pending("start_weight_update")
        ready = [u for u in self.all() if u.transfer_engine is not None]
        if not ready:
            self.target.start_update()  # raises: no transfer engine
        started: list[WeightUpdater] = []
        try:
            for updater in ready:
                updater.start_update()
                started.append(updater)
        except BaseException:
            for updater in started:
                updater.abort_update()
            raise
        self._discard_loras()  # (every update ends by commit or discard: nothing is staged here)

    def update_weights(self, update_info: dict) -> int:
        self._refuse_while_init_pending("update_weights")
        updater, update_info = self._split(update_info, "update_info")
        try:
            return updater.update_weights(update_info)
        except WeightTransferError:  # this model's update is over and restored: so is the other's
            for other in self.all():
                if other is not updater:
                    other.abort_update()
            self._discard_loras()
            raise

    def update_lora(self, update_info: dict, lora: LoRARequest) -> int:
        """One call of adapter tensors for `lora` (LoRAWeightUpdater.update); staged until finish_update."""
        self._refuse_while_init_pending("update_weights")
        if self.loras is None:
            raise ValueError("update_info.lora_name: LoRA is off; start the engine with enable_lora=True (--enable-lora)")
        try:
            return self.loras.update(update_info, lora)
        except WeightTransferError:  # the target's update is over and restored: so is the draft's
            if self.draft is not None:
                self.draft.abort_update()
            raise

    def _discard_loras(self) -> bool:
        return self.loras.discard() if self.loras is not None else False

    def finish_update(self) -> None:
        self._refuse_while_init_pending("finish_weight_update")
        updating = [u for u in self.all() if u.updating]
        if not updating:  # raises: no transfer engine, or no update in progress
            ready = [u for u in self.all() if u.transfer_engine is not None]
            (ready or [self.target])[0].finish_update()
        for updater in updating:
            updater.finish_update()
        if self.loras is not None:
            self.loras.commit()

    def abort_update(self) -> bool:
        """Restores every model an update in progress changed; False if none was in progress."""
        self._refuse_while_init_pending("abort_weight_update")
        aborted = [u.abort_update() for u in self.all()]  # every one, not up to the first that was updating
        return self._discard_loras() or any(aborted)

    def shutdown(self) -> None:
        self._refuse_while_init_pending("shutdown_weight_transfer_engine")
        self._discard_loras()
        for updater in self.all():
            updater.shutdown()

    def release(self) -> None:
        """The worker shuts down: a pending init is dropped and every model's updater released (see WeightUpdater.release)."""
        self.cancel_init()
        self._discard_loras()
        for updater in self.all():
            updater.release()

    @property
    def consistent(self) -> bool:
        return all(u.consistent for u in self.all())

