"""GET /metrics of a real `rollout launch` process, read as a vLLM dashboard reads it: vLLM's family
names, types and labels, values that move with the requests served, the sleep state after /sleep."""

from __future__ import annotations

import re

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

SERVED = "served-tiny"


@pytest.fixture(scope="module")
def server(launch_server):
    return launch_server("tiny-llama", "--served-model-name", SERVED, "--enable-rl-routes")


def scrape(server) -> tuple[str, dict]:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return text, {f.name: f for f in text_string_to_metric_families(text)}


def value(families: dict, family: str, sample: str, **labels: str) -> float:
    """The one sample `sample` of `family` whose labels include `labels` (and model_name=SERVED)."""
    labels = {"model_name": SERVED, **labels}
    found = [s.value for s in families[family].samples
             if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())]  # fmt: skip
    assert len(found) == 1, (family, sample, labels, found)
    return found[0]


def test_metrics_speak_vllms_names_and_move(server):
    text, before = scrape(server)
    # The series a vLLM dashboard's queries select, by name and labels, in the text itself:
    # rate(vllm:generation_tokens_total{model_name="..."}[1m]) and
    # histogram_quantile(0.9, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket[1m]))).
    assert re.search(r'^vllm:generation_tokens_total\{[^}]*model_name="served-tiny"[^}]*\} 0\.0$', text, re.M)
    assert re.search(r'^vllm:time_to_first_token_seconds_bucket\{[^}]*le="\+Inf"[^}]*\} 0\.0$', text, re.M)
    assert before["vllm:generation_tokens"].type == "counter"
    assert before["vllm:time_to_first_token_seconds"].type == "histogram"
    assert before["vllm:num_requests_running"].type == "gauge"
    for sample in before["vllm:prompt_tokens"].samples:
        assert sample.labels["model_name"] == SERVED and sample.labels["engine"] == "0"
    # The cache config as an info gauge, with the blocks the engine made.
    (info,) = before["vllm:cache_config_info"].samples
    assert info.value == 1 and int(info.labels["num_gpu_blocks"]) > 0 and info.labels["block_size"] == "16"
    assert value(before, "vllm:engine_sleep_state", "vllm:engine_sleep_state", sleep_state="awake") == 1

    bodies = [
        {"model": SERVED, "prompt": "Hello there", "max_tokens": 5, "ignore_eos": True},
        {"model": SERVED, "prompt": "The quick brown fox", "max_tokens": 3, "ignore_eos": True},
        {"model": SERVED, "prompt": "Once upon a time", "max_tokens": 4, "n": 2, "ignore_eos": True},
    ]
    usage = []
    for body in bodies:
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        usage.append(r.json()["usage"])
    _, after = scrape(server)
    num_generated = sum(u["completion_tokens"] for u in usage)
    assert num_generated == 5 + 3 + 2 * 4
    assert value(after, "vllm:generation_tokens", "vllm:generation_tokens_total") == num_generated
    # Each of the n=2 request's sequences is a finished engine request; the request itself counts once for n.
    assert value(after, "vllm:request_success", "vllm:request_success_total", finished_reason="length") == 4
    assert value(after, "vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count") == 4
    assert value(after, "vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_bucket", le="+Inf") == 4
    assert value(after, "vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count") == 4
    assert value(after, "vllm:request_generation_tokens", "vllm:request_generation_tokens_sum") == num_generated
    assert value(after, "vllm:request_params_n", "vllm:request_params_n_count") == 3
    assert value(after, "vllm:request_params_n", "vllm:request_params_n_sum") == 1 + 1 + 2
    assert value(after, "vllm:request_params_max_tokens", "vllm:request_params_max_tokens_sum") == 5 + 3 + 4 + 4
    assert value(after, "vllm:request_max_num_generation_tokens",
                 "vllm:request_max_num_generation_tokens_sum") == 5 + 3 + 4  # fmt: skip
    prompt = value(after, "vllm:prompt_tokens", "vllm:prompt_tokens_total")
    # Counted per engine request, as in vLLM: the n=2 request's prompt twice (usage counts it once).
    assert prompt == sum(u["prompt_tokens"] for u in usage) + usage[2]["prompt_tokens"]
    by_source = sum(value(after, "vllm:prompt_tokens_by_source", "vllm:prompt_tokens_by_source_total", source=s)
                    for s in ("local_compute", "local_cache_hit", "external_kv_transfer"))  # fmt: skip
    assert by_source == prompt
    assert value(after, "vllm:iteration_tokens_total", "vllm:iteration_tokens_total_count") > 0
    assert value(after, "vllm:num_requests_running", "vllm:num_requests_running") == 0


def test_prefix_cache_counters_count_what_the_engine_process_found(server):
    # The engine runs in its own process with async scheduling: the step that looks a prompt up in the
    # prefix cache has no outputs yet, and its counts must still reach /metrics.
    _, before = scrape(server)
    names = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:prompt_tokens_cached")
    start = {name: value(before, name, name + "_total") for name in names}
    body = {"model": SERVED, "prompt": "hello " * 40, "max_tokens": 2, "ignore_eos": True}
    usage = []
    for _ in range(3):  # the first computes the prompt, the next two hit its full blocks
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        usage.append(r.json()["usage"])
    _, after = scrape(server)
    moved = {name: value(after, name, name + "_total") - start[name] for name in names}
    num_prompt = usage[0]["prompt_tokens"]
    assert moved["vllm:prefix_cache_queries"] == 3 * num_prompt
    hits = 2 * (num_prompt // 16) * 16  # full 16-token blocks, twice (the last token is always computed)
    if num_prompt % 16 == 0:
        hits -= 2 * 16
    assert moved["vllm:prefix_cache_hits"] == moved["vllm:prompt_tokens_cached"] == hits > 0
    assert value(after, "vllm:prompt_tokens_cached_by_source", "vllm:prompt_tokens_cached_by_source_total",
                 source="device") >= hits  # fmt: skip


def test_sleep_state_follows_sleep_and_wake_up(server):
    r = httpx.post(server.url + "/sleep", params={"level": 1}, timeout=120)
    assert r.status_code == 200, r.text
    _, asleep = scrape(server)
    states = {s: value(asleep, "vllm:engine_sleep_state", "vllm:engine_sleep_state", sleep_state=s)
              for s in ("awake", "weights_offloaded", "discard_all")}  # fmt: skip
    assert states == {"awake": 0, "weights_offloaded": 1, "discard_all": 0}
    assert value(asleep, "rollout:engine_sleep_level", "rollout:engine_sleep_level") == 1  # ours, beside vLLM's
    r = httpx.post(server.url + "/wake_up", timeout=120)
    assert r.status_code == 200, r.text
    _, awake = scrape(server)
    assert value(awake, "vllm:engine_sleep_state", "vllm:engine_sleep_state", sleep_state="awake") == 1
    assert value(awake, "vllm:engine_sleep_state", "vllm:engine_sleep_state", sleep_state="weights_offloaded") == 0


def test_weight_version_info_follows_the_served_version(server):
    def versions() -> dict[str, float]:
        _, families = scrape(server)
        return {s.labels["weight_version"]: s.value for s in families["rollout:weight_version_info"].samples}

    body = {"model": SERVED, "prompt": "Hello", "max_tokens": 2, "ignore_eos": True}
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=120).status_code == 200
    assert versions() == {"default": 1}
    r = httpx.post(server.url + "/update_weight_version", json={"new_version": "step-7"}, timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=120).status_code == 200
    assert versions() == {"step-7": 1}  # one series per engine: the old version's is gone
