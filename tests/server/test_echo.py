"""/v1/completions echo against a real `rollout launch` (float32, tiny llama): the prompt's tokens with their
logprobs (the first null) then the completion, exactly as lm-evaluation-harness's local-completions asks for
them, equal to HF's forward; max_tokens 0 for the prompt alone; and vLLM's output-length rules."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from hf_reference import hf_token_logprobs

pytestmark = pytest.mark.slow

MODEL = "tiny"
MAX_MODEL_LEN = 256  # tests/server_launch.py's


@pytest.fixture(scope="module")
def model_path(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def server(launch_server, model_path):
    return launch_server(model_path, "--served-model-name", MODEL)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def _ids(http, text: str) -> list[int]:
    return http.post("/tokenize", json={"prompt": text}).json()["tokens"]


def _lm_eval_body(ids: list[int]) -> dict:
    # lm_eval/models/openai_completions.py LocalCompletionsAPI._create_payload(generate=False), batch of one.
    return {"model": MODEL, "prompt": [ids], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}


def test_lm_eval_loglikelihood_request_equals_hf(http, model_path):
    ids = _ids(http, "The quick brown fox jumps over the lazy dog")
    r = http.post("/v1/completions", json=_lm_eval_body(ids))
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    lp = choice["logprobs"]
    n = len(ids) + 1  # the prompt, then the one generated token
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    hf_chosen, hf_best = hf_token_logprobs(model_path, ids)
    got = lp["token_logprobs"][1:len(ids)]
    assert max(abs(a - b) for a, b in zip(got, hf_chosen)) < 1e-4
    # Each prompt position's top logprobs hold the token itself and the most likely one.
    for top, token, chosen, best in zip(lp["top_logprobs"][1:len(ids)], lp["tokens"][1:], hf_chosen, hf_best):
        assert 1 <= len(top) <= 2 and abs(top[token] - chosen) < 1e-4 and abs(max(top.values()) - best) < 1e-4
    # The text is the prompt then the completion; offsets follow the token texts.
    prompt_text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert choice["text"].startswith(prompt_text) and len(choice["text"]) > len(prompt_text)
    assert lp["text_offset"][0] == 0
    assert all(b - a == len(t) for a, b, t in zip(lp["text_offset"], lp["text_offset"][1:], lp["tokens"]))
    # What lm-eval's parse_logprobs sums: the continuation after a context of ctxlen tokens, less the last.
    ctxlen = 4
    assert abs(sum(lp["token_logprobs"][ctxlen:-1]) - sum(hf_chosen[ctxlen - 1:])) < 1e-4
    assert r.json()["usage"]["prompt_tokens"] == len(ids)


def test_max_tokens_0_returns_the_prompt_alone(http, client, model_path):
    ids = _ids(http, "She sells sea shells")
    body = {**_lm_eval_body(ids), "max_tokens": 0}
    (choice,) = http.post("/v1/completions", json=body).json()["choices"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
    assert choice["text"] == http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    hf_chosen, _ = hf_token_logprobs(model_path, ids)
    assert max(abs(a - b) for a, b in zip(lp["token_logprobs"][1:], hf_chosen)) < 1e-4
    # The openai SDK parses the same answer, null first entries included.
    out = client.completions.create(model=MODEL, prompt=ids, echo=True, max_tokens=0, logprobs=0)
    assert out.choices[0].logprobs.token_logprobs[0] is None and out.choices[0].text == choice["text"]
    assert len(out.choices[0].logprobs.tokens) == len(ids)
    # Without echo, 0 tokens is no request.
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_echo_of_text_without_logprobs_and_with_n(client):
    out = client.completions.create(model=MODEL, prompt="Once upon a time", echo=True, max_tokens=4, n=2,
                                    temperature=0.0, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    for c in out.choices:
        assert c.text.startswith("Once upon a time") and c.logprobs is None
    plain = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0.0,
                                      extra_body={"ignore_eos": True})
    assert out.choices[0].text == "Once upon a time" + plain.choices[0].text


def _stream(http, body: dict) -> list[dict]:
    chunks = []
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_streamed_echo_equals_plain(http):
    ids = _ids(http, "Numbers: one two three")
    body = {"model": MODEL, "prompt": ids, "echo": True, "logprobs": 2, "max_tokens": 5, "temperature": 0.0,
            "ignore_eos": True}
    (plain,) = http.post("/v1/completions", json=body).json()["choices"]
    text, tokens, logprobs, offsets = "", [], [], []
    for chunk in _stream(http, body):
        for c in chunk["choices"]:
            text += c["text"]
            tokens += c["logprobs"]["tokens"]
            logprobs += c["logprobs"]["token_logprobs"]
            offsets += c["logprobs"]["text_offset"]
    assert text == plain["text"] and tokens == plain["logprobs"]["tokens"]
    assert offsets == plain["logprobs"]["text_offset"]
    assert logprobs[0] is None and plain["logprobs"]["token_logprobs"][0] is None
    assert max(abs(a - b) for a, b in zip(logprobs[1:], plain["logprobs"]["token_logprobs"][1:])) < 1e-4


def test_output_length_rules_are_vllm_033s(http):
    ids = _ids(http, "Counting")
    # More output than the context holds: a 400 naming the field, with vLLM's message.
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": MAX_MODEL_LEN + 1})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "max_tokens"
    assert error["message"] == (f"max_tokens={MAX_MODEL_LEN + 1} cannot be greater than max_model_len={MAX_MODEL_LEN}. "
                                f"Please request fewer output tokens. (parameter=max_tokens, value={MAX_MODEL_LEN + 1})")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**4}
    r = http.post("/v1/chat/completions", json=chat)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
    # A prompt that leaves fewer positions than max_tokens: the output stops at max_model_len, as vLLM
    # 0.33 clamps max_tokens to max_model_len - prompt length.
    prompt = [5] * (MAX_MODEL_LEN - 3)
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 10, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3 and r.json()["choices"][0]["finish_reason"] == "length"
    # A prompt that leaves no position for an output token: a 400 naming the prompt.
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": [5] * MAX_MODEL_LEN, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_return_tokens_as_token_ids(http):
    ids = _ids(http, "Once upon")
    body = {**_lm_eval_body(ids), "return_tokens_as_token_ids": True}
    (choice,) = http.post("/v1/completions", json=body).json()["choices"]
    lp = choice["logprobs"]
    assert lp["tokens"][:len(ids)] == [f"token_id:{t}" for t in ids]
    assert all(k.startswith("token_id:") for top in lp["top_logprobs"][1:] for k in top)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True,
            "top_logprobs": 1, "return_tokens_as_token_ids": True, "return_token_ids": True}
    (c,) = http.post("/v1/chat/completions", json=chat).json()["choices"]
    assert [p["token"] for p in c["logprobs"]["content"]] == [f"token_id:{t}" for t in c["token_ids"]]


def test_streamed_prompt_token_ids_once_per_choice(http):
    ids = _ids(http, "Hello")
    body = {"model": MODEL, "prompt": ids, "n": 2, "max_tokens": 3, "return_token_ids": True, "ignore_eos": True}
    seen: dict[int, int] = {}
    for chunk in _stream(http, body):
        for c in chunk["choices"]:
            if c["prompt_token_ids"] is not None:
                assert c["prompt_token_ids"] == ids
                seen[c["index"]] = seen.get(c["index"], 0) + 1
    assert seen == {0: 1, 1: 1}
