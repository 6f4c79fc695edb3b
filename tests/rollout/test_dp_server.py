"""`rollout launch --data-parallel-size 2`: one HTTP server over two engine processes (a RolloutGroup)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from rl_http import local_update_over_http
from safetensors.torch import load_file

from engine.sampling_params import SamplingParams
from engine.tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.slow  # a server and two engine processes: ~30 s to start on 2 CPU cores

MODEL = "tiny-dp"
PROMPTS = ["The quick brown fox", "Once upon a time", "A rollout is", "hello world", "one two three", "RL with PPO",
           "Data parallel engines", "a b c d"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def server(launch_server, tiny_checkpoint):
    return launch_server(tiny_checkpoint("llama"), "--data-parallel-size", "2", "--served-model-name", MODEL,
                         "--enable-rl-routes")


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def _completion(http, prompt: str, max_tokens: int = MAX_TOKENS, **sampling) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "return_token_ids": True,
            "return_weight_versions": True, **sampling}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _per_engine(http, name: str, **labels: str) -> dict[str, float]:
    """{engine label: value} of one sample name on /metrics (other labels must match `labels`)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                values[sample.labels["engine"]] = values.get(sample.labels["engine"], 0.0) + sample.value
    return values


def _burst(http, bodies: list[dict]) -> list[dict]:
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(lambda kw: _completion(http, **kw), bodies))


def test_a_burst_keeps_both_engines_busy_and_outputs_match_one_engine(http, tiny_checkpoint):
    from rollout import RolloutWorker

    assert http.get("/get_world_size").json() == {"world_size": 2}
    greedy = _burst(http, [{"prompt": p, "temperature": 0.0} for p in PROMPTS])
    seeded = _burst(http, [{"prompt": p, "temperature": 1.0, "seed": 7 + i} for i, p in enumerate(PROMPTS)])
    served = _per_engine(http, "vllm:request_success_total", finished_reason="length")
    assert set(served) == {"0", "1"} and all(v > 0 for v in served.values()), served
    assert sum(served.values()) >= 2 * len(PROMPTS)
    routed = _per_engine(http, "rollout:dp_requests_routed_total")
    assert all(routed[e] > 0 for e in ("0", "1")), routed
    # The coordinator's numbers (each engine's scheduler) are there per engine too.
    assert set(_per_engine(http, "vllm:num_requests_waiting")) == {"0", "1"}

    with RolloutWorker(model=tiny_checkpoint("llama"), device="cpu", dtype="float32", max_model_len=256,
                       disable_log_stats=True) as single:
        expected_greedy = single.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
        expected_seeded = single.generate(PROMPTS, [
            SamplingParams(temperature=1.0, seed=7 + i, max_tokens=MAX_TOKENS, ignore_eos=True) for i in range(len(PROMPTS))
        ])
    assert [c["token_ids"] for c in greedy] == [o.outputs[0].token_ids for o in expected_greedy]
    assert [c["token_ids"] for c in seeded] == [o.outputs[0].token_ids for o in expected_seeded]


class _Stream:
    """A streamed greedy completion read in a thread: `started` is set on its first chunk."""

    def __init__(self, http, prompt: str, max_tokens: int) -> None:
        self.chunks: list[dict] = []
        self.started = threading.Event()
        self.error: BaseException | None = None
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                "stream": True, "return_token_ids": True}
        self.thread = threading.Thread(target=self._run, args=(http, body), daemon=True)
        self.thread.start()

    def _run(self, http, body) -> None:
        try:
            with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        self.chunks.append(json.loads(line[6:]))
                        self.started.set()
        except BaseException as e:
            self.error = e
        finally:
            self.started.set()

    def join(self) -> None:
        self.thread.join(120)
        assert not self.thread.is_alive(), "the stream did not end"
        assert self.error is None, self.error

    @property
    def token_ids(self) -> list[int]:
        return [t for c in self.chunks for t in c["choices"][0].get("token_ids") or []]

    @property
    def finish_reason(self) -> str | None:
        return self.chunks[-1]["choices"][0]["finish_reason"]


def _paused(http) -> bool:
    return http.get("/is_paused").json()["is_paused"]


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
def test_pause_with_one_engine_busy_and_one_idle_returns_and_resume_restarts_both(http, mode):
    prompt = f"Once upon a time in {mode} mode"
    max_tokens = {"abort": 200, "wait": 40, "keep": 100}[mode]
    expected = _completion(http, prompt, max_tokens, temperature=0.0)["token_ids"] if mode != "abort" else None
    stream = _Stream(http, prompt, max_tokens)
    assert stream.started.wait(60) and stream.error is None
    busy = _per_engine(http, "rollout:dp_outstanding_tokens")
    if mode != "wait":  # (a wait-mode stream may finish before this read; pause must not care)
        assert sorted(v > 0 for v in busy.values()) == [False, True], busy  # one engine busy, one idle
    r = http.post("/pause", params={"mode": mode})
    assert r.status_code == 200, r.text
    try:
        assert _paused(http)
        if mode == "abort":
            stream.join()
            assert stream.finish_reason == "abort" and len(stream.token_ids) < max_tokens
        elif mode == "wait":  # returned once the busy engine's request finished
            stream.join()
            assert stream.finish_reason == "length" and stream.token_ids == expected
        if mode != "keep":  # abort and wait refuse new requests on every engine
            for p in PROMPTS[:4]:
                r = http.post("/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": 2})
                assert r.status_code == 503, r.text
    finally:
        assert http.post("/resume").status_code == 200
    assert not _paused(http)
    stream.join()
    if mode == "keep":  # frozen, then continued where it stopped
        assert stream.finish_reason == "length" and stream.token_ids == expected
    # Both engines serve again.
    routed_before = _per_engine(http, "rollout:dp_requests_routed_total")
    outputs = _burst(http, [{"prompt": p, "temperature": 0.0, "max_tokens": 4} for p in PROMPTS[:4]])
    assert all(c["finish_reason"] == "length" for c in outputs)
    routed = _per_engine(http, "rollout:dp_requests_routed_total")
    assert all(routed[e] > routed_before[e] for e in ("0", "1")), (routed_before, routed)


def test_a_weight_update_over_http_reaches_both_engines(http, tiny_checkpoint, tmp_path_factory):
    from weight_transfer import hf_state_checksums

    original = load_file(os.path.join(tiny_checkpoint("llama"), "model.safetensors"))
    new = load_file(os.path.join(make_tiny_checkpoint(tmp_path_factory.mktemp("dp-seed1"), "llama", seed=1),
                                 "model.safetensors"))
    for weights, version in ((new, "v1"), (original, "v2")):
        local_update_over_http(http, weights, version)
        assert http.get("/weight_info").json()["weight_version"] == version
        report = http.post("/weight_checker", json={"baseline": hf_state_checksums(weights)}).json()
        assert report["match"] is True and [e["match"] for e in report["engines"]] == [True, True]
        outputs = _burst(http, [{"prompt": p, "temperature": 0.0} for p in PROMPTS[:4]])
        assert {tuple(v.values()) for c in outputs for v in c["weight_versions"]} == {(version, 0, MAX_TOKENS)}


def test_an_nccl_sync_over_gloo_gives_each_engine_its_own_rank(http, server, tiny_checkpoint):
    # Last in the module: the engines keep the trainer's weights.
    import torch
    from transformers import AutoModelForCausalLM

    from weight_transfer import hf_state_checksums
    from weight_transfer.base import trainer_init
    from weight_transfer.clients import HTTPWeightSyncClient
    from weight_transfer.nccl import NCCLTrainerInitInfo

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("llama"), dtype=torch.float32)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    client = HTTPWeightSyncClient(server.url)
    # One sender + one worker per engine: the group rewrites rank_offset 1 to 1 and 2.
    info = NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=0, world_size=3, timeout_s=30.0)
    trainer = trainer_init(info, client=client, source=model)
    try:
        trainer.send_weights(weight_version="nccl-1")
    finally:
        trainer.shutdown()
        client.close()
    report = http.post("/weight_checker", json={"baseline": hf_state_checksums(model.state_dict())}).json()
    assert report["match"] is True and [e["match"] for e in report["engines"]] == [True, True]
    assert report["weight_version"] == "nccl-1"
