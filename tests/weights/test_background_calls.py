"""call_in_background: threads are reused between calls, a call never waits behind another, and a
bounded call (TrainerWeightTransferEngine._bounded) still times out and still carries failures."""

from __future__ import annotations

import threading
import time

import pytest

from weight_transfer.base import answer_of
from weight_transfer.clients import _BackgroundThreads, call_in_background


def test_sequential_calls_reuse_one_thread():
    pool = _BackgroundThreads()
    assert pool.submit(lambda: 1, ()).result(timeout=10) == 1
    time.sleep(0.05)  # the thread goes back to waiting once the result is out
    started = pool.num_started
    idents = {pool.submit(threading.get_ident, ()).result(timeout=10) for _ in range(50)}
    assert pool.num_started == started  # no thread started for any of them
    assert len(idents) == 1


def test_a_call_never_waits_behind_a_running_one():
    pool = _BackgroundThreads()
    release = threading.Event()
    blocked = pool.submit(release.wait, (30,))
    # The blocked call holds its thread; the next ones run at once on others.
    assert pool.submit(lambda x: x + 1, (1,)).result(timeout=10) == 2
    assert not blocked.done()
    release.set()
    assert blocked.result(timeout=10) is True


def test_many_concurrent_calls_all_run_together():
    pool = _BackgroundThreads(max_idle=2)
    barrier = threading.Barrier(6)
    futures = [pool.submit(barrier.wait, (10,)) for _ in range(6)]  # only passes once all 6 run at once
    assert sorted(f.result(timeout=20) for f in futures) == list(range(6))
    time.sleep(0.05)
    assert pool._idle <= 2  # the others left after their call


def test_idle_threads_leave_and_a_later_call_still_runs():
    pool = _BackgroundThreads(idle_s=0.05)
    assert pool.submit(lambda: "a", ()).result(timeout=10) == "a"
    time.sleep(0.3)
    assert pool._idle == 0
    assert pool.submit(lambda: "b", ()).result(timeout=10) == "b"


def test_failures_reach_the_future_and_the_thread_serves_on():
    pool = _BackgroundThreads()

    def fail():
        raise ValueError("engine said no")

    with pytest.raises(ValueError, match="engine said no"):
        pool.submit(fail, ()).result(timeout=10)
    assert pool.submit(lambda: 3, ()).result(timeout=10) == 3


def test_the_thread_is_named_after_the_call_while_it_runs():
    def start_weight_update():
        return threading.current_thread().name

    assert call_in_background(start_weight_update).result(timeout=10) == "weight-sync-start_weight_update"
    assert call_in_background(threading.current_thread).result(timeout=10).daemon


def test_a_bounded_call_times_out_naming_it_and_the_next_call_is_not_held_up():
    release = threading.Event()
    with pytest.raises(TimeoutError, match=r"finish_weight_update: the engine did not answer within timeout_s=0.1"):
        answer_of(call_in_background(release.wait, 30), 0.1, "finish_weight_update")
    # The stuck call keeps its thread; another call gets one of its own.
    assert answer_of(call_in_background(lambda: "ok"), 10, "get_world_size") == "ok"
    release.set()


def test_a_timeout_error_raised_by_the_call_itself_is_kept():
    def late():
        raise TimeoutError("the engine's own wait timed out")

    with pytest.raises(TimeoutError, match="the engine's own wait timed out"):
        answer_of(call_in_background(late), 10, "update_weights")
