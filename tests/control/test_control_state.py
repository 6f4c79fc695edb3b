"""ControlState on its own (no torch, no engine): the pause state it derives, sleep and wake-up plans, update expiry, the pending init."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.control import PauseState
from engine.control_state import ControlState
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.exceptions import WeightUpdateStateError
from engine.sampling_params import SamplingParams


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _snapshot(control: ControlState) -> tuple:
    return (control.pause_mode, control.asleep, control.sleep_level, control.weight_update_active,
            control.weights_consistent, control.init_pending, control.pause_state)


def test_pause_state_is_the_strictest_any_control_asks_for():
    control = ControlState()
    assert control.pause_state == PauseState.UNPAUSED and control.may_schedule
    control.pause("wait")
    assert control.pause_state == PauseState.PAUSED_NEW and control.may_schedule and control.paused
    control.pause("abort")  # pausing again switches the mode
    assert control.pause_mode == "abort" and control.pause_state == PauseState.PAUSED_NEW
    control.start_weight_update()  # an update holds everything, whatever the pause mode
    assert control.pause_state == PauseState.PAUSED_ALL and not control.may_schedule
    control.end_weight_update(consistent=True)
    assert control.pause_state == PauseState.PAUSED_NEW
    control.pause("keep")
    assert control.pause_state == PauseState.PAUSED_ALL
    control.resume()
    assert control.pause_state == PauseState.UNPAUSED and not control.paused


def test_a_mix_of_weights_holds_every_request_until_an_update_ends_consistent():
    control = ControlState()
    control.start_weight_update()
    control.end_weight_update(consistent=False)  # a failed transfer that could not roll back
    assert not control.weight_update_active and control.pause_state == PauseState.PAUSED_ALL
    control.resume()  # resuming does not serve a mix
    assert control.pause_state == PauseState.PAUSED_ALL
    control.start_weight_update()
    control.end_weight_update(consistent=True)
    assert control.pause_state == PauseState.UNPAUSED


def test_an_unknown_pause_mode_changes_nothing():
    control = ControlState()
    control.pause("wait")
    before = _snapshot(control)
    with pytest.raises(ValueError, match="mode"):
        control.pause("pause_everything")
    assert _snapshot(control) == before


def test_sleep_and_pause_are_independent():
    control = ControlState()
    control.pause("wait")
    control.record_sleep(control.plan_sleep(0))
    assert control.pause_state == PauseState.PAUSED_ALL
    control.resume()  # does not wake
    assert control.sleeping and control.pause_state == PauseState.PAUSED_ALL
    control.pause("abort")
    control.record_wake_up(control.plan_wake_up(None))  # does not resume
    assert not control.sleeping and control.paused and control.pause_state == PauseState.PAUSED_NEW


@pytest.mark.parametrize("level, asleep", [(0, {"scheduling"}), (1, {"scheduling", "weights", "kv_cache"}),
                                           (2, {"scheduling", "weights", "kv_cache"})])
def test_sleep_records_what_sleeps_and_again_at_the_same_level_is_a_no_op(level, asleep):
    control = ControlState()
    assert control.plan_sleep(level) == level and not control.sleeping  # planning changes nothing
    control.record_sleep(level)
    assert control.asleep == asleep and control.sleep_level == level
    assert control.plan_sleep(level) is None
    other = 2 if level != 2 else 1
    with pytest.raises(ValueError, match=f"already asleep at level {level}"):
        control.plan_sleep(other)
    for bad in (3, -1, True, "1"):
        with pytest.raises(ValueError, match="level"):
            control.plan_sleep(bad)
    assert control.asleep == asleep and control.sleep_level == level


def test_scheduling_wakes_with_the_last_memory_tag_and_never_before_it():
    control = ControlState()
    control.record_sleep(2)
    with pytest.raises(ValueError, match="'scheduling' cannot wake while \\['kv_cache'\\] still sleeps"):
        control.plan_wake_up(["weights", "scheduling"])
    with pytest.raises(ValueError, match="tags"):
        control.plan_wake_up(["weights", "gpu"])
    assert control.asleep == {"scheduling", "weights", "kv_cache"}
    woken = control.plan_wake_up(["weights"])
    assert woken == {"weights"}
    control.record_wake_up(woken)
    assert control.asleep == {"scheduling", "kv_cache"} and control.sleep_level == 2
    # Sleeping at the same level again is not a no-op now that the weights are awake.
    with pytest.raises(ValueError, match="already asleep at level 2"):
        control.plan_sleep(2)
    assert control.plan_wake_up(["weights"]) == frozenset()  # awake parts are skipped
    control.record_wake_up(control.plan_wake_up("kv_cache"))  # one tag as a string
    assert not control.sleeping and control.sleep_level == 0 and control.pause_state == PauseState.UNPAUSED


def test_after_sleep_0_only_scheduling_wakes_it():
    control = ControlState()
    control.record_sleep(0)
    assert control.plan_wake_up(["weights", "kv_cache"]) == frozenset()  # nothing of them sleeps
    control.record_wake_up(frozenset())
    assert control.asleep == {"scheduling"}
    control.record_wake_up(control.plan_wake_up(["scheduling"]))
    assert not control.sleeping


def test_an_update_expires_after_its_idle_timeout_without_a_call():
    clock = FakeClock()
    control = ControlState(weight_update_idle_timeout_s=30.0, clock=clock)
    clock.now += 1000
    assert not control.weight_update_idle_expired()  # no update in progress
    control.start_weight_update()
    clock.now += 29.9
    assert not control.weight_update_idle_expired()
    control.record_weight_call()  # update_weights: the idle time starts again
    clock.now += 29.9
    assert not control.weight_update_idle_expired()
    clock.now += 0.1
    assert control.weight_update_idle_expired()
    control.end_weight_update(consistent=True)
    assert not control.weight_update_idle_expired()


def test_an_update_never_expires_without_an_idle_timeout():
    clock = FakeClock()
    control = ControlState(weight_update_idle_timeout_s=0.0, clock=clock)
    control.start_weight_update()
    clock.now += 1e9
    assert not control.weight_update_idle_expired()


def test_one_transfer_init_at_a_time():
    control = ControlState()
    control.begin_init()
    with pytest.raises(WeightUpdateStateError, match="still waiting for its peer"):
        control.begin_init()
    assert control.init_pending and control.pause_state == PauseState.UNPAUSED  # generation goes on meanwhile
    control.end_init()
    control.begin_init()
    assert control.init_pending


def test_schedulers_sharing_a_control_state_see_one_pause_state():
    """A scheduler rebuilt after a fault (EngineCore.reset_after_fault) keeps the pause: it reads the same state."""
    control = ControlState()
    control.pause("keep")
    old = Scheduler(SchedulerConfig(max_num_seqs=4), CacheConfig(block_size=4), 32, 64, control=control)
    rebuilt = Scheduler(SchedulerConfig(max_num_seqs=4), CacheConfig(block_size=4), 32, 64, control=control)
    rebuilt.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=4), None))
    assert old.pause_state == rebuilt.pause_state == PauseState.PAUSED_ALL
    assert rebuilt.schedule().is_empty
    control.resume()
    assert rebuilt.pause_state == PauseState.UNPAUSED and rebuilt.schedule().num_scheduled_tokens == {"a": 3}
    assert rebuilt.make_stats().pause_state == PauseState.UNPAUSED
    assert Scheduler(SchedulerConfig(), CacheConfig(block_size=4), 32, 64).control is not control  # its own
