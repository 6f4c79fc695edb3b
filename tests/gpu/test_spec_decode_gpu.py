"""Speculative decoding on the GPU in bf16: greedy tokens equal plain decoding's, verify steps replay CUDA graphs."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def make_llm(path, speculative_config=None, **kw):
    return LLM(path, device="cuda", max_model_len=512, kv_cache_memory_bytes=1 << 28, max_num_seqs=16,
               speculative_config=speculative_config, **kw)


def prompts(vocab: int, repetitive: bool):
    rng = random.Random(1)
    out = []
    for i in range(12):
        if repetitive and i % 2 == 0:  # a phrase repeated: n-gram lookups find it
            out.append({"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(7)] * 5})
        else:
            out.append({"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randint(4, 60))]})
    return out


def spec_config(method, path, arch, tiny_checkpoint):
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    draft = path if method == "draft_same" else tiny_checkpoint("qwen3" if arch == "llama" else "llama")
    return {"method": "draft_model", "num_speculative_tokens": 3, "model": draft}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("method", ["ngram", "draft_same", "draft_other"])
def test_greedy_tokens_equal_plain_decoding_in_float32(tiny_checkpoint, arch, method):
    """The GPU path (Triton attention over verify rows, verify-step graphs, the draft's graphs) is exact:
    in float32, where no near-tie flips, every token equals plain decoding's."""
    path = tiny_checkpoint(arch)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    plain = make_llm(path, dtype="float32")
    work = prompts(plain.engine_core.vocab_size, repetitive=method == "ngram")
    expected = [list(o.outputs[0].token_ids) for o in plain.generate(work, params, use_tqdm=False)]
    plain.engine_core.shutdown()
    spec = make_llm(path, spec_config(method, path, arch, tiny_checkpoint), dtype="float32")
    got = [list(o.outputs[0].token_ids) for o in spec.generate(work, params, use_tqdm=False)]
    assert got == expected
    worker = spec.engine_core.executor.worker
    graphs = worker.model_runner.cuda_graphs
    assert graphs is not None and graphs.num_verify_replays > 0  # verify steps ran as graph replays
    totals = spec.engine_core.scheduler.spec_totals
    assert totals.num_drafts > 0
    if method == "draft_same":
        assert totals.num_accepted_tokens == totals.num_draft_tokens  # its own argmax
    if method != "ngram":
        assert worker.draft_proposer.cuda_graphs.num_replays > 0
    spec.engine_core.shutdown()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("method", ["ngram", "draft_same", "draft_other"])
def test_bf16_greedy_tokens_equal_plain_decoding_up_to_near_ties(tiny_checkpoint, arch, method):
    """In bf16 a verify step computes a row's logits in other kernels than a one-token decode step (other
    GEMM shapes, the multi-token attention tile), so a near-tie may flip. Each request's tokens equal plain
    decoding's, or its first difference is between two tokens plain decoding scored within 0.125 (bf16
    logprob steps at these magnitudes are 1/64 to 1/32)."""
    path = tiny_checkpoint(arch)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=5)
    plain = make_llm(path)
    work = prompts(plain.engine_core.vocab_size, repetitive=method == "ngram")
    plain_out = [o.outputs[0] for o in plain.generate(work, params, use_tqdm=False)]
    # Plain decoding itself is not batch-invariant in bf16: each request alone (batch 1, other kernels).
    alone = [list(plain.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids) for p in work]
    plain.engine_core.shutdown()
    spec = make_llm(path, spec_config(method, path, arch, tiny_checkpoint))
    got = [list(o.outputs[0].token_ids) for o in spec.generate(work, params, use_tqdm=False)]
    same_spec = sum(near_tie_or_equal(out, tokens) for out, tokens in zip(plain_out, got))
    same_alone = sum(near_tie_or_equal(out, tokens) for out, tokens in zip(plain_out, alone))
    print(f"{arch} {method}: requests identical to plain batched decoding: speculative {same_spec}/{len(got)}, "
          f"plain one at a time {same_alone}/{len(got)}")
    assert same_spec >= len(got) // 2
    assert spec.engine_core.executor.worker.model_runner.cuda_graphs.num_verify_replays > 0
    spec.engine_core.shutdown()


def near_tie_or_equal(out, tokens) -> bool:
    """True if tokens equal out's; otherwise asserts their first difference is a near-tie in out's scores."""
    expected = list(out.token_ids)
    if tokens == expected:
        return True
    i = next(j for j, (a, b) in enumerate(zip(tokens, expected)) if a != b)
    scores = out.logprobs[i]  # the reference's top logprobs at the first difference
    assert tokens[i] in scores, (i, tokens[i], expected[i], scores)
    gap = scores[expected[i]].logprob - scores[tokens[i]].logprob
    assert 0 <= gap <= 0.125, (i, gap)
    return False


def test_draft_attention_backend_is_chosen_separately(tiny_checkpoint):
    """The draft on the torch reference attention (eager), the model on Triton; float32, so tokens compare exactly."""
    path = tiny_checkpoint("llama")
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain = make_llm(path, dtype="float32")
    work = prompts(plain.engine_core.vocab_size, repetitive=False)
    expected = [list(o.outputs[0].token_ids) for o in plain.generate(work, params, use_tqdm=False)]
    plain.engine_core.shutdown()
    spec = make_llm(path, {"method": "draft_model", "num_speculative_tokens": 2, "model": path,
                           "attention_backend": "torch_ref"}, dtype="float32")
    got = [list(o.outputs[0].token_ids) for o in spec.generate(work, params, use_tqdm=False)]
    assert got == expected
    assert spec.engine_core.executor.worker.draft_proposer.cuda_graphs is None  # torch_ref cannot replay: eager
    totals = spec.engine_core.scheduler.spec_totals
    assert totals.num_accepted_tokens == totals.num_draft_tokens > 0  # the same model, another attention kernel
    spec.engine_core.shutdown()


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed_addresses", "allocator"])
def test_sleep_and_wake_up_keep_or_recapture_the_draft_graphs(tiny_checkpoint, fixed):
    """Sleep frees the KV caches both models' graphs read (the draft's layers are in the same KV region).
    At fixed addresses both models' graphs stay valid and are kept; without, wake-up captures the draft's again."""
    path = tiny_checkpoint("llama")
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    spec = make_llm(path, {"method": "draft_model", "num_speculative_tokens": 3, "model": path}, dtype="float32",
                    sleep_fixed_addresses=fixed)
    work = prompts(spec.engine_core.vocab_size, repetitive=False)
    before = [list(o.outputs[0].token_ids) for o in spec.generate(work, params, use_tqdm=False)]
    core = spec.engine_core
    draft = core.executor.worker.draft_proposer
    old_graphs = draft.cuda_graphs
    assert old_graphs is not None
    core.sleep(1)
    if fixed:
        assert draft.cuda_graphs is old_graphs
    else:
        assert draft.cuda_graphs is None
    core.wake_up()
    if fixed:
        assert draft.cuda_graphs is old_graphs
    else:
        assert draft.cuda_graphs is not None and draft.cuda_graphs is not old_graphs
    replays = draft.cuda_graphs.num_replays
    after = [list(o.outputs[0].token_ids) for o in spec.generate(work, params, use_tqdm=False)]
    assert after == before
    assert draft.cuda_graphs.num_replays > replays  # the draft's graphs served after wake-up
    totals = core.scheduler.spec_totals
    assert totals.num_accepted_tokens == totals.num_draft_tokens
    core.shutdown()
