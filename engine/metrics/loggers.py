"""Stat loggers: the periodic log line, plugin loading, and the manager that fans each step out to them."""

from __future__ import annotations

import importlib.metadata
import logging
import time
from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry

from engine.config import EngineConfig
from engine.core.stats import SchedulerStats, SpecDecodingStats
from engine.metrics.base import StatLoggerBase, StatLoggerFactory
from engine.metrics.flops import estimator_for
from engine.metrics.iteration_stats import IterationStats, IterationStatsRecorder
from engine.metrics.prometheus import PrometheusStatLogger
from engine.wire import EngineCoreOutputs

logger = logging.getLogger(__name__)

STAT_LOGGER_ENTRY_POINT_GROUP = "rollout_toolkit.stat_loggers"

__all__ = [
    "STAT_LOGGER_ENTRY_POINT_GROUP",
    "LoggingStatLogger",
    "PrometheusStatLogger",
    "StatLoggerBase",
    "StatLoggerFactory",
    "StatLoggerManager",
    "load_stat_logger_plugins",
]


def format_usage(fraction: float) -> str:
    """A fraction as a percentage that reads 0 only when it is 0: a large cache (a CPU engine's holds
    ~50k blocks) with a few requests in it shows "0.03%", not "0.0%"."""
    percent = 100 * fraction
    if 0 < percent < 0.1:
        return f"{percent:.2g}%"
    return f"{percent:.1f}%"


class LoggingStatLogger(StatLoggerBase):
    """One INFO line per engine at most every log_stats_interval seconds; rates cover the time since the last line.

    When the engine speculates, the line ends with the interval's draft acceptance rate
    (accepted / draft tokens), mean acceptance length (1 + accepted / drafts: the tokens a
    request gains per verifying step) and acceptance rate per draft position (accepted / drafts).
    """

    def __init__(self, config: EngineConfig, engine_index: int = 0) -> None:
        self.engine_index = engine_index
        self.interval = config.observability.log_stats_interval
        self.estimator = estimator_for(config)
        settings = config.speculative.settings
        self.num_spec_tokens = settings.num_speculative_tokens if settings is not None else 0  # 0: no speculation
        self.last_log_time = time.monotonic()
        # Latest gauges.
        self.num_running_reqs = 0
        self.num_waiting_reqs = 0
        self.kv_cache_usage = 0.0
        self._reset_interval()

    def _reset_interval(self) -> None:
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.flops = 0.0
        self.spec_decoding = SpecDecodingStats(self.num_spec_tokens) if self.num_spec_tokens else None

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        engine_index: int = 0,
    ) -> None:
        if scheduler_stats is not None:
            s = scheduler_stats
            self.num_running_reqs = s.num_running_reqs
            self.num_waiting_reqs = s.num_waiting_reqs
            self.kv_cache_usage = s.kv_cache_usage
            self.prefix_cache_queries += s.prefix_cache_queries
            self.prefix_cache_hits += s.prefix_cache_hits
            if self.estimator is not None:
                self.flops += self.estimator.estimate(s.step_work).flops
            if s.spec_decoding is not None:
                self._add_spec_decoding(s.spec_decoding)
        if iteration_stats is not None:
            self.num_prompt_tokens += iteration_stats.num_prompt_tokens
            self.num_generation_tokens += iteration_stats.num_generation_tokens

    def _add_spec_decoding(self, stats: SpecDecodingStats) -> None:
        if self.spec_decoding is None:  # speculation the config did not announce: report it from now on
            self.num_spec_tokens = stats.num_spec_tokens
            self.spec_decoding = SpecDecodingStats(self.num_spec_tokens)
        self.spec_decoding.add(stats)

    def log(self) -> None:
        now = time.monotonic()
        elapsed = now - self.last_log_time
        if elapsed < self.interval:
            return
        hit_rate = self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        fmt = (
            "Engine %03d: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %s, Prefix cache hit rate: %.1f%%, "
            "Estimated: %.3f TFLOP/s"
        )
        args = [
            self.engine_index,
            self.num_prompt_tokens / elapsed,
            self.num_generation_tokens / elapsed,
            self.num_running_reqs,
            self.num_waiting_reqs,
            format_usage(self.kv_cache_usage),
            100 * hit_rate,
            self.flops / elapsed / 1e12,
        ]
        if (spec := self.spec_decoding) is not None:
            # An interval without drafts reads as rate 0 and length 1 (each step gained one token).
            drafts = max(spec.num_drafts, 1)
            fmt += (
                ", Spec decode draft acceptance rate: %.1f%%, Mean acceptance length: %.2f, "
                "Per-position acceptance rate: %s"
            )
            args += [
                100 * spec.num_accepted_tokens / max(spec.num_draft_tokens, 1),
                1 + spec.num_accepted_tokens / drafts,
                ", ".join(f"{n / drafts:.3f}" for n in spec.num_accepted_tokens_per_pos),
            ]
        logger.info(fmt, *args)
        self.last_log_time = now
        self._reset_interval()

    def log_engine_initialized(self) -> None:
        logger.info("Engine %03d: stats every %.1f s", self.engine_index, self.interval)


def load_stat_logger_plugins(names: Sequence[str]) -> list[StatLoggerFactory]:
    """The factories registered under `names` in the entry-point group, in order of `names`."""
    if not names:
        return []
    available = {ep.name: ep for ep in importlib.metadata.entry_points(group=STAT_LOGGER_ENTRY_POINT_GROUP)}
    for name in names:
        if name not in available:
            raise ValueError(
                f"stat_loggers: no stat logger plugin named {name!r} in entry-point group "
                f"{STAT_LOGGER_ENTRY_POINT_GROUP!r} (installed: {sorted(available)})"
            )
    return [available[name].load() for name in names]


class StatLoggerManager:
    """Fans each step's stats out to every logger: per engine the log line and any plugins or
    custom loggers, plus one PrometheusStatLogger for all engines.

    A frontend either records stats it built itself (record()), or lets the manager's
    IterationStatsRecorder build them: on_request_added() per engine request,
    record_engine_outputs() per EngineCoreOutputs, on_requests_aborted() when it drops requests.
    """

    def __init__(
        self,
        config: EngineConfig,
        model_name: str,
        engine_indexes: Sequence[int] = (0,),
        custom_loggers: Sequence[StatLoggerFactory] | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.engine_indexes = list(engine_indexes)
        factories: list[StatLoggerFactory] = []
        if not config.observability.disable_log_stats:
            factories.append(LoggingStatLogger)
        factories += load_stat_logger_plugins(config.observability.stat_loggers)
        factories += list(custom_loggers or [])
        self.per_engine_loggers: dict[int, list[StatLoggerBase]] = {
            i: [_build(factory, config, i) for factory in factories] for i in self.engine_indexes
        }
        self.prometheus_logger = PrometheusStatLogger(config, model_name, self.engine_indexes, registry)
        self.iteration_stats = IterationStatsRecorder()

    def _loggers(self, engine_index: int) -> list[StatLoggerBase]:
        if engine_index not in self.per_engine_loggers:
            raise ValueError(f"engine_index: {engine_index} is not one of {self.engine_indexes}")
        return [*self.per_engine_loggers[engine_index], self.prometheus_logger]

    def _all_loggers(self) -> list[StatLoggerBase]:
        return [lg for loggers in self.per_engine_loggers.values() for lg in loggers] + [self.prometheus_logger]

    def add_stat_logger(self, stat_logger: StatLoggerBase, engine_index: int = 0) -> None:
        """Adds a logger that gets `engine_index`'s stats from now on (e.g. a data-parallel group's coordinator)."""
        if not isinstance(stat_logger, StatLoggerBase):
            raise ValueError(f"stat_logger: expected a StatLoggerBase, got {type(stat_logger).__name__}")
        self._loggers(engine_index)  # validates the index
        self.per_engine_loggers[engine_index].append(stat_logger)

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        engine_index: int = 0,
    ) -> None:
        for stat_logger in self._loggers(engine_index):
            stat_logger.record(scheduler_stats, iteration_stats, engine_index)

    def record_admission_rejection(self, reason: str, engine_index: int = 0) -> None:
        for stat_logger in self._loggers(engine_index):
            stat_logger.record_admission_rejection(reason, engine_index)

    def record_weight_update(self, operation: str, seconds: float, engine_index: int = 0) -> None:
        for stat_logger in self._loggers(engine_index):
            stat_logger.record_weight_update(operation, seconds, engine_index)

    def log(self) -> None:
        for stat_logger in self._all_loggers():
            stat_logger.log()

    def log_engine_initialized(self, num_gpu_blocks: int | None = None) -> None:
        """Once the engine is ready; `num_gpu_blocks` (its KV blocks) goes into vllm:cache_config_info."""
        for stat_logger in self._all_loggers():
            if stat_logger is self.prometheus_logger:
                self.prometheus_logger.log_engine_initialized(num_gpu_blocks)
            else:
                stat_logger.log_engine_initialized()

    # ---- the frontend's side: requests in, engine outputs in ----

    def on_request_added(
        self,
        req_id: str,
        arrival_time: float,
        num_prompt_tokens: int,
        parent_req_id: str | None = None,
        max_tokens: int | None = None,
        n: int = 1,
    ) -> None:
        """See IterationStatsRecorder.on_request_added."""
        self.iteration_stats.on_request_added(req_id, arrival_time, num_prompt_tokens, parent_req_id, max_tokens, n)

    def on_requests_aborted(self, req_ids: Iterable[str]) -> None:
        self.iteration_stats.on_requests_aborted(req_ids)

    def record_engine_outputs(
        self, outputs: EngineCoreOutputs, now: float | None = None, stopped_req_ids: Iterable[str] = ()
    ) -> IterationStats:
        """Records one step (its scheduler stats and the IterationStats it makes), then log()s.

        `stopped_req_ids`: requests the frontend finished itself in this step (stop strings).
        """
        iteration_stats = self.iteration_stats.on_engine_outputs(outputs, now, stopped_req_ids)
        self.record(outputs.scheduler_stats, iteration_stats, outputs.engine_index)
        self.log()
        return iteration_stats

    # ---- reading ----

    def prometheus_text(self) -> bytes:
        """All metrics in the Prometheus text format (the body of GET /metrics)."""
        return self.prometheus_logger.prometheus_text()

    def get_metrics_snapshot(self) -> dict[str, float]:
        """Counters, gauges and histogram sums/counts as plain numbers (see PrometheusStatLogger.snapshot)."""
        return self.prometheus_logger.snapshot()


def _build(factory: StatLoggerFactory, config: EngineConfig, engine_index: int) -> StatLoggerBase:
    stat_logger = factory(config, engine_index)
    if not isinstance(stat_logger, StatLoggerBase):
        raise TypeError(f"stat logger factory {factory!r} returned {type(stat_logger).__name__}, not a StatLoggerBase")
    return stat_logger
