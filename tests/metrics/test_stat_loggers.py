"""Stat loggers: Prometheus exposition, the snapshot, plugins through entry points, and the log line."""

import logging
import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.core.stats import SchedulerStats, StepWork
from engine.metrics.iteration_stats import FinishedRequestStats, IterationStats
from engine.metrics.loggers import LoggingStatLogger, StatLoggerManager

# vLLM family name (as the parser reports it: counters without `_total`) -> type and labels beyond
# model_name and engine (vLLM 0.33's, vllm/v1/metrics/loggers.py).
FAMILIES = {
    "num_requests_running": ("gauge", ()),
    "num_requests_waiting": ("gauge", ()),
    "num_requests_waiting_by_reason": ("gauge", ("reason",)),
    "engine_sleep_state": ("gauge", ("sleep_state",)),
    "kv_cache_usage_perc": ("gauge", ()),
    "prefix_cache_queries": ("counter", ()),
    "prefix_cache_hits": ("counter", ()),
    "external_prefix_cache_queries": ("counter", ()),
    "external_prefix_cache_hits": ("counter", ()),
    "num_preemptions": ("counter", ()),
    "prompt_tokens": ("counter", ()),
    "prompt_tokens_by_source": ("counter", ("source",)),
    "prompt_tokens_cached": ("counter", ()),
    "prompt_tokens_cached_by_source": ("counter", ("source",)),
    "generation_tokens": ("counter", ()),
    "request_success": ("counter", ("finished_reason",)),
    "request_prompt_tokens": ("histogram", ()),
    "request_generation_tokens": ("histogram", ()),
    "iteration_tokens_total": ("histogram", ()),
    "request_max_num_generation_tokens": ("histogram", ()),
    "request_params_n": ("histogram", ()),
    "request_params_max_tokens": ("histogram", ()),
    "request_prefill_kv_computed_tokens": ("histogram", ()),
    "time_to_first_token_seconds": ("histogram", ()),
    "inter_token_latency_seconds": ("histogram", ()),
    "request_time_per_output_token_seconds": ("histogram", ()),
    "e2e_request_latency_seconds": ("histogram", ()),
    "request_queue_time_seconds": ("histogram", ()),
    "request_inference_time_seconds": ("histogram", ()),
    "request_prefill_time_seconds": ("histogram", ()),
    "request_decode_time_seconds": ("histogram", ()),
    "estimated_flops_per_gpu": ("counter", ()),
    "estimated_read_bytes_per_gpu": ("counter", ()),
    "estimated_write_bytes_per_gpu": ("counter", ()),
}


def scheduler_stats():
    work = StepWork()
    work.add_row(0, 4, samples=True)
    work.add_row(9, 1, samples=True)
    work.num_steps = 1
    return SchedulerStats(
        num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.25, prefix_cache_queries=8,
        prefix_cache_hits=4, num_preemptions=1, step_num_preemptions=1, step_work=work,
    )  # fmt: skip


def iteration_stats():
    done = FinishedRequestStats("a", "length", 2.0, 4, 3, 0.5, 0.5, 1.0)
    return IterationStats(0.0, 4, 2, [0.2], [0.05], [done])


def test_prometheus_families_parse_with_labels(engine_config):
    manager = StatLoggerManager(engine_config, "tiny", engine_indexes=[0, 1])
    manager.record(scheduler_stats(), iteration_stats(), engine_index=1)
    manager.record_admission_rejection("queue_full", engine_index=0)
    families = {f.name: f for f in text_string_to_metric_families(manager.prometheus_text().decode())}
    for name, (kind, extra_labels) in FAMILIES.items():
        family = families["vllm:" + name]
        assert family.type == kind, name
        assert family.samples, name
        for sample in family.samples:
            assert set(sample.labels) - {"le"} == {"model_name", "engine", *extra_labels}, name
            assert sample.labels["model_name"] == "tiny", name
            assert sample.labels["engine"] in ("0", "1"), name
    # Admission is counted per frontend, as in vLLM: no engine label, vLLM's reason names.
    assert families["vllm:admission_rejections"].type == "counter"
    for sample in families["vllm:admission_rejections"].samples:
        assert set(sample.labels) == {"model_name", "reason"}

    def value(name, **labels):
        (sample,) = [
            s for f in families.values() for s in f.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        ]  # fmt: skip
        return sample.value

    assert value("vllm:num_requests_running", engine="1") == 2
    assert value("vllm:num_requests_running", engine="0") == 0
    assert value("vllm:request_success_total", engine="1", finished_reason="length") == 1
    assert value("vllm:request_success_total", engine="1", finished_reason="stop") == 0
    assert value("vllm:admission_rejections_total", reason="max_num_queued_reqs") == 1
    assert value("vllm:admission_rejections_total", reason="max_num_queued_tokens") == 0
    assert value("vllm:time_to_first_token_seconds_count", engine="1") == 1
    assert value("vllm:estimated_flops_per_gpu_total", engine="1") > 0
    assert value("vllm:estimated_read_bytes_per_gpu_total", engine="1") > 0


def test_snapshot_is_plain_numbers_and_managers_do_not_collide(engine_config):
    first = StatLoggerManager(engine_config, "tiny")
    second = StatLoggerManager(engine_config, "tiny")  # its own registry: no duplicate-series error
    first.record(scheduler_stats(), iteration_stats())
    first.record(scheduler_stats(), iteration_stats())
    snap = first.get_metrics_snapshot()
    assert all(isinstance(v, float) for v in snap.values())
    assert snap["vllm:num_requests_running"] == 2
    assert snap["vllm:kv_cache_usage_perc"] == 0.25
    assert snap["vllm:prompt_tokens_total"] == 8
    assert snap["vllm:generation_tokens_total"] == 4
    assert snap["vllm:num_preemptions_total"] == 2
    assert snap["vllm:prefix_cache_hits_total"] == 8
    assert snap['vllm:request_success_total{finished_reason="length"}'] == 2
    assert snap["vllm:e2e_request_latency_seconds_sum"] == 4.0
    assert snap["vllm:e2e_request_latency_seconds_count"] == 2
    assert second.get_metrics_snapshot()["vllm:prompt_tokens_total"] == 0


def test_plugin_logger_receives_records(engine_config, recording_plugin):
    engine_config.observability.stat_loggers = ["recorder"]
    manager = StatLoggerManager(engine_config, "tiny", engine_indexes=[0, 1])
    assert [p.engine_index for p in recording_plugin.instances] == [0, 1]
    stats = scheduler_stats()
    manager.record(stats, None, engine_index=1)
    manager.log()
    first, second = recording_plugin.instances
    assert first.records == [] and second.records == [(stats, None, 1)]
    assert first.num_logs == second.num_logs == 1


def test_unknown_plugin_name_raises(engine_config, recording_plugin):
    engine_config.observability.stat_loggers = ["recorder", "no_such_logger"]
    with pytest.raises(ValueError, match="no_such_logger"):
        StatLoggerManager(engine_config, "tiny")


def test_custom_logger_factory_must_build_a_stat_logger(engine_config, recording_plugin):
    manager = StatLoggerManager(engine_config, "tiny", custom_loggers=[recording_plugin])
    assert isinstance(manager.per_engine_loggers[0][-1], recording_plugin)
    with pytest.raises(TypeError, match="not a StatLoggerBase"):
        StatLoggerManager(engine_config, "tiny", custom_loggers=[lambda config, index: object()])


def test_logging_logger_emits_one_line_per_interval(engine_config, caplog):
    stat_logger = LoggingStatLogger(engine_config, engine_index=0)
    stat_logger.record(scheduler_stats(), iteration_stats())
    with caplog.at_level(logging.INFO, logger="engine.metrics.loggers"):
        stat_logger.log()  # the interval has not passed yet
        assert caplog.records == []
        stat_logger.last_log_time -= engine_config.observability.log_stats_interval
        stat_logger.log()
        stat_logger.log()  # just logged: nothing
    [record] = caplog.records
    line = record.getMessage()
    for pattern in [
        r"Engine 000",
        r"Avg prompt throughput: [\d.]+ tokens/s",
        r"Avg generation throughput: [\d.]+ tokens/s",
        r"Running: 2 reqs",
        r"Waiting: 1 reqs",
        r"KV cache usage: 25\.0%",
        r"Prefix cache hit rate: 50\.0%",
        r"Estimated: [\d.]+ TFLOP/s",
    ]:
        assert re.search(pattern, line), (pattern, line)


def test_disable_log_stats_drops_the_log_line(engine_config):
    engine_config.observability.disable_log_stats = True
    assert StatLoggerManager(engine_config, "tiny").per_engine_loggers == {0: []}


def test_finished_requests_of_a_step_are_each_observed(engine_config):
    """A step finishing many requests (repeated token counts, distinct latencies, mixed reasons, some
    without max_tokens) fills every per-request histogram as one observe() per request would."""
    done = [
        FinishedRequestStats(f"r{i}", ("length", "stop", "abort")[i % 3], 0.1 + i * 0.37, 4 + i % 2, 1 + i % 4,
                             0.01 * i, 0.02, 0.003 * i, num_cached_tokens=i % 2, max_tokens=(None if i % 5 == 0 else 6))
        for i in range(40)
    ]
    manager = StatLoggerManager(engine_config, "tiny")
    manager.record(scheduler_stats(), IterationStats(0.0, 4, 2, [0.2], [0.05], done))
    families = {f.name: f for f in text_string_to_metric_families(manager.prometheus_text().decode())}

    def check(name, values):
        samples = families["vllm:" + name].samples
        buckets = [(float(s.labels["le"]), s.value) for s in samples if s.name.endswith("_bucket")]
        assert buckets, name
        for bound, cumulative in buckets:
            assert cumulative == sum(v <= bound for v in values), (name, bound)
        (total,) = [s.value for s in samples if s.name.endswith("_sum")]
        assert total == pytest.approx(sum(values)), name

    check("e2e_request_latency_seconds", [d.e2e_latency for d in done])
    check("request_queue_time_seconds", [d.queue_time for d in done])
    check("request_decode_time_seconds", [d.decode_time for d in done])
    check("request_inference_time_seconds", [d.inference_time for d in done])
    check("request_time_per_output_token_seconds", [d.mean_time_per_output_token for d in done])
    check("request_prompt_tokens", [d.num_prompt_tokens for d in done])
    check("request_generation_tokens", [d.num_generation_tokens for d in done])
    check("request_prefill_kv_computed_tokens", [d.num_prompt_tokens - d.num_cached_tokens for d in done])
    check("request_params_max_tokens", [d.max_tokens for d in done if d.max_tokens])
    success = {s.labels["finished_reason"]: s.value for s in families["vllm:request_success"].samples
               if s.name.endswith("_total")}  # fmt: skip
    assert (success["length"], success["stop"], success["abort"]) == (14, 13, 13)
