"""Batch-invariant mode on the GPU: a row's linear output and a request's tokens do not depend on the batch."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.kernels import batch_invariant

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n, k", [(4096, 1024), (1000, 72), (151936, 64)])
def test_fixed_tile_gemm_rows_do_not_depend_on_m(dtype, n, k):
    torch.manual_seed(0)
    x = torch.randn(131, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5
    b = torch.randn(n, device="cuda", dtype=dtype)
    full = batch_invariant.linear_invariant(x, w, b)
    ref = F.linear(x.float(), w.float(), b.float())
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert float((full.float() - ref).norm() / ref.norm()) < tol
    for rows in (slice(7, 8), slice(0, 5), slice(60, 131)):  # one row, a few, a tail across tiles
        assert torch.equal(batch_invariant.linear_invariant(x[rows], w, b), full[rows])


def make_llm(path, **kw):
    return LLM(path, device="cuda", max_model_len=512, kv_cache_memory_bytes=1 << 28, max_num_seqs=16,
               batch_invariant=True, **kw)


def prompts(vocab: int):
    rng = random.Random(2)
    out = []
    for i in range(12):
        if i % 2 == 0:  # a repeated phrase, so n-gram drafts get accepted
            out.append({"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(7)] * 5})
        else:
            out.append({"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randint(4, 60))]})
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bf16_tokens_are_the_same_alone_batched_and_with_each_speculator(tiny_checkpoint, arch):
    """The bf16 greedy check speculative decoding asks for, made exact: with batch-invariant numerics a
    request's tokens are the same alone, in a batch, and with n-gram or draft-model speculation."""
    path = tiny_checkpoint(arch)
    other = tiny_checkpoint("qwen3" if arch == "llama" else "llama")
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    plain = make_llm(path)
    work = prompts(plain.engine_core.vocab_size)
    batched = [list(o.outputs[0].token_ids) for o in plain.generate(work, params, use_tqdm=False)]
    alone = [list(plain.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids) for p in work]
    assert alone == batched
    assert plain.engine_core.executor.worker.model_runner.cuda_graphs.num_replays > 0
    plain.engine_core.shutdown()
    configs = {
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
        "draft_same": {"method": "draft_model", "num_speculative_tokens": 3, "model": path},
        "draft_other": {"method": "draft_model", "num_speculative_tokens": 3, "model": other},
    }
    for name, config in configs.items():
        spec = make_llm(path, speculative_config=config)
        got = [list(o.outputs[0].token_ids) for o in spec.generate(work, params, use_tqdm=False)]
        assert got == batched, name
        totals = spec.engine_core.scheduler.spec_totals
        assert totals.num_drafts > 0, name
        if name == "draft_same":  # the draft's one-token passes now compute the verify step's numbers
            assert totals.num_accepted_tokens == totals.num_draft_tokens, name
        assert spec.engine_core.executor.worker.model_runner.cuda_graphs.num_verify_replays > 0, name
        spec.engine_core.shutdown()
