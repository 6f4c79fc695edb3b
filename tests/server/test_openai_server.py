"""`rollout launch` as a real process, driven with the official openai client and httpx."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

API_KEY = "sk-test"
MODEL = "tiny"


@pytest.fixture(scope="module")
def server(launch_server, tiny_checkpoint):
    return launch_server(tiny_checkpoint("llama"), "--api-key", API_KEY, "--served-model-name", MODEL)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


def _complete(client, **kwargs):
    kwargs.setdefault("model", MODEL)
    kwargs.setdefault("max_tokens", 6)
    return client.completions.create(**kwargs)


def _assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    # vLLM 0.33's types: a failed declared type or a route's own refusal is typed with the status phrase,
    # a serving-layer refusal with vLLM's error class name (rollout/server/errors.py).
    assert error["type"] in {400: {"Bad Request", "BadRequestError"}, 401: {"Unauthorized"},
                             404: {"NotFoundError"}, 503: {"ServiceUnavailableError", "Service Unavailable"}}[status]
    if param is not None:
        if error["type"] == "Bad Request":  # a failed declared type: the field where it was sent (vLLM's param)
            assert error["param"] == f"body.{param}" or error["param"].startswith(f"body.{param}."), error
        else:
            assert error["param"] == param, error
    return error


# ---------------------------------------------------------------------------- OpenAI routes


def test_models_lists_the_served_name(client, server):
    assert server.served_model == MODEL
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_from_text(client):
    out = _complete(client, prompt="The quick brown fox", temperature=0.0, max_tokens=5,
                    extra_body={"ignore_eos": True})
    (choice,) = out.choices
    assert out.id.startswith("cmpl-") and out.model == MODEL
    assert isinstance(choice.text, str) and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 5 and out.usage.prompt_tokens > 0


def test_token_ids_in_token_ids_and_logprobs_out(client, http):
    prompt_ids = http.post("/tokenize", json={"prompt": "Once upon a time"}).json()["tokens"]
    out = _complete(client, prompt=prompt_ids, temperature=0.0, max_tokens=5, logprobs=2,
                    extra_body={"return_token_ids": True, "ignore_eos": True})
    (choice,) = out.choices
    extra = choice.model_extra
    assert extra["prompt_token_ids"] == prompt_ids
    assert len(extra["token_ids"]) == 5
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(x <= 0.0 for x in lp.token_logprobs)
    # top-2 plus the sampled token (tokens with the same text share one key)
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    # Greedy: the sampled token is the most likely one.
    assert all(abs(t - max(top.values())) < 1e-4 for t, top in zip(lp.token_logprobs, lp.top_logprobs))
    text = http.post("/detokenize", json={"tokens": extra["token_ids"]}).json()["prompt"]
    assert text == choice.text
    # The same prompt as text gives the same tokens.
    again = _complete(client, prompt="Once upon a time", temperature=0.0, max_tokens=5,
                      extra_body={"return_token_ids": True, "ignore_eos": True})
    assert again.choices[0].model_extra["prompt_token_ids"] == prompt_ids
    assert again.choices[0].model_extra["token_ids"] == extra["token_ids"]


def test_prompt_logprobs(client, http):
    prompt_ids = http.post("/tokenize", json={"prompt": "She sells sea shells"}).json()["tokens"]
    out = _complete(client, prompt=prompt_ids, max_tokens=2, extra_body={"prompt_logprobs": 1})
    positions = out.choices[0].model_extra["prompt_logprobs"]
    assert len(positions) == len(prompt_ids) and positions[0] is None
    for token_id, position in zip(prompt_ids[1:], positions[1:]):
        assert str(token_id) in position and all(lp["logprob"] <= 0.0 for lp in position.values())


def test_n_samples_and_seed(client):
    kwargs = dict(prompt="Hello", n=2, temperature=1.0, seed=1234, max_tokens=8, extra_body={"ignore_eos": True})
    first = _complete(client, **kwargs)
    second = _complete(client, **kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.usage.completion_tokens == 16


def test_batch_prompts(client):
    out = _complete(client, prompt=["Hello", "The dog"], n=2, temperature=0.0, max_tokens=3)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    single = _complete(client, prompt="The dog", temperature=0.0, max_tokens=3)
    assert out.choices[2].text == single.choices[0].text


def test_max_tokens(client):
    out = _complete(client, prompt="Numbers:", max_tokens=3, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert len(out.choices[0].model_extra["token_ids"]) == 3
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"


def test_stop_string(client):
    full = _complete(client, prompt="The scheduler", temperature=0.0, max_tokens=10, logprobs=0,
                     extra_body={"ignore_eos": True}).choices[0]
    # A stop string taken from the greedy output (a token's text well inside it).
    candidates = [t for t in full.logprobs.tokens[2:] if t.strip() and "\ufffd" not in t]
    if not candidates:
        pytest.skip("greedy output has no clean token to stop on")
    stop = candidates[0]
    stopped = _complete(client, prompt="The scheduler", temperature=0.0, max_tokens=10, stop=[stop],
                        extra_body={"ignore_eos": True}).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.index(stop)]
    assert stopped.model_extra["stop_reason"] == stop


def test_completion_stream_equals_plain(client):
    kwargs = dict(prompt="A rollout is", temperature=1.0, seed=7, max_tokens=12, extra_body={"ignore_eos": True})
    plain = _complete(client, **kwargs).choices[0].text
    chunks = list(_complete(client, stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello! How are you today?"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0.0,
                                         logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    (choice,) = out.choices
    assert out.id.startswith("chatcmpl-") and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and out.usage.completion_tokens == 6
    content = choice.logprobs.content
    assert len(content) == 6
    # Token texts add up to the content, but for bytes of a character that never completes: the content
    # shows U+FFFD for them, their token texts are "" (as vLLM's logprobs write them).
    assert "".join(t.token for t in content) == choice.message.content.replace("\ufffd", "")
    assert all(len(t.top_logprobs) == 2 and t.bytes == list(t.token.encode()) for t in content)


def test_chat_stream_equals_plain_with_n(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], n=2, seed=11,
                  temperature=1.0, max_tokens=10, extra_body={"ignore_eos": True})
    plain = client.chat.completions.create(**kwargs)
    texts = {c.index: c.message.content for c in plain.choices}
    streamed: dict[int, str] = {0: "", 1: ""}
    roles, finish, usage = set(), {}, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        usage = chunk.usage or usage
        for c in chunk.choices:
            roles.add(c.delta.role) if c.delta.role else None
            streamed[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert streamed == texts
    assert roles == {"assistant"} and finish == {0: "length", 1: "length"}
    assert usage.completion_tokens == 20 == plain.usage.completion_tokens


def test_chat_return_token_ids(client, http):
    messages = [{"role": "user", "content": "What is two plus two?"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                         extra_body={"return_token_ids": True})
    expected = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    assert out.model_extra["prompt_token_ids"] == expected
    assert len(out.choices[0].model_extra["token_ids"]) == out.usage.completion_tokens


def test_return_routed_experts_needs_a_moe_model(http):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "return_routed_experts": True}
    _assert_error(http.post("/v1/completions", json=body), 400, "return_routed_experts")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "return_routed_experts": True}
    _assert_error(http.post("/v1/chat/completions", json=body), 400, "return_routed_experts")


# ---------------------------------------------------------------------------- other routes


def test_tokenize_detokenize_round_trip(http):
    text = "Reinforcement learning, café 🙂"
    tokens = http.post("/tokenize", json={"prompt": text}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 256
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": text}
    _assert_error(http.post("/detokenize", json={"tokens": [10**9]}), 400, "tokens")


def test_health_version_metrics(server, client, http):
    def counters() -> dict[str, float]:
        response = httpx.get(server.url + "/metrics")  # no API key needed
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
        values = {}
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                if family.type == "counter" and sample.name.endswith("_total"):
                    values[sample.name] = values.get(sample.name, 0.0) + sample.value
        return values

    assert httpx.get(server.url + "/health").status_code == 200
    assert http.get("/version").json()["version"]
    before = counters()
    _complete(client, prompt="Count me", max_tokens=4, extra_body={"ignore_eos": True})
    after = counters()
    moved = {name for name in after if after[name] > before.get(name, 0.0)}
    assert any("request" in name for name in moved), moved
    assert any("token" in name for name in moved), moved


# ---------------------------------------------------------------------------- errors


BAD_COMPLETIONS = [
    ({"prompt": "x", "foo": 1}, 400, "foo"),  # unknown field
    ({"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),  # wrong type
    ({"prompt": "x", "stream": 1}, 400, "stream"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),  # out of range
    ({"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ({"prompt": "x", "logprobs": 100}, 400, "logprobs"),
    ({"prompt": "x", "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens"),
    ({"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ({"prompt": "x", "logit_bias": {"abc": 1.0}}, 400, "logit_bias"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),  # 0 only with echo (tests/server/test_echo.py)
    ({"prompt": "x", "max_tokens": 257}, 400, "max_tokens"),  # more than max_model_len
    ({"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": [3] * 300}, 400, "prompt"),  # over max_model_len
    ({"prompt": "word " * 400}, 400, "prompt"),
    ({"prompt": [10**7]}, 400, "prompt_token_ids"),  # outside the vocabulary
    ({"prompt": "x", "temperature": -1, "stream": True}, 400, "temperature"),  # a status, not a broken stream
    ({"prompt": "x", "model": "no-such-model"}, 404, "model"),
]


@pytest.mark.parametrize("body,status,param", BAD_COMPLETIONS, ids=[p for _, _, p in BAD_COMPLETIONS])
def test_bad_completion_requests(http, client, body, status, param):
    _assert_error(http.post("/v1/completions", json=body), status, param)


BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi", "extra": 1}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream": True, "top_k": -5}, "top_k"),
]


@pytest.mark.parametrize("body,param", BAD_CHATS, ids=[p for _, p in BAD_CHATS])
def test_bad_chat_requests(http, body, param):
    _assert_error(http.post("/v1/chat/completions", json=body), 400, param)


@pytest.mark.parametrize("content", [b'{"prompt": "x"', b"[1, 2]", b"", b"null"])
def test_malformed_json(http, content):
    _assert_error(http.post("/v1/completions", content=content, headers={"content-type": "application/json"}), 400)


def test_openai_client_raises_typed_errors_and_server_keeps_serving(client):
    # The SDK picks its class by status and reads type, param and code from our error body (vLLM's values).
    with pytest.raises(openai.BadRequestError) as bad:
        _complete(client, prompt="x", temperature=-1.0)
    assert (bad.value.type, bad.value.param, bad.value.status_code) == ("Bad Request", "body.temperature", 400)
    assert "temperature" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        _complete(client, prompt="x", max_tokens=257)
    assert (bad.value.type, bad.value.param) == ("BadRequestError", "max_tokens")
    with pytest.raises(openai.NotFoundError) as missing:
        _complete(client, prompt="x", model="gpt-4")
    assert (missing.value.type, missing.value.param, missing.value.status_code) == ("NotFoundError", "model", 404)
    assert _complete(client, prompt="still serving", max_tokens=2).choices[0].text is not None


def test_api_key_required(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/tokenize")):
            response = httpx.request(method, server.url + path, headers=headers, json={"prompt": "x"})
            _assert_error(response, 401)
    bad_client = openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_client.models.list()
    assert httpx.get(server.url + "/health").status_code == 200
