"""Greedy tokens and prompt logprobs of our engine against HF transformers, with every scheduler feature on."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams

ARCHS = [
    ("llama", {}),
    ("qwen2", {}),
    ("qwen3", {}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
]
NUM_PROMPTS = 16
MAX_TOKENS = 24


def _prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """16 prompts of different lengths; most share a 40-token prefix (2.5 blocks of 16)."""
    rng = random.Random(seed)
    low = 3  # skip the special tokens
    shared = [rng.randrange(low, vocab_size) for _ in range(40)]
    prompts = []
    for i in range(NUM_PROMPTS):
        suffix = [rng.randrange(low, vocab_size) for _ in range(1 + 7 * i)]
        prompts.append((shared + suffix) if i % 4 else suffix + shared[:5])
    return prompts


def _hf_model(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.generation_config.eos_token_id = None  # run to max_new_tokens, like ignore_eos
    return model.eval()


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch,overrides", ARCHS, ids=["llama", "qwen2", "qwen3", "llama3-rope"])
def test_greedy_matches_hf_with_chunking_prefix_hits_and_preemption(tiny_checkpoint, arch, overrides):
    path = tiny_checkpoint(arch, **overrides)
    hf = _hf_model(path)
    prompts = _prompts(hf.config.vocab_size)
    expected = [_hf_greedy(hf, p) for p in prompts]

    llm = LLM(
        path,
        dtype="float32",
        max_model_len=256,
        block_size=16,
        max_num_seqs=16,
        max_num_batched_tokens=48,  # forces chunked prefill of every longer prompt
        num_gpu_blocks_override=24,  # far fewer than 16 sequences need: preemption
        enable_prefix_caching=True,
        device="cpu",
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    for prompt, out, want in zip(prompts, outputs, expected):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == want
        assert out.outputs[0].finish_reason == "length"
    stats = llm.engine_core.scheduler.make_stats()
    assert stats.num_preemptions > 0, "the KV cache was meant to be small enough to preempt"
    assert llm.engine_core.scheduler.kv_cache_manager.total_prefix_cache_hits > 0


@pytest.mark.parametrize("arch,overrides", ARCHS[:3], ids=["llama", "qwen2", "qwen3"])
def test_prompt_logprobs_match_hf(tiny_checkpoint, arch, overrides):
    path = tiny_checkpoint(arch, **overrides)
    hf = _hf_model(path)
    prompts = _prompts(hf.config.vocab_size, seed=1)[:6]
    llm = LLM(path, dtype="float32", max_model_len=256, max_num_batched_tokens=32, device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)  # [P, V]
        assert out.prompt_logprobs[0] is None
        assert len(out.prompt_logprobs) == len(prompt)
        for pos in range(1, len(prompt)):
            entry = out.prompt_logprobs[pos]
            token = prompt[pos]
            assert abs(entry[token].logprob - ref[pos - 1, token].item()) < 1e-4
            top2 = torch.topk(ref[pos - 1], 2).indices.tolist()
            assert set(top2) <= set(entry)
            for rank, t in enumerate(top2, start=1):
                assert abs(entry[t].logprob - ref[pos - 1, t].item()) < 1e-4
