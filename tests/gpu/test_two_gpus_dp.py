"""`rollout launch --data-parallel-size 2` on two GPUs: one engine per GPU, and pause, sleep and weight updates reach both."""

from __future__ import annotations

import concurrent.futures
import os

import httpx
import pytest
import torch
from rl_http import local_update_over_http
from safetensors.torch import load_file

from engine.tiny_models import make_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"),
]

MODEL = "tiny-dp-gpu"
PROMPTS = ["The quick brown fox", "Once upon a time", "A rollout is", "hello world", "one two three", "RL with PPO"]


@pytest.fixture(scope="module")
def server(launch_server, tiny_checkpoint):
    return launch_server(tiny_checkpoint("llama"), "--data-parallel-size", "2", "--served-model-name", MODEL,
                         "--enable-rl-routes", "--device", "cuda", "--dtype", "bfloat16",
                         "--gpu-memory-utilization", "0.2")


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def _used_gib(device: int) -> float:
    free, total = torch.cuda.mem_get_info(device)
    return (total - free) / 2**30


def _burst(http, max_tokens: int = 8) -> list[list[int]]:
    def one(prompt: str) -> list[int]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                "return_token_ids": True}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS * 2))


def _routed(http) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            if s.name == "rollout:dp_requests_routed_total":
                values[s.labels["engine"]] = values.get(s.labels["engine"], 0.0) + s.value
    return values


def test_each_engine_on_its_own_gpu_and_both_serve(http):
    assert _used_gib(0) > 1.0 and _used_gib(1) > 1.0  # each engine's KV cache on its own device
    outputs = _burst(http)
    assert outputs[: len(PROMPTS)] == outputs[len(PROMPTS):]  # greedy: the same prompt, the same tokens, either engine
    routed = _routed(http)
    assert routed.get("0", 0) > 0 and routed.get("1", 0) > 0, routed


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
def test_pause_and_resume_reach_both_gpus(http, mode):
    before = _burst(http, 4)
    r = http.post("/pause", params={"mode": mode})
    assert r.status_code == 200, r.text
    assert http.get("/is_paused").json()["is_paused"] is True
    assert http.post("/resume").status_code == 200
    assert _burst(http, 4) == before


def test_sleep_frees_memory_on_both_gpus_and_wake_up_restores_outputs(http):
    before = _burst(http, 4)
    used = [_used_gib(0), _used_gib(1)]
    assert http.post("/sleep", params={"level": 1}).status_code == 200
    asleep = [_used_gib(0), _used_gib(1)]
    assert all(a < u - 0.5 for a, u in zip(asleep, used)), (used, asleep)  # the KV cache went on both
    assert http.post("/wake_up").status_code == 200
    assert _burst(http, 4) == before


def test_a_weight_update_reaches_both_gpus(http, tiny_checkpoint, tmp_path_factory):
    from weight_transfer import hf_state_checksums

    def bf16(path: str) -> dict[str, torch.Tensor]:  # the engines' dtype: what a trainer sends them
        return {k: v.to(torch.bfloat16) for k, v in load_file(os.path.join(path, "model.safetensors")).items()}

    original = bf16(tiny_checkpoint("llama"))
    new = bf16(make_tiny_checkpoint(tmp_path_factory.mktemp("gpu-dp-seed1"), "llama", seed=1))
    before = _burst(http, 4)
    for weights, version in ((new, "v1"), (original, "v2")):
        local_update_over_http(http, weights, version)
        report = http.post("/weight_checker", json={"baseline": hf_state_checksums(weights)}).json()
        assert report["match"] is True and [e["match"] for e in report["engines"]] == [True, True]
        outputs = _burst(http, 4)
        if version == "v1":
            assert outputs != before  # other weights, other tokens
    assert outputs == before  # the original weights are back: the original tokens
