"""Top-p without a sort or a host sync: a pivot search for each row's nucleus boundary, and sampling that mostly skips it.

The boundary of a row's nucleus is the largest value t in the row whose tokens at or above it
hold mass >= p:  t = max{ v in row : sum_{x >= v} softmax(x / T) >= p }.  Such a t is always a
value of the row (mass only changes at a row value), and keeping every token >= t is exactly
the rule of engine/sample/topk_topp.py (ties with the boundary token all kept).

Mass, exactly the same wherever it is counted: each float maps to an int32 key with the same
order; a program sums exp(x / T - row max) of its chunk's tokens at or above a few pivot keys,
each lane over its own tiles in float32, then every lane's sum is cut to a multiple of 2^-40
and the lanes, chunks and rows are added as int64. Integer sums do not depend on their order,
so the mass at or above a key is one number whichever kernel, pivot count or batch computes it,
and it never grows with the key. (Lane sums are <= 8 and a row has < 2^23 tokens: no overflow.)

Search (top_p_threshold_triton): keep keys [lo, hi] with mass(>= lo) >= p and mass(>= hi + 1)
< p; each pass counts the mass at 16 evenly spaced pivots in one read of the row. bf16 logits
(straight from the model) have 2^16 keys: 4 passes; float32 8.

Sampling (top_p_sample_triton): Gumbel-max over the tokens >= lower picks a candidate c; c is in
the nucleus iff mass(> x_c) < p, one cheap count. If it is, c is also the Gumbel-max over the
nucleus (a subset holding it), so it is the token. If not, every nucleus token lies above x_c:
sample again over those. Most rows accept at once (a draw lands outside the nucleus with
probability <= 1 - p); the few left after `rounds` take the search, and only they do the work
(every kernel skips rows marked done). Same tokens as the search then one thresholded draw,
because both decide membership on the same integer masses.

Each kernel runs one program per (row, chunk); the row's last program to finish (an atomic
count) combines the chunks, so a pass is one launch. Every launch count is fixed, so nothing
waits on the host and async scheduling keeps overlapping steps. Rows with p >= 1 keep every token >= `lower` (the top-k threshold, or -inf);
tokens below it are out of the nucleus and carry no mass (top-k first, then top-p).
"""

from __future__ import annotations

import torch

from engine.kernels import cdiv
from engine.kernels.sampling import gumbel_sample_triton

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

_BLOCK = 1024  # the stats pass's tile; the counting passes read the same chunks in tiles of _BLOCK // 4
_PIVOTS = 16  # subintervals per search pass: pivot 0 is lo itself (known to hold mass >= p)
# Tiles of _BLOCK per (row, chunk) program: fixed, so a lane's float32 sum runs over the same
# tokens in the same order in any batch.
_TILES = 2


if triton is not None:

    @triton.jit
    def _key(x, KEY_SHIFT: tl.constexpr):
        """float32 -> int32 with the same order (-0.0 just below +0.0); >> KEY_SHIFT drops bits 16-bit floats never set."""
        b = x.to(tl.int32, bitcast=True)
        b = tl.where(b < 0, b ^ 0x7FFFFFFF, b)
        return b >> KEY_SHIFT

    @triton.jit
    def _value(key, KEY_SHIFT: tl.constexpr):
        """The float32 of a key (the inverse of _key): negative keys had their dropped low bits set by the flip."""
        key = key << KEY_SHIFT
        bits = tl.where(key < 0, (key | ((1 << KEY_SHIFT) - 1)) ^ 0x7FFFFFFF, key)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _scaled(x, inv_temp, HAS_TEMPERATURE: tl.constexpr):
        # x / T as x * float32(1 / T): within an ulp of the division, and the same in every kernel here.
        if HAS_TEMPERATURE:
            x = x * inv_temp
        return x

    @triton.jit
    def _inv_temp(temp_ptr, row, HAS_TEMPERATURE: tl.constexpr):
        inv_temp = 1.0
        if HAS_TEMPERATURE:
            inv_temp = 1.0 / tl.load(temp_ptr + row)
        return inv_temp

    @triton.jit
    def _lower(lower_ptr, row, HAS_LOWER: tl.constexpr):
        lower = float("-inf")
        if HAS_LOWER:
            lower = tl.load(lower_ptr + row)
        return lower

    @triton.jit
    def _holds(mass, total, p):
        """Whether `mass` (int64) is at least the fraction p of the row's `total`: the one comparison every kernel makes."""
        return mass.to(tl.float64) >= p.to(tl.float64) * total.to(tl.float64)

    @triton.jit
    def _chunk_mass(
        base, chunk, V, lower, inv_temp, row_max, pivots,  # pivots: [PIVOTS] int32 keys
        HAS_TEMPERATURE: tl.constexpr, KEY_SHIFT: tl.constexpr, TILES: tl.constexpr, BLOCK: tl.constexpr,
        PIVOTS: tl.constexpr,
    ):
        """The chunk's mass at or above each pivot, int64 [PIVOTS] (see the module docstring: the same for any PIVOTS)."""
        acc = tl.zeros([BLOCK, PIVOTS], dtype=tl.float32)
        for t in range(TILES):
            v = (chunk * TILES + t) * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(base + v, mask=v < V, other=float("-inf")).to(tl.float32)
            kept = (x >= lower) & (x > float("-inf"))
            w = tl.where(kept, tl.exp(_scaled(x, inv_temp, HAS_TEMPERATURE) - row_max), 0.0)  # [BLOCK], <= 1
            key = _key(x, KEY_SHIFT)
            acc += tl.where(key[:, None] >= pivots[None, :], w[:, None], 0.0)  # [BLOCK, P]
        return tl.sum((acc * 1099511627776.0).to(tl.int64), axis=0)  # x 2^40: units of 2^-40 of the row's top weight, truncated

    @triton.jit
    def _last_of_row(count_ptr, row, num_chunks):
        """Counts this program's chunk as finished (its stores before it): True for the row's last one, which then
        reads every chunk's result (loads .cg, past L1) and resets the counter for the next kernel."""
        last = tl.atomic_add(count_ptr + row, 1, sem="acq_rel") == num_chunks - 1
        if last:
            tl.store(count_ptr + row, 0)
        return last

    @triton.jit(do_not_specialize=["num_chunks"])
    def _stats_kernel(
        chunk_ptr,  # [B, C, 3] int32 scratch: the chunk's max of x / T (float bits), min and max kept key
        row_max_ptr,  # [B] float32 out
        state_ptr,  # [B, 4] int64 out: total mass Z (set by the first count), lo, hi, smallest kept key
        done_ptr, thr_ptr,  # [B] int32 / float32 out: p >= 1 (nothing to decide), lower
        count_ptr, logits_ptr, lower_ptr, temp_ptr, p_ptr, stride_row, V, num_chunks,
        HAS_LOWER: tl.constexpr, HAS_TEMPERATURE: tl.constexpr, KEY_SHIFT: tl.constexpr, TILES: tl.constexpr,
        BLOCK: tl.constexpr, CHUNKS: tl.constexpr,
    ):
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        lower = _lower(lower_ptr, row, HAS_LOWER)
        inv_temp = _inv_temp(temp_ptr, row, HAS_TEMPERATURE)
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
        out = (row * num_chunks + chunk) * 3
        tl.store(chunk_ptr + out, tl.max(m, axis=0).to(tl.int32, bitcast=True))
        tl.store(chunk_ptr + out + 1, tl.min(kmin, axis=0))
        tl.store(chunk_ptr + out + 2, tl.max(kmax, axis=0))
        if _last_of_row(count_ptr, row, num_chunks):
            c = tl.arange(0, CHUNKS)
            mask = c < num_chunks
            at = chunk_ptr + (row * num_chunks + c) * 3
            maxes = tl.load(at, mask=mask, other=0, cache_modifier=".cg").to(tl.float32, bitcast=True)
            row_max = tl.max(tl.where(mask, maxes, float("-inf")), axis=0)
            lo = tl.min(tl.load(at + 1, mask=mask, other=2147483647, cache_modifier=".cg"), axis=0)
            hi = tl.max(tl.load(at + 2, mask=mask, other=-2147483647, cache_modifier=".cg"), axis=0)
            hi = tl.maximum(hi, lo)  # nothing kept (lo = INT_MAX): an empty interval stays put
            tl.store(row_max_ptr + row, row_max)
            tl.store(state_ptr + row * 4 + 0, 0)
            tl.store(state_ptr + row * 4 + 1, lo.to(tl.int64))
            tl.store(state_ptr + row * 4 + 2, hi.to(tl.int64))
            tl.store(state_ptr + row * 4 + 3, lo.to(tl.int64))
            tl.store(done_ptr + row, (tl.load(p_ptr + row) >= 1.0).to(tl.int32))
            tl.store(thr_ptr + row, lower)

    @triton.jit
    def _row_mass(part_ptr, row, num_chunks, CHUNKS: tl.constexpr, PIVOTS: tl.constexpr, USED: tl.constexpr):
        """The row's mass at each of its first USED pivots ([USED] int64): every chunk's counts added (by the last)."""
        c = tl.arange(0, CHUNKS)
        d = tl.arange(0, USED)
        part = tl.load(part_ptr + (row * num_chunks + c[:, None]) * PIVOTS + d[None, :], mask=(c < num_chunks)[:, None],
                       other=0, cache_modifier=".cg")  # [C, USED]
        return tl.sum(part, axis=0)

    @triton.jit(do_not_specialize=["num_chunks"])
    def _pass_kernel(
        part_ptr,  # [B, C, PIVOTS] int64 scratch: the chunk's mass at or above each pivot
        state_ptr, row_max_ptr, done_ptr, out_ptr, count_ptr, logits_ptr, lower_ptr, temp_ptr, p_ptr, stride_row, V,
        num_chunks,
        HAS_LOWER: tl.constexpr, HAS_TEMPERATURE: tl.constexpr, KEY_SHIFT: tl.constexpr, TILES: tl.constexpr,
        BLOCK: tl.constexpr, PIVOTS: tl.constexpr, CHUNKS: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr,
    ):
        """One search pass: count the mass at 16 pivots in [lo, hi]; the row's last chunk narrows [lo, hi] to the
        subinterval holding the boundary (and after the LAST pass writes the boundary value to out)."""
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        if tl.load(done_ptr + row) == 0:
            lo = tl.load(state_ptr + row * 4 + 1)
            hi = tl.load(state_ptr + row * 4 + 2)
            step = (hi - lo + PIVOTS) // PIVOTS  # ceil((hi - lo + 1) / PIVOTS) >= 1
            d = tl.arange(0, PIVOTS)
            # Pivots above hi count nothing that matters; capped at hi + 1 they fit in int32 (keys stay below 2^31 - 1).
            pivots = tl.minimum(lo + d.to(tl.int64) * step, hi + 1).to(tl.int32)  # [P]
            lower = _lower(lower_ptr, row, HAS_LOWER)
            mass = _chunk_mass(logits_ptr + row.to(tl.int64) * stride_row, chunk, V, lower,
                               _inv_temp(temp_ptr, row, HAS_TEMPERATURE), tl.load(row_max_ptr + row), pivots,
                               HAS_TEMPERATURE, KEY_SHIFT, TILES, BLOCK, PIVOTS)
            tl.store(part_ptr + (row * num_chunks + chunk) * PIVOTS + d, mass)
            if _last_of_row(count_ptr, row, num_chunks):
                mass = _row_mass(part_ptr, row, num_chunks, CHUNKS, PIVOTS, PIVOTS)
                if FIRST:
                    # lo is the smallest kept key: its mass is the row's whole mass.
                    total = tl.sum(tl.where(d == 0, mass, 0), axis=0)
                    tl.store(state_ptr + row * 4 + 0, total)
                else:
                    total = tl.load(state_ptr + row * 4 + 0)
                ok = _holds(mass, total, tl.load(p_ptr + row)) & (lo + d.to(tl.int64) * step <= hi) & (d > 0)
                best = tl.max(tl.where(ok, d, 0), axis=0)  # the largest pivot still holding mass >= p (0: lo itself)
                new_lo = lo + best.to(tl.int64) * step
                new_hi = tl.where(best < PIVOTS - 1, tl.minimum(hi, new_lo + step - 1), hi)
                tl.store(state_ptr + row * 4 + 1, new_lo)
                tl.store(state_ptr + row * 4 + 2, new_hi)
                if LAST:  # lo = hi: the boundary key (nothing finite kept: the lower bound stands)
                    value = _value(new_lo.to(tl.int32), KEY_SHIFT)
                    tl.store(out_ptr + row, tl.where(total <= 0, lower, tl.maximum(value, lower)))

    @triton.jit(do_not_specialize=["num_chunks"])
    def _check_kernel(
        part_ptr,  # [B, C, PIVOTS] int64 scratch: columns 0, 1 = the chunk's whole mass, its mass above the candidate
        done_ptr, thr_ptr,  # [B] int32 and float32, updated: accepted rows are done; the rest draw above the candidate
        token_ptr, state_ptr, row_max_ptr, count_ptr, logits_ptr, lower_ptr, temp_ptr, p_ptr, stride_row, V,
        num_chunks,
        HAS_LOWER: tl.constexpr, HAS_TEMPERATURE: tl.constexpr, KEY_SHIFT: tl.constexpr, TILES: tl.constexpr,
        BLOCK: tl.constexpr, PIVOTS: tl.constexpr, CHUNKS: tl.constexpr,
    ):
        """Whether each row's drawn token lies in its nucleus: iff what lies strictly above it falls short of p."""
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        if tl.load(done_ptr + row) == 0:
            base = logits_ptr + row.to(tl.int64) * stride_row
            cand = _key(tl.load(base + tl.load(token_ptr + row)).to(tl.float32), KEY_SHIFT)
            d = tl.arange(0, 2)
            smallest = tl.load(state_ptr + row * 4 + 3).to(tl.int32)
            pivots = tl.where(d == 0, smallest, cand + 1)  # mass(>= smallest kept key) is the whole row's
            mass = _chunk_mass(base, chunk, V, _lower(lower_ptr, row, HAS_LOWER),
                               _inv_temp(temp_ptr, row, HAS_TEMPERATURE), tl.load(row_max_ptr + row), pivots,
                               HAS_TEMPERATURE, KEY_SHIFT, TILES, BLOCK, 2)
            tl.store(part_ptr + (row * num_chunks + chunk) * PIVOTS + d, mass)
            if _last_of_row(count_ptr, row, num_chunks):
                mass = _row_mass(part_ptr, row, num_chunks, CHUNKS, PIVOTS, 2)
                total = tl.sum(tl.where(d == 0, mass, 0), axis=0)
                above = tl.sum(tl.where(d == 1, mass, 0), axis=0)
                tl.store(state_ptr + row * 4 + 0, total)
                # Nothing kept (total 0): nothing to refine, the draw stands.
                accepted = (total <= 0) | (_holds(above, total, tl.load(p_ptr + row)) == 0)
                tl.store(done_ptr + row, accepted.to(tl.int32))
                thr = tl.load(thr_ptr + row)
                tl.store(thr_ptr + row, tl.where(accepted, thr, _value(cand + 1, KEY_SHIFT)))


class _Rows:
    """One batch's scratch and launch arguments, with the stats pass run (row max, kept key range, done, thr)."""

    def __init__(self, logits: torch.Tensor, p: torch.Tensor, lower: torch.Tensor | None,
                 temperature: torch.Tensor | None):
        assert logits.stride(-1) == 1
        self.logits = logits
        self.num_rows, self.vocab_size = num_rows, vocab_size = logits.shape
        assert vocab_size < 2**23, "int64 mass sums need fewer than 2^23 tokens a row"
        device = logits.device
        self.num_chunks = num_chunks = cdiv(cdiv(vocab_size, _BLOCK), _TILES)
        self.p = p if p.dtype == torch.float32 and p.is_contiguous() else p.to(torch.float32).contiguous()
        self.lower = self.p if lower is None else lower.to(torch.float32).reshape(num_rows).contiguous()
        self.temp = self.p if temperature is None else temperature.to(torch.float32).contiguous()
        self.args = dict(HAS_LOWER=lower is not None, HAS_TEMPERATURE=temperature is not None,
                         KEY_SHIFT=16 if logits.dtype == torch.bfloat16 else 0,  # bf16's float32 bits end in 16 zeros
                         CHUNKS=1 << max(0, (num_chunks - 1).bit_length()))
        self.row_max = torch.empty(num_rows, dtype=torch.float32, device=device)
        self.state = torch.empty(num_rows, 4, dtype=torch.int64, device=device)
        self.done = torch.empty(num_rows, dtype=torch.int32, device=device)  # the stats pass sets p >= 1
        self.thr = torch.empty(num_rows, dtype=torch.float32, device=device)  # the stats pass sets `lower`
        self.part = torch.empty(num_rows, num_chunks, _PIVOTS, dtype=torch.int64, device=device)
        self.count = torch.zeros(num_rows, dtype=torch.int32, device=device)  # every kernel leaves it zero
        self.grid = (num_rows, num_chunks)
        chunk_stats = self.part.view(torch.int32)  # scratch until the first count
        _stats_kernel[self.grid](chunk_stats, self.row_max, self.state, self.done, self.thr, self.count, logits,
                                 self.lower, self.temp, self.p, logits.stride(0), vocab_size, num_chunks, **self.args,
                                 TILES=_TILES, BLOCK=_BLOCK, num_warps=4)

    def search(self) -> None:
        """Writes the boundary value of every row not done into thr."""
        num_passes = 4 if self.args["KEY_SHIFT"] else 8  # 16 or 32 key bits, 4 bits a pass
        for i in range(num_passes):
            # The same chunks in tiles of _BLOCK // 4: the [tile, pivots] block fits in registers.
            _pass_kernel[self.grid](self.part, self.state, self.row_max, self.done, self.thr, self.count, self.logits,
                                    self.lower, self.temp, self.p, self.logits.stride(0), self.vocab_size,
                                    self.num_chunks, **self.args, TILES=_TILES * 4, BLOCK=_BLOCK // 4,
                                    PIVOTS=_PIVOTS, FIRST=i == 0, LAST=i == num_passes - 1, num_warps=4)

    def check(self, tokens: torch.Tensor) -> None:
        """Marks done every row whose drawn token is in its nucleus; raises the others' thr just above it."""
        _check_kernel[self.grid](self.part, self.done, self.thr, tokens, self.state, self.row_max, self.count,
                                 self.logits, self.lower, self.temp, self.p, self.logits.stride(0), self.vocab_size,
                                 self.num_chunks, **self.args, TILES=_TILES * 4, BLOCK=_BLOCK // 4, PIVOTS=_PIVOTS,
                                 num_warps=4)


def top_p_threshold_triton(
    logits: torch.Tensor,  # [B, V] float32, bf16 or fp16, unit stride along V
    p: torch.Tensor,  # [B] float32; >= 1 = off
    lower: torch.Tensor | None = None,  # [B] float32 values in logits' space (the top-k threshold); None = -inf
    temperature: torch.Tensor | None = None,  # [B] float32 > 0; None = the logits are already scaled
) -> torch.Tensor:  # [B, 1] float32, in logits' value space
    """Each row's top-p boundary value over the tokens >= lower (see the module docstring); no host sync."""
    num_rows = logits.shape[0]
    if num_rows == 0:
        return torch.empty(0, 1, dtype=torch.float32, device=logits.device)
    rows = _Rows(logits, p, lower, temperature)
    rows.search()  # rows with p >= 1 are done and keep `lower`
    return rows.thr.view(num_rows, 1)


def top_p_sample_triton(
    logits: torch.Tensor,  # [B, V] float32, bf16 or fp16, unit stride along V
    keys: torch.Tensor,  # [B] int64 sampling keys (engine/kernels/sampling.py); < 0 = greedy
    p: torch.Tensor,  # [B] float32; >= 1 = off (greedy rows pass 1)
    lower: torch.Tensor | None = None,  # [B] float32, the top-k threshold; None = -inf
    temperature: torch.Tensor | None = None,  # [B] float32 > 0 for the draw (greedy rows: ignored)
    nucleus_temperature: torch.Tensor | None = None,  # [B] float32 > 0 for the mass (greedy rows pass 1)
    rounds: int = 1,
) -> torch.Tensor:  # [B] int64
    """The Gumbel-max token over each row's top-k-then-top-p set (see the module docstring); no host sync.

    The same token as gumbel_sample_triton(logits, keys, temperature, threshold) with the threshold
    of top_p_threshold_triton(logits, p, lower, nucleus_temperature)."""
    num_rows = logits.shape[0]
    if num_rows == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    rows = _Rows(logits, p, lower, nucleus_temperature)
    tokens = gumbel_sample_triton(logits, keys, temperature, None if lower is None else rows.lower)
    for i in range(rounds):
        rows.check(tokens)
        if i < rounds - 1:
            gumbel_sample_triton(logits, keys, temperature, rows.thr, done=rows.done, out=tokens)
    rows.search()  # the rows still undecided: their exact boundary (from `lower`, not the raised bound)
    gumbel_sample_triton(logits, keys, temperature, rows.thr, done=rows.done, out=tokens)
    return tokens
