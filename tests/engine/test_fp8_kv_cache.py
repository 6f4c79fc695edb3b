"""kv_cache_dtype="fp8": an e4m3 KV cache of half the bytes (twice the blocks), close to the model-dtype cache's logprobs."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import CacheConfig


def _engine(path, kv_cache_dtype):
    return LLM(path, dtype="float32", device="cpu", max_model_len=256, kv_cache_memory_bytes=4 << 20,
               kv_cache_dtype=kv_cache_dtype)


def test_fp8_cache_has_twice_the_blocks_and_close_logprobs(tiny_checkpoint):
    path = tiny_checkpoint("qwen3")
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 90 + 5 for j in range(40 + 9 * i)]} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    results = {}
    for dtype in ("auto", "fp8"):
        with _engine(path, dtype) as llm:
            results[dtype] = (llm.engine_core.num_blocks, llm.generate(prompts, params, use_tqdm=False))
            if dtype == "fp8":
                caches = [m.kv_cache for m in llm.engine_core.executor.worker.attn_layers]
                assert caches and all(c.dtype == torch.float8_e4m3fn for c in caches)
                assert all(bool(torch.isfinite(c.float()).all()) for c in caches)
    (auto_blocks, auto_out), (fp8_blocks, fp8_out) = results["auto"], results["fp8"]
    assert fp8_blocks == 4 * auto_blocks  # float32 model: 4 bytes per element against 1
    diffs, sizes = [], []
    for a, f in zip(auto_out, fp8_out, strict=True):
        # The prompt's logprobs are teacher-forced: the same tokens, so only the cache's rounding differs.
        for pa, pf in zip(a.prompt_logprobs[1:], f.prompt_logprobs[1:], strict=True):
            (tok, la), = [(t, lp.logprob) for t, lp in pa.items()][:1]
            diffs.append(abs(la - pf[tok].logprob))
            sizes.append(abs(la))
        assert len(f.outputs[0].token_ids) == 12
    diffs, sizes = torch.tensor(diffs), torch.tensor(sizes)
    assert float(diffs.max()) > 0  # the cache really is fp8
    # e4m3 rounds K and V by up to 1/16 (relative): logprobs move by a few percent of their size, never more.
    assert float(diffs.mean()) < 0.03 * float(sizes.mean()), (float(diffs.mean()), float(sizes.mean()))


def test_unknown_kv_cache_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .*'fp8'.*got 'int4'"):
        CacheConfig(kv_cache_dtype="int4")
