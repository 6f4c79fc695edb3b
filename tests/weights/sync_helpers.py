"""Shared pieces of the weight-sync backend tests: a trainer-side HF model with changed weights and HTTP checks of the engine."""

from __future__ import annotations

import httpx
import torch

from weight_transfer.checksums import hf_state_checksums
from weight_helpers import MAX_TOKENS, PROMPTS, hf_greedy, hf_model

__all__ = ["PROMPTS", "MAX_TOKENS", "trainer_model", "http_greedy", "assert_engine_serves", "hf_greedy"]


def trainer_model(path: str, seed: int = 1234, scale: float = 0.05) -> torch.nn.Module:
    """The HF model of checkpoint `path` with every parameter changed (deterministically by seed)."""
    model = hf_model(path)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)
    return model


def http_greedy(url: str, prompts=PROMPTS, max_tokens: int = MAX_TOKENS, api_key: str | None = None) -> list[list[int]]:
    """Greedy token ids from a `rollout launch` server's /v1/completions (prompts as token ids)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    outs = []
    with httpx.Client(base_url=url, headers=headers, timeout=120) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        for prompt in prompts:
            r = http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                    "temperature": 0.0, "ignore_eos": True, "return_token_ids": True})
            assert r.status_code == 200, r.text
            outs.append(r.json()["choices"][0]["token_ids"])
    return outs


def assert_engine_serves(url: str, model: torch.nn.Module, weight_version: str | None = None) -> None:
    """The server's greedy outputs equal HF's on `model`, its checksums equal the model's, and (if given) its version."""
    assert http_greedy(url) == hf_greedy(model)
    with httpx.Client(base_url=url, timeout=120) as http:
        report = http.post("/weight_checker", json={"baseline": hf_state_checksums(model.state_dict())}).json()
        assert report["match"], {k: report[k] for k in ("mismatches", "missing", "unexpected")}
        if weight_version is not None:
            assert report["weight_version"] == weight_version
