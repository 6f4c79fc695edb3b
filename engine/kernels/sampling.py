"""Batch-independent sampling in one pass over the logits: Triton kernel and its torch reference.

Gumbel-max with counter-based noise: token = argmax(logits[v] - log(-log u(key, v))), where
u is a hash of the row's 63-bit key and the vocabulary index. A row's key comes from its
own (seed, position) when seeded, so its token depends on nothing else in the batch; no
softmax, sort or generator state is needed. Rows with key < 0 are greedy (no noise).
The hash uses only masked 32-bit products, so torch (int64) and Triton compute the same u.
"""

from __future__ import annotations

import torch

from engine.kernels import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

_M32 = 0xFFFFFFFF


def _fmix32_ref(h: torch.Tensor) -> torch.Tensor:  # int64 holding values < 2^32
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def uniform_noise_ref(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """u in (0, 1), float32 [B, V]: a hash of (key, token index); exact in float32."""
    k0 = (keys & _M32)[:, None]
    k1 = ((keys >> 32) & _M32)[:, None]
    v = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)[None, :]
    h = ((v * 0x9E3779B1) & _M32) ^ k0
    h = _fmix32_ref(h) ^ k1
    h = _fmix32_ref(h)
    return ((h >> 9) * 2 + 1).to(torch.float32) * (2.0**-24)  # odd multiples of 2^-24


def gumbel_sample_ref(
    logits: torch.Tensor,  # [B, V] float32, temperature and masks already applied
    keys: torch.Tensor,  # [B] int64; < 0 means greedy
) -> torch.Tensor:  # [B] int64
    """argmax(logits + Gumbel(key)) per row; greedy rows take argmax(logits)."""
    u = uniform_noise_ref(keys.clamp_min(0), logits.shape[1])
    noise = -torch.log(-torch.log(u))
    noise = torch.where((keys < 0)[:, None], torch.zeros_like(noise), noise)
    return (logits + noise).argmax(dim=-1)


if triton is not None:

    @triton.jit
    def _fmix32(h):
        h = h ^ (h >> 16)
        h = (h * 0x85EBCA6B) & 0xFFFFFFFF
        h = h ^ (h >> 13)
        h = (h * 0xC2B2AE35) & 0xFFFFFFFF
        return h ^ (h >> 16)

    @triton.jit
    def _gumbel_sample_kernel(out_ptr, logits_ptr, keys_ptr, stride_row, V, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        key = tl.load(keys_ptr + row)
        greedy = key < 0
        key = tl.maximum(key, 0)
        k0 = key & 0xFFFFFFFF
        k1 = (key >> 32) & 0xFFFFFFFF
        best_val = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
        best_idx = tl.zeros([BLOCK], dtype=tl.int64)
        base = logits_ptr + row.to(tl.int64) * stride_row
        for start in range(0, V, BLOCK):
            v = start + tl.arange(0, BLOCK)
            x = tl.load(base + v, mask=v < V, other=float("-inf")).to(tl.float32)
            v64 = v.to(tl.int64)
            h = ((v64 * 0x9E3779B1) & 0xFFFFFFFF) ^ k0
            h = _fmix32(_fmix32(h) ^ k1)
            u = ((h >> 9) * 2 + 1).to(tl.float32) * (1.0 / 16777216.0)
            noise = -tl.log(-tl.log(u))
            val = tl.where(greedy, x, x + noise)
            better = val > best_val  # strict: earlier indices win ties within a lane
            best_val = tl.where(better, val, best_val)
            best_idx = tl.where(better, v64, best_idx)
        top = tl.max(best_val, axis=0)
        # Lowest index among lanes holding the maximum (torch.argmax's tie rule).
        idx = tl.min(tl.where(best_val == top, best_idx, V), axis=0)
        tl.store(out_ptr + row, idx)


def gumbel_sample_triton(logits: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    if logits.stride(-1) != 1:
        return gumbel_sample_ref(logits, keys)
    num_rows, vocab_size = logits.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows:
        _gumbel_sample_kernel[(num_rows,)](out, logits, keys, logits.stride(0), vocab_size, BLOCK=1024, num_warps=4)
    return out


def gumbel_sample(logits: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """One token per row; Triton on GPU, the reference on CPU."""
    if use_triton(logits):
        return gumbel_sample_triton(logits, keys)
    return gumbel_sample_ref(logits, keys)
