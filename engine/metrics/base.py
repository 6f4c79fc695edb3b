"""StatLoggerBase: the interface every stat logger (built-in or plugin) implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from engine.config import EngineConfig
from engine.core.stats import SchedulerStats
from engine.metrics.iteration_stats import IterationStats


class StatLoggerBase(ABC):
    """Receives every engine step's stats; may report them when log() is called.

    Plugins are built as `factory(config, engine_index)` (a subclass itself is such a
    factory), one instance per engine.
    """

    @abstractmethod
    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        engine_index: int = 0,
    ) -> None:
        """Takes one step's stats; must be cheap (it runs on the step's path)."""

    def log(self) -> None:
        """Reports what was recorded, if it is time to (called often; rate-limits itself)."""

    def log_engine_initialized(self) -> None:
        """Called once when the engine is ready."""

    def record_admission_rejection(self, reason: str, engine_index: int = 0) -> None:
        """A request the frontend refused (admission control) before it reached an engine."""

    def record_weight_update(self, operation: str, seconds: float, engine_index: int = 0) -> None:
        """One weight-update lifecycle call (e.g. "update") and how long it took."""


StatLoggerFactory = Callable[[EngineConfig, int], StatLoggerBase]
