"""The CPU thread policy (engine/executor/cpu_threads.py): a pure function of cores, ranks and OMP_NUM_THREADS, and what applying it does."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.executor.cpu_threads import CpuThreadPlan, allowed_cpus, plan_cpu_threads


def test_one_core_runs_one_thread_there():
    assert plan_cpu_threads([0]) == CpuThreadPlan(1, (0,), plan_cpu_threads([0]).reason)


def test_two_cores_leave_the_lowest_to_the_front_end():
    plan = plan_cpu_threads([0, 1])
    assert (plan.num_threads, plan.cpus) == (1, (1,))
    assert "core 0 left to the front end" in plan.reason


def test_many_cores_one_thread_per_compute_core():
    plan = plan_cpu_threads(range(16))
    assert (plan.num_threads, plan.cpus) == (15, tuple(range(1, 16)))


def test_an_affinity_mask_is_respected_whatever_the_core_numbers():
    plan = plan_cpu_threads({9, 4, 6})  # e.g. taskset -c 4,6,9: unordered, with gaps
    assert (plan.num_threads, plan.cpus) == (2, (6, 9))


def test_ranks_get_equal_disjoint_slices_after_the_front_end_core():
    plans = [plan_cpu_threads(range(8), world_size=2, rank=r) for r in range(2)]
    assert [(p.num_threads, p.cpus) for p in plans] == [(3, (1, 2, 3)), (3, (4, 5, 6))]  # core 7 left over


def test_no_front_end_core_when_it_would_leave_a_rank_without_one():
    plans = [plan_cpu_threads([0, 1], world_size=2, rank=r) for r in range(2)]
    assert [(p.num_threads, p.cpus) for p in plans] == [(1, (0,)), (1, (1,))]
    assert "no core left" in plans[0].reason


def test_more_ranks_than_cores_run_one_thread_each_unpinned():
    plan = plan_cpu_threads([0, 1], world_size=4, rank=3)
    assert (plan.num_threads, plan.cpus) == (1, None)


@pytest.mark.parametrize("value", ["1", "3", " 2 "])
def test_users_omp_num_threads_wins_and_leaves_the_affinity_alone(value):
    plan = plan_cpu_threads(range(8), world_size=2, rank=1, omp_num_threads=value)
    assert (plan.num_threads, plan.cpus) == (int(value), None)
    assert "OMP_NUM_THREADS" in plan.reason


def test_empty_omp_num_threads_counts_as_unset():
    assert plan_cpu_threads([0, 1], omp_num_threads="") == plan_cpu_threads([0, 1])


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_bad_omp_num_threads_is_refused_clearly(value):
    with pytest.raises(ValueError, match="OMP_NUM_THREADS must be a positive integer"):
        plan_cpu_threads([0, 1], omp_num_threads=value)


@pytest.mark.parametrize(("cpus", "world_size", "rank"), [([], 1, 0), ([0], 0, 0), ([0, 1], 2, 2), ([0], 1, -1)])
def test_bad_arguments_are_refused(cpus, world_size, rank):
    with pytest.raises(ValueError):
        plan_cpu_threads(cpus, world_size, rank)


_APPLY = """
import json, os, sys, threading
from engine.executor.cpu_threads import apply_cpu_threads
started = threading.Event()
helper = threading.Thread(target=started.wait, daemon=True)  # a thread that exists before the pinning
helper.start()
plan = apply_cpu_threads(pin=sys.argv[1] == "pin")
import torch
tasks = {t: sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
started.set()
print(json.dumps({"plan": [plan.num_threads, plan.cpus], "torch": torch.get_num_threads(), "tasks": tasks}))
"""


def _apply_in_child(mode: str, env: dict[str, str]) -> dict:
    import json

    out = subprocess.run([sys.executable, "-c", _APPLY, mode], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = os.getcwd() + os.pathsep + env.get("PYTHONPATH", "")
    return {**env, **extra}


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no affinity API on this platform")
def test_apply_pins_every_thread_of_the_process_and_sets_torch_threads():
    want = plan_cpu_threads(allowed_cpus())
    got = _apply_in_child("pin", _env())
    assert got["plan"] == [want.num_threads, list(want.cpus)]
    assert got["torch"] == want.num_threads
    assert len(got["tasks"]) >= 2 and all(cpus == list(want.cpus) for cpus in got["tasks"].values())


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no affinity API on this platform")
def test_apply_without_pin_sets_threads_only_and_user_env_wins():
    unpinned = _apply_in_child("nopin", _env())
    assert unpinned["plan"][1] is None and all(c == allowed_cpus() for c in unpinned["tasks"].values())
    assert unpinned["torch"] == plan_cpu_threads(allowed_cpus()).num_threads
    user = _apply_in_child("pin", _env(OMP_NUM_THREADS="3"))
    assert user["plan"] == [3, None] and user["torch"] == 3
    assert all(c == allowed_cpus() for c in user["tasks"].values())
