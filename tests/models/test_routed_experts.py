"""return_routed_experts end to end on a tiny Qwen3-MoE: the LLM's per-token routing equals HF's router top-k
over prompt + output[:-1], with chunked prefill, batching, preemption and requests that did not ask for it."""

from __future__ import annotations

import pytest
import torch

from hf_reference import hf_router_top_k

from engine import LLM, SamplingParams

PROMPTS = [[5, 17, 99, 230, 41], [300, 12, 7, 88, 150, 201, 33, 60, 9, 14, 2, 71], [77, 78, 79], [1, 2, 3, 4, 5, 6, 7]]
MAX_TOKENS = 6


def _llm(path: str, **kwargs) -> LLM:
    args = {"dtype": "float32", "device": "cpu", "max_model_len": 64, "block_size": 4, "enable_prefix_caching": True}
    args.update(kwargs)
    return LLM(path, **args)


@pytest.fixture(scope="module")
def moe_path(tiny_checkpoint):
    return tiny_checkpoint("qwen3_moe")


def _check_against_hf(path, prompts, outputs, asked):
    seqs = [p + o.outputs[0].token_ids[:-1] for p, o, a in zip(prompts, outputs, asked) if a]
    expected = iter(hf_router_top_k(path, seqs))
    for prompt, out, ask in zip(prompts, outputs, asked):
        c = out.outputs[0]
        if not ask:
            assert c.routed_experts is None
            continue
        # One row per position that went through the model: the prompt and every output token but the last.
        assert len(c.routed_experts) == len(prompt) + len(c.token_ids) - 1
        assert c.routed_experts == next(expected)


def test_routed_experts_match_hf_with_chunked_prefill_and_mixed_batch(moe_path):
    llm = _llm(moe_path, max_num_batched_tokens=4)  # prompts prefill in chunks beside other requests' decodes
    asked = [True, True, False, True]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, return_routed_experts=a) for a in asked]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    _check_against_hf(moe_path, PROMPTS, outputs, asked)
    flat = {e for out in outputs if out.outputs[0].routed_experts for row in out.outputs[0].routed_experts for l in row for e in l}
    assert len(flat) > 2  # the routing really varies

    # A repeated prompt would hit the prefix cache; a request asking for routing skips it (a cached block
    # keeps KV, not routing), so its routing still covers the whole prompt.
    again = llm.generate([{"prompt_token_ids": PROMPTS[1]}], params[0], use_tqdm=False)
    assert again[0].outputs[0].routed_experts == outputs[1].outputs[0].routed_experts


def test_routed_experts_survive_preemption(moe_path):
    prompts = [[(7 * i + j) % 500 + 1 for j in range(10)] for i in range(8)]
    llm = _llm(moe_path, max_model_len=32, max_num_batched_tokens=16, num_gpu_blocks_override=12)  # too few blocks: preemption
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, return_routed_experts=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine_core.scheduler.make_stats().num_preemptions > 0, "the KV cache was meant to be small enough to preempt"
    _check_against_hf(moe_path, prompts, outputs, [True] * len(prompts))


def test_sampled_with_n_and_temperature(moe_path):
    llm = _llm(moe_path)
    params = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=4, return_routed_experts=True)
    [out] = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
    assert len(out.outputs) == 2
    seqs = [PROMPTS[0] + c.token_ids[:-1] for c in out.outputs]
    assert [c.routed_experts for c in out.outputs] == hf_router_top_k(moe_path, seqs)


def test_dense_model_refuses_return_routed_experts(tiny_checkpoint):
    llm = _llm(tiny_checkpoint("qwen3"))
    with pytest.raises(ValueError, match="return_routed_experts"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(return_routed_experts=True), use_tqdm=False)
    # Nothing changed: the engine keeps serving.
    assert llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].routed_experts is None


def test_flag_is_validated():
    with pytest.raises(ValueError, match="return_routed_experts"):
        SamplingParams(return_routed_experts="yes")
