"""Top-p boundary per row without a sort or a host sync: a pivot search over the values' order-preserving integer keys.

The boundary of a row's nucleus is the largest value t in the row whose tokens at or above it
hold mass >= p:  t = max{ v in row : sum_{x >= v} softmax(x / T) >= p }.  Such a t is always a
value of the row (mass only changes at a row value), and keeping every token >= t is exactly
the rule of engine/sample/topk_topp.py (ties with the boundary token all kept).

Search: map each float to an int32 key with the same order, keep an interval [lo, hi] of keys
with mass(>= lo) >= p and mass(>= hi + 1) < p, and in each pass count the mass at or above 15
evenly spaced pivots inside it (one read of the row, chunked over many programs; the mass sums
in float64, reduced in a fixed order, so a row's result depends on nothing else). 16-bit
dtypes (bf16 logits straight from the model) have 2^16 keys: 4 passes; float32 8. Every launch
count is fixed, so nothing waits on the host and async scheduling keeps overlapping steps.

Rows with p >= 1 get `lower` (the top-k threshold, or -inf) back. Tokens below `lower` are out
of the nucleus and carry no mass (top-k first, then top-p over what it kept).
"""

from __future__ import annotations

import torch

from engine.kernels import cdiv

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

_BLOCK = 1024
_PIVOTS = 16  # subintervals per pass: pivot 0 is lo itself (known to hold mass >= p)
# Tiles per (row, chunk) program: fixed, so a row's float64 sums run in the same order in any
# batch (its threshold, and so its token, never depends on the other rows).
_TILES = 2


if triton is not None:

    @triton.jit
    def _key(x, KEY_SHIFT: tl.constexpr):
        """float32 -> int32 with the same order (-0.0 just below +0.0); >> KEY_SHIFT drops bits 16-bit floats never set."""
        b = x.to(tl.int32, bitcast=True)
        b = tl.where(b < 0, b ^ 0x7FFFFFFF, b)
        return b >> KEY_SHIFT

    @triton.jit
    def _scaled(x, inv_temp, HAS_TEMPERATURE: tl.constexpr):
        # The same float32 x / T as torch's division (see engine/kernels/sampling.py for why the product is exact).
        if HAS_TEMPERATURE:
            x = (x.to(tl.float64) * inv_temp).to(tl.float32)
        return x

    @triton.jit(do_not_specialize=["num_chunks"])
    def _stats_kernel(
        max_ptr, lo_ptr, hi_ptr,  # [B, C]: chunk max of x / T, min and max key of the kept tokens
        logits_ptr, lower_ptr, temp_ptr, stride_row, V, num_chunks,
        HAS_TEMPERATURE: tl.constexpr, KEY_SHIFT: tl.constexpr, TILES: tl.constexpr, BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        lower = tl.load(lower_ptr + row)
        inv_temp = 1.0
        if HAS_TEMPERATURE:
            inv_temp = 1.0 / tl.load(temp_ptr + row).to(tl.float64)
        base = logits_ptr + row.to(tl.int64) * stride_row
        m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
        kmin = tl.full([BLOCK], 2147483647, dtype=tl.int32)
        kmax = tl.full([BLOCK], -2147483647, dtype=tl.int32)  # below every finite key
        for t in range(TILES):
            v = (chunk * TILES + t) * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(base + v, mask=v < V, other=float("-inf")).to(tl.float32)
            kept = (x >= lower) & (x > float("-inf"))
            m = tl.maximum(m, tl.where(kept, _scaled(x, inv_temp, HAS_TEMPERATURE), float("-inf")))
            key = _key(x, KEY_SHIFT)
            kmin = tl.minimum(kmin, tl.where(kept, key, 2147483647))
            kmax = tl.maximum(kmax, tl.where(kept, key, -2147483647))
        out = row * num_chunks + chunk
        tl.store(max_ptr + out, tl.max(m, axis=0))
        tl.store(lo_ptr + out, tl.min(kmin, axis=0))
        tl.store(hi_ptr + out, tl.max(kmax, axis=0))

    @triton.jit(do_not_specialize=["num_chunks"])
    def _init_kernel(
        state_ptr,  # [B, 4] float64: row max M, total mass Z (set by the first update), lo, hi (keys, exact in float64)
        max_ptr, lo_ptr, hi_ptr, num_chunks, CHUNKS: tl.constexpr,
    ):
        row = tl.program_id(0)
        c = tl.arange(0, CHUNKS)
        mask = c < num_chunks
        row_max = tl.max(tl.load(max_ptr + row * num_chunks + c, mask=mask, other=float("-inf")), axis=0)
        lo = tl.min(tl.load(lo_ptr + row * num_chunks + c, mask=mask, other=2147483647), axis=0)
        hi = tl.max(tl.load(hi_ptr + row * num_chunks + c, mask=mask, other=-2147483647), axis=0)
        hi = tl.maximum(hi, lo)  # nothing kept (lo = INT_MAX): an empty interval stays put
        tl.store(state_ptr + row * 4 + 0, row_max.to(tl.float64))
        tl.store(state_ptr + row * 4 + 2, lo.to(tl.float64))
        tl.store(state_ptr + row * 4 + 3, hi.to(tl.float64))

    @triton.jit(do_not_specialize=["num_chunks"])
    def _pass_kernel(
        part_ptr,  # [B, C, PIVOTS] float64: the chunk's mass at or above each pivot (pivot 0 unused)
        state_ptr, logits_ptr, lower_ptr, temp_ptr, stride_row, V, num_chunks,
        HAS_TEMPERATURE: tl.constexpr, KEY_SHIFT: tl.constexpr, TILES: tl.constexpr, BLOCK: tl.constexpr,
        PIVOTS: tl.constexpr,
    ):
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        row_max = tl.load(state_ptr + row * 4 + 0).to(tl.float32)
        lo = tl.load(state_ptr + row * 4 + 2).to(tl.int64)
        hi = tl.load(state_ptr + row * 4 + 3).to(tl.int64)
        step = (hi - lo + PIVOTS) // PIVOTS  # ceil((hi - lo + 1) / PIVOTS) >= 1
        d = tl.arange(0, PIVOTS)
        pivots = lo + d.to(tl.int64) * step  # [P]; pivots above hi count nothing that matters
        lower = tl.load(lower_ptr + row)
        inv_temp = 1.0
        if HAS_TEMPERATURE:
            inv_temp = 1.0 / tl.load(temp_ptr + row).to(tl.float64)
        base = logits_ptr + row.to(tl.int64) * stride_row
        acc = tl.zeros([PIVOTS], dtype=tl.float64)
        for t in range(TILES):
            v = (chunk * TILES + t) * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(base + v, mask=v < V, other=float("-inf")).to(tl.float32)
            kept = (x >= lower) & (x > float("-inf"))
            w = tl.where(kept, tl.exp(_scaled(x, inv_temp, HAS_TEMPERATURE) - row_max), 0.0)  # [BLOCK]
            key = _key(x, KEY_SHIFT).to(tl.int64)
            above = key[:, None] >= pivots[None, :]  # [BLOCK, P]
            acc += tl.sum(tl.where(above, w[:, None], 0.0).to(tl.float64), axis=0)
        tl.store(part_ptr + (row * num_chunks + chunk) * PIVOTS + d, acc)

    @triton.jit(do_not_specialize=["num_chunks"])
    def _update_kernel(state_ptr, part_ptr, p_ptr, num_chunks, CHUNKS: tl.constexpr, PIVOTS: tl.constexpr,
                       FIRST: tl.constexpr):
        row = tl.program_id(0)
        lo = tl.load(state_ptr + row * 4 + 2).to(tl.int64)
        hi = tl.load(state_ptr + row * 4 + 3).to(tl.int64)
        c = tl.arange(0, CHUNKS)
        d = tl.arange(0, PIVOTS)
        part = tl.load(part_ptr + (row * num_chunks + c[:, None]) * PIVOTS + d[None, :], mask=(c < num_chunks)[:, None],
                       other=0.0)  # [C, P]
        mass = tl.sum(part, axis=0)  # [P], chunks summed in a fixed order
        if FIRST:
            # lo is the smallest kept key: its mass is the row's whole mass, summed exactly as every pivot's is.
            total = tl.sum(tl.where(d == 0, mass, 0.0), axis=0)
            tl.store(state_ptr + row * 4 + 1, total)
        else:
            total = tl.load(state_ptr + row * 4 + 1)
        step = (hi - lo + PIVOTS) // PIVOTS
        pivots = lo + d.to(tl.int64) * step
        target = tl.load(p_ptr + row).to(tl.float64) * total
        ok = (mass >= target) & (pivots <= hi) & (d > 0)
        best = tl.max(tl.where(ok, d, 0), axis=0)  # the largest pivot still holding mass >= p (0: lo itself)
        new_lo = lo + best.to(tl.int64) * step
        new_hi = tl.where(best < PIVOTS - 1, tl.minimum(hi, new_lo + step - 1), hi)
        tl.store(state_ptr + row * 4 + 2, new_lo.to(tl.float64))
        tl.store(state_ptr + row * 4 + 3, new_hi.to(tl.float64))

    @triton.jit
    def _finish_kernel(out_ptr, state_ptr, lower_ptr, p_ptr, KEY_SHIFT: tl.constexpr):
        row = tl.program_id(0)
        key = tl.load(state_ptr + row * 4 + 2).to(tl.int32) << KEY_SHIFT
        # Inverse of _key: negative keys had their dropped low bits set by the flip.
        bits = tl.where(key < 0, (key | ((1 << KEY_SHIFT) - 1)) ^ 0x7FFFFFFF, key)
        value = bits.to(tl.float32, bitcast=True)
        lower = tl.load(lower_ptr + row)
        total = tl.load(state_ptr + row * 4 + 1)
        nothing = total <= 0.0  # nothing finite kept: the row's lower bound stands
        p = tl.load(p_ptr + row)
        tl.store(out_ptr + row, tl.where((p >= 1.0) | nothing, lower, tl.maximum(value, lower)))


def top_p_threshold_triton(
    logits: torch.Tensor,  # [B, V] float32, bf16 or fp16, unit stride along V
    p: torch.Tensor,  # [B] float32; >= 1 = off
    lower: torch.Tensor | None = None,  # [B] float32 values in logits' space (the top-k threshold); None = -inf
    temperature: torch.Tensor | None = None,  # [B] float32 > 0; None = the logits are already scaled
) -> torch.Tensor:  # [B, 1] float32, in logits' value space
    """Each row's top-p boundary value over the tokens >= lower (see the module docstring); no host sync."""
    assert logits.stride(-1) == 1
    num_rows, vocab_size = logits.shape
    device = logits.device
    out = torch.empty(num_rows, dtype=torch.float32, device=device)
    if num_rows == 0:
        return out.view(0, 1)
    key_shift = 16 if logits.dtype == torch.bfloat16 else 0  # a bf16 value's float32 bits end in 16 zeros
    num_passes = 4 if key_shift else 8  # 16 or 32 key bits, 4 bits a pass
    tiles = _TILES
    num_chunks = cdiv(cdiv(vocab_size, _BLOCK), tiles)
    chunks_pow2 = 1 << max(0, (num_chunks - 1).bit_length())
    p = p.to(device=device, dtype=torch.float32).contiguous()
    if lower is None:
        lower = torch.full((num_rows,), float("-inf"), dtype=torch.float32, device=device)
    lower = lower.to(device=device, dtype=torch.float32).reshape(num_rows).contiguous()
    temp = p if temperature is None else temperature.to(device=device, dtype=torch.float32).contiguous()
    chunk_max = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=device)
    chunk_lo = torch.empty(num_rows, num_chunks, dtype=torch.int32, device=device)
    chunk_hi = torch.empty(num_rows, num_chunks, dtype=torch.int32, device=device)
    state = torch.empty(num_rows, 4, dtype=torch.float64, device=device)
    part = torch.empty(num_rows, num_chunks, _PIVOTS, dtype=torch.float64, device=device)
    common = dict(HAS_TEMPERATURE=temperature is not None, KEY_SHIFT=key_shift)
    grid = (num_rows, num_chunks)
    _stats_kernel[grid](chunk_max, chunk_lo, chunk_hi, logits, lower, temp, logits.stride(0), vocab_size,
                        num_chunks, **common, TILES=tiles, BLOCK=_BLOCK, num_warps=4)
    _init_kernel[(num_rows,)](state, chunk_max, chunk_lo, chunk_hi, num_chunks, CHUNKS=chunks_pow2)
    # The same chunks in tiles of 256: the [tile, pivots] float64 block fits in registers.
    pass_block = _BLOCK // 4
    for i in range(num_passes):
        _pass_kernel[grid](part, state, logits, lower, temp, logits.stride(0), vocab_size, num_chunks, **common,
                           TILES=tiles * 4, BLOCK=pass_block, PIVOTS=_PIVOTS, num_warps=4)
        _update_kernel[(num_rows,)](state, part, p, num_chunks, CHUNKS=chunks_pow2, PIVOTS=_PIVOTS, FIRST=i == 0)
    _finish_kernel[(num_rows,)](out, state, lower, p, KEY_SHIFT=key_shift)
    return out.view(num_rows, 1)
