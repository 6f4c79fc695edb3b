"""ControlState: what the RL controls (pause, sleep, weight updates, transfer init) have done to an engine, and so what its scheduler may do."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import TypeVar

from engine.control import (
    MEMORY_TAGS,
    PauseMode,
    PauseState,
    check_pause_mode,
    check_sleep_level,
    check_wake_up_tags,
    tags_put_to_sleep,
)
from engine.exceptions import WeightUpdateStateError

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable)


def _transition(method: F) -> F:
    """Marks a method that changes the state: it logs each change of the derived pause_state."""

    @functools.wraps(method)
    def changed(self: ControlState, *args, **kwargs):
        before = self.pause_state
        result = method(self, *args, **kwargs)
        if self.pause_state != before:
            logger.info("EngineCore: pause state %s -> %s", before.name, self.pause_state.name)
        return result

    return changed  # type: ignore[return-value]


class ControlState:
    """An EngineCore's control state in one place; its Scheduler reads pause_state from here and nothing sets it beside.

    Invariants:
    - pause_state is derived, never stored: PAUSED_ALL while any part sleeps, a keep-mode pause
      holds, a weight update is in progress, or the weights are a mix (a failed transfer that
      could not roll back), so no step ever sees half an update; else PAUSED_NEW while paused
      (abort or wait mode); else UNPAUSED.
    - Pause and sleep are independent: resume() wakes nothing and waking resumes nothing.
    - "scheduling" sleeps whenever "weights" or "kv_cache" does (it wakes with the last of
      them); sleep_level is the last sleep's level while anything sleeps, else 0.
    - At most one weight-transfer init waits for its peer.
    Plain Python that touches no device: the EngineCore asks here first (plan_*: validation,
    nothing changes), does the work on its workers, then records what happened, so a call that
    fails on a worker leaves this state as it was.
    """

    def __init__(self, weight_update_idle_timeout_s: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        """weight_update_idle_timeout_s: how long an update in progress may go without a call (<= 0: forever)."""
        self.pause_mode: PauseMode | None = None  # set while paused
        self.asleep: frozenset[str] = frozenset()  # the WakeUpTags still asleep
        self._level = 0  # the last sleep's level (meaningful while asleep)
        self.weight_update_active = False  # between start_weight_update and its finish or abort
        self.weights_consistent = True  # False: a failed transfer that could not roll back left a mix
        # sleep(2) then wake_up without reload_weights: the weights are zeros until an update writes them all,
        # and add_request refuses (EngineCore); scheduling itself is not held (nothing can be queued).
        self.weights_discarded = False
        self.init_pending = False  # an init_weight_transfer_engine waits for its peer
        self.weight_update_idle_timeout_s = weight_update_idle_timeout_s
        self._clock = clock
        self._last_weight_call = 0.0  # clock() at the end of the update's last call

    # ---- what follows from it ----------------------------------------------------------------

    @property
    def pause_state(self) -> PauseState:
        if self.asleep or self.pause_mode == "keep" or self.weight_update_active or not self.weights_consistent:
            return PauseState.PAUSED_ALL
        if self.pause_mode is not None:
            return PauseState.PAUSED_NEW
        return PauseState.UNPAUSED

    @property
    def may_schedule(self) -> bool:
        return self.pause_state != PauseState.PAUSED_ALL

    @property
    def paused(self) -> bool:
        return self.pause_mode is not None

    @property
    def sleeping(self) -> bool:
        return bool(self.asleep)

    @property
    def sleep_level(self) -> int:
        """The level the engine sleeps at; 0 when awake (and at level 0)."""
        return self._level if self.asleep else 0

    # ---- pause -------------------------------------------------------------------------------

    @_transition
    def pause(self, mode: object) -> PauseMode:
        """Pauses in `mode` (pausing again switches it); ValueError for an unknown mode, nothing changed."""
        self.pause_mode = check_pause_mode(mode)
        return self.pause_mode

    @_transition
    def resume(self) -> None:
        self.pause_mode = None

    # ---- sleep and wake-up -------------------------------------------------------------------

    def plan_sleep(self, level: object) -> int | None:
        """The level sleep(level) puts the engine to sleep at, or None when it already sleeps there (a no-op).

        ValueError for a bad level, or for another level while asleep (the caller wakes up first).
        """
        level = check_sleep_level(level)
        if not self.asleep:
            return level
        if level == self._level and self.asleep == tags_put_to_sleep(level):
            return None
        raise ValueError(  # the caller's order of calls, not an engine failure: HTTP 400
            f"level: the engine is already asleep at level {self._level} (asleep: "
            f"{sorted(self.asleep)}); wake_up() before sleeping at level {level}"
        )

    @_transition
    def record_sleep(self, level: int) -> None:
        """The workers are asleep at `level` (see plan_sleep)."""
        self.asleep = frozenset(tags_put_to_sleep(level))
        self._level = level

    @_transition
    def record_kv_cache_released(self) -> None:
        """release_kv_cache_memory freed the KV cache (the weights stay): it sleeps, and so does scheduling."""
        self.asleep = frozenset({"kv_cache", "scheduling"})
        self._level = 0

    def plan_wake_up(self, tags: object) -> frozenset[str]:
        """The tags wake_up(tags) wakes: those asked for (None: all) that sleep.

        ValueError for an unknown tag, or for "scheduling" while weights or KV cache would still
        sleep (scheduling needs the memory back).
        """
        to_wake = frozenset(check_wake_up_tags(tags)) & self.asleep
        memory_left = (self.asleep - to_wake) & MEMORY_TAGS
        if "scheduling" in to_wake and memory_left:
            raise ValueError(
                f"tags: 'scheduling' cannot wake while {sorted(memory_left)} still sleeps; wake them together"
            )
        return to_wake

    @_transition
    def record_wake_up(self, woken: frozenset[str]) -> None:
        """The workers woke `woken` (see plan_wake_up); scheduling wakes with the last memory tag."""
        asleep = self.asleep - woken
        if woken & MEMORY_TAGS and not asleep & MEMORY_TAGS:
            asleep -= {"scheduling"}
        self.asleep = asleep

    # ---- weight updates ----------------------------------------------------------------------

    @_transition
    def start_weight_update(self) -> None:
        self.weight_update_active = True
        self.record_weight_call()

    def record_weight_call(self) -> None:
        """A call of the update in progress just ended: its idle time starts again."""
        self._last_weight_call = self._clock()

    @_transition
    def end_weight_update(self, consistent: bool) -> None:
        """The update is over (finished, aborted, failed, or its transfer engine shut down); `consistent`:
        whether the workers' weights are all of one version (False holds every request)."""
        self.weight_update_active = False
        self.weights_consistent = consistent

    def weight_update_idle_expired(self) -> bool:
        """True when an update is in progress and got no call for weight_update_idle_timeout_s."""
        limit = self.weight_update_idle_timeout_s
        return self.weight_update_active and limit > 0 and self._clock() - self._last_weight_call >= limit

    # ---- weight-transfer init (its rendezvous runs in the workers' background) ---------------

    def begin_init(self) -> None:
        """An init starts waiting for its peer; WeightUpdateStateError while another one still does."""
        if self.init_pending:
            raise WeightUpdateStateError(
                "init_weight_transfer_engine: another init_weight_transfer_engine is still waiting for its peer; "
                "call again once it has answered"
            )
        self.init_pending = True

    def end_init(self) -> None:
        """The init is answered (done, failed, or never started)."""
        self.init_pending = False
