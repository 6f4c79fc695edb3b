"""Speculative decoding emits exactly the tokens decoding without it emits: greedy, seeded sampling, logprobs."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.engine.test_async_scheduling import PROBE_PARAMS, flatten, workload_with_stops


def make_llm(path, speculative_config=None, **kw):
    kw = {"max_model_len": 256, "max_num_seqs": 6, **kw}
    return LLM(path, dtype="float32", device="cpu", speculative_config=speculative_config, **kw)


def assert_same_outputs(got, expected):
    """Tokens, finish and stop reasons exactly; logprobs to 1e-3 (the steps' shapes differ, so float32 sums do)."""
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        if e[1] == "prompt":
            assert g[:2] == e[:2] and _close(g[2], e[2]), (g, e)
            continue
        assert g[:5] == e[:5], (g[:5], e[:5])
        assert _close(g[5], e[5]), (g, e)


def _close(a, b):
    if a is None or b is None:
        return a is b
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return abs(a - b) <= 1e-3
    return a == b


def ngram(k=3):
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.mark.parametrize("num_blocks, with_history", [(None, False), (10, False), (None, True)])
@pytest.mark.parametrize("method", ["ngram", "draft_same", "draft_other"])
def test_speculative_outputs_equal_plain_outputs(tiny_checkpoint, method, num_blocks, with_history):
    """The async-scheduling workload (greedy, seeded top-k/top-p and min_tokens, logprobs, prompt
    logprobs, stop tokens, n=2, penalties) with each speculator; 10 blocks force preemptions."""
    path = tiny_checkpoint("llama")
    kw = {"num_gpu_blocks_override": num_blocks, "max_model_len": 128} if num_blocks else {}
    plain = make_llm(path, **kw)
    probe, greedy, prompts, params = workload_with_stops(plain, with_history)
    expected = flatten(plain.generate(prompts, params, use_tqdm=False))
    plain.engine_core.shutdown()

    if method == "ngram":
        config = ngram()
    else:  # the model itself as its draft (all greedy drafts right), or another architecture of the same vocabulary
        config = {"method": "draft_model", "num_speculative_tokens": 3,
                  "model": path if method == "draft_same" else tiny_checkpoint("qwen3")}
    spec = make_llm(path, config, **kw)
    spec_greedy = spec.generate(probe, PROBE_PARAMS, use_tqdm=False)
    assert_same_outputs(flatten(spec_greedy), flatten(greedy))
    got = flatten(spec.generate(prompts, params, use_tqdm=False))
    assert_same_outputs(got, expected)
    totals = spec.engine_core.scheduler.spec_totals
    assert totals.num_drafts > 0  # it really speculated
    if method == "draft_same":  # (random prompts and an unrelated random draft give little to accept)
        assert totals.num_accepted_tokens > 0
    assert sum(totals.num_accepted_tokens_per_pos) == totals.num_accepted_tokens
    core = spec.engine_core
    assert core.async_scheduling is False
    assert not core.has_unfinished_requests()
    core.shutdown()


def test_ngram_accepts_drafts_on_repetitive_text_and_changes_nothing(tiny_checkpoint):
    """Prompts that repeat a phrase: lookups find continuations, many are accepted, outputs stay the same."""
    path = tiny_checkpoint("llama")
    phrase = [[11, 12, 13, 14, 15, 16, 17], [40, 41, 42, 43], [7, 8, 9, 10, 11]]
    prompts = [{"prompt_token_ids": p * 6} for p in phrase]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=3, max_tokens=40, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, top_k=3)]
    plain = make_llm(path)
    expected = flatten(plain.generate(prompts, params, use_tqdm=False))
    plain.engine_core.shutdown()
    spec = make_llm(path, ngram(k=4))
    assert_same_outputs(flatten(spec.generate(prompts, params, use_tqdm=False)), expected)
    totals = spec.engine_core.scheduler.spec_totals
    assert totals.num_drafts > 0 and totals.num_accepted_tokens > 0
    assert totals.num_accepted_tokens_per_pos[0] >= totals.num_accepted_tokens_per_pos[-1]
    spec.engine_core.shutdown()


def test_the_model_as_its_own_draft_has_every_greedy_draft_accepted(tiny_checkpoint):
    """The draft's KV mirrors the model's at every known position, through chunked prefill and
    rejected-free steps: with the model as its draft, greedy drafts are all right."""
    import random

    path = tiny_checkpoint("llama")
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 400) for _ in range(rng.randint(3, 90))]} for _ in range(8)]
    spec = make_llm(path, {"method": "draft_model", "num_speculative_tokens": 3, "model": path},
                    max_num_batched_tokens=64)  # long prompts arrive in chunks
    spec.generate(prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    totals = spec.engine_core.scheduler.spec_totals
    assert totals.num_draft_tokens > 0
    assert totals.num_accepted_tokens == totals.num_draft_tokens
    spec.engine_core.shutdown()


@pytest.mark.parametrize("method", ["ngram", "draft_same"])
def test_prefix_cache_hits_are_unaffected(tiny_checkpoint, method):
    """Requests sharing a 48-token prefix hit the prefix cache (the draft model's KV sits in the same
    blocks, so a hit serves both) and still emit plain decoding's tokens."""
    path = tiny_checkpoint("llama")
    shared = [(7 * i) % 300 + 3 for i in range(48)]
    prompts = [{"prompt_token_ids": shared + [100 + i, 200 + i]} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = make_llm(path)
    expected = [list(o.outputs[0].token_ids) for o in plain.generate(prompts, params, use_tqdm=False)]
    plain.engine_core.shutdown()
    config = ngram() if method == "ngram" else {"method": "draft_model", "num_speculative_tokens": 3, "model": path}
    spec = make_llm(path, config, max_num_seqs=1)  # one at a time: each later request finds the blocks cached
    got = [list(o.outputs[0].token_ids) for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    kv = spec.engine_core.scheduler.kv_cache_manager
    assert kv.total_prefix_cache_hits >= 3 * 48
    if method == "draft_same":  # the draft's KV in the hit blocks is right too: every greedy draft accepted
        totals = spec.engine_core.scheduler.spec_totals
        assert totals.num_accepted_tokens == totals.num_draft_tokens > 0
    spec.engine_core.shutdown()


def test_sleep_and_wake_up_keep_the_draft_model_working(tiny_checkpoint):
    """Sleep frees both models' KV caches (the draft's layers are the worker's attn_layers too); after
    wake-up the model as its own draft still has every greedy draft accepted."""
    path = tiny_checkpoint("llama")
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + i, 9, 13 + i, 2]} for i in range(3)]
    spec = make_llm(path, {"method": "draft_model", "num_speculative_tokens": 3, "model": path})
    core = spec.engine_core
    before = [list(o.outputs[0].token_ids) for o in spec.generate(prompts, params, use_tqdm=False)]
    worker = core.executor.worker
    num_layers = len(worker.attn_layers)
    assert num_layers == 2 * len([m for m in worker.model.modules() if m.__class__.__name__ == "Attention"])
    core.sleep(1)
    assert all(layer.kv_cache is None or layer.kv_cache.numel() == 0 for layer in worker.attn_layers)
    core.wake_up()
    after = [list(o.outputs[0].token_ids) for o in spec.generate(prompts, params, use_tqdm=False)]
    assert after == before
    totals = core.scheduler.spec_totals
    assert totals.num_accepted_tokens == totals.num_draft_tokens > 0
    core.shutdown()
