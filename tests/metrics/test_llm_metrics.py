"""Metrics of a real offline LLM run on the tiny checkpoint: counters move, plugins see every step."""

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams


@pytest.fixture
def make_llm(tiny_checkpoint):
    def make(**kwargs):
        return LLM(tiny_checkpoint(), device="cpu", dtype="float32", max_model_len=64, **kwargs)

    return make


def test_generate_moves_counters(make_llm):
    llm = make_llm()
    before = llm.get_metrics_snapshot()
    assert before["rollout:generation_tokens_total"] == 0
    params = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.0)
    outputs = llm.generate(["Hello there", "The quick brown fox"], params, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)

    snap = llm.get_metrics_snapshot()
    num_prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    assert snap["rollout:prompt_tokens_total"] == num_prompt_tokens
    assert snap["rollout:generation_tokens_total"] == 10
    assert snap['rollout:request_success_total{finished_reason="length"}'] == 2
    assert snap['rollout:request_success_total{finished_reason="stop"}'] == 0
    assert snap["rollout:time_to_first_token_seconds_count"] == 2
    assert snap["rollout:inter_token_latency_seconds_count"] == 8  # 4 per request after the first
    assert snap["rollout:e2e_request_latency_seconds_count"] == 2
    assert snap["rollout:request_queue_time_seconds_count"] == 2
    assert snap["rollout:prefix_cache_queries_total"] >= num_prompt_tokens
    assert snap["rollout:estimated_flops_per_gpu_total"] > 0
    assert snap["rollout:estimated_read_bytes_per_gpu_total"] > 0
    assert snap["rollout:num_requests_running"] == 0  # the last step finished both

    # n > 1 children and a second call keep counting.
    llm.generate("Hello there", SamplingParams(n=2, max_tokens=3, ignore_eos=True, seed=1), use_tqdm=False)
    snap = llm.get_metrics_snapshot()
    assert snap['rollout:request_success_total{finished_reason="length"}'] == 4
    assert snap["rollout:generation_tokens_total"] == 16
    assert llm.stat_loggers.iteration_stats.requests == {}


def test_stop_string_counts_as_stop(make_llm):
    llm = make_llm(disable_log_stats=True)
    [first] = llm.generate("Hello there", SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0), use_tqdm=False)
    stop = first.outputs[0].text[2:4]
    if not stop.strip():
        pytest.skip("the tiny model's output has no usable stop string")
    [out] = llm.generate("Hello there", SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0, stop=[stop]), use_tqdm=False)
    assert out.outputs[0].finish_reason == "stop"
    snap = llm.get_metrics_snapshot()
    assert snap['rollout:request_success_total{finished_reason="stop"}'] == 1
    assert llm.stat_loggers.iteration_stats.requests == {}


def test_plugin_sees_every_step(make_llm, recording_plugin):
    llm = make_llm(stat_loggers=["recorder"])
    llm.generate(["Hello there"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    [plugin] = recording_plugin.instances
    assert plugin.records, "no record() calls"
    assert all(s is not None for s, _, _ in plugin.records)  # the engine core attaches scheduler stats
    assert sum(it.num_generation_tokens for _, it, _ in plugin.records) == 3
    assert sum(s.step_work.num_decode_tokens for s, _, _ in plugin.records) == 2  # the first token comes from prefill
