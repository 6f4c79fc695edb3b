"""Mixture-of-experts routing and expert computation: Triton grouped GEMMs on GPU beside plain-torch references.

The Triton path (fused_experts_triton) never leaves the device (no host sync, so it fits a CUDA
graph): the (token, k) pairs are sorted by expert and each expert's run is padded to whole
blocks of BLOCK_M rows (align_pairs), then two grouped GEMMs each run one program per
(block, column tile) against that block's expert:

    hidden [T, H] --gather rows--> x w13[e]^T --> [T*K, 2I] --silu_and_mul--> [T*K, I]
                  --x w2[e]^T, times the pair's router weight--> [T*K, H] --sum over k--> [T, H]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels import cdiv, use_triton
from engine.kernels.activation import silu_and_mul

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


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


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, k) pairs grouped by expert, each expert's run padded to a multiple of block_m rows.

    Returns (pair_ids [num_blocks * block_m] int64, block_expert [num_blocks] int64): row j of
    the padded order holds flat pair t * K + k, or T * K (padding); block b's rows all belong to
    expert block_expert[b], or -1 for a block past the last expert's run. Pairs whose id is
    outside [0, num_experts) (another expert-parallel rank's, -1 padding) are left out. Sizes are
    upper bounds known without reading the ids (cdiv(T*K, block_m) + num_experts blocks), so the
    device never waits for the host:

        ids [[2, 0], [0, 2]], block_m 2  ->  e0: pairs 1, 2   e2: pairs 0, 3
        pair_ids [1, 2, 0, 3, pad...]      block_expert [0, 2, -1, ...]
    """
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    held = (flat >= 0) & (flat < num_experts)
    flat = torch.where(held, flat, num_experts)  # pairs not held here: a last, unpadded bucket
    order = flat.argsort(stable=True)  # pair ids grouped by expert
    counts = torch.bincount(flat, minlength=num_experts + 1)  # [E + 1]
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m  # [E] rows of each expert's run
    starts = torch.cumsum(counts, 0) - counts  # [E + 1] first sorted position of each expert
    padded_starts = torch.cumsum(padded, 0) - padded  # [E] first padded row of each expert
    sorted_expert = flat[order]  # [T*K]
    position = torch.arange(num_pairs, device=device)
    kept = sorted_expert < num_experts
    safe_expert = sorted_expert.clamp(max=num_experts - 1)
    rows = padded_starts[safe_expert] + (position - starts[sorted_expert])  # padded row of each sorted pair
    num_blocks = cdiv(num_pairs, block_m) + num_experts
    pair_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int64, device=device)
    pair_ids[rows[kept]] = order[kept]
    # Block b belongs to the expert whose padded run contains row b * block_m.
    ends = torch.cumsum(padded, 0)  # [E]
    block_start = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(ends, block_start, right=True)  # [num_blocks]
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return pair_ids, block_expert


if triton is not None:

    # num_pairs (T * K) changes every step: not specialized, so serving compiles no new variants.
    @triton.jit(do_not_specialize=["num_pairs"])
    def _grouped_gemm_kernel(
        c_ptr, a_ptr, b_ptr, pair_ids_ptr, block_expert_ptr, weights_ptr,
        num_pairs, N, K, a_row_div,
        stride_am, stride_be, stride_bn, stride_cm,
        MUL_WEIGHT: tl.constexpr, DOT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """C[pair, n] = sum_k A[pair // a_row_div, k] * B[e, n, k] (x weights[pair]) for the pairs of one block."""
        block = tl.program_id(0)
        expert = tl.load(block_expert_ptr + block)
        if expert < 0:
            return
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(pair_ids_ptr + rows)  # int64; num_pairs marks padding
        valid = pair < num_pairs
        a_row = pair // a_row_div
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        b_base = b_ptr + expert.to(tl.int64) * stride_be
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            a = tl.load(a_ptr + a_row[:, None] * stride_am + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_base + cols[None, :].to(tl.int64) * stride_bn + ks[:, None],
                        mask=col_ok[None, :] & k_ok[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]: B[e]^T
            acc += tl.dot(a, b, input_precision=DOT_PRECISION)
        if MUL_WEIGHT:
            w = tl.load(weights_ptr + pair, mask=valid, other=0.0).to(tl.float32)
            acc = acc * w[:, None]
        tl.store(c_ptr + pair[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=valid[:, None] & col_ok[None, :])


def _grouped_gemm(out, a, b, pair_ids, block_expert, weights, a_row_div: int, block_m: int) -> None:
    num_pairs = out.shape[0]
    N, K = b.shape[1], b.shape[2]
    block_n, block_k = 64, 64
    grid = (block_expert.numel(), triton.cdiv(N, block_n))
    _grouped_gemm_kernel[grid](
        out, a, b, pair_ids, block_expert, weights if weights is not None else out,
        num_pairs, N, K, a_row_div,
        a.stride(0), b.stride(0), b.stride(1), out.stride(0),
        MUL_WEIGHT=weights is not None, DOT_PRECISION="ieee" if a.dtype == torch.float32 else None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )


def fused_experts_triton(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """fused_experts_ref's result through two grouped GEMMs (see the module docstring)."""
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0 or hidden.stride(-1) != 1 or w13.stride(-1) != 1 or w2.stride(-1) != 1:
        return fused_experts_ref(hidden, w13, w2, topk_weights, topk_ids)
    num_experts, two_i, _ = w13.shape
    block_m = 16 if num_tokens * top_k <= 16 * num_experts else 64  # decode: few pairs per expert
    pair_ids, block_expert = align_pairs(topk_ids, num_experts, block_m)
    num_pairs = num_tokens * top_k
    up = torch.empty(num_pairs, two_i, dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(up, hidden, w13, pair_ids, block_expert, None, top_k, block_m)  # rows of pairs not held stay garbage
    act = silu_and_mul(up)  # [T*K, I]
    down = torch.zeros(num_pairs, w2.shape[1], dtype=hidden.dtype, device=hidden.device)  # pairs not held: 0
    weights = topk_weights.reshape(-1).contiguous()
    _grouped_gemm(down, act, w2, pair_ids, block_expert, weights, 1, block_m)
    return down.view(num_tokens, top_k, -1).sum(dim=1, dtype=torch.float32).to(hidden.dtype)


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return select_experts_ref(router_logits, top_k, renormalize)


def fused_experts(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    if use_triton(hidden) and triton is not None:
        return fused_experts_triton(hidden, w13, w2, topk_weights, topk_ids)
    return fused_experts_ref(hidden, w13, w2, topk_weights, topk_ids)
