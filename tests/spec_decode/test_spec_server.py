"""A real `rollout launch --speculative-config` server: greedy output equals offline output, /metrics counts drafts."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import LLM, SamplingParams
from engine.tiny_models import builtin_model_dir

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# Repeated phrases, so the n-gram lookups find continuations (and the model's greedy tokens often repeat them).
PROMPTS = ["the cat sat on the mat. the cat sat on the mat. the cat sat on the",
           "one two three four one two three four one two three",
           "Once upon a time"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server(launch_server):
    return launch_server(MODEL, "--speculative-config", json.dumps(NGRAM))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def expected():
    """Each prompt's greedy token ids and text from the offline engine without speculation."""
    llm = LLM(builtin_model_dir(MODEL), dtype="float32", device="cpu", max_model_len=256)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    llm.shutdown()
    return [(list(o.outputs[0].token_ids), o.outputs[0].text) for o in outs]


def _spec_counters(server) -> dict[str, float]:
    response = httpx.get(server.url + "/metrics", timeout=30)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if "spec_decode" in sample.name:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def test_greedy_completions_equal_offline_ones_and_metrics_count_drafts(server, client, expected):
    before = _spec_counters(server)
    out = client.completions.create(model=MODEL, prompt=PROMPTS, temperature=0.0, max_tokens=MAX_TOKENS,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    choices = sorted(out.choices, key=lambda c: c.index)
    assert [(c.model_extra["token_ids"], c.text) for c in choices] == expected
    assert all(c.finish_reason == "length" for c in choices)
    assert out.usage.completion_tokens == MAX_TOKENS * len(PROMPTS)

    after = _spec_counters(server)
    moved = {name: after[name] - before.get(name, 0.0) for name in after}
    drafts = sum(v for name, v in moved.items() if "num_draft_tokens" in name)
    accepted = sum(v for name, v in moved.items() if "num_accepted_tokens" in name and "per_pos" not in name)
    assert drafts > 0 and accepted > 0, after


def test_streamed_greedy_tokens_equal_offline_ones(client, expected):
    """A verifying step can emit several tokens at once; the stream still carries each exactly once, in order."""
    for prompt, (token_ids, text) in zip(PROMPTS, expected):
        stream = client.completions.create(model=MODEL, prompt=prompt, temperature=0.0, max_tokens=MAX_TOKENS,
                                           stream=True, logprobs=1,
                                           extra_body={"ignore_eos": True, "return_token_ids": True})
        got_ids, got_text, num_logprobs = [], "", 0
        for chunk in stream:
            for c in chunk.choices:
                got_ids += c.model_extra.get("token_ids") or []
                got_text += c.text
                num_logprobs += len(c.logprobs.tokens) if c.logprobs else 0
        assert got_ids == token_ids and got_text == text
        assert num_logprobs == MAX_TOKENS
