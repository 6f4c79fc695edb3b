"""POST /inference/v1/generate (token in, token out, vLLM 0.33's bodies) against a real `rollout launch`:
greedy tokens equal HF's, logprobs by token id, weight-version spans, text mode, a stream that adds up to
the plain answer, and bad input refused naming the field."""

from __future__ import annotations

import json

import httpx
import pytest

from hf_reference import hf_greedy

pytestmark = pytest.mark.slow

MODEL = "tiny"
PROMPT = [5, 17, 99, 230, 41, 300, 12]


@pytest.fixture(scope="module")
def model_path(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def http(launch_server, model_path):
    server = launch_server(model_path, "--served-model-name", MODEL)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


GREEDY = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True, "logprobs": 2}


def _generate(http, **body) -> dict:
    r = http.post("/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": GREEDY, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_tokens_out_equal_hf_with_logprobs_by_token_id(http, model_path):
    answer = _generate(http, request_id="my-req-1", return_token_ids=True)
    assert answer["request_id"] == "my-req-1" and answer["output_mode"] == "tokens" and answer["model"] == MODEL
    assert answer["prompt_token_ids"] == PROMPT
    (choice,) = answer["choices"]
    assert "text" not in choice and choice["finish_reason"] == "length"
    assert choice["token_ids"] == hf_greedy(model_path, PROMPT, 6)
    assert choice["weight_versions"] == [{"version": "default", "start": 0, "end": 6}]
    content = choice["logprobs"]["content"]
    assert [p["token_id"] for p in content] == choice["token_ids"]
    for p in content:
        assert p["rank"] == 1 and p["top_logprobs"][0]["token_id"] == p["token_id"]  # greedy: the likeliest
        assert len(p["top_logprobs"]) == 2 and p["logprob"] == p["top_logprobs"][0]["logprob"] <= 0.0
    assert answer["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 6, "total_tokens": len(PROMPT) + 6,
                               "prompt_tokens_details": None, "completion_tokens_details": None}
    # The same tokens as /v1/completions gives.
    plain = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "return_token_ids": True,
                                               **{k: v for k, v in GREEDY.items() if k != "logprobs"}}).json()
    assert plain["choices"][0]["token_ids"] == choice["token_ids"]


def test_text_mode_and_unset_max_tokens(http):
    answer = _generate(http, output_mode="text")
    (choice,) = answer["choices"]
    text = http.post("/detokenize", json={"tokens": choice["token_ids"]}).json()["prompt"]
    assert choice["text"] == text
    assert [p["token"] for p in choice["logprobs"]["content"]]  # chat-style logprobs with token texts
    # No max_tokens: up to max_model_len (256 in tests/server_launch.py).
    r = http.post("/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": {"ignore_eos": True}})
    assert len(r.json()["choices"][0]["token_ids"]) == 256 - len(PROMPT)


def test_stream_adds_up_to_the_plain_answer(http):
    plain = _generate(http)["choices"][0]
    chunks = []
    body = {"token_ids": PROMPT, "sampling_params": GREEDY, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    with http.stream("POST", "/inference/v1/generate", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    *token_chunks, usage = chunks
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    assert token_chunks[0]["prompt_token_ids"] == PROMPT and all("prompt_token_ids" not in c for c in token_chunks[1:])
    choices = [c["choices"][0] for c in token_chunks]
    assert [t for c in choices for t in c["token_ids"]] == plain["token_ids"]
    assert [p for c in choices for p in c["logprobs"]["content"]] == plain["logprobs"]["content"]
    assert all(c["weight_versions"] is None for c in choices[:-1])
    assert choices[-1]["weight_versions"] == plain["weight_versions"] and choices[-1]["finish_reason"] == "length"


BAD = [
    # A failed declared type names the field where it was sent, as vLLM's recorded answer does.
    ({"token_ids": []}, "body.token_ids"),
    ({"token_ids": [-1]}, "body.token_ids.0"),
    ({"sampling_params": {"top_p": 2.0}}, "sampling_params"),
    ({"sampling_params": {"no_such_field": 1}}, "sampling_params"),
    ({"sampling_params": {"structured_outputs": {"json": {}}}}, "sampling_params"),
    ({"sampling_params": {"logprobs": 1000}}, "sampling_params"),
    ({"output_mode": "derender"}, "output_mode"),
    ({"features": {"mm_hashes": {}}}, "features"),
    ({"token_ids": [10**7]}, "prompt_token_ids"),
    ({"model": "other"}, "model"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[p for _, p in BAD])
def test_bad_requests_name_the_field(http, body, param):
    r = http.post("/inference/v1/generate", json={"token_ids": PROMPT, **body})
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param, r.text
