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
    assert before["vllm:generation_tokens_total"] == 0
    params = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.0)
    outputs = llm.generate(["Hello there", "The quick brown fox"], params, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)

    snap = llm.get_metrics_snapshot()
    num_prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    assert snap["vllm:prompt_tokens_total"] == num_prompt_tokens
    assert snap["vllm:generation_tokens_total"] == 10
    assert snap['vllm:request_success_total{finished_reason="length"}'] == 2
    assert snap['vllm:request_success_total{finished_reason="stop"}'] == 0
    assert snap["vllm:time_to_first_token_seconds_count"] == 2
    assert snap["vllm:inter_token_latency_seconds_count"] == 8  # 4 per request after the first
    assert snap["vllm:e2e_request_latency_seconds_count"] == 2
    assert snap["vllm:request_queue_time_seconds_count"] == 2
    assert snap["vllm:prefix_cache_queries_total"] >= num_prompt_tokens
    assert snap["vllm:estimated_flops_per_gpu_total"] > 0
    assert snap["vllm:estimated_read_bytes_per_gpu_total"] > 0
    assert snap["vllm:num_requests_running"] == 0  # the last step finished both

    # n > 1 children and a second call keep counting.
    llm.generate("Hello there", SamplingParams(n=2, max_tokens=3, ignore_eos=True, seed=1), use_tqdm=False)
    snap = llm.get_metrics_snapshot()
    assert snap['vllm:request_success_total{finished_reason="length"}'] == 4
    assert snap["vllm:generation_tokens_total"] == 16
    assert llm.stat_loggers.iteration_stats.requests == {}
    assert llm.stat_loggers.iteration_stats.parents == {}

    # Per-request histograms: 4 engine requests, but 3 user requests (the n=2 one counts once).
    assert snap["vllm:request_prompt_tokens_count"] == 4
    assert snap["vllm:request_generation_tokens_sum"] == 16
    assert snap["vllm:request_params_max_tokens_sum"] == 5 + 5 + 3 + 3
    assert snap["vllm:request_params_n_count"] == 3 and snap["vllm:request_params_n_sum"] == 1 + 1 + 2
    assert snap["vllm:request_max_num_generation_tokens_sum"] == 5 + 5 + 3
    assert snap["vllm:request_inference_time_seconds_count"] == 4
    assert snap["vllm:request_time_per_output_token_seconds_count"] == 4
    # The cache config as labels, with the blocks the engine made.
    info = [k for k in snap if k.startswith("vllm:cache_config_info{")]
    assert len(info) == 1 and f'num_gpu_blocks="{llm.engine_core.num_blocks}"' in info[0], info
    assert 'block_size="16"' in info[0] and snap[info[0]] == 1


def test_prompt_tokens_by_source(make_llm):
    llm = make_llm(disable_log_stats=True)
    prompt = " ".join(["word"] * 14)  # more than two 16-token blocks: the second run hits the cache
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    llm.generate(prompt, params, use_tqdm=False)
    llm.generate(prompt, params, use_tqdm=False)
    snap = llm.get_metrics_snapshot()
    # Prompt tokens by source add up to the prompt tokens.
    by_source = {src: snap[f'vllm:prompt_tokens_by_source_total{{source="{src}"}}']
                 for src in ("local_compute", "local_cache_hit", "external_kv_transfer")}  # fmt: skip
    assert sum(by_source.values()) == snap["vllm:prompt_tokens_total"]
    assert by_source["local_cache_hit"] > 0 and by_source["external_kv_transfer"] == 0
    assert snap["vllm:prompt_tokens_cached_total"] == by_source["local_cache_hit"]
    assert snap["vllm:request_prefill_kv_computed_tokens_sum"] == by_source["local_compute"]
    assert snap['vllm:prompt_tokens_cached_by_source_total{source="device"}'] == snap["vllm:prefix_cache_hits_total"]
    # Each step's tokens: prompt tokens computed plus tokens generated, over every step.
    assert snap["vllm:iteration_tokens_total_sum"] == by_source["local_compute"] + snap["vllm:generation_tokens_total"]


def test_stop_string_counts_as_stop(make_llm):
    llm = make_llm(disable_log_stats=True)
    [first] = llm.generate("Hello there", SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0), use_tqdm=False)
    stop = first.outputs[0].text[2:4]
    if not stop.strip():
        pytest.skip("the tiny model's output has no usable stop string")
    [out] = llm.generate("Hello there", SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0, stop=[stop]), use_tqdm=False)
    assert out.outputs[0].finish_reason == "stop"
    snap = llm.get_metrics_snapshot()
    assert snap['vllm:request_success_total{finished_reason="stop"}'] == 1
    assert llm.stat_loggers.iteration_stats.requests == {}


def test_plugin_sees_every_step(make_llm, recording_plugin):
    llm = make_llm(stat_loggers=["recorder"])
    llm.generate(["Hello there"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    [plugin] = recording_plugin.instances
    assert plugin.records, "no record() calls"
    assert all(s is not None for s, _, _ in plugin.records)  # the engine core attaches scheduler stats
    assert sum(it.num_generation_tokens for _, it, _ in plugin.records) == 3
    assert sum(s.step_work.num_decode_tokens for s, _, _ in plugin.records) == 2  # the first token comes from prefill


def test_preempted_requests_are_counted_per_request(tiny_checkpoint):
    # 6 blocks of 16 tokens cannot hold 8 sequences of up to 40 tokens at once: the scheduler preempts.
    llm = LLM(tiny_checkpoint(), device="cpu", dtype="float32", max_model_len=64, block_size=16,
              num_gpu_blocks_override=6, max_num_seqs=8, enable_prefix_caching=False, disable_log_stats=True)  # fmt: skip
    params = SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0)
    llm.generate([f"prompt number {i} says" for i in range(8)], params, use_tqdm=False)
    snap = llm.get_metrics_snapshot()
    engine_wide = snap["vllm:num_preemptions_total"]
    assert engine_wide > 0, "the KV cache was meant to be small enough to preempt"
    # Every preemption belongs to one finished request: the per-request histogram adds up to the counter.
    assert snap["vllm:request_num_preemptions_count"] == 8
    assert snap["vllm:request_num_preemptions_sum"] == engine_wide
