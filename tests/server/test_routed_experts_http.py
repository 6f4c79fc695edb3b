"""Routed experts over HTTP as vLLM answers them: `rollout launch` on a tiny Qwen3-MoE, /v1/completions and
/v1/chat/completions, plain and streamed, a base64 .npy [position, layer, k] array equal to HF's router top-k;
asked per request (return_routed_experts) or for every request (--enable-return-routed-experts), with
routed_experts_prompt_start leaving out the first prompt rows."""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest

from hf_reference import hf_router_top_k

pytestmark = pytest.mark.slow

MODEL = "tiny-moe"


@pytest.fixture(scope="module")
def moe_path(tiny_checkpoint):
    return tiny_checkpoint("qwen3_moe")


@pytest.fixture(scope="module")
def http(launch_server, moe_path):
    server = launch_server(moe_path, "--served-model-name", MODEL, "--max-num-batched-tokens", "4")
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _decode(b64: str) -> np.ndarray:
    # vLLM's documented decode: np.load(io.BytesIO(base64.b64decode(s)))
    return np.load(io.BytesIO(base64.b64decode(b64)), allow_pickle=False)


def _hf(path: str, seq: list[int]) -> list[list[list[int]]]:
    return hf_router_top_k(path, [seq])[0]


def _body(**extra):
    return {"model": MODEL, "max_tokens": 5, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True, **extra}


def _stream_choices(http, path: str, body: dict) -> list[dict]:
    choices = []
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices += json.loads(line[6:])["choices"]
    return choices


def test_completions_plain_and_streamed(http, moe_path):
    prompt = [5, 17, 99, 230, 41, 300, 12]
    out = http.post("/v1/completions", json=_body(prompt=prompt, return_routed_experts=True))
    assert out.status_code == 200, out.text
    (choice,) = out.json()["choices"]
    routed = _decode(choice["routed_experts"])
    assert routed.dtype == np.uint8  # vLLM's dtype for up to 256 experts
    assert routed.tolist() == _hf(moe_path, prompt + choice["token_ids"][:-1])

    plain = http.post("/v1/completions", json=_body(prompt=prompt)).json()["choices"][0]
    assert plain["routed_experts"] is None and plain["token_ids"] == choice["token_ids"]

    # Streamed: the whole array once, in the choice's last chunk.
    chunks = _stream_choices(http, "/v1/completions", _body(prompt=prompt, return_routed_experts=True))
    assert all(c["routed_experts"] is None for c in chunks[:-1]) and chunks[-1]["finish_reason"] == "length"
    assert _decode(chunks[-1]["routed_experts"]).tolist() == routed.tolist()

    # routed_experts_prompt_start: the first prompt rows left out; past the prompt's end: a 400 naming it.
    start = 3
    skipped = http.post("/v1/completions", json=_body(prompt=prompt, return_routed_experts=True,
                                                      routed_experts_prompt_start=start)).json()["choices"][0]
    assert _decode(skipped["routed_experts"]).tolist() == routed.tolist()[start:]
    r = http.post("/v1/completions", json=_body(prompt=prompt, return_routed_experts=True,
                                                routed_experts_prompt_start=len(prompt) + 1))
    assert r.status_code == 400 and r.json()["error"]["param"] == "routed_experts_prompt_start", r.text


def test_chat_completions(http, moe_path):
    body = _body(messages=[{"role": "user", "content": "hello there"}], return_routed_experts=True)
    out = http.post("/v1/chat/completions", json=body).json()
    (choice,) = out["choices"]
    expected = _hf(moe_path, out["prompt_token_ids"] + choice["token_ids"][:-1])
    assert _decode(choice["routed_experts"]).tolist() == expected
    chunks = _stream_choices(http, "/v1/chat/completions", body)
    assert _decode(chunks[-1]["routed_experts"]).tolist() == expected


def test_enable_return_routed_experts_answers_every_request(launch_server, moe_path, tiny_checkpoint):
    server = launch_server(moe_path, "--served-model-name", MODEL, "--enable-return-routed-experts")
    prompt = [8, 9, 10, 11]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        (choice,) = http.post("/v1/completions", json=_body(prompt=prompt)).json()["choices"]
    assert _decode(choice["routed_experts"]).tolist() == _hf(moe_path, prompt + choice["token_ids"][:-1])
