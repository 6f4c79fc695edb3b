"""The fuzz tier: schemathesis over /openapi.json of a real `rollout launch --enable-rl-routes --api-key` process
(with --enable-lora --allow-runtime-lora-updating, so that vLLM's LoRA routes are fuzzed too).

With the key, every operation gets the coverage phase's cases (every documented field and its
boundaries) and up to MAX_EXAMPLES fuzzed ones (one worker; hooks undo pause, sleep and weight
updates so that generation keeps being exercised), and each test asserts that every operation of
the document was called in both phases; the checks are schemathesis's own:
no 5xx but the documented 502/503/504, every status and body as the document says, no request
past 30 s. Without the key, every protected operation answers 401 and nothing changes.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import subprocess
import sys

import httpx
import pytest

pytestmark = pytest.mark.slow

API_KEY = "sk-fuzz"
HERE = os.path.dirname(os.path.abspath(__file__))
OPEN_PATHS = {"/health", "/metrics"}
REQUEST_TIMEOUT_S = 30
# Fuzzing-phase cases per operation (the coverage phase's cases come on top, whatever this is).
MAX_EXAMPLES = 10
# schemathesis's not_a_server_error check: 5xx fail except the statuses the document promises for
# an engine that cannot serve now (503), a transfer peer that failed (502) or timed out (504).
CONFIG = """\
[checks.not_a_server_error]
expected-statuses = ["2xx", "3xx", "4xx", "502", "503", "504"]
"""


@pytest.fixture(scope="module")
def server(launch_server, tiny_checkpoint):
    # With vLLM's LoRA load/unload routes too (no --allowed-lora-paths: every fuzzed lora_path is refused).
    return launch_server(tiny_checkpoint("llama"), "--enable-rl-routes", "--api-key", API_KEY,
                         "--enable-lora", "--allow-runtime-lora-updating")


def _documented_operations(server) -> set[tuple[str, str]]:
    doc = httpx.get(server.url + "/openapi.json", timeout=30).json()
    return {(method.upper(), path) for path, ops in doc["paths"].items() for method in ops}


def _fuzz(server, workdir, *, api_key: str | None) -> tuple[int, str, collections.Counter]:
    """Runs schemathesis; returns its exit code, its output and (method, path, status) counts (status None:
    no response: a network error or a request past the timeout). Asserts that each phase (coverage,
    fuzzing) called every operation of the document."""
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "schemathesis.toml"), "w") as f:
        f.write(CONFIG)
    env = dict(os.environ, ROLLOUT_FUZZ_URL=server.url, PYTHONPATH=HERE)
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", server.url + "/openapi.json",
           "--max-examples", str(MAX_EXAMPLES), "--workers", "1", "--seed", "20",
           "--phases", "coverage,fuzzing", "--request-timeout", str(REQUEST_TIMEOUT_S),
           "--checks", "not_a_server_error,status_code_conformance,response_schema_conformance",
           "--suppress-health-check", "all", "--report", "ndjson", "--report-dir", "report"]
    if api_key is not None:
        cmd += ["--header", f"Authorization: Bearer {api_key}"]
        env.update(SCHEMATHESIS_HOOKS="schemathesis_hooks", ROLLOUT_FUZZ_API_KEY=api_key)
    done = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
    counts: collections.Counter = collections.Counter()
    called: dict[str, set[tuple[str, str]]] = {"coverage": set(), "fuzzing": set()}
    (report,) = glob.glob(os.path.join(workdir, "report", "*.ndjson"))
    with open(report) as f:
        for line in f:
            event = json.loads(line)
            finished = event.get("ScenarioFinished")
            if finished is None:
                continue
            for interaction in finished.get("recorder", {}).get("interactions", {}).values():
                request, response = interaction["request"], interaction.get("response")
                path = "/" + request["uri"].split("/", 3)[3].split("?")[0]
                counts[(request["method"], path, response["status_code"] if response else None)] += 1
                called.setdefault(finished["phase"], set()).add((request["method"], path))
    documented = _documented_operations(server)
    for phase, operations in called.items():
        assert not documented - operations, (phase, sorted(documented - operations))
    return done.returncode, done.stdout + done.stderr, counts


def _state(server) -> dict:
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as c:
        return {path: c.get(path).json() for path in ("/is_paused", "/is_sleeping", "/get_weight_version")}


def test_the_document_describes_the_server(server):
    """No 422 (the server answers 400 with the OpenAI error body), 401/413 where they can happen,
    /health's empty body and /metrics' text as they are."""
    doc = httpx.get(server.url + "/openapi.json", timeout=30).json()
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    operations = [(path, method, op) for path, ops in doc["paths"].items() for method, op in ops.items()]
    assert len(operations) > 25
    for path, method, op in operations:
        responses = op["responses"]
        assert "422" not in responses, (method, path)
        if method == "post":
            assert responses["400"]["content"]["application/json"]["schema"] == error_ref, (method, path)
        if "requestBody" in op:
            assert "413" in responses, (method, path)
        assert ("401" in responses) == (path not in OPEN_PATHS), (method, path)
    health = doc["paths"]["/health"]["get"]["responses"]
    assert health["200"].get("content", {}) == {} and "503" in health
    assert list(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == [
        "text/plain; version=0.0.4; charset=utf-8"]
    completions = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "401", "404", "413", "503"} <= set(completions)
    assert set(completions["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "504" in doc["paths"]["/init_weight_transfer_engine"]["post"]["responses"]
    load_lora = doc["paths"]["/v1/load_lora_adapter"]["post"]["responses"]
    assert list(load_lora["200"]["content"]) == ["text/plain"] and {"400", "401", "404"} <= set(load_lora)
    r = httpx.get(server.url + "/health", timeout=30)
    assert r.status_code == 200 and r.content == b""


def test_every_operation_fuzzed_with_the_key_answers_as_documented(server, tmp_path):
    rc, output, counts = _fuzz(server, str(tmp_path / "with-key"), api_key=API_KEY)
    assert rc == 0, output[-6000:]
    assert not [k for k in counts if k[2] == 500], counts
    assert not [k for k in counts if k[2] is None], f"requests without an answer within {REQUEST_TIMEOUT_S} s"
    # Generation was really exercised, not starved by a fuzzed /sleep or /pause.
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert counts[("POST", path, 200)] >= 5, (path, {k: v for k, v in counts.items() if k[1] == path})
    operations = {(m, p) for (m, p, _) in counts}
    assert ("POST", "/update_weights") in operations and ("POST", "/sleep") in operations
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.get("/health").status_code == 200


def test_without_the_key_every_protected_operation_is_401_and_nothing_changes(server, tmp_path):
    before = _state(server)
    rc, output, counts = _fuzz(server, str(tmp_path / "no-key"), api_key=None)
    assert rc == 0, output[-6000:]
    documented = {(m, p) for (m, p, s) in counts if s != 405}  # other methods are probes of each path
    protected = {op for op in documented if op[1] not in OPEN_PATHS}
    assert len(protected) > 20
    for method, path in protected:
        statuses = {s for (m, p, s) in counts if (m, p) == (method, path)} - {405}
        assert statuses == {401}, (method, path, statuses)
    assert _state(server) == before
