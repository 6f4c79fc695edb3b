"""PrometheusStatLogger: the engine's metric families (prefix `rollout:`) in a prometheus_client registry."""

from __future__ import annotations

import collections
from bisect import bisect_left
from collections.abc import Callable, Sequence
from types import SimpleNamespace

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.metrics import MetricWrapperBase

from engine.config import EngineConfig
from engine.core.stats import SchedulerStats, SpecDecodingStats
from engine.metrics.base import StatLoggerBase
from engine.metrics.flops import estimator_for
from engine.metrics.iteration_stats import IterationStats
from engine.metrics.rl import frontend_metrics_text
from engine.wire import FinishReason

PREFIX = "rollout:"
LABELS = ["model_name", "engine"]

# Seconds. TTFT spans a cached short prompt to a long queue; ITL is one decode step.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
ITL_BUCKETS = [0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0]  # fmt: skip
REQUEST_BUCKETS = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 3840.0, 7680.0]  # fmt: skip

# Gauges that are fractions: a snapshot over several engines averages them instead of adding.
_MEAN_OVER_ENGINES = {PREFIX + "kv_cache_usage_perc"}
# State gauges: a snapshot over several engines shows the most paused / deepest asleep one.
_MAX_OVER_ENGINES = {PREFIX + "engine_paused", PREFIX + "engine_sleep_level"}


class PrometheusStatLogger(StatLoggerBase):
    """All engines of one frontend in one registry, told apart by the `engine` label.

    Each logger owns a fresh CollectorRegistry unless given one, so several engines or
    LLMs in one process (tests) never collide; a server that wants the process-wide
    `prometheus_client.REGISTRY` passes it, and then only one logger may use it.
    """

    def __init__(
        self,
        config: EngineConfig,
        model_name: str,
        engine_indexes: Sequence[int] = (0,),
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry() if registry is None else registry
        self.estimator = estimator_for(config)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, LABELS, registry=self.registry)

        def counter(name: str, doc: str, extra_labels: Sequence[str] = ()) -> Counter:
            return Counter(PREFIX + name, doc, LABELS + list(extra_labels), registry=self.registry)

        def histogram(name: str, doc: str, buckets: list[float], extra_labels: Sequence[str] = ()) -> Histogram:
            return Histogram(PREFIX + name, doc, LABELS + list(extra_labels), buckets=buckets, registry=self.registry)

        self.num_requests_running = gauge("num_requests_running", "Requests running in the engine.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting in the engine.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).")
        self.engine_paused = gauge(
            "engine_paused", "Scheduler pause state: 0 unpaused, 1 new requests refused, 2 nothing scheduled."
        )
        self.engine_sleep_level = gauge(
            "engine_sleep_level", "Level of the engine's sleep (1 weights offloaded, 2 discarded); 0 awake or level 0."
        )
        self.prefix_cache_queries = counter("prefix_cache_queries", "Tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Tokens found in the prefix cache.")
        self.num_preemptions = counter("num_preemptions", "Requests preempted (recomputed later).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that got their first token.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.request_success = counter("request_success", "Finished requests by finish reason.", ["finished_reason"])
        self.admission_rejections = counter("admission_rejections", "Requests refused by admission control.", ["reason"])
        self.weight_update_duration = histogram(
            "weight_update_duration_seconds",
            "Duration of each weight-update lifecycle call (init, start, update, finish, shutdown), seen by the frontend.",
            [0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0],
            ["operation"],
        )
        self.estimated_flops = counter("estimated_flops_per_gpu", "Estimated FLOPs per GPU (analytic).")
        self.estimated_read_bytes = counter("estimated_read_bytes_per_gpu", "Estimated bytes read per GPU (analytic).")
        self.estimated_write_bytes = counter("estimated_write_bytes_per_gpu", "Estimated bytes written per GPU (analytic).")
        self.time_to_first_token = histogram("time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Between two outputs of a request.", ITL_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "Arrival to finish.", REQUEST_BUCKETS)
        self.request_queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled (estimated).", REQUEST_BUCKETS)
        self.request_prefill_time = histogram("request_prefill_time_seconds", "First scheduled to first token.", REQUEST_BUCKETS)
        self.request_decode_time = histogram("request_decode_time_seconds", "First token to last token.", REQUEST_BUCKETS)
        # Only in a registry whose engine speculates (or once speculation stats arrive), as in vLLM.
        self._counter = counter
        settings = config.speculative.settings
        self.spec_decode = SpecDecodeMetrics(counter, settings.num_speculative_tokens) if settings else None

        # Each engine's labelled series, made once: labels() costs a lookup under a lock, and a
        # step records into ~20 series (plus 5 per finished request). Valid while no series is
        # ever removed from a metric (nothing calls remove() or clear()).
        self._series: dict[int, SimpleNamespace] = {}
        # Create every engine's series up front, so /metrics lists them before the first request.
        for engine_index in engine_indexes:
            self._engine_series(engine_index)

    def _engine_metrics(self) -> dict[str, MetricWrapperBase]:
        """The metrics labelled by model_name and engine only, by attribute name."""
        names = [
            "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
            "engine_paused", "engine_sleep_level",
            "prefix_cache_queries", "prefix_cache_hits", "num_preemptions",
            "prompt_tokens", "generation_tokens", "estimated_flops",
            "estimated_read_bytes", "estimated_write_bytes", "time_to_first_token",
            "inter_token_latency", "e2e_request_latency", "request_queue_time",
            "request_prefill_time", "request_decode_time",
        ]  # fmt: skip
        return {name: getattr(self, name) for name in names}

    def _engine_series(self, engine_index: int) -> SimpleNamespace:
        """One engine's series: an attribute per metric of _engine_metrics(), named alike, plus
        request_success by finish reason and `spec` (None while there are no spec_decode families)."""
        series = self._series.get(engine_index)
        if series is None:
            labels = (self.model_name, str(engine_index))
            series = SimpleNamespace(**{name: m.labels(*labels) for name, m in self._engine_metrics().items()})
            series.request_success = {str(r): self.request_success.labels(*labels, str(r)) for r in FinishReason}
            series.spec = self.spec_decode.series(labels) if self.spec_decode is not None else None
            self._series[engine_index] = series
        return series

    def _record_spec_decoding(self, e: SimpleNamespace, engine_index: int, stats: SpecDecodingStats) -> None:
        if e.spec is None:  # speculation the config did not announce: add the families now
            if self.spec_decode is None:
                self.spec_decode = SpecDecodeMetrics(self._counter, stats.num_spec_tokens)
            e.spec = self.spec_decode.series((self.model_name, str(engine_index)))
        self.spec_decode.record(e.spec, stats)

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        engine_index: int = 0,
    ) -> None:
        e = self._engine_series(engine_index)
        if scheduler_stats is not None:
            s = scheduler_stats
            e.num_requests_running.set(s.num_running_reqs)
            e.num_requests_waiting.set(s.num_waiting_reqs)
            e.kv_cache_usage_perc.set(s.kv_cache_usage)
            e.engine_paused.set(s.pause_state)
            e.engine_sleep_level.set(s.sleep_level)
            e.prefix_cache_queries.inc(s.prefix_cache_queries)
            e.prefix_cache_hits.inc(s.prefix_cache_hits)
            e.num_preemptions.inc(s.step_num_preemptions)
            if self.estimator is not None:
                cost = self.estimator.estimate(s.step_work)
                e.estimated_flops.inc(cost.flops)
                e.estimated_read_bytes.inc(cost.read_bytes)
                e.estimated_write_bytes.inc(cost.write_bytes)
            if s.spec_decoding is not None:
                self._record_spec_decoding(e, engine_index, s.spec_decoding)
        if iteration_stats is not None:
            it = iteration_stats
            e.prompt_tokens.inc(it.num_prompt_tokens)
            e.generation_tokens.inc(it.num_generation_tokens)
            if it.time_to_first_tokens:
                observe_all(e.time_to_first_token, it.time_to_first_tokens)
            if it.inter_token_latencies:
                observe_all(e.inter_token_latency, it.inter_token_latencies)
            for req in it.finished_requests:
                success = e.request_success.get(req.finish_reason)
                if success is None:  # not a FinishReason name: a series of its own, as before
                    success = self.request_success.labels(self.model_name, str(engine_index), req.finish_reason)
                success.inc()
                e.e2e_request_latency.observe(req.e2e_latency)
                e.request_queue_time.observe(req.queue_time)
                e.request_prefill_time.observe(req.prefill_time)
                e.request_decode_time.observe(req.decode_time)

    def record_admission_rejection(self, reason: str, engine_index: int = 0) -> None:
        self.admission_rejections.labels(self.model_name, str(engine_index), reason).inc()

    def record_weight_update(self, operation: str, seconds: float, engine_index: int = 0) -> None:
        self.weight_update_duration.labels(self.model_name, str(engine_index), operation).observe(seconds)

    def prometheus_text(self) -> bytes:
        """The registry in the Prometheus text format, then the frontend-wide RL families (the body of GET /metrics)."""
        return generate_latest(self.registry) + frontend_metrics_text()

    def snapshot(self) -> dict[str, float]:
        """Every sample as a plain number (see registry_snapshot)."""
        return registry_snapshot(self.registry)


class SpecDecodeMetrics:
    """The speculative-decoding counters (vLLM's spec_decode_* families): drafts verified and how
    many of their tokens the model accepted, in total and by draft position.

    The acceptance rate is accepted / draft tokens; the mean acceptance length (tokens a request
    gains per verifying step, its own sampled token included) is 1 + accepted / drafts.
    """

    def __init__(self, counter: Callable[..., Counter], num_spec_tokens: int) -> None:
        self.num_spec_tokens = num_spec_tokens
        self.num_drafts = counter("spec_decode_num_drafts", "Request steps that verified at least one draft token.")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.num_accepted_tokens_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0 is the first draft token).",
            ["position"],
        )

    def series(self, labels: tuple[str, str]) -> SimpleNamespace:
        """One engine's series (labels: model_name, engine); every configured position's made up front."""
        return SimpleNamespace(
            labels=labels,
            num_drafts=self.num_drafts.labels(*labels),
            num_draft_tokens=self.num_draft_tokens.labels(*labels),
            num_accepted_tokens=self.num_accepted_tokens.labels(*labels),
            per_pos=[self.num_accepted_tokens_per_pos.labels(*labels, str(i)) for i in range(self.num_spec_tokens)],
        )

    def record(self, series: SimpleNamespace, stats: SpecDecodingStats) -> None:
        series.num_drafts.inc(stats.num_drafts)
        series.num_draft_tokens.inc(stats.num_draft_tokens)
        series.num_accepted_tokens.inc(stats.num_accepted_tokens)
        for pos, num_accepted in enumerate(stats.num_accepted_tokens_per_pos):
            if pos == len(series.per_pos):  # more positions than configured: series of their own
                series.per_pos.append(self.num_accepted_tokens_per_pos.labels(*series.labels, str(pos)))
            series.per_pos[pos].inc(num_accepted)


def observe_all(histogram, values: list[float]) -> None:
    """histogram.observe(v) for each of `values`, equal values in one go.

    A step's requests that were all seen in the previous step share one inter-token latency,
    so a decode step of hundreds of rows observes one value a few hundred times: that is one
    bucket increment and one sum increment here, not one observe() per row. This reaches into
    prometheus_client's Histogram (the _sum, _buckets and _upper_bounds that observe() itself
    uses); where those are missing it falls back to observe().
    """
    if len(values) == 1 or not hasattr(histogram, "_upper_bounds"):
        for value in values:
            histogram.observe(value)
        return
    for value, count in collections.Counter(values).items():
        histogram._sum.inc(value * count)
        # observe() counts a value in the first bucket whose upper bound is >= it (the last is +Inf).
        histogram._buckets[bisect_left(histogram._upper_bounds, value)].inc(count)


def registry_snapshot(registry: CollectorRegistry) -> dict[str, float]:
    """Every sample of `registry` as a plain number, keyed by its Prometheus sample name.

    Labels other than model_name and engine stay in the key
    (`rollout:request_success_total{finished_reason="length"}`); engines are added up,
    except fraction gauges, which are averaged, and state gauges, of which the largest counts.
    Histograms give `_sum` and `_count`.
    """
    values: dict[str, list[float]] = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name.endswith(("_created", "_bucket")):
                continue
            extra = sorted((k, v) for k, v in sample.labels.items() if k not in LABELS)
            key = sample.name + ("{" + ",".join(f'{k}="{v}"' for k, v in extra) + "}" if extra else "")
            values.setdefault(key, []).append(sample.value)
    return {
        k: sum(v) / len(v) if k in _MEAN_OVER_ENGINES else max(v) if k in _MAX_OVER_ENGINES else sum(v)
        for k, v in values.items()
    }
