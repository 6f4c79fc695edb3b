"""Rotary position embedding (neox style, from a float32 cos/sin cache): Triton kernel and torch reference."""

from __future__ import annotations

import torch

from engine.kernels import next_power_of_2, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_size: int) -> torch.Tensor:
    num_tokens = x.shape[0]
    x = x.view(num_tokens, -1, head_size)  # [T, H, D]
    x1, x2 = x.chunk(2, dim=-1)
    # Same arithmetic as HF: x * cat(cos, cos) + rotate_half(x) * cat(sin, sin).
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.view(num_tokens, -1)


def rotary_embedding_ref(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, Hq * D]
    k: torch.Tensor,  # [T, Hkv * D]
    cos_cache: torch.Tensor,  # [max_position, D/2] float32
    sin_cache: torch.Tensor,  # [max_position, D/2] float32
    head_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rotated q, rotated k) as new tensors; cos/sin are cast to q's dtype first (HF)."""
    cos = cos_cache[positions].to(q.dtype)[:, None, :]  # [T, 1, D/2]
    sin = sin_cache[positions].to(q.dtype)[:, None, :]
    return _rotate_ref(q, cos, sin, head_size), _rotate_ref(k, cos, sin, head_size)


if triton is not None:

    @triton.jit
    def _rotate_heads(src, dst, token, stride, num_heads, cos, sin,
                      HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_HALF)
        mask = (h[:, None] < num_heads) & (d[None, :] < HALF)
        off = h[:, None] * (2 * HALF) + d[None, :]  # [BLOCK_H, BLOCK_HALF]
        base = src + token.to(tl.int64) * stride
        x1 = tl.load(base + off, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(base + off + HALF, mask=mask, other=0.0).to(tl.float32)
        out_base = dst + token.to(tl.int64) * (num_heads * 2 * HALF)
        dtype = dst.dtype.element_ty
        tl.store(out_base + off, (x1 * cos[None, :] - x2 * sin[None, :]).to(dtype), mask=mask)
        tl.store(out_base + off + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(dtype), mask=mask)

    @triton.jit
    def _rotary_kernel(
        q_out_ptr, k_out_ptr, q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr,
        stride_q, stride_k, stride_cache, num_q_heads, num_k_heads,
        HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    ):
        token = tl.program_id(0)
        pos = tl.load(pos_ptr + token)
        d = tl.arange(0, BLOCK_HALF)
        d_mask = d < HALF
        dtype = q_ptr.dtype.element_ty
        # cos/sin rounded to the model dtype first, as HF does.
        cos = tl.load(cos_ptr + pos * stride_cache + d, mask=d_mask, other=0.0).to(dtype).to(tl.float32)
        sin = tl.load(sin_ptr + pos * stride_cache + d, mask=d_mask, other=0.0).to(dtype).to(tl.float32)
        _rotate_heads(q_ptr, q_out_ptr, token, stride_q, num_q_heads, cos, sin, HALF, BLOCK_H, BLOCK_HALF)
        _rotate_heads(k_ptr, k_out_ptr, token, stride_k, num_k_heads, cos, sin, HALF, BLOCK_H, BLOCK_HALF)


def rotary_embedding_triton(positions, q, k, cos_cache, sin_cache, head_size):
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_cache.stride(-1) != 1 or head_size % 2:
        return rotary_embedding_ref(positions, q, k, cos_cache, sin_cache, head_size)
    num_tokens = q.shape[0]
    num_q_heads, num_k_heads = q.shape[1] // head_size, k.shape[1] // head_size
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens:
        half = head_size // 2
        _rotary_kernel[(num_tokens,)](
            q_out, k_out, q, k, positions, cos_cache, sin_cache,
            q.stride(0), k.stride(0), cos_cache.stride(0), num_q_heads, num_k_heads,
            HALF=half, BLOCK_H=next_power_of_2(max(num_q_heads, num_k_heads)),
            BLOCK_HALF=next_power_of_2(half), num_warps=4,
        )
    return q_out, k_out


def rotary_embedding(positions, q, k, cos_cache, sin_cache, head_size):
    """(rotated q, rotated k); Triton on GPU, the reference on CPU."""
    if use_triton(q):
        return rotary_embedding_triton(positions, q, k, cos_cache, sin_cache, head_size)
    return rotary_embedding_ref(positions, q, k, cos_cache, sin_cache, head_size)
