"""The fault cycle over HTTP: inject, in-flight requests fail, status unhealthy, retry recovers; no retry -> dead."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.slow

LONG = {"prompt": "Tell me a story", "max_tokens": 1800, "ignore_eos": True, "temperature": 0.0}
SHORT = {"prompt": "Hello there", "max_tokens": 8, "temperature": 0.0}


def _num_running(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        if family.name == "vllm:num_requests_running":
            return sum(s.value for s in family.samples)
    return 0.0


def _start_in_flight(url: str, num: int) -> tuple[list[threading.Thread], dict]:
    results: dict[int, httpx.Response] = {}

    def run(i: int) -> None:
        results[i] = httpx.post(url + "/v1/completions", json=LONG, timeout=120)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(num)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while _num_running(url) < num and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _num_running(url) == num, "the requests should be running before the fault"
    return threads, results


def _failed(response: httpx.Response) -> bool:
    """A request the fault ended: an error status, or a choice that finished with "error"."""
    if response.status_code >= 500:
        return "error" in response.json()
    return response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "error"


def test_fault_then_retry_recovers(launch_server):
    server = launch_server("tiny-llama", "--max-model-len", "2048", "--enable-fault-tolerance",
                           "--enable-fault-injection", "--engine-recovery-timeout-sec", "60")
    url = server.url
    before = httpx.post(url + "/v1/completions", json=SHORT, timeout=60).json()["choices"][0]["text"]
    assert httpx.get(url + "/fault_tolerance/status").json()["status"] == "healthy"

    threads, results = _start_in_flight(url, 2)
    assert httpx.post(url + "/fault_tolerance/inject", timeout=30).status_code == 202
    for t in threads:
        t.join(timeout=30)
    assert sorted(results) == [0, 1] and all(_failed(r) for r in results.values()), [r.text for r in results.values()]

    status = httpx.get(url + "/fault_tolerance/status").json()
    assert status == {"schema_version": 1, "total_engines": 1, "engines": [{"id": 0, "status": "unhealthy"}],
                      "status": "unhealthy", "enabled": True}
    refused = httpx.post(url + "/v1/completions", json=SHORT, timeout=60)
    assert refused.status_code != 200 or refused.json()["choices"][0]["finish_reason"] == "error"

    bad = httpx.post(url + "/fault_tolerance/apply", json={"instruction": "reboot"}, timeout=30)
    assert bad.status_code == 400 and "instruction" in bad.json()["error"]["message"]
    applied = httpx.post(url + "/fault_tolerance/apply", json={"instruction": "retry", "params": {}}, timeout=60)
    assert applied.status_code == 202 and set(applied.json()) == {"message", "request_id"}  # vLLM's: at once
    deadline = time.monotonic() + 60  # the retry runs in the background: poll the status, as vLLM's clients do
    while httpx.get(url + "/fault_tolerance/status").json()["status"] != "healthy" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert httpx.get(url + "/fault_tolerance/status").json()["engines"] == [{"id": 0, "status": "healthy"}]
    again = httpx.post(url + "/v1/completions", json=SHORT, timeout=60)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == before
    assert httpx.get(url + "/health").status_code == 200


def test_fault_without_retry_exits_after_the_timeout(launch_server):
    server = launch_server("tiny-llama", "--max-model-len", "2048", "--enable-fault-tolerance",
                           "--enable-fault-injection", "--engine-recovery-timeout-sec", "2")
    url = server.url
    threads, results = _start_in_flight(url, 1)
    assert httpx.post(url + "/fault_tolerance/inject", timeout=30).status_code == 202
    for t in threads:
        t.join(timeout=30)
    assert _failed(results[0]), results[0].text
    deadline = time.monotonic() + 30  # the 2 s recovery timeout, then the engine exits
    status = None
    while time.monotonic() < deadline:
        status = httpx.get(url + "/health", timeout=5).status_code
        if status == 503:
            break
        time.sleep(0.2)
    assert status == 503
    assert httpx.get(url + "/fault_tolerance/status").json()["status"] == "dead"


def test_inject_route_is_absent_without_the_switch(launch_server):
    server = launch_server("tiny-llama", "--enable-fault-tolerance")
    assert httpx.post(server.url + "/fault_tolerance/inject", timeout=30).status_code == 404
