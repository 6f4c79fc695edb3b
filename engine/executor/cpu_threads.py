"""CPU thread policy of an engine process: how many torch threads it runs and which cores it is pinned to.

Why: torch's intra-op pool synchronises its threads at the end of every parallel region, so a
pool with more threads than free cores waits for the thread the OS has descheduled. On a 2-core
machine where another process keeps one core busy, 2 threads ran the tiny model at 468 tok/s
against 3,708 with 1. So, as vLLM does on CPU: one compute thread per core the engine may use,
and when there are two or more such cores one is left to the front end (the API server or the
LLM caller's process, which tokenizes, detokenizes and moves requests while the engine computes).

The policy is a pure function (plan_cpu_threads) of the allowed cores, the ranks sharing them and
the user's OMP_NUM_THREADS; apply_cpu_threads carries a plan out in the calling process. Pinning
is a process-wide mask (every thread of the process, and the threads it starts later inherit it),
not one core per torch thread: torch has no Python API to bind its pool's threads one by one.
Only for device cpu; GPU processes keep torch's defaults.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from collections.abc import Iterable, Sequence

# EngineCoreProc's process name (engine/core_proc_handle.py names it f"EngineCore_{index}"): a
# process so named belongs to the engine, which may pin it. Anywhere else (an in-process LLM) the
# process is the caller's, whose other threads must keep their cores.
ENGINE_PROCESS_PREFIX = "EngineCore_"


@dataclasses.dataclass(frozen=True)
class CpuThreadPlan:
    """What one engine process runs: num_threads torch threads, on the cores `cpus` (None: not pinned)."""

    num_threads: int
    cpus: tuple[int, ...] | None
    reason: str


def plan_cpu_threads(
    allowed_cpus: Iterable[int], world_size: int = 1, rank: int = 0, omp_num_threads: str | None = None
) -> CpuThreadPlan:
    """The thread count and cores of rank `rank` of `world_size` ranks sharing `allowed_cpus`.

    - OMP_NUM_THREADS set by the user: that many threads, not pinned (the user decides).
    - Otherwise one core (the lowest-numbered allowed one) is left to the front end when there
      are at least two cores and still one per rank after it; the rest are split into equal
      contiguous slices, one per rank, each rank running one thread per core of its slice,
      pinned to it. Cores left over by the division stay unused rather than unbalance the ranks.
    - Fewer cores than ranks: one thread each, not pinned (the OS shares the cores out).
    """
    cpus = sorted(set(allowed_cpus))
    if not cpus:
        raise ValueError("allowed_cpus is empty: the process may run on no core")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size), got rank={rank} world_size={world_size}")
    if omp_num_threads is not None and omp_num_threads.strip() != "":
        try:
            num = int(omp_num_threads)
        except ValueError:
            num = 0
        if num < 1:
            raise ValueError(f"OMP_NUM_THREADS must be a positive integer, got {omp_num_threads!r}")
        return CpuThreadPlan(num, None, f"OMP_NUM_THREADS={num} set by the user")
    if len(cpus) < world_size:
        return CpuThreadPlan(1, None, f"{world_size} ranks on {len(cpus)} cores: one thread each, not pinned")
    reserve = 1 if len(cpus) - 1 >= world_size else 0
    compute = cpus[reserve:]
    per_rank = len(compute) // world_size
    mine = tuple(compute[rank * per_rank : (rank + 1) * per_rank])
    why = f"core {cpus[0]} left to the front end" if reserve else "no core left to the front end"
    return CpuThreadPlan(per_rank, mine, f"{len(cpus)} allowed cores, {world_size} rank(s), {why}")


def allowed_cpus() -> list[int]:
    """The cores this process may run on: its affinity mask where the platform has one, else all of them."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def engine_owns_process() -> bool:
    """True in an EngineCoreProc process (pinning it touches nothing of the caller's)."""
    return multiprocessing.current_process().name.startswith(ENGINE_PROCESS_PREFIX)


def apply_cpu_threads(world_size: int = 1, rank: int = 0, pin: bool = True) -> CpuThreadPlan:
    """Plans this process's threads from its affinity mask and environment, then sets torch's thread
    count and, when pin and the plan has cores, pins every thread of the process to them."""
    plan = plan_cpu_threads(allowed_cpus(), world_size, rank, os.environ.get("OMP_NUM_THREADS"))
    if pin and plan.cpus is not None and hasattr(os, "sched_setaffinity"):
        _pin_process(plan.cpus)
    elif not pin and plan.cpus is not None:
        plan = dataclasses.replace(plan, cpus=None, reason=plan.reason + "; not pinned (the caller's process)")
    import torch

    torch.set_num_threads(plan.num_threads)
    return plan


def _pin_process(cpus: Sequence[int]) -> None:
    """Sets the affinity of every thread of this process (Linux applies sched_setaffinity per thread)."""
    mask = set(cpus)
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no procfs: the calling thread, and those it starts from now on
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, mask)
        except (ProcessLookupError, PermissionError):  # a thread that just ended, or a foreign policy
            pass
