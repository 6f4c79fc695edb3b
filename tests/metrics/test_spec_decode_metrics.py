"""Speculative-decoding metrics: the spec_decode_* Prometheus counters (per engine, per draft position) and the log line."""

import logging
import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.core.stats import SchedulerStats, SpecDecodingStats
from engine.metrics.loggers import LoggingStatLogger, StatLoggerManager
from engine.metrics.multi_engine import MultiEngineMetrics

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
SPEC_COUNTERS = [
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos",
]


@pytest.fixture
def spec_config(tiny_checkpoint):
    from engine.engine_args import create_engine_config

    return create_engine_config(
        model=tiny_checkpoint(), device="cpu", dtype="float32", max_model_len=64, speculative_config=NGRAM
    )


def spec_stats(*drafts):
    """SchedulerStats whose speculation verified `drafts`: (num_draft_tokens, num_accepted_tokens) each."""
    spec = SpecDecodingStats(num_spec_tokens=3)
    for num_draft_tokens, num_accepted_tokens in drafts:
        spec.observe(num_draft_tokens, num_accepted_tokens)
    return SchedulerStats(num_running_reqs=len(drafts), spec_decoding=spec)


def families(text: bytes):
    return {f.name: f for f in text_string_to_metric_families(text.decode())}


def counter_values(family):
    """{(engine, position or None): value} of a counter family's `_total` samples."""
    return {
        (s.labels["engine"], s.labels.get("position")): s.value for s in family.samples if s.name.endswith("_total")
    }


def test_counters_per_engine_and_position(spec_config):
    manager = StatLoggerManager(spec_config, "tiny", engine_indexes=[0, 1])
    before = families(manager.prometheus_text())
    for name in SPEC_COUNTERS:  # listed before the first step, at zero, for every engine (and position)
        assert before[name].type == "counter", name
        assert all(v == 0 for v in counter_values(before[name]).values()), name
    assert set(counter_values(before["vllm:spec_decode_num_accepted_tokens_per_pos"])) == {
        (e, p) for e in "01" for p in "012"
    }

    manager.record(spec_stats((3, 2), (3, 0), (2, 2)), None, engine_index=1)
    manager.record(spec_stats((3, 3)), None, engine_index=1)  # a second interval adds up
    manager.record(spec_stats((1, 1)), None, engine_index=0)
    manager.record(SchedulerStats(), None, engine_index=0)  # no speculation this step: nothing moves
    after = families(manager.prometheus_text())
    for name in SPEC_COUNTERS:
        for sample in after[name].samples:
            assert sample.labels["model_name"] == "tiny"
    assert counter_values(after["vllm:spec_decode_num_drafts"]) == {("0", None): 1, ("1", None): 4}
    assert counter_values(after["vllm:spec_decode_num_draft_tokens"]) == {("0", None): 1, ("1", None): 11}
    assert counter_values(after["vllm:spec_decode_num_accepted_tokens"]) == {("0", None): 1, ("1", None): 7}
    assert counter_values(after["vllm:spec_decode_num_accepted_tokens_per_pos"]) == {
        ("0", "0"): 1, ("0", "1"): 0, ("0", "2"): 0,
        ("1", "0"): 3, ("1", "1"): 3, ("1", "2"): 1,
    }  # fmt: skip

    snap = manager.get_metrics_snapshot()  # engines added up
    assert snap["vllm:spec_decode_num_drafts_total"] == 5
    assert snap["vllm:spec_decode_num_draft_tokens_total"] == 12
    assert snap["vllm:spec_decode_num_accepted_tokens_total"] == 8
    per_pos = [snap[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}'] for i in range(3)]
    assert per_pos == [4, 3, 1]


def test_no_spec_families_without_speculation_until_stats_arrive(engine_config):
    manager = StatLoggerManager(engine_config, "tiny", engine_indexes=[0, 1])
    manager.record(SchedulerStats(num_running_reqs=1), None, engine_index=0)
    assert b"spec_decode" not in manager.prometheus_text()
    assert not any("spec_decode" in k for k in manager.get_metrics_snapshot())

    # Stats from a speculating engine the config did not announce still count.
    manager.record(spec_stats((3, 1)), None, engine_index=1)
    manager.record(spec_stats((2, 2)), None, engine_index=1)
    manager.record(spec_stats((3, 3)), None, engine_index=0)
    got = families(manager.prometheus_text())
    assert counter_values(got["vllm:spec_decode_num_drafts"]) == {("0", None): 1, ("1", None): 2}
    assert counter_values(got["vllm:spec_decode_num_accepted_tokens_per_pos"]) == {
        ("0", "0"): 1, ("0", "1"): 1, ("0", "2"): 1,
        ("1", "0"): 2, ("1", "1"): 1, ("1", "2"): 0,
    }  # fmt: skip


def test_data_parallel_registries_keep_spec_counters_apart(spec_config):
    managers = [StatLoggerManager(spec_config, "tiny") for _ in range(2)]  # each frontend calls its engine "0"
    managers[0].record(spec_stats((3, 1)), None)
    managers[1].record(spec_stats((3, 3), (3, 2)), None)
    metrics = MultiEngineMetrics([m.prometheus_logger.registry for m in managers])
    got = families(metrics.prometheus_text())
    assert counter_values(got["vllm:spec_decode_num_accepted_tokens"]) == {("0", None): 1, ("1", None): 5}
    assert counter_values(got["vllm:spec_decode_num_accepted_tokens_per_pos"]) == {
        ("0", "0"): 1, ("0", "1"): 0, ("0", "2"): 0,
        ("1", "0"): 2, ("1", "1"): 2, ("1", "2"): 1,
    }  # fmt: skip
    snap = metrics.snapshot()
    assert snap["vllm:spec_decode_num_drafts_total"] == 3
    assert snap["vllm:spec_decode_num_draft_tokens_total"] == 9
    assert snap['vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] == 3


def test_stats_from_the_engine_process_decode_into_the_same_counters(spec_config):
    """SchedulerStats travel to the frontend inside msgpack-encoded EngineCoreOutputs."""
    from engine.serial_utils import MsgpackDecoder, MsgpackEncoder
    from engine.wire import EngineCoreOutputs

    frames = MsgpackEncoder().encode(EngineCoreOutputs(scheduler_stats=spec_stats((3, 2), (1, 0))))
    decoded = MsgpackDecoder(EngineCoreOutputs).decode([bytes(f) for f in frames]).scheduler_stats
    manager = StatLoggerManager(spec_config, "tiny")
    manager.record(decoded, None)
    snap = manager.get_metrics_snapshot()
    assert snap["vllm:spec_decode_num_draft_tokens_total"] == 4
    assert snap['vllm:spec_decode_num_accepted_tokens_per_pos_total{position="1"}'] == 1


def logged_line(stat_logger, caplog):
    caplog.clear()
    stat_logger.last_log_time -= stat_logger.interval
    with caplog.at_level(logging.INFO, logger="engine.metrics.loggers"):
        stat_logger.log()
    [record] = caplog.records
    return record.getMessage()


def test_log_line_reports_acceptance_per_interval(spec_config, engine_config, caplog):
    stat_logger = LoggingStatLogger(spec_config, engine_index=0)
    stat_logger.record(spec_stats((3, 2), (3, 0)), None)
    stat_logger.record(spec_stats((2, 2), (3, 3)), None)
    line = logged_line(stat_logger, caplog)
    # 7 of 11 draft tokens in 4 drafts: 63.6%, 1 + 7/4 = 2.75 tokens per verifying step.
    assert re.search(r"Spec decode draft acceptance rate: 63\.6%", line), line
    assert re.search(r"Mean acceptance length: 2\.75", line), line
    assert re.search(r"Per-position acceptance rate: 0\.750, 0\.750, 0\.250$", line), line
    assert "Running: 2 reqs" in line  # the rest of the line is unchanged

    stat_logger.record(SchedulerStats(), None)  # an interval without drafts
    line = logged_line(stat_logger, caplog)
    assert "Spec decode draft acceptance rate: 0.0%, Mean acceptance length: 1.00" in line, line
    assert "Per-position acceptance rate: 0.000, 0.000, 0.000" in line, line

    plain = LoggingStatLogger(engine_config, engine_index=0)
    plain.record(SchedulerStats(), None)
    assert "Spec decode" not in logged_line(plain, caplog)


def test_llm_with_ngram_speculation_exports_consistent_counters(tiny_checkpoint, caplog):
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(
        tiny_checkpoint("llama"), device="cpu", dtype="float32", max_model_len=128, max_num_seqs=4,
        speculative_config=NGRAM, log_stats_interval=1e-6,
    )  # fmt: skip
    # Prompts that repeat a phrase: the n-gram lookup finds continuations and some are accepted.
    phrases = [[11, 12, 13, 14, 15, 16, 17], [40, 41, 42, 43], [7, 8, 9, 10, 11]]
    prompts = [{"prompt_token_ids": p * 6} for p in phrases]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    with caplog.at_level(logging.INFO, logger="engine.metrics.loggers"):
        outputs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 30 for o in outputs)

    snap = llm.get_metrics_snapshot()
    num_drafts = snap["vllm:spec_decode_num_drafts_total"]
    num_draft_tokens = snap["vllm:spec_decode_num_draft_tokens_total"]
    num_accepted = snap["vllm:spec_decode_num_accepted_tokens_total"]
    per_pos = [snap[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}'] for i in range(3)]
    assert num_drafts > 0 and num_draft_tokens > 0 and num_accepted > 0
    assert num_drafts <= num_draft_tokens <= 3 * num_drafts
    assert num_accepted <= num_draft_tokens
    assert sum(per_pos) == num_accepted
    assert per_pos[0] >= per_pos[1] >= per_pos[2]  # a position is accepted only after the ones before it
    assert per_pos[0] <= num_drafts
    assert snap["vllm:generation_tokens_total"] == 90  # accepted drafts count as generated tokens once
    totals = llm.engine_core.scheduler.spec_totals  # the scheduler's own running count agrees
    assert num_drafts == totals.num_drafts and num_draft_tokens == totals.num_draft_tokens
    assert num_accepted == totals.num_accepted_tokens
    assert per_pos == totals.num_accepted_tokens_per_pos

    lines = [r.getMessage() for r in caplog.records if "Spec decode" in r.getMessage()]
    assert lines, "no log line with the speculation numbers"
    assert any(re.search(r"Mean acceptance length: (?!1\.00)[\d.]+", line) for line in lines), lines
    llm.engine_core.shutdown()
