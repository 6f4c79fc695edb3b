"""GPU tier: the Triton fused MoE (grouped GEMMs over expert-aligned blocks) against its torch reference."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.moe import fused_experts_ref, fused_experts_triton, select_experts_ref

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _case(num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen, device=DEV).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen, device=DEV) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen, device=DEV) * inter**-0.5).to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=gen, device=DEV).to(dtype)
    weights, ids = select_experts_ref(logits, top_k, renormalize=True)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_tokens,hidden,inter,num_experts,top_k", [
    (1, 128, 64, 8, 2),        # decode, one token
    (7, 256, 96, 16, 4),       # odd sizes: partial tiles in every dimension
    (300, 512, 256, 64, 8),    # prefill, Qwen3-MoE-like routing
    (64, 2048, 768, 128, 8),   # Qwen3-30B-A3B's hidden / expert sizes
])
def test_fused_experts_matches_reference(dtype, num_tokens, hidden, inter, num_experts, top_k):
    x, w13, w2, weights, ids = _case(num_tokens, hidden, inter, num_experts, top_k, dtype, seed=num_tokens)
    ref = fused_experts_ref(x, w13, w2, weights, ids).double()
    out = fused_experts_triton(x, w13, w2, weights, ids)
    assert not torch.isnan(out).any()
    err = float((out.double() - ref).norm() / ref.norm())
    assert err < (2e-2 if dtype == torch.bfloat16 else 1e-5), err


def test_pairs_of_experts_held_elsewhere_contribute_nothing():
    # Expert parallelism hands the kernel local ids; another rank's experts (and -1 padding) are out of range.
    x, w13, w2, weights, ids = _case(40, 128, 64, 8, 2, torch.bfloat16, seed=3)
    ids = ids.clone()
    ids[::3, 0] = -1
    ids[1::5, 1] = 11
    ref = fused_experts_ref(x, w13, w2, weights, ids).double()
    out = fused_experts_triton(x, w13, w2, weights, ids).double()
    assert float((out - ref).norm() / ref.norm()) < 2e-2
    only_foreign = torch.zeros_like(ids) - 1
    assert torch.count_nonzero(fused_experts_triton(x, w13, w2, weights, only_foreign)) == 0
