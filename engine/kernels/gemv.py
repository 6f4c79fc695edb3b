"""Small-M linear (GEMV-like, for decode): a bandwidth-bound Triton kernel beside F.linear as its reference.

At M <= MAX_M rows the op reads N*K weights once and does only M multiply-adds per weight, so
its floor is weight bytes / HBM bandwidth; cuBLAS picks GEMM tiles that leave most of the
bandwidth unused there. Each program streams a [BLOCK_N, K-range] slab of W, multiplies it by
all M rows of x at once and accumulates in float32:

    x [M, K]      W [N, K] (nn.Linear layout)          out [M, N]
    ----------    +------------------+  <- pid_n      -----------
    all rows  .   | BLOCK_N rows     |  split 0 | 1  = BLOCK_N cols
                  +------------------+

With few column blocks (small N, large K) the K range is split over SPLIT_K programs: each
writes float32 partial sums to a [M, SPLIT_K, N] buffer, and a second kernel sums them, adds
the bias and casts. No host reads, no data-dependent host branches: the whole path can be
captured in a CUDA graph. Two inner products: "dot" (tl.dot with x padded to 16 rows: tensor
cores, W staged through shared memory by the software pipeline) for any M, and "fma" for M == 1
(a plain GEMV: W straight from global into registers, multiplied by the broadcast x row).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kernels import batch_invariant, cdiv, cpu_linear, next_power_of_2, use_triton
from engine.kernels.pdl import pdl_args

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference is all there is
    triton = None
else:
    from engine.kernels.pdl import wait_inputs

# ---- dispatch and config constants (benchmarks/gemv_configs.py measures them) -------------------------
# Rows up to which the kernel may be used. At M <= 16 the op stays far below the H200's ridge point
# (~790 TFLOP/s / ~4.3 TB/s = ~180 FLOP per byte; here M FLOP per weight byte), and one tl.dot tile of
# 16 rows covers every row, so W is streamed exactly once; past 16 a second row block would re-read W.
# One row always takes the kernel (the "fma" GEMV: 1.18 ms against 1.46 ms with cuBLAS for a 0.6B
# decode step, h200-decode-latency*.json). 2-16 rows take it only for shapes in CONFIG_TABLE, i.e.
# where benchmarks/gemv_configs.py measured a config beating cuBLAS (its heuristic configs did not:
# a 16-row 0.6B step took 1.95 ms against 1.80 with cuBLAS); every other shape stays on cuBLAS.
# ROLLOUT_GEMV_MAX_M overrides the bound (0: cuBLAS everywhere; 1: one-row calls only).
MAX_M = int(os.environ.get("ROLLOUT_GEMV_MAX_M", "16"))
NUM_SMS = 132  # H200
# Programs to aim for: several waves of resident programs so that enough loads are in flight.
TARGET_PROGRAMS = 4 * NUM_SMS
MAX_SPLIT_K = 16
MIN_K_TILES_PER_SPLIT = 1  # each split streams at least this many BLOCK_K tiles
MIN_FMA_BLOCK_N, MIN_DOT_BLOCK_N = 4, 16  # the heuristic narrows column blocks down to these before splitting K
# float32 accumulator elements per thread of the fma variant (BLOCK_N * BLOCK_K / threads).
FMA_ACC_PER_THREAD = 64
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class GemvConfig:
    """One launch config: tile sizes, split-K factor, inner product and warps/stages."""

    block_n: int
    block_k: int
    split_k: int = 1  # asked for; the launch rounds each split to whole BLOCK_K tiles (split_k_range)
    use_dot: bool = False  # M > 1 always takes dot
    num_warps: int = 4
    num_stages: int = 3


# Measured winners, (M bucket, N, K) -> config; a call with M rows uses the smallest bucket >= M
# (M 2..4 -> 4, 5..8 -> 8, 9..16 -> 16: every M > 1 runs the same 16-row dot tile anyway). From
# benchmarks/results/h200-gemv-configs.json (one H200, CUDA graphs, weights streamed from HBM): every
# shape and bucket where the best config beat cuBLAS, with both times. At M == 1 a shape not listed
# falls back to default_config(); at M > 1 it is not the kernel's (cuBLAS runs it).
M_BUCKETS = (1, 4, 8, 16)
CONFIG_TABLE: dict[tuple[int, int, int], GemvConfig] = {
    (4, 1024, 2048): GemvConfig(32, 128, 4, True, 4, 4),  # qwen3-0.6b o: 5.35 vs 12.77 us
    (8, 1024, 2048): GemvConfig(32, 128, 4, True, 4, 4),  # qwen3-0.6b o: 5.39 vs 5.84 us
    (16, 1024, 2048): GemvConfig(32, 128, 4, True, 4, 4),  # qwen3-0.6b o: 5.44 vs 5.89 us
    (4, 1024, 3072): GemvConfig(32, 128, 8, True, 4, 3),  # qwen3-0.6b down: 6.18 vs 7.46 us
    (8, 1024, 3072): GemvConfig(32, 128, 8, True, 4, 3),  # qwen3-0.6b down: 6.25 vs 7.40 us
    (16, 1024, 3072): GemvConfig(32, 256, 4, True, 4, 4),  # qwen3-0.6b down: 6.26 vs 7.67 us
    (4, 151936, 1024): GemvConfig(64, 128, 1, True, 4, 4),  # qwen3-0.6b lm_head: 72.85 vs 76.45 us
    (8, 151936, 1024): GemvConfig(64, 128, 1, True, 4, 4),  # qwen3-0.6b lm_head: 74.31 vs 77.56 us
    (16, 151936, 1024): GemvConfig(128, 128, 1, True, 8, 3),  # qwen3-0.6b lm_head: 75.75 vs 78.71 us
    (4, 2048, 1536): GemvConfig(16, 256, 1, True, 4, 4),  # qwen2.5-1.5b qkv: 5.01 vs 5.28 us
    (8, 2048, 1536): GemvConfig(16, 256, 1, True, 4, 4),  # qwen2.5-1.5b qkv: 5.02 vs 5.29 us
    (16, 2048, 1536): GemvConfig(16, 256, 1, True, 4, 4),  # qwen2.5-1.5b qkv: 5.01 vs 5.30 us
    (4, 1536, 1536): GemvConfig(16, 256, 1, True, 4, 4),  # qwen2.5-1.5b o: 4.91 vs 5.97 us
    (8, 1536, 1536): GemvConfig(16, 256, 1, True, 4, 4),  # qwen2.5-1.5b o: 4.92 vs 5.23 us
    (16, 1536, 1536): GemvConfig(16, 256, 1, True, 4, 4),  # qwen2.5-1.5b o: 4.92 vs 5.22 us
    (4, 17920, 1536): GemvConfig(32, 128, 1, True, 4, 3),  # qwen2.5-1.5b gate_up: 15.61 vs 17.05 us
    (8, 17920, 1536): GemvConfig(64, 128, 1, True, 4, 3),  # qwen2.5-1.5b gate_up: 15.75 vs 17.19 us
    (16, 17920, 1536): GemvConfig(64, 128, 1, True, 4, 3),  # qwen2.5-1.5b gate_up: 15.99 vs 17.43 us
    (4, 1536, 8960): GemvConfig(32, 128, 8, True, 4, 4),  # qwen2.5-1.5b down: 11.17 vs 11.80 us
    (8, 1536, 8960): GemvConfig(32, 128, 8, True, 4, 4),  # qwen2.5-1.5b down: 11.26 vs 11.74 us
    (16, 1536, 8960): GemvConfig(32, 128, 8, True, 4, 3),  # qwen2.5-1.5b down: 11.42 vs 11.95 us
    (4, 3584, 3584): GemvConfig(64, 128, 4, True, 4, 4),  # qwen2.5-7b o: 10.22 vs 11.42 us
    (8, 3584, 3584): GemvConfig(64, 128, 4, True, 4, 4),  # qwen2.5-7b o: 10.28 vs 11.34 us
    (16, 3584, 3584): GemvConfig(64, 128, 4, True, 4, 3),  # qwen2.5-7b o: 10.36 vs 11.48 us
    (4, 37888, 3584): GemvConfig(64, 128, 1, True, 4, 2),  # qwen2.5-7b gate_up: 63.26 vs 70.24 us
    (8, 37888, 3584): GemvConfig(64, 128, 1, True, 4, 2),  # qwen2.5-7b gate_up: 63.45 vs 71.13 us
    (16, 37888, 3584): GemvConfig(32, 128, 1, True, 4, 2),  # qwen2.5-7b gate_up: 64.38 vs 71.64 us
    (4, 3584, 18944): GemvConfig(64, 128, 8, True, 4, 3),  # qwen2.5-7b down: 36.10 vs 38.63 us
    (8, 3584, 18944): GemvConfig(64, 128, 8, True, 4, 3),  # qwen2.5-7b down: 36.45 vs 39.06 us
    (16, 3584, 18944): GemvConfig(32, 128, 4, True, 4, 3),  # qwen2.5-7b down: 37.19 vs 40.87 us
    (4, 152064, 3584): GemvConfig(128, 128, 1, True, 8, 3),  # qwen2.5-7b lm_head: 240.52 vs 248.89 us
    (8, 152064, 3584): GemvConfig(128, 128, 1, True, 8, 3),  # qwen2.5-7b lm_head: 242.25 vs 250.54 us
    (16, 152064, 3584): GemvConfig(128, 128, 1, True, 8, 3),  # qwen2.5-7b lm_head: 244.38 vs 252.56 us
}


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N]: exactly F.linear."""
    return F.linear(x, weight, bias)


def default_config(m: int, n: int, k: int) -> GemvConfig:
    """The heuristic for shapes not in CONFIG_TABLE: fma for one row, dot above; narrower column blocks,
    then split K, until the grid reaches TARGET_PROGRAMS (a split costs a second kernel, narrowing nothing)."""
    use_dot, num_warps = m > 1, 4
    if use_dot:
        block_n, block_k, min_block_n = 32, 256, MIN_DOT_BLOCK_N
    else:
        block_k = 512 if k >= 512 else max(16, next_power_of_2(k))
        block_n = max(MIN_FMA_BLOCK_N, min(64, FMA_ACC_PER_THREAD * 32 * num_warps // block_k))
        min_block_n = MIN_FMA_BLOCK_N
    while cdiv(n, block_n) < TARGET_PROGRAMS and block_n > min_block_n:
        block_n //= 2
    return GemvConfig(block_n, block_k, _split_for(n, k, block_n, block_k), use_dot, num_warps)


def _split_for(n: int, k: int, block_n: int, block_k: int) -> int:
    """Smallest power-of-2 split of K that brings the grid to TARGET_PROGRAMS, within the K tiles there are."""
    num_n_blocks = cdiv(n, block_n)
    max_split = max(1, min(MAX_SPLIT_K, cdiv(k, block_k) // MIN_K_TILES_PER_SPLIT))
    split = 1
    while num_n_blocks * split < TARGET_PROGRAMS and split * 2 <= max_split:
        split *= 2
    return split


def _bucket(m: int) -> int:
    return next((b for b in M_BUCKETS if b >= m), m)


@functools.lru_cache(maxsize=1024)
def pick_config(m: int, n: int, k: int) -> GemvConfig:
    """The config for one call: the measured table first, then the heuristic."""
    return CONFIG_TABLE.get((_bucket(m), n, k)) or default_config(m, n, k)


def measured_faster(m: int, n: int, k: int) -> bool:
    """Whether the kernel takes an M-row call of this shape: always for one row, else only where
    CONFIG_TABLE holds a config measured faster than cuBLAS."""
    return m == 1 or (_bucket(m), n, k) in CONFIG_TABLE


if triton is not None:

    # M changes with the decode batch and k_per_split with M's config: neither is specialized, so
    # serving compiles one variant per (BLOCK_M, config) and never per batch size.
    @triton.jit(do_not_specialize=["M", "k_per_split"])
    def _gemv_kernel(
        out_ptr, x_ptr, w_ptr, b_ptr,
        M, N, K, k_per_split,
        stride_xm, stride_wn, stride_om, stride_os,
        HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, USE_DOT: tl.constexpr, EVEN_K: tl.constexpr,
        DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """out[m, n] (or partial[m, split, n]) = sum over this program's K range of x[m, k] * W[n, k]."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        # Rows past N read row (n % N) instead of being masked: W loads stay unpredicated and
        # vectorized; those columns are never stored.
        w_rows = w_ptr + (offs_n % N).to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
        x_rows = x_ptr + offs_m[:, None] * stride_xm  # [BLOCK_M, 1]
        x_bcast = x_ptr + offs_n[:, None] * 0  # [BLOCK_N, 1], all row 0 (the one-row GEMV)
        # k_per_split is a whole number of BLOCK_K tiles, so no tile straddles two splits; the last
        # split may hold fewer tiles, and only the very last tile can run past K.
        k_start = pid_k * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        # Inner product (constexpr-selected): tl.dot on x padded to 16 rows, or for one row a plain GEMV
        # whose accumulator holds per-lane products only (the cross-lane sum over K happens once, after
        # the loop).
        if USE_DOT:
            wait_inputs(PDL)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            k_loop = k_start
        else:
            # The first tile by hand: its weights are loaded before the wait for the kernel that wrote x
            # (no kernel of the step writes W), so the load overlaps that kernel's tail (pdl.py).
            offs_k = tl.max_contiguous(tl.multiple_of(k_start + tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
            mask_k = offs_k < K
            if EVEN_K:
                w = tl.load(w_rows + offs_k[None, :], eviction_policy="evict_first")
            else:
                w = tl.load(w_rows + offs_k[None, :], mask=mask_k[None, :], other=0.0, eviction_policy="evict_first")
            wait_inputs(PDL)
            x = tl.load(x_bcast + offs_k[None, :], mask=mask_k[None, :], other=0.0)
            acc2 = w.to(tl.float32) * x.to(tl.float32)  # == 0 + w * x: the same bits as a zeroed start
            k_loop = k_start + BLOCK_K
        for k in range(k_loop, k_end, BLOCK_K):
            offs_k = tl.max_contiguous(tl.multiple_of(k + tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
            mask_k = offs_k < K
            # W is streamed once: evict it first, so x (re-read by every program) stays in cache.
            if EVEN_K:
                w = tl.load(w_rows + offs_k[None, :], eviction_policy="evict_first")
            else:
                w = tl.load(w_rows + offs_k[None, :], mask=mask_k[None, :], other=0.0, eviction_policy="evict_first")
            if USE_DOT:
                x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
            else:
                # x's one row is loaded broadcast to W's [BLOCK_N, BLOCK_K] shape: both loads then get
                # the same register layout, so W never goes through shared memory to meet x (the
                # repeated x reads hit L1).
                x = tl.load(x_bcast + offs_k[None, :], mask=mask_k[None, :], other=0.0)
                acc2 += w.to(tl.float32) * x.to(tl.float32)
        if not USE_DOT:
            acc = tl.sum(acc2, axis=1)[None, :]  # [1, BLOCK_N]
        mask = mask_m[:, None] & mask_n[None, :]
        out_ptrs = out_ptr + offs_m[:, None] * stride_om + pid_k * stride_os + offs_n[None, :]
        if SPLIT:
            tl.store(out_ptrs, acc, mask=mask)  # float32 partials; the reduce kernel adds bias
        else:
            if HAS_BIAS:
                acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _split_reduce_kernel(
        out_ptr, part_ptr, b_ptr, N,
        HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
    ):
        """out[m, n] = sum over s of partial[m, s, n] (+ bias[n]), cast to out's dtype."""
        wait_inputs(PDL)
        m = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        part = part_ptr + m.to(tl.int64) * SPLIT_K * N + offs
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            acc += tl.load(part + s * N, mask=mask, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + m.to(tl.int64) * N + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


REDUCE_BLOCK = 1024


def split_k_range(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(K elements per split, number of splits): whole BLOCK_K tiles per split, e.g. 37 tiles asked
    into 4 splits -> 10 tiles each, the last one 7; asking more splits than tiles gives one tile each."""
    tiles_per_split = cdiv(cdiv(k, block_k), max(1, split_k))
    return tiles_per_split * block_k, cdiv(k, tiles_per_split * block_k)


def linear_triton(
    x: torch.Tensor,  # [M, K], K contiguous
    weight: torch.Tensor,  # [N, K], K contiguous
    bias: torch.Tensor | None = None,  # [N]
    config: GemvConfig | None = None,
) -> torch.Tensor:  # [M, N] in x's dtype
    """x @ weight^T (+ bias) through the small-M kernel; `config` overrides pick_config (benchmarks)."""
    M, K = x.shape
    N = weight.shape[0]
    cfg = config or pick_config(M, N, K)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    use_dot = cfg.use_dot or M > 1  # the fma path is the one-row GEMV
    block_m = max(16, next_power_of_2(M)) if use_dot else 1
    # tl.dot needs every tile dim >= 16
    block_n, block_k = (max(16, cfg.block_n), max(16, cfg.block_k)) if use_dot else (cfg.block_n, cfg.block_k)
    k_per_split, split_k = split_k_range(K, block_k, cfg.split_k)
    split = split_k > 1
    target = torch.empty(M, split_k, N, dtype=torch.float32, device=x.device) if split else out
    b = bias if bias is not None else x  # never read without HAS_BIAS
    _gemv_kernel[(cdiv(N, block_n), split_k)](
        target, x, weight, b,
        M, N, K, k_per_split,
        x.stride(0), weight.stride(0), target.stride(0), N if split else 0,
        HAS_BIAS=bias is not None, SPLIT=split, USE_DOT=use_dot,
        EVEN_K=K % block_k == 0,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(),
    )
    if split:
        _split_reduce_kernel[(M, cdiv(N, REDUCE_BLOCK))](
            out, target, b, N, HAS_BIAS=bias is not None, SPLIT_K=split_k, BLOCK=REDUCE_BLOCK, num_warps=4,
            **pdl_args(),
        )
    return out


def _kernel_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether linear_triton takes this call: small M, half-precision, K-contiguous, inference."""
    m = x.numel() // max(1, x.shape[-1]) if x.dim() >= 1 else 0
    if not 1 <= m <= MAX_M:  # cheapest test first (prefill fails it)
        return False
    if x.dtype not in SUPPORTED_DTYPES or weight.dtype != x.dtype or weight.dim() != 2:
        return False
    if x.shape[-1] != weight.shape[1] or x.shape[-1] == 0 or x.stride(-1) != 1 or weight.stride(1) != 1:
        return False
    if bias is not None and (bias.dtype != x.dtype or bias.dim() != 1 or bias.stride(0) != 1):
        return False
    if not measured_faster(m, weight.shape[0], weight.shape[1]):
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))  # the kernel has no backward


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias); the small-M Triton kernel for few-row CUDA inputs, F.linear otherwise
    (the fixed-tile GEMM of engine/kernels/batch_invariant.py for every CUDA call when that mode is on;
    bucketed row counts for half-precision CPU inputs, engine/kernels/cpu_linear.py)."""
    if batch_invariant.applies(x, weight):
        return batch_invariant.linear_invariant(x, weight, bias)
    if cpu_linear.applies(x):
        return cpu_linear.linear(x, weight, bias)
    if not (use_triton(x) and _kernel_applies(x, weight, bias)):
        return linear_ref(x, weight, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # a view for the [T, K] inputs the engine passes
    return linear_triton(x2, weight, bias).reshape(*lead, weight.shape[0])
