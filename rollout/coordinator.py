"""Coordinator: the latest scheduler stats of each engine of a data-parallel group (queue, running, KV usage)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.stats import SchedulerStats
from engine.metrics.base import StatLoggerBase
from engine.metrics.iteration_stats import IterationStats


@dataclass
class EngineLoad:
    """One engine's scheduler as its last step reported it."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    num_steps: int = 0  # steps reported since the start (0: none yet)


class _EngineStatsListener(StatLoggerBase):
    """Added to one engine's StatLoggerManager: every step's scheduler stats land in its EngineLoad."""

    def __init__(self, load: EngineLoad) -> None:
        self.load = load

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        engine_index: int = 0,
    ) -> None:
        if scheduler_stats is None:
            return
        self.load.num_running_reqs = scheduler_stats.num_running_reqs
        self.load.num_waiting_reqs = scheduler_stats.num_waiting_reqs
        self.load.kv_cache_usage = scheduler_stats.kv_cache_usage
        self.load.num_steps += 1


class Coordinator:
    """Keeps an EngineLoad per engine, fed by the stats each engine already sends its frontend.

    The balancer reads `loads` (waiting queue as a tie-break); /metrics shows the same numbers
    per engine through each frontend's own gauges.
    """

    def __init__(self, num_engines: int) -> None:
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        self.loads = [EngineLoad() for _ in range(num_engines)]

    def resize(self, num_engines: int) -> None:
        """Elastic EP: engines are added at the end (fresh loads) or removed from the end."""
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        del self.loads[num_engines:]
        self.loads.extend(EngineLoad() for _ in range(num_engines - len(self.loads)))

    def listener(self, engine_index: int) -> StatLoggerBase:
        """The stat logger to add to engine `engine_index`'s StatLoggerManager."""
        return _EngineStatsListener(self.loads[engine_index])

    def num_waiting(self) -> list[int]:
        return [load.num_waiting_reqs for load in self.loads]

    def summary(self) -> list[dict]:
        """Per engine, in engine order: {"engine", "num_running_reqs", "num_waiting_reqs", "kv_cache_usage"}."""
        return [
            {
                "engine": i,
                "num_running_reqs": load.num_running_reqs,
                "num_waiting_reqs": load.num_waiting_reqs,
                "kv_cache_usage": load.kv_cache_usage,
            }
            for i, load in enumerate(self.loads)
        ]
