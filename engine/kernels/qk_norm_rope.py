"""Qwen3's per-head q/k RMSNorm fused with rotary embedding: one Triton launch in place on the qkv output, beside its torch reference."""

from __future__ import annotations

import torch

from engine.kernels import next_power_of_2, use_triton
from engine.kernels.pdl import pdl_args
from engine.kernels.norm import rms_norm_ref
from engine.kernels.rotary import rotary_embedding_ref

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None
else:
    from engine.kernels.pdl import wait_inputs


def qk_norm_rope_ref(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, Hq * D]
    k: torch.Tensor,  # [T, Hkv * D]
    q_weight: torch.Tensor,  # [D]
    k_weight: torch.Tensor,  # [D]
    eps: float,
    cos_cache: torch.Tensor,  # [max_position, D/2] float32
    sin_cache: torch.Tensor,  # [max_position, D/2] float32
    head_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rope(rms_norm(q) per head), rope(rms_norm(k) per head)) as new tensors: exactly the unfused ops.

    The Triton version writes its result into q and k instead; callers use only the returned tensors.
    """
    num_tokens = q.shape[0]
    q = rms_norm_ref(q.reshape(num_tokens, -1, head_size), q_weight, eps).view(num_tokens, -1)
    k = rms_norm_ref(k.reshape(num_tokens, -1, head_size), k_weight, eps).view(num_tokens, -1)
    return rotary_embedding_ref(positions, q, k, cos_cache, sin_cache, head_size)


if triton is not None:

    @triton.jit
    def _round(x, dtype: tl.constexpr):
        """float32 x rounded to dtype (nearest even) and widened back: a rounding point of the reference.

        For bfloat16 by integer ops, because the compiler may fold a float32 -> bfloat16 -> float32
        cast pair away (seen on an H200: a quarter of the outputs then differed from the reference).
        """
        if dtype == tl.bfloat16:
            u = x.to(tl.uint32, bitcast=True)
            u = u + 0x7FFF + ((u >> 16) & 1)
            return ((u >> 16) << 16).to(tl.float32, bitcast=True)
        else:
            return x.to(dtype).to(tl.float32)

    @triton.jit
    def _norm_rope_heads(base, num_heads, w_ptr, cos, sin, eps,
                         HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
        # One token's heads as two [BLOCK_H, BLOCK_HALF] halves (neox rope pairs d with d + HALF):
        #   head h:  | x1 = [h*D, h*D + HALF) | x2 = [h*D + HALF, (h+1)*D) |
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_HALF)
        d_mask = d < HALF
        mask = (h[:, None] < num_heads) & d_mask[None, :]
        off = h[:, None] * (2 * HALF) + d[None, :]
        dtype: tl.constexpr = base.dtype.element_ty
        x1 = tl.load(base + off, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(base + off + HALF, mask=mask, other=0.0).to(tl.float32)
        # RMSNorm as rms_norm_ref: float32 statistics, normalised value rounded to the model dtype,
        # then times the weight (rounded once, as torch's elementwise product).
        var = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)  # [BLOCK_H]
        r = tl.rsqrt(var + eps)[:, None]
        w1 = tl.load(w_ptr + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        y1 = _round(_round(x1 * r, dtype) * w1, dtype)
        y2 = _round(_round(x2 * r, dtype) * w2, dtype)
        # Rope as rotary_embedding_ref in the model dtype: each product rounded, then the sum.
        c = cos[None, :]
        s = sin[None, :]
        o1 = _round(_round(y1 * c, dtype) - _round(y2 * s, dtype), dtype)
        o2 = _round(_round(y2 * c, dtype) + _round(y1 * s, dtype), dtype)
        tl.store(base + off, o1.to(dtype), mask=mask)  # exact: o1, o2 are already dtype values
        tl.store(base + off + HALF, o2.to(dtype), mask=mask)

    @triton.jit
    def _qk_norm_rope_kernel(
        q_ptr, k_ptr, pos_ptr, q_w_ptr, k_w_ptr, cos_ptr, sin_ptr,
        stride_q, stride_k, stride_cache, num_q_heads, num_k_heads, eps,
        HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr,
    ):
        wait_inputs(PDL)
        # One program per token (the grid carries the token count, so no int argument varies per step).
        # In place is safe: a program reads all of its token's heads before it stores any.
        token = tl.program_id(0)
        pos = tl.load(pos_ptr + token)
        d = tl.arange(0, BLOCK_HALF)
        d_mask = d < HALF
        dtype: tl.constexpr = q_ptr.dtype.element_ty
        # cos/sin rounded to the model dtype first, as HF does.
        cos = _round(tl.load(cos_ptr + pos * stride_cache + d, mask=d_mask, other=0.0), dtype)
        sin = _round(tl.load(sin_ptr + pos * stride_cache + d, mask=d_mask, other=0.0), dtype)
        tok = token.to(tl.int64)
        _norm_rope_heads(q_ptr + tok * stride_q, num_q_heads, q_w_ptr, cos, sin, eps, HALF, BLOCK_H, BLOCK_HALF)
        _norm_rope_heads(k_ptr + tok * stride_k, num_k_heads, k_w_ptr, cos, sin, eps, HALF, BLOCK_H, BLOCK_HALF)


def qk_norm_rope_triton(positions, q, k, q_weight, k_weight, eps, cos_cache, sin_cache, head_size):
    """qk_norm_rope_ref's result, written into q and k (strided row views of the qkv output are fine)."""
    dtypes_ok = q.dtype == k.dtype and torch.promote_types(q.dtype, q_weight.dtype) == q.dtype \
        and torch.promote_types(k.dtype, k_weight.dtype) == k.dtype
    if (q.dim() != 2 or k.dim() != 2 or q.stride(-1) != 1 or k.stride(-1) != 1 or cos_cache.stride(-1) != 1
            or head_size % 2 or not dtypes_ok or not q_weight.is_contiguous() or not k_weight.is_contiguous()):
        return qk_norm_rope_ref(positions, q, k, q_weight, k_weight, eps, cos_cache, sin_cache, head_size)
    num_tokens = q.shape[0]
    num_q_heads, num_k_heads = q.shape[1] // head_size, k.shape[1] // head_size
    if num_tokens:
        half = head_size // 2
        _qk_norm_rope_kernel[(num_tokens,)](
            q, k, positions, q_weight, k_weight, cos_cache, sin_cache,
            q.stride(0), k.stride(0), cos_cache.stride(0), num_q_heads, num_k_heads, eps,
            HALF=half, BLOCK_H=next_power_of_2(max(num_q_heads, num_k_heads)),
            BLOCK_HALF=next_power_of_2(half), num_warps=4, **pdl_args(),
        )
    return q, k


def qk_norm_rope(positions, q, k, q_weight, k_weight, eps, cos_cache, sin_cache, head_size):
    """(normalised and rotated q, k); Triton on GPU (in place), the reference on CPU (new tensors)."""
    if use_triton(q):
        return qk_norm_rope_triton(positions, q, k, q_weight, k_weight, eps, cos_cache, sin_cache, head_size)
    return qk_norm_rope_ref(positions, q, k, q_weight, k_weight, eps, cos_cache, sin_cache, head_size)
