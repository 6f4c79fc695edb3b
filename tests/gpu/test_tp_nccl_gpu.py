"""GPU tier: tensor parallelism of size 2 over NCCL (one GPU per rank) against one GPU: same logits, same greedy tokens."""

from __future__ import annotations

import pytest
import torch
from tp_group import TPGroup, greedy, load_engine_model

pytestmark = pytest.mark.gpu
ATOL = 1e-3  # float32, but GPU kernels reduce in other orders than one GPU's
MAX_TOKENS = 8
PROMPTS = [[5, 17, 99, 230, 41], [300, 12, 7, 88, 150, 201, 33, 60, 9], [77, 501, 79], [508, 3, 260, 4]]
VARIANTS = {
    "llama-kv1-bias-odd-vocab": ("llama", {"num_key_value_heads": 1, "attention_bias": True, "mlp_bias": True,
                                           "vocab_size": 509}),
    "qwen3": ("qwen3", {}),
}


@pytest.fixture(scope="module")
def gpu_tp_group():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    group = TPGroup(2, "cuda")
    try:
        yield group
    finally:
        group.close()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tp2_over_nccl_matches_one_gpu(gpu_tp_group, tiny_checkpoint, variant):
    arch, overrides = VARIANTS[variant]
    path = tiny_checkpoint(arch, **overrides)
    ref_logits, ref_tokens = greedy(load_engine_model(path, "cuda:0"), PROMPTS, MAX_TOKENS)
    ranks = gpu_tp_group.run("rank_greedy", path, PROMPTS, MAX_TOKENS)
    for rank in ranks:
        assert rank["generated"] == ref_tokens
        for got, expected in zip(rank["logits"], ref_logits, strict=True):
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    for a, b in zip(ranks[0]["logits"], ranks[1]["logits"]):
        assert torch.equal(a, b)  # every rank samples from the same logits
