"""The RL control routes on a real `rollout launch --enable-rl-routes` process, driven with httpx."""

from __future__ import annotations

import json
import os
import threading
import time

import httpx
import pytest
import torch
from hf_reference import hf_greedy
from rl_http import local_update_over_http
from safetensors.torch import load_file

from engine.tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.slow

API_KEY = "sk-rl"
MODEL = "tiny"


@pytest.fixture(scope="module")
def server(launch_server, tiny_checkpoint):
    return launch_server(tiny_checkpoint("llama"), "--api-key", API_KEY, "--served-model-name", MODEL,
                         "--enable-rl-routes")


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


def _assert_error(response: httpx.Response, status: int, *words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    # vLLM 0.33's types: a failed declared type or a route's own refusal is typed with the status phrase,
    # a serving-layer refusal with vLLM's error class name (rollout/server/errors.py).
    assert error["type"] in {400: {"Bad Request", "BadRequestError"}, 401: {"Unauthorized"},
                             404: {"NotFoundError"}, 503: {"ServiceUnavailableError", "Service Unavailable"}}[status]
    for word in words:
        assert word in error["message"], error
    return error


def _assert_not_found(response: httpx.Response) -> None:
    """A route that is not mounted is a path this server does not serve: FastAPI's own 404 body, as vLLM's."""
    assert response.status_code == 404 and response.json() == {"detail": "Not Found"}, response.text


def _state(http) -> tuple[bool, bool]:
    return http.get("/is_paused").json()["is_paused"], http.get("/is_sleeping").json()["is_sleeping"]


def _greedy(http, prompt, max_tokens=8) -> dict:
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
                                            "return_weight_versions": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


class _Stream:
    """A streamed completion read in a thread: `started` is set on its first token chunk."""

    def __init__(self, http, prompt: str, max_tokens: int) -> None:
        self.chunks: list[dict] = []
        self.started = threading.Event()
        self.error: BaseException | None = None
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "return_token_ids": True}
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

    def join(self) -> list[dict]:
        self.thread.join(120)
        assert not self.thread.is_alive(), "the stream did not end"
        assert self.error is None, self.error
        return self.chunks

    @property
    def token_ids(self) -> list[int]:
        return [t for c in self.chunks for t in c["choices"][0].get("token_ids") or []]

    @property
    def finish_reason(self) -> str | None:
        return self.chunks[-1]["choices"][0]["finish_reason"]


# ---------------------------------------------------------------------------- off, auth, simple routes


def test_rl_routes_are_404_unless_enabled(launch_server, tiny_checkpoint):
    plain = launch_server(tiny_checkpoint("llama"))
    with httpx.Client(base_url=plain.url, timeout=60) as c:
        for method, path in [("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused"), ("POST", "/sleep"),
                             ("POST", "/wake_up"), ("GET", "/is_sleeping"), ("POST", "/abort_requests"),
                             ("POST", "/update_weights"), ("GET", "/weight_info"), ("POST", "/weight_checker"),
                             ("GET", "/get_world_size"), ("POST", "/init_weight_transfer_engine"),
                             ("GET", "/fault_tolerance/status")]:
            _assert_not_found(c.request(method, path))
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    plain.stop()


def test_weight_transfer_backend_flag_limits_init_and_abort_restores(launch_server, tiny_checkpoint):
    from safetensors.torch import load_file

    from weight_transfer.local import make_update_info

    server = launch_server(tiny_checkpoint("llama"), "--enable-rl-routes", "--weight-transfer-backend", "local",
                           "--weight-update-idle-timeout-s", "2")
    with httpx.Client(base_url=server.url, timeout=60) as c:
        _assert_error(c.post("/init_weight_transfer_engine", json={"init_info": {"backend": "nccl"}}), 400,
                      "init_info.backend", "'local'")
        assert c.post("/init_weight_transfer_engine", json={"init_info": {"backend": "local"}}).status_code == 200
        before = c.post("/weight_checker").json()["checksums"]
        assert c.post("/abort_weight_update").json() == {"aborted": False, "weight_version": "default"}  # ours
        assert c.post("/start_weight_update").status_code == 200
        new = load_file(f"{tiny_checkpoint('llama', seed=1)}/model.safetensors")
        r = c.post("/update_weights", json={"update_info": make_update_info(new.items(), "b64")})
        assert r.status_code == 200, r.text
        assert c.post("/weight_checker").json()["checksums"] != before
        assert c.post("/abort_weight_update").json() == {"aborted": True, "weight_version": "default"}
        assert c.post("/weight_checker").json()["checksums"] == before
        r = c.post("/v1/completions", json={"model": server.served_model, "prompt": "hi", "max_tokens": 4})
        assert r.status_code == 200, r.text  # serving again after the abort
        # A trainer that goes silent mid-update: the engine aborts the update itself after the idle limit.
        assert c.post("/start_weight_update").status_code == 200
        assert c.post("/update_weights", json={"update_info": make_update_info(new.items(), "b64")}).status_code == 200
        deadline = time.monotonic() + 30
        while c.post("/weight_checker").json()["checksums"] != before and time.monotonic() < deadline:
            time.sleep(0.5)
        assert c.post("/weight_checker").json()["checksums"] == before
        assert c.post("/abort_weight_update").json()["aborted"] is False  # nothing left in progress
        r = c.post("/v1/completions", json={"model": server.served_model, "prompt": "hi", "max_tokens": 4})
        assert r.status_code == 200, r.text
    server.stop()


def test_fault_tolerance_routes_are_mounted_by_their_own_flag(launch_server, tiny_checkpoint):
    ft = launch_server(tiny_checkpoint("llama"), "--enable-fault-tolerance", "--api-key", API_KEY)
    with httpx.Client(base_url=ft.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        # vLLM's schema (schema_version, total_engines, engines[{id, status}]) plus our status and enabled
        assert c.get("/fault_tolerance/status").json() == {
            "schema_version": 1, "total_engines": 1, "engines": [{"id": 0, "status": "healthy"}],
            "status": "healthy", "enabled": True}
        _assert_error(c.post("/fault_tolerance/apply", json={"instruction": "reboot"}), 400, "reboot")
        _assert_error(c.post("/fault_tolerance/apply", json={}), 400, "instruction")
        _assert_error(c.post("/fault_tolerance/apply", json={"instruction": "retry", "params": 3}), 400, "params")
        r = c.post("/fault_tolerance/apply", json={"instruction": "retry", "params": {}})  # healthy: nothing to do
        assert r.status_code == 202, r.text
        body = r.json()
        assert body["message"] == "Request accepted; poll /fault_tolerance/status for updates."
        assert set(body) == {"message", "request_id"} and len(body["request_id"]) == 36  # a uuid4
        assert c.get("/fault_tolerance/status").json()["engines"] == [{"id": 0, "status": "healthy"}]
        _assert_not_found(c.post("/pause"))  # the RL routes have their own flag
        _assert_error(c.get("/fault_tolerance/status", headers={"Authorization": "Bearer nope"}), 401)
    ft.stop()


def test_api_key_is_enforced_and_nothing_changes(server, http):
    with httpx.Client(base_url=server.url, timeout=60) as anonymous:
        _assert_error(anonymous.post("/pause"), 401)
        _assert_error(anonymous.post("/sleep"), 401)
        _assert_error(anonymous.get("/is_paused"), 401)
        _assert_error(anonymous.post("/update_weights", json={"update_info": {}}), 401)
    _assert_error(http.post("/pause", headers={"Authorization": "Bearer wrong"}), 401)
    assert _state(http) == (False, False)


def test_world_size_prefix_cache_and_abort_of_unknown_ids(http):
    assert http.get("/get_world_size").json() == {"world_size": 1}
    assert http.get("/get_world_size", params={"include_dp": "false"}).json() == {"world_size": 1}
    r = http.post("/reset_prefix_cache")
    assert r.status_code == 200 and r.json() == {"success": True}  # vLLM's body; nothing runs, so it resets
    r = http.post("/reset_prefix_cache", params={"reset_running_requests": "true", "reset_external": "true"})
    assert r.status_code == 200 and r.json() == {"success": True}
    _assert_error(http.post("/reset_prefix_cache", params={"reset_running_requests": "maybe"}), 400,
                  "reset_running_requests")
    r = http.post("/abort_requests", json={"request_ids": ["cmpl-nope", "cmpl-nope-2"]})
    assert r.status_code == 200 and r.json() == {"status": "aborted", "aborted": 2}  # vLLM counts the ids sent
    assert http.post("/abort_requests", json={}).json() == {"status": "aborted", "aborted": 0}  # all: none run


def test_control_answers_are_vllms(http):
    """The bodies vLLM 0.33's routers answer (entrypoints/rl/online, serve/dev/sleep)."""
    assert http.post("/pause", params={"mode": "wait", "clear_cache": "false"}).json() == {"status": "paused"}
    assert http.post("/resume").json() == {"status": "resumed"}
    assert http.post("/sleep", params={"level": 0, "mode": "abort"}).json() == {"status": "sleeping", "level": 0}
    assert http.post("/wake_up", params={"tags": ["scheduling"]}).json() == {"status": "awake", "tags": ["scheduling"]}
    assert http.post("/sleep", params={"level": 1}).json() == {"status": "sleeping", "level": 1}
    assert http.post("/wake_up", params={"tags": "weights"}).json() == {"status": "sleeping", "tags": ["weights"]}
    assert http.post("/wake_up").json() == {"status": "awake", "tags": None}
    version = http.get("/weight_info").json()["weight_version"]
    assert http.post("/update_weight_version", json={"new_version": "v-relabel"}).json() == {
        "success": True, "new_version": "v-relabel"}
    assert http.post("/update_weight_version", json={"new_version": version}).json()["success"] is True
    assert _state(http) == (False, False)


# ---------------------------------------------------------------------------- bad input: 400, no state change


def test_bad_pause_mode_is_400_and_nothing_changes(http):
    error = _assert_error(http.post("/pause", params={"mode": "later"}), 400, "mode", "later")
    assert error["param"] == "query.mode"  # where it was sent, as vLLM names it
    assert _state(http) == (False, False)


def test_bad_sleep_level_is_400_and_nothing_changes(http):
    _assert_error(http.post("/sleep", params={"level": 3}), 400, "level", "3")
    assert _assert_error(http.post("/sleep", params={"level": "deep"}), 400, "level")["param"] == "query.level"
    assert _state(http) == (False, False)


def test_unknown_wake_up_tag_is_400_and_the_engine_stays_asleep(http):
    assert http.post("/sleep", params={"level": 1}).status_code == 200
    try:
        _assert_error(http.post("/wake_up", params={"tags": ["weights", "gpu"]}), 400, "gpu")
        assert _state(http) == (False, True)
    finally:
        assert http.post("/wake_up").status_code == 200
    assert _state(http) == (False, False)


@pytest.mark.parametrize(
    "path,body,words",
    [
        ("/abort_requests", {"request_ids": "cmpl-1"}, ["request_ids"]),
        ("/init_weight_transfer_engine", {}, ["init_info"]),
        ("/update_weights", {}, ["update_info"]),
        ("/update_weights", {"update_info": {}, "extra": 1}, ["extra", "unknown field"]),
        ("/update_weight_version", {}, ["new_version"]),
        ("/finish_weight_update", {"version": "v1"}, ["version", "unknown field"]),
        ("/weight_checker", {"baseline": {}, "strict": True}, ["strict", "unknown field"]),
        ("/weight_checker", {"action": "compare"}, ["baseline", "compare"]),
        ("/weight_checker", {"action": "shred"}, ["action", "shred"]),
        ("/init_weight_transfer_engine", {"init_info": {"backend": "pigeon"}}, ["pigeon"]),
    ],
)
def test_missing_or_unknown_body_fields_are_400_naming_the_field(http, path, body, words):
    before = http.get("/weight_info").json()
    _assert_error(http.post(path, json=body), 400, *words)
    assert http.get("/weight_info").json() == before
    assert _state(http) == (False, False)


def test_non_json_bodies_are_refused(http):
    _assert_error(http.post("/update_weights", content=b"\x80\x04\x95pickle", headers={"Content-Type": "application/octet-stream"}), 400)
    _assert_error(http.post("/update_weights", content=b"not json", headers={"Content-Type": "application/json"}), 400)


# ---------------------------------------------------------------------------- pause and sleep


def test_pause_abort_ends_an_in_flight_request_and_refuses_new_ones(http):
    stream = _Stream(http, "Once upon a time", max_tokens=200)
    assert stream.started.wait(60)
    r = http.post("/pause", params={"mode": "abort"})
    assert r.status_code == 200, r.text
    try:
        stream.join()
        assert stream.finish_reason == "abort" and len(stream.token_ids) < 200
        assert _state(http) == (True, False)
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        _assert_error(r, 503, "paused")
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        _assert_error(r, 503)
    finally:
        assert http.post("/resume").status_code == 200
    assert _state(http) == (False, False)
    assert _greedy(http, "hi", 2)["finish_reason"] == "length"


def test_pause_wait_returns_after_in_flight_requests_finish(http):
    stream = _Stream(http, "Once upon a time", max_tokens=120)
    assert stream.started.wait(60)
    r = http.post("/pause", params={"mode": "wait"})
    try:
        assert r.status_code == 200, r.text
        stream.join()
        assert stream.finish_reason == "length" and len(stream.token_ids) == 120
        assert http.get("/is_paused").json() == {"is_paused": True}
        _assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}), 503)
    finally:
        http.post("/resume")


def test_pause_keep_then_resume_continues_the_same_request(http):
    expected = _greedy(http, "The quick brown fox", 120)["token_ids"]
    stream = _Stream(http, "The quick brown fox", max_tokens=120)
    assert stream.started.wait(60)
    assert http.post("/pause", params={"mode": "keep"}).status_code == 200
    assert http.get("/is_paused").json() == {"is_paused": True}
    assert http.post("/resume").status_code == 200
    stream.join()
    assert stream.finish_reason == "length"
    assert stream.token_ids == expected


def test_sleep_refuses_requests_with_503_and_wake_up_restores_outputs(http):
    before = _greedy(http, "A rollout is")["token_ids"]
    assert http.post("/sleep").status_code == 200  # level 1 by default
    try:
        assert _state(http) == (False, True)
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "A rollout is", "max_tokens": 2})
        _assert_error(r, 503)
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True})
        _assert_error(r, 503)
    finally:
        assert http.post("/wake_up").status_code == 200
    assert _state(http) == (False, False)
    assert _greedy(http, "A rollout is")["token_ids"] == before
    # Waking in parts: weights first, then the rest.
    assert http.post("/sleep", params={"level": 1}).status_code == 200
    assert http.post("/wake_up", params={"tags": ["weights"]}).status_code == 200
    assert http.post("/wake_up", params={"tags": ["kv_cache", "scheduling"]}).json()["status"] == "awake"
    assert _greedy(http, "A rollout is")["token_ids"] == before


def test_abort_requests_ends_a_running_stream(http):
    stream = _Stream(http, "Once upon a time", max_tokens=200)
    assert stream.started.wait(60)
    req_id = stream.chunks[0]["id"]
    assert http.post("/abort_requests", json={"request_ids": [req_id]}).json() == {"status": "aborted", "aborted": 1}
    stream.join()
    assert stream.finish_reason == "abort"


# ---------------------------------------------------------------------------- weights


def test_weight_update_over_http_matches_hf_with_the_new_weights(http, tiny_checkpoint, tmp_path_factory):
    from weight_transfer import hf_state_checksums
    from weight_transfer.local import make_update_info

    original_dir = tiny_checkpoint("llama")
    other_dir = make_tiny_checkpoint(tmp_path_factory.mktemp("seed1"), "llama", seed=1)
    original = load_file(os.path.join(original_dir, "model.safetensors"))
    new = load_file(os.path.join(other_dir, "model.safetensors"))
    prompt_ids = http.post("/tokenize", json={"prompt": "The quick brown fox"}).json()["tokens"]
    before = _greedy(http, prompt_ids, 12)["token_ids"]
    assert before == hf_greedy(original_dir, prompt_ids, 12)

    baseline_new = hf_state_checksums(new)
    check = http.post("/weight_checker", json={"baseline": baseline_new}).json()
    assert check["match"] is False and check["mismatches"]

    local_update_over_http(http, new, "v1")
    info = http.get("/weight_info").json()
    assert info["weight_version"] == "v1"
    assert http.post("/weight_checker", json={"baseline": baseline_new}).json()["match"] is True
    assert "checksums" in http.post("/weight_checker").json()
    after = _greedy(http, prompt_ids, 12)
    assert after["token_ids"] == hf_greedy(other_dir, prompt_ids, 12) != before
    assert after["weight_versions"] == [{"version": "v1", "start": 0, "end": 12}]

    # A bad update (unknown name, wrong shape) is a 400 and the new weights keep serving.
    name, tensor = next(iter(new.items()))
    for bad in ({"no.such.weight": tensor}, {name: torch.zeros(3, 3)}):
        assert http.post("/start_weight_update").status_code == 200
        r = http.post("/update_weights", json={"update_info": make_update_info(bad.items(), encoding="b64")})
        _assert_error(r, 400)
        assert http.post("/finish_weight_update", json={}).status_code == 200
    assert http.post("/weight_checker", json={"baseline": baseline_new}).json()["match"] is True
    assert _greedy(http, prompt_ids, 12)["token_ids"] == after["token_ids"]

    r = http.post("/update_weight_version", json={"new_version": "v1.1"})
    assert r.status_code == 200 and r.json() == {"success": True, "new_version": "v1.1"}
    assert http.get("/weight_info").json()["weight_version"] == "v1.1"

    local_update_over_http(http, original, "v2")  # back to what the other tests expect
    assert http.post("/weight_checker", json={"baseline": hf_state_checksums(original)}).json()["match"] is True
    restored = _greedy(http, prompt_ids, 12)
    assert restored["token_ids"] == before and restored["weight_versions"] == [{"version": "v2", "start": 0, "end": 12}]

    # Each lifecycle call's duration lands in the histogram, by operation.
    from prometheus_client.parser import text_string_to_metric_families

    counts = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        if family.name == "rollout:weight_update_duration_seconds":
            for sample in family.samples:
                if sample.name.endswith("_count"):
                    counts[sample.labels["operation"]] = sample.value
    assert all(counts.get(op, 0) >= 2 for op in ("init", "start", "update", "finish")), counts


def test_a_one_call_update_over_http_lands_or_changes_nothing(http, tiny_checkpoint, tmp_path_factory):
    """POST /apply_weight_update (ours): start, update_weights and finish in one request; bad input is a 400 naming
    the tensor, with the old weights serving and no update left open."""
    from weight_transfer import hf_state_checksums
    from weight_transfer.local import make_update_info

    original = load_file(os.path.join(tiny_checkpoint("llama"), "model.safetensors"))
    new = load_file(os.path.join(make_tiny_checkpoint(tmp_path_factory.mktemp("seed3"), "llama", seed=3),
                                 "model.safetensors"))
    version = http.get("/weight_info").json()["weight_version"]
    assert http.post("/init_weight_transfer_engine", json={"init_info": {"backend": "local"}}).status_code == 200
    name, tensor = next(iter(new.items()))
    for bad in ({"no.such.weight": tensor}, {name: torch.zeros(3, 3)}):
        r = http.post("/apply_weight_update", json={"update_info": make_update_info(bad.items(), encoding="b64"),
                                                    "weight_version": "bad"})
        _assert_error(r, 400, next(iter(bad)))
        assert http.post("/abort_weight_update").json() == {"aborted": False, "weight_version": version}
    assert http.post("/weight_checker", json={"baseline": hf_state_checksums(original)}).json()["match"] is True

    for weights, label in ((new, "one-call"), (original, version)):
        r = http.post("/apply_weight_update", json={"update_info": make_update_info(weights.items(), encoding="b64"),
                                                    "weight_version": label})
        assert r.status_code == 200 and r.json() == {"message": "Weights updated"}, r.text
        assert http.get("/weight_info").json()["weight_version"] == label
        assert http.post("/weight_checker", json={"baseline": hf_state_checksums(weights)}).json()["match"] is True


def test_vllm_weight_checker_checksum_reset_compare(http, tiny_checkpoint):
    """vLLM's /weight_checker: keys "dp0:pp0:pcp0:tp0:<parameter>", plain sha256 of the raw bytes."""
    import hashlib

    original = load_file(os.path.join(tiny_checkpoint("llama"), "model.safetensors"))
    checksums = http.post("/weight_checker", json={"action": "checksum"}).json()["checksums"]
    assert checksums and all(k.startswith("dp0:pp0:pcp0:tp0:") and len(v) == 64 for k, v in checksums.items())
    name = "model.norm.weight"  # a weight the engine holds as the checkpoint has it (not fused, not padded)
    dtype = getattr(torch, http.get("/weight_info").json()["weights"][name]["dtype"])
    raw = original[name].to(dtype).contiguous().view(-1).view(torch.uint8).numpy()
    assert checksums["dp0:pp0:pcp0:tp0:" + name] == hashlib.sha256(raw).hexdigest()
    assert http.post("/collective_rpc", json={"method": "compute_weight_checksums"}).json() == {"results": [
        checksums]}
    assert http.post("/weight_checker", json={"action": "compare", "baseline": checksums}).json() == {
        "match": True, "mismatches": []}
    try:
        assert http.post("/weight_checker", json={"action": "reset"}).json() == {"status": "reset"}
        compared = http.post("/weight_checker", json={"action": "compare", "baseline": checksums}).json()
        assert compared["match"] is False and "dp0:pp0:pcp0:tp0:" + name in compared["mismatches"]
        assert len(compared["mismatches"]) == len(checksums)  # every weight is zero now
    finally:
        local_update_over_http(http, original, "default")
    assert http.post("/weight_checker", json={"action": "compare", "baseline": checksums}).json()["match"] is True
    _assert_error(http.post("/collective_rpc", json={"method": "__init__"}), 400, "method", "__init__")


def test_shutdown_weight_transfer_engine_requires_a_new_init(http):
    assert http.post("/init_weight_transfer_engine", json={"init_info": {"backend": "local"}}).status_code == 200
    assert http.post("/shutdown_weight_transfer_engine").status_code == 200
    # Without a transfer engine the lifecycle refuses to start, and says why.
    refused = http.post("/start_weight_update")
    _assert_error(refused, 400, "init_weight_transfer_engine")
    # The routes time their calls under vLLM's family, by operation, the refused one included (as vLLM's do).
    from prometheus_client.parser import text_string_to_metric_families

    counts = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        if family.name == "vllm:rl_weight_update_operation_duration_seconds":
            counts = {s.labels["operation"]: s.value for s in family.samples if s.name.endswith("_count")}
    assert all(counts.get(op, 0) >= 1 for op in ("init", "shutdown", "start")), counts


def test_release_kv_cache_memory_over_http(http):
    """vLLM's /release_kv_cache_memory: {"status": "kv_cache_released"} after a completed pause, and the
    engine sleeps until /wake_up?tags=kv_cache; without the pause a 400 (vLLM: an uncaught 500)."""
    before = _greedy(http, "A rollout is")["token_ids"]
    _assert_error(http.post("/release_kv_cache_memory"), 400, "requires a completed pause")
    assert http.post("/pause", params={"mode": "wait"}).json() == {"status": "paused"}
    try:
        assert http.post("/release_kv_cache_memory").json() == {"status": "kv_cache_released"}
        assert _state(http) == (True, True)
        assert http.post("/wake_up", params={"tags": "kv_cache"}).json() == {"status": "awake", "tags": ["kv_cache"]}
    finally:
        http.post("/resume")
    assert _state(http) == (False, False)
    assert _greedy(http, "A rollout is")["token_ids"] == before


def test_server_info_has_vllms_keys(http):
    text = http.get("/server_info").json()
    assert set(text) == {"vllm_config", "vllm_env", "system_env"} and "max_model_len" in text["vllm_config"]
    as_json = http.get("/server_info", params={"config_format": "json"}).json()["vllm_config"]
    assert as_json["model"]["max_model_len"] == http.post("/tokenize", json={"prompt": "a"}).json()["max_model_len"]
    _assert_error(http.get("/server_info", params={"config_format": "yaml"}), 400, "config_format")


def test_vllm_elastic_ep_routes_on_a_single_engine(http):
    """vLLM's /is_scaling_elastic_ep body (idle: one engine never scales) and /scale_elastic_ep's 400s."""
    assert http.post("/is_scaling_elastic_ep").json() == {
        "is_scaling_elastic_ep": False, "phase": "idle", "epoch": None, "error": None,
        "requested_data_parallel_size": None}
    _assert_error(http.post("/scale_elastic_ep", json={}), 400, "new_data_parallel_size is required")
    _assert_error(http.post("/scale_elastic_ep", json={"new_data_parallel_size": 0}), 400, "positive integer")
    _assert_error(http.post("/scale_elastic_ep", json={"new_data_parallel_size": 2, "drain_timeout": 1.5}), 400,
                  "drain_timeout")
    _assert_error(http.post("/scale_elastic_ep", json={"new_data_parallel_size": 2}), 400, "lockstep")
    assert _state(http) == (False, False)
