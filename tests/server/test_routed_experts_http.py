"""return_routed_experts over HTTP: `rollout launch` on a tiny Qwen3-MoE, /v1/completions and /v1/chat/completions,
plain and streamed, against HF's router top-k."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

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


@torch.no_grad()
def _hf_top_k(path: str, seq: list[int]) -> list[list[list[int]]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    k = AutoConfig.from_pretrained(path).num_experts_per_tok
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    logits = hf(torch.tensor([seq]), output_router_logits=True).router_logits  # per MoE layer [T, E]
    return torch.stack([torch.topk(torch.softmax(l.float(), -1), k, -1).indices for l in logits], dim=1).tolist()


def _body(**extra):
    return {"model": MODEL, "max_tokens": 5, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True, **extra}


def test_completions_plain_and_streamed(http, moe_path):
    prompt = [5, 17, 99, 230, 41, 300, 12]
    out = http.post("/v1/completions", json=_body(prompt=prompt, return_routed_experts=True))
    assert out.status_code == 200, out.text
    (choice,) = out.json()["choices"]
    assert choice["routed_experts"] == _hf_top_k(moe_path, prompt + choice["token_ids"][:-1])

    plain = http.post("/v1/completions", json=_body(prompt=prompt)).json()["choices"][0]
    assert plain["routed_experts"] is None and plain["token_ids"] == choice["token_ids"]

    # Streamed: each chunk carries its new positions; together they are the whole routing.
    rows = []
    with http.stream("POST", "/v1/completions", json=_body(prompt=prompt, return_routed_experts=True, stream=True)) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    rows += c["routed_experts"] or []
    assert rows == choice["routed_experts"]


def test_chat_completions(http, moe_path):
    body = _body(messages=[{"role": "user", "content": "hello there"}], return_routed_experts=True)
    out = http.post("/v1/chat/completions", json=body).json()
    (choice,) = out["choices"]
    assert choice["routed_experts"] == _hf_top_k(moe_path, out["prompt_token_ids"] + choice["token_ids"][:-1])
