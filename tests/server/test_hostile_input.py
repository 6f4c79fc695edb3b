"""Hostile input and heavy load against a real `rollout launch` process: each case is refused fast with a 4xx naming
what is wrong, and the server stays healthy, small and serving the same greedy output."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import threading
import time
from urllib.parse import urlsplit

import httpx
import psutil
import pytest

pytestmark = pytest.mark.slow

API_KEY = "sk-hostile"
MODEL = "tiny"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# The longest any refusal may take: a hang (the bugs these tests reproduce took 5 s to minutes)
# fails on this client timeout instead of blocking the suite.
REFUSAL_TIMEOUT_S = 5.0
GREEDY = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}


def _tree_rss(pid: int) -> int:
    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])


def _greedy(c: httpx.Client) -> str:
    r = c.post("/v1/completions", json=GREEDY)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _refused(response: httpx.Response, status: int, *words: str, param: str | None = None) -> dict:
    """Asserts an OpenAI-style error of `status` whose message names every word."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    for word in words:
        assert word in error["message"], error
    if param is not None:
        if error["type"] == "Bad Request":  # a failed declared type: the field where it was sent (vLLM's param)
            assert any(error["param"] == f"{at}.{param}" or error["param"].startswith(f"{at}.{param}.")
                       for at in ("body", "query")), error
        else:
            assert error["param"] == param, error
    return error


@pytest.fixture(scope="module")
def server(launch_server, tiny_checkpoint):
    return launch_server(tiny_checkpoint("llama"), "--api-key", API_KEY, "--served-model-name", MODEL,
                         "--enable-rl-routes")


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=REFUSAL_TIMEOUT_S) as c:
        yield c


@pytest.fixture(scope="module")
def baseline(server, client):
    """The greedy output and process-tree memory before any hostile case (after one warm-up request)."""
    _greedy(client)
    return {"text": _greedy(client), "rss": _tree_rss(server.proc.pid)}


@pytest.fixture
def healthy_after(server, client, baseline):
    """Each test leaves the server healthy and serving what it served before."""
    yield
    assert client.get("/health").status_code == 200
    assert _greedy(client) == baseline["text"]
    assert client.get("/is_paused").json() == {"is_paused": False}
    assert client.get("/is_sleeping").json() == {"is_sleeping": False}


# ---------------------------------------------------------------------------- 1. n


@pytest.mark.usefixtures("healthy_after")
def test_unbounded_n_is_refused_before_anything_is_allocated(client):
    _refused(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "n": 40000}), 400,
             "n must be at most max_num_seqs=256", "40000", param="n")
    _refused(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "n": 10**6}), 400, "n", param="n")
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "n": 9542251074}
    _refused(client.post("/v1/chat/completions", json=chat), 400, "9542251074", param="n")
    _refused(client.post("/v1/completions", json={"prompt": "hi", "n": 0}), 400, param="n")
    # n within the engine's limit but a batch whose prompts x n passes --max-batch-sequences.
    batch = {"prompt": ["hi"] * 20, "max_tokens": 1, "n": 250}
    _refused(client.post("/v1/completions", json=batch), 400, "5000 sequences", "--max-batch-sequences")
    _refused(client.post("/v1/completions", json={"prompt": "hi", "best_of": 10**9}), 400, "best_of", param="best_of")


def test_a_client_that_gives_up_on_the_largest_n_leaves_the_server_answering(server, client, baseline):
    """The largest n the engine takes, abandoned mid-flight: its 256 children abort at once and
    /health answers right away (aborting them was quadratic, leaving it silent for minutes)."""
    body = {"model": MODEL, "prompt": "Tell me a story", "max_tokens": 200, "ignore_eos": True, "n": 256}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=1.0)
    assert client.get("/health").status_code == 200
    deadline = time.monotonic() + 30
    while _num_running(client) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _num_running(client) == 0, "the abandoned request's children kept running"
    assert _greedy(client) == baseline["text"]


def _num_running(client: httpx.Client) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("vllm:num_requests_running{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no vllm:num_requests_running gauge")


# ---------------------------------------------------------------------------- 2. body size and long prompts


@pytest.mark.usefixtures("healthy_after")
def test_a_body_over_the_limit_is_413_before_it_is_read(client):
    big = b'{"prompt": "' + b"a" * 50_000_000 + b'"}'
    error = _refused(client.post("/v1/completions", content=big, headers={"Content-Type": "application/json"}), 413,
                     "--max-request-body-bytes")
    assert error["type"] == "Request Entity Too Large"  # the status phrase, as vLLM types an HTTP status it raises

    def chunks():  # no Content-Length: refused once the bytes read pass the limit
        yield b'{"prompt": "'
        for _ in range(50):
            yield b"a" * 1_000_000
        yield b'"}'

    _refused(client.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}), 413)


@pytest.mark.usefixtures("healthy_after")
def test_prompts_that_cannot_fit_are_refused_from_their_length(client):
    # 20 MB of text fits the body limit; it is refused from its character count, not tokenized.
    _refused(client.post("/v1/completions", json={"prompt": "a b " * 5_000_000}), 400,
             "20000000 characters cannot fit max_model_len=256", param="prompt")
    chat = {"messages": [{"role": "user", "content": "hello " * 2_000_000}]}
    _refused(client.post("/v1/chat/completions", json=chat), 400, "cannot fit max_model_len", param="prompt")
    _refused(client.post("/tokenize", json={"prompt": "x" * 10_000_000}), 400, "cannot fit", param="prompt")
    # 4M token ids: refused from the list's length.
    _refused(client.post("/v1/completions", json={"prompt": [5] * 4_000_000}), 400, "4000000 tokens", param="prompt")


# ---------------------------------------------------------------------------- 4. what used to be 500s


BIG = 2**64 + 1


@pytest.mark.parametrize("field", ["max_tokens", "top_k", "priority", "seed", "min_tokens", "n"])
def test_integers_past_64_bits_are_400_naming_the_field(client, field):
    _refused(client.post("/v1/completions", json={"prompt": "hi", field: BIG}), 400, field, "64 bits", param=field)


@pytest.mark.usefixtures("healthy_after")
def test_integers_past_64_bits_anywhere_are_400(client):
    _refused(client.post("/sleep", params={"level": str(BIG)}), 400, "level", param="level")
    _refused(client.post("/init_weight_transfer_engine", json={"init_info": {"backend": "local", "x": BIG}}), 400,
             "init_info.x", "64 bits", param="init_info")
    update = {"update_info": {"weights": [{"name": "a", "dtype": "float32", "shape": [BIG], "data_b64": ""}]}}
    _refused(client.post("/update_weights", json=update), 400, "update_info.weights[0].shape[0]", param="update_info")
    _refused(client.post("/weight_checker", json={"baseline": {"w": BIG}}), 400, "baseline.w", param="baseline")
    _refused(client.post("/v1/completions", json={"prompt": [1, 2, -BIG]}), 400, "prompt[2]", param="prompt")
    _refused(client.post("/v1/completions", json={"prompt": "hi", "logit_bias": {"5": BIG}}), 400, "logit_bias")
    digits = b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}"  # past Python's int-parsing limit
    _refused(client.post("/v1/completions", content=digits, headers={"Content-Type": "application/json"}), 400)
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    _refused(client.post("/v1/completions", content=deep, headers={"Content-Type": "application/json"}), 400, "deeper")


@pytest.mark.usefixtures("healthy_after")
def test_lone_surrogates_are_400_naming_the_field(client):
    raw = {"Content-Type": "application/json"}
    _refused(client.post("/v1/completions", content=b'{"prompt": "\\ud800abc"}', headers=raw), 400,
             "lone surrogate", param="prompt")
    chat = b'{"messages": [{"role": "user", "content": "\\ud800abc"}]}'
    _refused(client.post("/v1/chat/completions", content=chat, headers=raw), 400,
             "messages[0].content", param="messages")
    _refused(client.post("/tokenize", content=b'{"prompt": "\\udfff"}', headers=raw), 400, param="prompt")
    # A real surrogate pair is one character, and fine.
    pair = client.post("/v1/completions", content=b'{"prompt": "\\ud83d\\ude00", "max_tokens": 1}', headers=raw)
    assert pair.status_code == 200, pair.text


@pytest.mark.usefixtures("healthy_after")
def test_sleeping_at_another_level_while_asleep_is_400(client):
    assert client.post("/sleep", params={"level": 1}).status_code == 200
    try:
        for level in (2, 0):
            # A control route's refusal names the field in its message; its param is null, as vLLM's routers answer.
            error = _refused(client.post("/sleep", params={"level": level}), 400, "level", "already asleep at level 1")
            assert error["type"] == "Bad Request" and error["param"] is None, error
        assert client.get("/is_sleeping").json() == {"is_sleeping": True}
    finally:
        assert client.post("/wake_up").status_code == 200


# ---------------------------------------------------------------------------- 5. NaN and infinity


@pytest.mark.usefixtures("healthy_after")
def test_nan_and_infinity_are_400_naming_the_field(client):
    raw = {"Content-Type": "application/json"}
    for body, field in [
        (b'{"prompt": "hi", "temperature": NaN}', None),
        (b'{"prompt": "hi", "repetition_penalty": NaN}', None),
        (b'{"prompt": "hi", "logit_bias": {"5": NaN}}', None),
        (b'{"prompt": "hi", "temperature": Infinity}', None),
        (b'{"prompt": "hi", "repetition_penalty": -Infinity}', None),
        (b'{"prompt": "hi", "temperature": 1e999}', "body.temperature"),
        (b'{"prompt": "hi", "repetition_penalty": 1e400}', "body.repetition_penalty"),
        (b'{"prompt": "hi", "logit_bias": {"5": 1e999}}', "body.logit_bias"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "top_p": 1e999}', "body.top_p"),
        # Finite in JSON but not in the sampler's float32 (found by the fuzz tier: 5e-324 killed the engine).
        (b'{"prompt": "hi", "repetition_penalty": 5e-324, "allowed_token_ids": [0]}', "repetition_penalty"),
        (b'{"prompt": "hi", "logit_bias": {"5": 1e39}}', "logit_bias"),
    ]:
        path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
        error = _refused(client.post(path, content=body, headers=raw), 400)
        assert "finite" in error["message"] or "at least" in error["message"], error
        if field is not None:
            # JSON bounds are checked as the body is read (vLLM's location form, body.<field>); the
            # sampler's own checks name the field plainly, as vLLM's BadRequestError does.
            assert error["param"] == field, error


# ---------------------------------------------------------------------------- 6. errors keep the connection


def test_errors_keep_the_keep_alive_connection(server, baseline):
    """Twenty requests on one connection, every other one an error: the socket is never dropped."""
    url = urlsplit(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    headers = {**AUTH, "Content-Type": "application/json"}
    bad = [b'{"prompt": "hi", "temperature": NaN}', b'{"prompt": "\\ud800"}', b"[", b'{"prompt": "hi", "n": 0}',
           b'{"prompt": "hi", "max_tokens": 99999999999999999999999}']
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(GREEDY), headers=headers)
        first = conn.getresponse()
        assert first.status == 200
        first.read()
        sock = conn.sock
        for i in range(20):
            if i % 2:
                conn.request("POST", "/v1/completions", body=json.dumps(GREEDY), headers=headers)
                expected = 200
            else:
                conn.request("POST", "/v1/completions", body=bad[i // 2 % len(bad)], headers=headers)
                expected = 400
            response = conn.getresponse()
            body = response.read()
            assert response.status == expected, body
            assert response.getheader("Connection", "").lower() != "close"
            if expected == 200:
                assert json.loads(body)["choices"][0]["text"] == baseline["text"]
            else:
                assert json.loads(body)["error"]["code"] == 400
            assert conn.sock is sock, "the server dropped the keep-alive connection"
    finally:
        conn.close()


def test_an_unexpected_exception_is_a_json_500_and_keeps_the_connection(tiny_checkpoint):
    """A route that raises something no handler knows: the real middleware stack answers with the OpenAI
    error body, and the same connection serves the next request (uvicorn on a loopback port)."""
    import uvicorn

    from engine.async_llm import AsyncLLM
    from rollout.server.app import build_app
    from rollout.server.config import ServerConfig

    engine = AsyncLLM.from_engine_args(model=tiny_checkpoint("llama"), max_model_len=256, device="cpu",
                                       dtype="float32", disable_log_stats=True, multiprocess=False)

    async def broken(include_dp: bool = True) -> int:
        raise RuntimeError("an engine bug")

    engine.get_world_size = broken  # what a bug anywhere below a route looks like
    app = build_app(engine, ServerConfig(port=0, enable_rl_routes=True), model_name=MODEL)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error", lifespan="off")
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not uv.started and time.monotonic() < deadline:
            time.sleep(0.05)
        port = uv.servers[0].sockets[0].getsockname()[1]
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/get_world_size")
        response = conn.getresponse()
        error = json.loads(response.read())["error"]
        assert response.status == 500 and error["type"] == "InternalServerError"  # vLLM's type for a 500
        assert "RuntimeError: an engine bug" in error["message"]
        sock = conn.sock
        conn.request("GET", "/is_paused")
        response = conn.getresponse()
        assert response.status == 200 and json.loads(response.read()) == {"is_paused": False}
        assert conn.sock is sock
        conn.close()
    finally:
        uv.should_exit = True
        thread.join(10)
        engine.shutdown()


# ---------------------------------------------------------------------------- 10. sleep(2) without an update


def test_waking_from_level_2_without_an_update_refuses_and_a_reload_serves_the_checkpoint_under_its_version(
    server, client, baseline, tiny_checkpoint
):
    """sleep(2) discards the weights: woken without an update the server refuses to generate (503 saying
    why) rather than serve zeros or a stale version; wake_up?reload_weights=true re-reads the checkpoint,
    and the trained version's label must not stay on outputs that the checkpoint's weights computed."""
    from rl_http import local_update_over_http
    from safetensors.torch import load_file

    trained = load_file(f"{tiny_checkpoint('llama', seed=1)}/model.safetensors")
    local_update_over_http(client, trained, "trained-1")
    assert client.get("/get_weight_version").json() == {"weight_version": "trained-1"}
    assert _greedy(client) != baseline["text"]

    assert client.post("/sleep", params={"level": 2}).status_code == 200
    assert client.post("/wake_up").json() == {"status": "awake", "tags": None}
    refused = client.post("/v1/completions", json=GREEDY)
    assert refused.status_code == 503 and "discarded by sleep(level=2)" in refused.json()["error"]["message"]
    assert client.post("/sleep", params={"level": 2}).status_code == 200
    assert client.post("/wake_up", params={"reload_weights": True}).status_code == 200
    assert client.get("/get_weight_version").json() == {"weight_version": "default"}
    r = client.post("/v1/completions", json={**GREEDY, "return_weight_versions": True})
    choice = r.json()["choices"][0]
    assert choice["text"] == baseline["text"]
    assert [span["version"] for span in choice["weight_versions"]] == ["default"]


# ---------------------------------------------------------------------------- memory, last


def test_memory_after_the_hostile_cases_is_within_200_mb_of_before(server, client, baseline):
    """Runs after the cases above (module order): the server's process tree did not keep what they sent."""
    assert client.get("/health").status_code == 200
    grown = _tree_rss(server.proc.pid) - baseline["rss"]
    assert grown < 200 * 2**20, f"the server's process tree grew by {grown / 2**20:.0f} MB"


# ---------------------------------------------------------------------------- 7. admission under load


def _gauge(c: httpx.Client, name: str) -> float:
    for line in c.get("/metrics").text.splitlines():
        if line.startswith(f"vllm:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no vllm:{name} gauge")


def test_a_refusal_does_not_wait_behind_work(launch_server, tiny_checkpoint):
    """With the queue full, a request is refused before any work is spent on it: an 8 MB prompt (which took
    ~15 s to tokenize before its 503) and a burst of 200 concurrent clients get their 503s at once."""
    server = launch_server(tiny_checkpoint("llama"), "--max-num-queued-reqs", "2", "--max-num-seqs", "1",
                           "--max-model-len", "2048")
    long = {"prompt": "Tell me a story", "max_tokens": 2000, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=REFUSAL_TIMEOUT_S) as c:
        for num_held in (1, 2, 3):  # one at a time, so that none is refused: one runs, two wait
            threading.Thread(target=httpx.post, args=(server.url + "/v1/completions",),
                             kwargs={"json": long, "timeout": 120}, daemon=True).start()
            deadline = time.monotonic() + 30
            while _gauge(c, "num_requests_running") + _gauge(c, "num_requests_waiting") < num_held \
                    and time.monotonic() < deadline:
                time.sleep(0.05)
        assert _gauge(c, "num_requests_waiting") == 2, "the queue should be full (one running, two waiting)"

        big = c.post("/v1/completions", json={"prompt": "a b " * 2_000_000})
        error = _refused(big, 503, "max_num_queued_reqs=2")
        assert error["type"] == "Service Unavailable" and big.headers["Retry-After"] == "1"  # as vLLM types QueueOverflowError

        async def burst() -> list[httpx.Response]:
            limits = httpx.Limits(max_connections=200)
            async with httpx.AsyncClient(base_url=server.url, timeout=REFUSAL_TIMEOUT_S, limits=limits) as ac:
                return await asyncio.gather(*(ac.post("/v1/completions", json={"prompt": "hi"}) for _ in range(200)))

        for r in asyncio.run(burst()):
            _refused(r, 503, "max_num_queued_reqs")
        chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        _refused(chat, 503, "max_num_queued_reqs")
        assert c.get("/health").status_code == 200
    server.stop()  # ends the held requests too


# ---------------------------------------------------------------------------- 11. logs


def test_log_line_shows_kv_usage_of_running_requests_and_every_request_is_in_the_access_log(
    launch_server, tiny_checkpoint
):
    server = launch_server(tiny_checkpoint("llama"), "--no-disable-log-stats", "--log-stats-interval", "0.5",
                           "--max-model-len", "2048")  # launch() turns stats off; the last flag wins
    body = {"prompt": "Tell me a story", "max_tokens": 400, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=120) as c:
        threads = [threading.Thread(target=c.post, args=("/v1/completions",), kwargs={"json": body})
                   for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert c.post("/v1/completions", json={"prompt": "hi", "n": 0}).status_code == 400
        assert c.get("/nope").status_code == 404
    log = server.stderr_tail(200_000)
    usages = [float(m) for m in re.findall(r"Running: 16 reqs, Waiting: 0 reqs, KV cache usage: ([0-9.e-]+)%", log)]
    assert usages and all(u > 0 for u in usages), log[-3000:]
    assert '"POST /v1/completions HTTP/1.1" 200' in log
    assert '"POST /v1/completions HTTP/1.1" 400' in log and '"GET /nope HTTP/1.1" 404' in log
    server.stop()

    quiet = launch_server(tiny_checkpoint("llama"), "--disable-access-log")
    with httpx.Client(base_url=quiet.url, timeout=60) as c:
        assert c.get("/nope").status_code == 404
    assert "GET /nope" not in quiet.stderr_tail(200_000)
    quiet.stop()
