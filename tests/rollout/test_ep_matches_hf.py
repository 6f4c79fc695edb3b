"""DP=2 x EP=2 on CPU (gloo): a lockstep group over the tiny Qwen3-MoE gives HF transformers' greedy tokens and HF's router choices."""

from __future__ import annotations

import os
from unittest import mock

import pytest
from hf_reference import hf_greedy, hf_router_top_k

from engine.sampling_params import SamplingParams
from rollout import RolloutWorker

PROMPTS = [[5, 17, 99, 230, 41], [300, 12, 7, 88, 150, 201, 33, 60, 9], [77, 78, 79], [1, 2, 3, 4, 5, 6, 7], [42] * 6]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def moe_path(tiny_checkpoint):
    return tiny_checkpoint("qwen3_moe")


@pytest.fixture(scope="module")
def ep_group(moe_path):
    # One intra-op thread per engine process (they inherit it): two engines on two cores.
    with mock.patch.dict(os.environ, {"OMP_NUM_THREADS": "1"}):
        worker = RolloutWorker(model=moe_path, multiprocess=True, data_parallel_size=2, enable_expert_parallel=True,
                               device="cpu", dtype="float32", max_model_len=128, disable_log_stats=True)
    with worker:
        assert worker.engine.lockstep
        yield worker


def test_dp2_ep2_greedy_and_routing_equal_hf(ep_group, moe_path):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, return_routed_experts=True)
    outputs = ep_group.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert all(n > 0 for n in ep_group.engine.balancer.num_routed)  # both engines served some of them
    for prompt, out in zip(PROMPTS, outputs):
        assert out.outputs[0].token_ids == hf_greedy(moe_path, prompt, MAX_TOKENS)
    sequences = [p + o.outputs[0].token_ids[:-1] for p, o in zip(PROMPTS, outputs)]
    for out, expected in zip(outputs, hf_router_top_k(moe_path, sequences)):
        assert out.outputs[0].routed_experts == expected  # global expert ids, whichever rank holds them


def test_engines_holding_different_experts_agree_on_the_weights_they_share(ep_group):
    report = ep_group.weight_checker()
    held = [set(e["checksums"]) for e in report["engines"]]
    assert held[0] != held[1] and held[0] & held[1]  # each its own experts, the dense weights in common
    assert report["consistent"] is True
