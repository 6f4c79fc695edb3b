"""Batch-independent sampling in one pass over the logits: Triton kernel and its torch reference.

Gumbel-max with counter-based noise: token = argmax(logits[v] / T - log(-log u(key, v))),
where u is a hash of the row's 63-bit key and the vocabulary index. A row's key comes from
its own (seed, position) when seeded, so its token depends on nothing else in the batch; no
softmax, sort or generator state is needed. Rows with key < 0 are greedy (no noise, no T).
The hash uses only 32-bit products taken mod 2^32, so torch (int64, masked) and Triton
(uint32) compute the same u. The temperature T is optional: passing it lets the kernel read
the model's bf16 logits directly, upcasting and dividing in registers (the same float32
values as a separate `logits.float() / T`, without writing them out).

Resolution: u takes 2^23 values in [2^-24, 1 - 2^-24], so the noise lies in about [-2.8, 16.6]
and a token more than ~19.4 nats below its row's best can never be drawn (its exact
probability is below e^-19.4 ~ 4e-9; at most V * 4e-9 of mass, in practice far less).
"""

from __future__ import annotations

import numpy as np
import torch

from engine.kernels import cdiv, next_power_of_2, use_triton

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


def _apply_temperature_ref(logits: torch.Tensor, keys: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
    """float32 logits / T per row; greedy rows (key < 0) divide by 1, so they keep their values exactly."""
    logits = logits.to(torch.float32)
    if temperature is None:
        return logits
    temp = temperature.to(device=logits.device, dtype=torch.float32)  # [B]
    return logits / torch.where(keys < 0, torch.ones_like(temp), temp).unsqueeze(1)


def gumbel_sample_simple_ref(
    logits: torch.Tensor,  # [B, V] float32, masks already applied
    keys: torch.Tensor,  # [B] int64; < 0 means greedy
    temperature: torch.Tensor | None = None,  # [B] float32; None = already applied
) -> torch.Tensor:  # [B] int64
    """The definition, written plainly: argmax(logits / T + Gumbel(key)) per row; greedy rows take argmax(logits)."""
    logits = _apply_temperature_ref(logits, keys, temperature)
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
    logits: torch.Tensor,  # [B, V] any float dtype, masks already applied
    keys: torch.Tensor,  # [B] int64; < 0 means greedy
    temperature: torch.Tensor | None = None,  # [B] float32; None = already applied
) -> torch.Tensor:  # [B] int64
    """argmax(logits / T + Gumbel(key)) per row in float32; greedy rows take argmax(logits).

    Same tokens as gumbel_sample_simple_ref (the same u bit for bit, the same float ops), but
    in int32 and in blocks of rows that fit in cache (about 4x less memory traffic on CPU).
    When every row has few finite logits (top-k / top-p masked the rest), the noise is
    computed only at each row's finite candidates: -inf + noise never wins, and a tie of
    scores still goes to the lowest token index, as in argmax.
    """
    num_rows, vocab_size = logits.shape
    if num_rows == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    logits = _apply_temperature_ref(logits, keys, temperature)  # [B, V] float32
    max_finite = _max_finite(logits)
    dense = not 0 < max_finite <= vocab_size // _SPARSE_FRACTION
    if dense and logits.device.type == "cpu":
        return _gumbel_dense_cpu(logits, keys)
    greedy = keys < 0
    k = keys.clamp_min(0)
    k0 = torch.where((k & _M32) >= 2**31, (k & _M32) - 2**32, k & _M32).to(torch.int32)  # [B] low word
    k1 = torch.where((k >> 32) >= 2**31, (k >> 32) - 2**32, k >> 32).to(torch.int32)  # [B] high word
    if not dense:
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


def _max_finite(logits: torch.Tensor) -> int:
    """The most finite logits any row has (float32 [B, V]); on CPU a numpy pass (torch's boolean reductions
    cost several times more there), and at once V when no logit is -inf (nothing masked: the usual case)."""
    if logits.device.type != "cpu":
        return int((logits > float("-inf")).sum(dim=-1).max())
    values = logits.numpy()
    if not np.isneginf(values.min()):
        return logits.shape[1]
    return int(np.count_nonzero(values > -np.inf, axis=1).max())


_GOLDEN_U32 = np.uint32(0x9E3779B1)
_C1_U32, _C2_U32 = np.uint32(0x85EBCA6B), np.uint32(0xC2B2AE35)


def _fmix32_u32_(h: np.ndarray, tmp: np.ndarray) -> None:
    """_fmix32_ref on uint32 in place (numpy: shifts are logical and products wrap mod 2^32 by themselves)."""
    for shift, factor in ((16, _C1_U32), (13, _C2_U32)):
        np.right_shift(h, shift, out=tmp)
        h ^= tmp
        h *= factor
    np.right_shift(h, 16, out=tmp)
    h ^= tmp


def _gumbel_dense_cpu(logits: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:  # [B] int64
    """The dense branch of gumbel_sample_ref on CPU: the same u bit for bit and the same float32 ops, with the
    integer hash and the argmax in numpy over the tensors' memory (torch's int32 ops and argmax are several
    times slower there on small rows; the log stays torch's, so the noise is its values exactly).

    logits: float32 [B, V], already divided by the temperature; keys as gumbel_sample_ref's."""
    num_rows, vocab_size = logits.shape
    k = keys.clamp_min(0).numpy()
    k0 = (k & _M32).astype(np.uint32)  # [B] low word
    k1 = (k >> 32).astype(np.uint32)  # [B] high word
    out = np.empty(num_rows, dtype=np.int64)
    rows_per_block = max(1, _BLOCK_ELEMENTS // max(1, vocab_size))
    golden = np.arange(vocab_size, dtype=np.uint32) * _GOLDEN_U32  # [V], wraps mod 2^32
    values = logits.numpy()
    greedy = keys.numpy() < 0
    any_greedy = bool(greedy.any())
    for start in range(0, num_rows, rows_per_block):
        end = min(num_rows, start + rows_per_block)
        h = np.bitwise_xor(golden[None, :], k0[start:end, None])  # [b, V]
        tmp = np.empty_like(h)
        _fmix32_u32_(h, tmp)
        h ^= k1[start:end, None]
        _fmix32_u32_(h, tmp)
        h >>= 9  # the top 23 bits
        u = torch.from_numpy(h.astype(np.float32)).mul_(2.0**-23).add_(2.0**-24)  # (2m + 1) * 2^-24, exact
        log_e = u.log_().neg_().log_()  # log(-log u): minus the noise
        scores = torch.sub(logits[start:end], log_e, out=log_e).numpy()  # logits + noise
        if any_greedy:
            rows = greedy[start:end]
            scores[rows] = values[start:end][rows]
        out[start:end] = scores.argmax(axis=-1)  # the first index at the maximum, as torch's argmax
    return torch.from_numpy(out)


# The Triton path splits each row into chunks of whole BLOCK-sized tiles: one program per
# (row, chunk) writes the chunk's (best score, lowest index at it), a second kernel reduces a
# row's partials. Taking the max and then the lowest index at it is associative, so the token
# is the same for any chunking (and the same as a one-program-per-row scan).
#
#   row r:  | chunk 0: tiles 0..t-1 | chunk 1: tiles t..2t-1 | ... | chunk C-1 (may be short) |
#              -> (val[r,0], idx[r,0])  (val[r,1], idx[r,1])  ...      -> out[r]
_BLOCK = 1024
# Chunk lengths the heuristic picks from, in tiles: each is a compiled variant (TILES is a
# constexpr, which also keeps the loop bound a plain int for the interpreter).
_TILES_PER_CHUNK = (1, 2, 8)
# Use a longer chunk once it still leaves at least this many (row, chunk) programs: a few
# waves of the GPU, so a large batch pays less per-program overhead and a single row still
# spreads over all SMs.
_MIN_PROGRAMS = 4096


def gumbel_tiles_per_chunk(num_rows: int, vocab_size: int) -> int:
    """Tiles per chunk for the Triton path: one for small batches, longer chunks for large ones."""
    num_tiles = cdiv(max(1, vocab_size), _BLOCK)
    best = _TILES_PER_CHUNK[0]
    for tiles in _TILES_PER_CHUNK:
        if num_rows * cdiv(num_tiles, tiles) >= _MIN_PROGRAMS:
            best = tiles
    return best


def gumbel_row_classes(vocab_size: int, max_rows: int) -> list[int]:
    """The smallest row count for each chunk length the heuristic picks up to max_rows (each is a compiled
    variant, so the engine's warm-up samples once at each)."""
    rows: dict[int, int] = {}
    for n in range(1, max(1, max_rows) + 1):
        rows.setdefault(gumbel_tiles_per_chunk(n, vocab_size), n)
    return sorted(rows.values())


if triton is not None:

    @triton.jit
    def _fmix32_u32(h):  # uint32 in, uint32 out: products wrap mod 2^32 and shifts are logical, as in _fmix32_ref
        h = h ^ (h >> 16)
        h = h * 0x85EBCA6B
        h = h ^ (h >> 13)
        h = h * 0xC2B2AE35
        return h ^ (h >> 16)

    # Row and chunk counts change every step: not specialized, so one compiled kernel serves all.
    @triton.jit(do_not_specialize=["num_chunks"])
    def _gumbel_partial_kernel(
        val_ptr,  # [B, C] float32: each chunk's best score
        idx_ptr,  # [B, C] int32: lowest token index with that score
        logits_ptr,  # [B, V] any float dtype, unit stride along V
        keys_ptr,  # [B] int64; < 0 means greedy
        temp_ptr,  # [B] float32, read only when HAS_TEMPERATURE
        thr_ptr,  # [B] float32, read only when HAS_THRESHOLD: tokens below it are out (top-k / top-p)
        done_ptr,  # [B] int32, read only when HAS_DONE: rows != 0 are skipped (their token already stands)
        stride_row,
        V,
        num_chunks,
        HAS_TEMPERATURE: tl.constexpr,
        HAS_THRESHOLD: tl.constexpr,
        HAS_DONE: tl.constexpr,
        TILES: tl.constexpr,  # BLOCK-sized tiles per chunk
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        if HAS_DONE:
            if tl.load(done_ptr + row) != 0:
                return
        key = tl.load(keys_ptr + row)
        greedy = key < 0
        key = tl.maximum(key, 0)
        k0 = (key & 0xFFFFFFFF).to(tl.uint32)
        k1 = ((key >> 32) & 0xFFFFFFFF).to(tl.uint32)
        if HAS_TEMPERATURE:
            # x / T as float32(x * RN64(1 / T)): the product is within 2^-52 (relative) of x / T,
            # while x / T is either a float32 or at least 2^-49 away from a float32 rounding
            # midpoint (a midpoint has 25 significant bits, and x, T have 24), so rounding the
            # product gives exactly the correctly rounded x / T of torch's division, without
            # div.rn's per-element slow-path branch. Greedy rows multiply by 1 (exact).
            inv_temp = 1.0 / tl.load(temp_ptr + row).to(tl.float64)  # div.rn.f64: correctly rounded
            inv_temp = tl.where(greedy, 1.0, inv_temp)
        if HAS_THRESHOLD:
            threshold = tl.load(thr_ptr + row)
        best_val = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
        best_idx = tl.zeros([BLOCK], dtype=tl.int32)
        base = logits_ptr + row.to(tl.int64) * stride_row
        # The last chunk's tiles past V are fully masked (fewer than TILES of them per row).
        for t in range(TILES):
            v = (chunk * TILES + t) * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(base + v, mask=v < V, other=float("-inf")).to(tl.float32)
            if HAS_THRESHOLD:
                x = tl.where(x >= threshold, x, float("-inf"))  # compared unscaled, as the threshold was found
            if HAS_TEMPERATURE:
                x = (x.to(tl.float64) * inv_temp).to(tl.float32)
            h = v.to(tl.uint32) * 0x9E3779B1 ^ k0
            h = _fmix32_u32(_fmix32_u32(h) ^ k1)
            u = ((h >> 9) * 2 + 1).to(tl.float32) * (1.0 / 16777216.0)  # exact: < 2^24
            noise = -tl.log(-tl.log(u))
            val = tl.where(greedy, x, x + noise)
            better = val > best_val  # strict: earlier indices win ties within a lane
            best_val = tl.where(better, val, best_val)
            best_idx = tl.where(better, v, best_idx)
        top = tl.max(best_val, axis=0)
        # Lowest index among lanes holding the maximum (torch.argmax's tie rule); a chunk with
        # nothing above -inf reports index 0, as the one-pass scan did for such a row.
        idx = tl.min(tl.where(best_val == top, best_idx, V), axis=0)
        tl.store(val_ptr + row * num_chunks + chunk, top)
        tl.store(idx_ptr + row * num_chunks + chunk, idx)

    @triton.jit(do_not_specialize=["num_chunks"])
    def _argmax_partials_kernel(out_ptr, val_ptr, idx_ptr, done_ptr, num_chunks, V, CHUNKS: tl.constexpr,
                                HAS_DONE: tl.constexpr):
        row = tl.program_id(0)
        if HAS_DONE:
            if tl.load(done_ptr + row) != 0:
                return
        c = tl.arange(0, CHUNKS)
        mask = c < num_chunks
        vals = tl.load(val_ptr + row * num_chunks + c, mask=mask, other=float("-inf"))
        idxs = tl.load(idx_ptr + row * num_chunks + c, mask=mask, other=V)
        top = tl.max(vals, axis=0)
        # Chunks are in index order and each holds its lowest index, so this is the row's lowest.
        idx = tl.min(tl.where(vals == top, idxs, V), axis=0)
        tl.store(out_ptr + row, idx.to(tl.int64))


def gumbel_sample_triton(
    logits: torch.Tensor,
    keys: torch.Tensor,
    temperature: torch.Tensor | None = None,
    threshold: torch.Tensor | None = None,
    *,
    tiles_per_chunk: int | None = None,
    done: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Triton path of gumbel_sample; tiles_per_chunk overrides the chunking heuristic (tests, tuning).

    With done ([B] int32) and out ([B] int64), rows with done != 0 are skipped and keep their token in out."""
    assert (done is None) == (out is None)
    if logits.stride(-1) != 1:
        assert done is None
        return gumbel_sample_ref(_below_threshold_out(logits, threshold), keys, temperature)
    num_rows, vocab_size = logits.shape
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    num_tiles = cdiv(vocab_size, _BLOCK)
    tiles = gumbel_tiles_per_chunk(num_rows, vocab_size) if tiles_per_chunk is None else tiles_per_chunk
    tiles = max(1, min(tiles, num_tiles))
    num_chunks = cdiv(num_tiles, tiles)
    vals = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=logits.device)  # [B, C]
    idxs = torch.empty(num_rows, num_chunks, dtype=torch.int32, device=logits.device)  # [B, C]
    temp = keys if temperature is None else temperature.to(device=logits.device, dtype=torch.float32)  # [B]
    thr = keys if threshold is None else threshold.to(device=logits.device, dtype=torch.float32).reshape(num_rows)
    _gumbel_partial_kernel[(num_rows, num_chunks)](
        vals,
        idxs,
        logits,
        keys,
        temp,
        thr,
        keys if done is None else done,
        logits.stride(0),
        vocab_size,
        num_chunks,
        HAS_TEMPERATURE=temperature is not None,
        HAS_THRESHOLD=threshold is not None,
        HAS_DONE=done is not None,
        TILES=tiles,
        BLOCK=_BLOCK,
        num_warps=4,
    )
    # CHUNKS depends on the vocabulary only, so the reduce kernel compiles once per model.
    _argmax_partials_kernel[(num_rows,)](out, vals, idxs, keys if done is None else done, num_chunks, vocab_size,
                                         CHUNKS=next_power_of_2(num_tiles), HAS_DONE=done is not None)
    return out


def _below_threshold_out(logits: torch.Tensor, threshold: torch.Tensor | None) -> torch.Tensor:
    """A copy of logits with every token below its row's threshold ([B] or [B, 1], in logits' unscaled values) at
    -inf; logits itself without one."""
    if threshold is None:
        return logits
    return logits.masked_fill(logits < threshold.reshape(-1, 1).to(logits.device), float("-inf"))


def gumbel_sample(logits: torch.Tensor, keys: torch.Tensor, temperature: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row; Triton on GPU, the reference on CPU."""
    if use_triton(logits):
        return gumbel_sample_triton(logits, keys, temperature)
    return gumbel_sample_ref(logits, keys, temperature)
