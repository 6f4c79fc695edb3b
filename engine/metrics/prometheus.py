"""PrometheusStatLogger: the engine's metric families (vLLM's under `vllm:`, ours under `rollout:`) in one registry."""

from __future__ import annotations

import collections
import dataclasses
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
from engine.metrics.rl import SLEEP_STATES, frontend_metrics_text, sleep_state_values
from engine.wire import FinishReason

VLLM_PREFIX = "vllm:"  # every family vLLM 0.33 also has: its name, type, labels and buckets
PREFIX = "rollout:"  # our own families, which vLLM has no counterpart of
LABELS = ["model_name", "engine"]

# Histogram buckets, vLLM 0.33's defaults (vllm/v1/metrics/buckets.py). Seconds, then counts.
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]  # fmt: skip
ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
REQUEST_PARAMS_N_BUCKETS = [1, 2, 5, 10, 20]
REQUEST_NUM_PREEMPTIONS_BUCKETS = [1, 2, 3, 4, 5, 10, 20]
WEIGHT_UPDATE_BUCKETS = [0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]


def request_tokens_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len: vLLM's buckets for per-request token counts."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


# vllm:prompt_tokens_by_source's sources (where a prompt token's KV came from) and
# vllm:prompt_tokens_cached_by_source's cache tiers, as vLLM names them. Ours has one tier (the
# device's prefix cache) and no KV connector, so the other series stay at 0.
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
# vllm:num_requests_waiting_by_reason: "capacity" waits for a place in the batch; "deferred" (held
# back by a LoRA budget or a KV transfer) does not happen in this engine.
WAITING_REASONS = ("capacity", "deferred")
# vllm:admission_rejections' reasons, by our AdmissionError.reason (engine/exceptions.py).
ADMISSION_REASONS = {"queue_full": "max_num_queued_reqs", "queued_tokens": "max_num_queued_tokens"}

# Gauges that are fractions: a snapshot over several engines averages them instead of adding.
_MEAN_OVER_ENGINES = {VLLM_PREFIX + "kv_cache_usage_perc"}
# State gauges: a snapshot over several engines shows the most paused / deepest asleep one.
_MAX_OVER_ENGINES = {PREFIX + "engine_paused", PREFIX + "engine_sleep_level", VLLM_PREFIX + "cache_config_info"}


class PrometheusStatLogger(StatLoggerBase):
    """All engines of one frontend in one registry, told apart by the `engine` label.

    Families vLLM 0.33 also has carry its names (`vllm:`), types, label names and buckets, so
    dashboards and alerts written for vLLM read them unchanged; families of our own are `rollout:`.
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
        self.config = config
        self.engine_indexes = list(engine_indexes)
        self.registry = CollectorRegistry() if registry is None else registry
        self.estimator = estimator_for(config)

        def gauge(name: str, doc: str, extra_labels: Sequence[str] = (), prefix: str = VLLM_PREFIX) -> Gauge:
            return Gauge(prefix + name, doc, LABELS + list(extra_labels), registry=self.registry)

        def counter(name: str, doc: str, extra_labels: Sequence[str] = (), prefix: str = VLLM_PREFIX) -> Counter:
            return Counter(prefix + name, doc, LABELS + list(extra_labels), registry=self.registry)

        def histogram(name: str, doc: str, buckets: Sequence[float], extra_labels: Sequence[str] = (),
                      prefix: str = VLLM_PREFIX) -> Histogram:  # fmt: skip
            return Histogram(prefix + name, doc, LABELS + list(extra_labels), buckets=buckets, registry=self.registry)

        # max_model_len is resolved by create_engine_config; a hand-built config may leave it None.
        token_buckets = request_tokens_buckets(config.model.max_model_len or 1_000_000)
        # Scheduler state.
        self.num_requests_running = gauge("num_requests_running", "Requests in the engine's running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.num_requests_waiting_by_reason = gauge(
            "num_requests_waiting_by_reason",
            "Waiting requests by reason: 'capacity' waits for room in the batch; 'deferred' is always 0 here.",
            ["reason"],
        )
        self.engine_sleep_state = gauge(
            "engine_sleep_state",
            "1 for the engine's sleep state (awake, weights_offloaded: level 1, discard_all: level 2), else 0.",
            ["sleep_state"],
        )
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).")
        self.engine_paused = gauge(
            "engine_paused", "Scheduler pause state: 0 unpaused, 1 new requests refused, 2 nothing scheduled.",
            prefix=PREFIX,
        )
        self.engine_sleep_level = gauge(
            "engine_sleep_level", "Level of the engine's sleep (1 weights offloaded, 2 discarded); 0 awake or level 0.",
            prefix=PREFIX,
        )
        # Counters.
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.external_prefix_cache_queries = counter(
            "external_prefix_cache_queries", "Tokens looked up in an external KV cache (no KV connector here: 0)."
        )
        self.external_prefix_cache_hits = counter(
            "external_prefix_cache_hits", "Tokens found in an external KV cache (no KV connector here: 0)."
        )
        # vLLM has these for every model; a text-only one (all we serve) never queries the cache, as here.
        self.mm_cache_queries = counter("mm_cache_queries", "Multimodal cache queries, in items (text only here: 0).")
        self.mm_cache_hits = counter("mm_cache_hits", "Multimodal cache hits, in items (text only here: 0).")
        self.num_preemptions = counter("num_preemptions", "Requests preempted (recomputed later).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that got their first token.")
        self.prompt_tokens_by_source = counter(
            "prompt_tokens_by_source",
            "Those prompt tokens by where their KV came from: local_compute, local_cache_hit, external_kv_transfer.",
            ["source"],
        )
        self.prompt_tokens_cached = counter("prompt_tokens_cached", "Those prompt tokens served from a cache.")
        self.prompt_tokens_cached_by_source = counter(
            "prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the tier that held them (device: this engine's cache; no other tier here).",
            ["source"],
        )
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.request_success = counter("request_success", "Finished requests by finish reason.", ["finished_reason"])
        # vLLM counts admission per frontend: no engine label.
        self.admission_rejections = Counter(
            VLLM_PREFIX + "admission_rejections", "Requests refused by admission control (a queue limit), by reason.",
            ["model_name", "reason"], registry=self.registry,
        )  # fmt: skip
        self.estimated_flops = counter("estimated_flops_per_gpu", "Estimated FLOPs per GPU (analytic).")
        self.estimated_read_bytes = counter("estimated_read_bytes_per_gpu", "Estimated bytes read per GPU (analytic).")
        self.estimated_write_bytes = counter("estimated_write_bytes_per_gpu", "Estimated bytes written per GPU (analytic).")
        # Histograms of counts.
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per finished request.", token_buckets)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per finished request.", token_buckets
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens per engine step: prompt tokens computed plus tokens generated.",
            ITERATION_TOKENS_BUCKETS,
        )  # fmt: skip
        self.request_max_num_generation_tokens = histogram(
            "request_max_num_generation_tokens", "Per user request, the most tokens one of its n sequences generated.",
            token_buckets,
        )  # fmt: skip
        self.request_params_n = histogram("request_params_n", "The n parameter of finished requests.",
                                          REQUEST_PARAMS_N_BUCKETS)  # fmt: skip
        self.request_params_max_tokens = histogram(
            "request_params_max_tokens", "The max_tokens parameter of finished requests that gave one.", token_buckets
        )
        self.request_num_preemptions = histogram(
            "request_num_preemptions", "Times a finished request was preempted.", REQUEST_NUM_PREEMPTIONS_BUCKETS
        )
        self.request_prefill_kv_computed_tokens = histogram(
            "request_prefill_kv_computed_tokens", "Prompt tokens a finished request prefilled (cache hits excluded).",
            token_buckets,
        )  # fmt: skip
        # Histograms of times.
        self.time_to_first_token = histogram("time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Between two outputs of a request.", ITL_BUCKETS)
        self.request_time_per_output_token = histogram(
            "request_time_per_output_token_seconds", "Per finished request: decode time / (generated tokens - 1).",
            ITL_BUCKETS,
        )  # fmt: skip
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "Arrival to finish.", REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduled (estimated).", REQUEST_LATENCY_BUCKETS
        )
        self.request_inference_time = histogram(
            "request_inference_time_seconds", "First scheduled to last token.", REQUEST_LATENCY_BUCKETS
        )
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds", "First scheduled to first token.", REQUEST_LATENCY_BUCKETS
        )
        self.request_decode_time = histogram(
            "request_decode_time_seconds", "First token to last token.", REQUEST_LATENCY_BUCKETS
        )
        # Ours: per engine, successful calls only (vLLM's per-route family is engine/metrics/rl.py's).
        self.weight_update_duration = histogram(
            "weight_update_duration_seconds",
            "Duration of each successful weight-update lifecycle call (init, start, update, finish, shutdown; "
            "apply: one whole update in one call) on one engine, seen by its frontend.",
            WEIGHT_UPDATE_BUCKETS, ["operation"], prefix=PREFIX,
        )  # fmt: skip
        self.weight_version_info = Gauge(
            PREFIX + "weight_version_info", "The weight version an engine computes with (label weight_version; value 1).",
            LABELS + ["weight_version"], registry=self.registry,
        )  # fmt: skip
        self._weight_versions: dict[int, str] = {}  # engine -> the version its weight_version_info series shows
        self.cache_config_info: Gauge | None = None  # made by log_engine_initialized, once the cache is sized
        # Only in a registry whose engine speculates (or once speculation stats arrive), as in vLLM.
        self._counter = counter
        settings = config.speculative.settings
        self.spec_decode = SpecDecodeMetrics(counter, settings.num_speculative_tokens) if settings else None

        # Each engine's labelled series, made once: labels() costs a lookup under a lock, and a
        # step records into ~25 series (plus ~12 per finished request). Valid while no series is
        # ever removed from a metric (only weight_version_info's series are, and they are not cached here).
        self._series: dict[int, SimpleNamespace] = {}
        for reason in ADMISSION_REASONS.values():  # listed at 0 before the first refusal, as in vLLM
            self.admission_rejections.labels(model_name, reason)
        # Create every engine's series up front, so /metrics lists them before the first request.
        for engine_index in engine_indexes:
            self._engine_series(engine_index)

    def _engine_metrics(self) -> dict[str, MetricWrapperBase]:
        """The metrics labelled by model_name and engine only, by attribute name."""
        names = [
            "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
            "engine_paused", "engine_sleep_level",
            "prefix_cache_queries", "prefix_cache_hits", "external_prefix_cache_queries",
            "external_prefix_cache_hits", "mm_cache_queries", "mm_cache_hits", "num_preemptions",
            "prompt_tokens", "prompt_tokens_cached", "generation_tokens",
            "estimated_flops", "estimated_read_bytes", "estimated_write_bytes",
            "request_prompt_tokens", "request_generation_tokens", "iteration_tokens",
            "request_max_num_generation_tokens", "request_params_n", "request_params_max_tokens",
            "request_num_preemptions", "request_prefill_kv_computed_tokens",
            "time_to_first_token", "inter_token_latency", "request_time_per_output_token",
            "e2e_request_latency", "request_queue_time", "request_inference_time",
            "request_prefill_time", "request_decode_time",
        ]  # fmt: skip
        return {name: getattr(self, name) for name in names}

    def _engine_series(self, engine_index: int) -> SimpleNamespace:
        """One engine's series: an attribute per metric of _engine_metrics(), named alike, plus the
        labelled ones (request_success by finish reason, the by-source, by-reason and sleep-state
        series, by label value) and `spec` (None while there are no spec_decode families)."""
        series = self._series.get(engine_index)
        if series is None:
            labels = (self.model_name, str(engine_index))
            series = SimpleNamespace(**{name: m.labels(*labels) for name, m in self._engine_metrics().items()})
            series.request_success = {str(r): self.request_success.labels(*labels, str(r)) for r in FinishReason}
            series.prompt_tokens_by_source = {s: self.prompt_tokens_by_source.labels(*labels, s)
                                              for s in PROMPT_TOKEN_SOURCES}  # fmt: skip
            series.prompt_tokens_cached_by_source = {s: self.prompt_tokens_cached_by_source.labels(*labels, s)
                                                     for s in CACHE_HIT_SOURCES}  # fmt: skip
            series.waiting_by_reason = {r: self.num_requests_waiting_by_reason.labels(*labels, r)
                                        for r in WAITING_REASONS}  # fmt: skip
            series.sleep_state = {s: self.engine_sleep_state.labels(*labels, s) for s in SLEEP_STATES}
            for state, value in sleep_state_values(0).items():  # awake until the engine says otherwise
                series.sleep_state[state].set(value)
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
            e.waiting_by_reason["capacity"].set(s.num_waiting_reqs)
            e.kv_cache_usage_perc.set(s.kv_cache_usage)
            e.engine_paused.set(s.pause_state)
            e.engine_sleep_level.set(s.sleep_level)
            for state, value in sleep_state_values(s.sleep_level).items():
                e.sleep_state[state].set(value)
            e.prefix_cache_queries.inc(s.prefix_cache_queries)
            e.prefix_cache_hits.inc(s.prefix_cache_hits)
            e.prompt_tokens_cached_by_source["device"].inc(s.prefix_cache_hits)
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
            e.prompt_tokens_by_source["local_compute"].inc(it.num_computed_prompt_tokens)
            e.prompt_tokens_by_source["local_cache_hit"].inc(it.num_cached_prompt_tokens)
            e.prompt_tokens_cached.inc(it.num_cached_prompt_tokens)
            e.generation_tokens.inc(it.num_generation_tokens)
            if it.weight_version is not None and self._weight_versions.get(engine_index) != it.weight_version:
                self._set_weight_version(engine_index, it.weight_version)
            e.iteration_tokens.observe(it.num_computed_prompt_tokens + it.num_generation_tokens)
            if it.time_to_first_tokens:
                observe_all(e.time_to_first_token, it.time_to_first_tokens)
            if it.inter_token_latencies:
                observe_all(e.inter_token_latency, it.inter_token_latencies)
            if it.n_params:
                observe_all(e.request_params_n, it.n_params)
            if it.max_num_generation_tokens:
                observe_all(e.request_max_num_generation_tokens, it.max_num_generation_tokens)
            if it.finished_requests:
                self._record_finished(e, engine_index, it.finished_requests)

    def _record_finished(self, e: SimpleNamespace, engine_index: int, finished: list) -> None:
        """The per-request histograms and success counters of a step's finished requests, one
        observe_all per histogram (a step of an RL batch finishes hundreds of requests whose token
        counts are mostly equal) instead of eleven observe() calls per request."""
        reasons = collections.Counter(req.finish_reason for req in finished)
        for reason, count in reasons.items():
            success = e.request_success.get(reason)
            if success is None:  # not a FinishReason name: a series of its own, as before
                success = self.request_success.labels(self.model_name, str(engine_index), reason)
            success.inc(count)
        observe_all(e.e2e_request_latency, [req.e2e_latency for req in finished])
        observe_all(e.request_queue_time, [req.queue_time for req in finished])
        observe_all(e.request_prefill_time, [req.prefill_time for req in finished])
        observe_all(e.request_inference_time, [req.inference_time for req in finished])
        observe_all(e.request_decode_time, [req.decode_time for req in finished])
        observe_all(e.request_time_per_output_token, [req.mean_time_per_output_token for req in finished])
        observe_all(e.request_prompt_tokens, [req.num_prompt_tokens for req in finished])
        observe_all(e.request_generation_tokens, [req.num_generation_tokens for req in finished])
        observe_all(e.request_prefill_kv_computed_tokens, [req.num_prompt_tokens - req.num_cached_tokens for req in finished])
        observe_all(e.request_num_preemptions, [req.num_preemptions for req in finished])
        max_tokens = [req.max_tokens for req in finished if req.max_tokens]
        if max_tokens:
            observe_all(e.request_params_max_tokens, max_tokens)

    def _set_weight_version(self, engine_index: int, version: str) -> None:
        """One series per engine, for its current version: the previous version's series goes."""
        labels = (self.model_name, str(engine_index))
        previous = self._weight_versions.get(engine_index)
        if previous is not None:
            self.weight_version_info.remove(*labels, previous)
        self.weight_version_info.labels(*labels, version).set(1)
        self._weight_versions[engine_index] = version

    def record_admission_rejection(self, reason: str, engine_index: int = 0) -> None:
        self.admission_rejections.labels(self.model_name, ADMISSION_REASONS.get(reason, reason)).inc()

    def record_weight_update(self, operation: str, seconds: float, engine_index: int = 0) -> None:
        self.weight_update_duration.labels(self.model_name, str(engine_index), operation).observe(seconds)

    def log_engine_initialized(self, num_gpu_blocks: int | None = None) -> None:
        """Adds vllm:cache_config_info (an info-style gauge at 1, one series per engine) with the
        cache settings as labels, and the number of KV blocks the engine made when known."""
        if self.cache_config_info is not None:
            return
        info = cache_config_labels(self.config, num_gpu_blocks)
        self.cache_config_info = Gauge(
            VLLM_PREFIX + "cache_config_info", "Information of the engine's CacheConfig (labels; the value is 1).",
            [*info, "engine"], registry=self.registry,
        )  # fmt: skip
        for engine_index in self.engine_indexes:
            self.cache_config_info.labels(**info, engine=str(engine_index)).set(1)

    def prometheus_text(self) -> bytes:
        """The registry in the Prometheus text format, then the frontend-wide RL families (the body of GET /metrics)."""
        return generate_latest(self.registry) + frontend_metrics_text()

    def snapshot(self) -> dict[str, float]:
        """Every sample as a plain number (see registry_snapshot)."""
        return registry_snapshot(self.registry)


def cache_config_labels(config: EngineConfig, num_gpu_blocks: int | None) -> dict[str, str]:
    """vllm:cache_config_info's labels: the CacheConfig fields (vLLM's label names where it has the same
    field), `num_gpu_blocks` and `cache_dtype` (vLLM's label for kv_cache_dtype: "auto" is the model's dtype)."""
    cache = config.cache
    labels = {f.name: str(getattr(cache, f.name)) for f in dataclasses.fields(cache)}
    labels["cache_dtype"] = cache.kv_cache_dtype
    labels["num_gpu_blocks"] = str(num_gpu_blocks)
    return labels


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
    (`vllm:request_success_total{finished_reason="length"}`); engines are added up,
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
