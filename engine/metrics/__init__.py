"""Engine metrics: per-step stats, an analytic FLOPs/bytes estimate, and stat loggers (log line, Prometheus, plugins)."""

from engine.metrics.base import StatLoggerBase, StatLoggerFactory
from engine.metrics.flops import (
    ModelShape,
    StepCost,
    StepCostEstimator,
    estimate_step_cost,
)
from engine.metrics.iteration_stats import (
    FinishedRequestStats,
    IterationStats,
    IterationStatsRecorder,
    RequestStateStats,
)
from engine.metrics.loggers import (
    STAT_LOGGER_ENTRY_POINT_GROUP,
    LoggingStatLogger,
    PrometheusStatLogger,
    StatLoggerManager,
    load_stat_logger_plugins,
)

__all__ = [
    "STAT_LOGGER_ENTRY_POINT_GROUP",
    "FinishedRequestStats",
    "IterationStats",
    "IterationStatsRecorder",
    "LoggingStatLogger",
    "ModelShape",
    "PrometheusStatLogger",
    "RequestStateStats",
    "StatLoggerBase",
    "StatLoggerFactory",
    "StatLoggerManager",
    "StepCost",
    "StepCostEstimator",
    "estimate_step_cost",
    "load_stat_logger_plugins",
]
