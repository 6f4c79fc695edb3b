"""Batch-independent sampling in one pass over the logits: Triton kernel and its torch reference.

Gumbel-max with counter-based noise: token = argmax(logits[v] - log(-log u(key, v))), where
u is a hash of the row's 63-bit key and the vocabulary index. A row's key comes from its
own (seed, position) when seeded, so its token depends on nothing else in the batch; no
softmax, sort or generator state is needed. Rows with key < 0 are greedy (no noise).
The hash uses only masked 32-bit products, so torch (int64) and Triton compute the same u.

Resolution: u takes 2^23 values in [2^-24, 1 - 2^-24], so the noise lies in about [-2.8, 16.6]
and a token more than ~19.4 nats below its row's best can never be drawn (its exact
probability is below e^-19.4 ~ 4e-9; at most V * 4e-9 of mass, in practice far less).
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


def gumbel_sample_simple_ref(
    logits: torch.Tensor,  # [B, V] float32, temperature and masks already applied
    keys: torch.Tensor,  # [B] int64; < 0 means greedy
) -> torch.Tensor:  # [B] int64
    """The definition, written plainly: argmax(logits + Gumbel(key)) per row; greedy rows take argmax(logits)."""
    u = uniform_noise_ref(keys.clamp_min(0), logits.shape[1])
    noise = -torch.log(-torch.log(u))
    noise = torch.where((keys < 0)[:, None], torch.zeros_like(noise), noise)
    return (logits + noise).argmax(dim=-1)


def _signed32(c: int) -> int:
    """A 32-bit constant as the int32 with the same bits."""
    return c - (1 << 32) if c >= (1 << 31) else c


_C1, _C2, _GOLDEN = _signed32(0x85EBCA6B), _signed32(0xC2B2AE35), _signed32(0x9E3779B1)
# Rows per block of the CPU reference: about 2^18 elements, so a block's temporaries stay in cache.
_BLOCK_ELEMENTS = 1 << 18
# The reference samples among candidates only when every row keeps at most V / this many tokens.
_SPARSE_FRACTION = 8


def _fmix32_i32_(h: torch.Tensor, tmp: torch.Tensor) -> None:
    """_fmix32_ref on int32 bit patterns, in place: products wrap mod 2^32, shifts are made logical by masking."""
    torch.bitwise_right_shift(h, 16, out=tmp)
    h ^= tmp.bitwise_and_(0xFFFF)
    h *= _C1
    torch.bitwise_right_shift(h, 13, out=tmp)
    h ^= tmp.bitwise_and_(0x7FFFF)
    h *= _C2
    torch.bitwise_right_shift(h, 16, out=tmp)
    h ^= tmp.bitwise_and_(0xFFFF)


def _log_neg_log_u(k0: torch.Tensor, k1: torch.Tensor, golden: torch.Tensor) -> torch.Tensor:
    """log(-log u) (= minus the Gumbel noise), float32 [b, n], from the key words k0, k1 ([b] int32)
    and golden = (token index * 0x9E3779B1) as int32 ([b or 1, n])."""
    h = golden ^ k0[:, None]  # [b, n]
    tmp = torch.empty_like(h)
    _fmix32_i32_(h, tmp)
    h ^= k1[:, None]
    _fmix32_i32_(h, tmp)
    h.bitwise_right_shift_(9).bitwise_and_(0x7FFFFF)  # top 23 bits
    u = h.to(torch.float32).mul_(2.0**-23).add_(2.0**-24)  # (2m + 1) * 2^-24, exact
    return u.log_().neg_().log_()


def gumbel_sample_ref(
    logits: torch.Tensor,  # [B, V] float32, temperature and masks already applied
    keys: torch.Tensor,  # [B] int64; < 0 means greedy
) -> torch.Tensor:  # [B] int64
    """argmax(logits + Gumbel(key)) per row; greedy rows take argmax(logits).

    Same tokens as gumbel_sample_simple_ref (the same u bit for bit, the same float ops), but
    in int32 and in blocks of rows that fit in cache (about 4x less memory traffic on CPU).
    When every row has few finite logits (top-k / top-p masked the rest), the noise is
    computed only at each row's finite candidates: -inf + noise never wins, and a tie of
    scores still goes to the lowest token index, as in argmax.
    """
    num_rows, vocab_size = logits.shape
    if num_rows == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    logits = logits.to(torch.float32)
    greedy = keys < 0
    k = keys.clamp_min(0)
    k0 = torch.where((k & _M32) >= 2**31, (k & _M32) - 2**32, k & _M32).to(torch.int32)  # [B] low word
    k1 = torch.where((k >> 32) >= 2**31, (k >> 32) - 2**32, k >> 32).to(torch.int32)  # [B] high word

    max_finite = int((logits > float("-inf")).sum(dim=-1).max())
    if 0 < max_finite <= vocab_size // _SPARSE_FRACTION:
        values, ids = logits.topk(max_finite, dim=-1, sorted=False)  # [B, m]: all finite logits (and some -inf)
        golden = ids.to(torch.int32).mul_(_GOLDEN)  # [B, m]
        scores = torch.sub(values, _log_neg_log_u(k0, k1, golden))  # [B, m]
        scores = torch.where(greedy[:, None], values, scores)
        best = scores.amax(dim=-1, keepdim=True)  # [B, 1]
        return torch.where(scores == best, ids, vocab_size).amin(dim=-1)

    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    rows_per_block = max(1, _BLOCK_ELEMENTS // max(1, vocab_size))
    golden = torch.arange(vocab_size, dtype=torch.int32, device=logits.device).mul_(_GOLDEN)[None, :]  # [1, V]
    for start in range(0, num_rows, rows_per_block):
        end = min(num_rows, start + rows_per_block)
        log_e = _log_neg_log_u(k0[start:end], k1[start:end], golden)  # [b, V]
        scores = torch.sub(logits[start:end], log_e, out=log_e)  # logits + noise
        scores = torch.where(greedy[start:end, None], logits[start:end], scores)
        out[start:end] = scores.argmax(dim=-1)
    return out


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
