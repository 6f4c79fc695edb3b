"""Mixture-of-experts routing and expert computation: plain-torch references (a Triton kernel comes later, behind fused_experts)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.activation import silu_and_mul


def select_experts_ref(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax over experts (in float32) -> the top_k of each token -> (weights [T, K] in the logits' dtype,
    expert ids [T, K] int64, best first); weights renormalized to sum 1 per token when `renormalize`."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights.to(router_logits.dtype), topk_ids


def fused_experts_ref(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2 * I, H]: each expert's [gate | up] rows
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K]
    topk_ids: torch.Tensor,  # [T, K] int
) -> torch.Tensor:  # [T, H]
    """sum over k of topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t]), expert(x) = w2 (silu(x w1^T) * x w3^T).

    An id outside [0, E) (another expert-parallel rank's expert, or -1 padding) contributes nothing.
    The (token, k) pairs are sorted by expert so each active expert runs once, on its tokens:

        topk_ids  [[2, 0], [0, 3]]  ->  flat [2, 0, 0, 3]  ->  by expert: e0 <- tokens [0, 1], e2 <- [0], e3 <- [1]
    """
    top_k = topk_ids.shape[1]
    num_experts = w13.shape[0]
    out = torch.zeros_like(hidden)
    flat_ids = topk_ids.reshape(-1).long()  # [T * K]
    held = (flat_ids >= 0) & (flat_ids < num_experts)
    flat_ids = torch.where(held, flat_ids, num_experts)  # pairs of experts not held here sort last, and are skipped
    order = flat_ids.argsort(stable=True)  # (token, k) pairs grouped by expert
    token_ids = order // top_k  # [T * K] the token of each sorted pair
    weights = topk_weights.reshape(-1)[order]  # [T * K]
    counts = torch.bincount(flat_ids, minlength=num_experts + 1)[:num_experts].tolist()  # one host sync (reference)
    start = 0
    for expert_id, count in enumerate(counts):
        if count == 0:
            continue
        rows = token_ids[start:start + count]  # [n]
        x = hidden.index_select(0, rows)  # [n, H]
        y = F.linear(silu_and_mul(F.linear(x, w13[expert_id])), w2[expert_id])  # [n, H]
        out.index_add_(0, rows, y * weights[start:start + count, None])
        start += count
    return out


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return select_experts_ref(router_logits, top_k, renormalize)


def fused_experts(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    return fused_experts_ref(hidden, w13, w2, topk_weights, topk_ids)
