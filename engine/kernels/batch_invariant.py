"""Batch-invariant numerics (opt-in): a token's logits do not depend on what else is in its step.

Off by default. With it on (ModelConfig.batch_invariant), every linear layer on the GPU (the LM head
too) runs one Triton GEMM with one fixed tile shape for any number of rows, and attention uses one
tile shape and no split-KV for decode, verify and prefill rows alike, reducing over KV in tiles at
absolute positions from 0 with query tiles at absolute positions too
(engine.kernels.attention.paged_attention_invariant). So a row is also the same whether its prefix
came from the prefix cache, from earlier chunks or from the same step, after a preemption's
recompute, and wherever its KV blocks lie. Each output element then goes through
the same reduction, in the same order, whatever the batch: a request's tokens are the same alone
or in a batch of 256, and with or without speculative decoding (whose verify steps otherwise run
other GEMM shapes than decode steps, so a bf16 near-tie can flip). The price is speed: cuBLAS's
and the small-M kernel's shape-tuned choices are given up. trainers/invariant_forward.py runs the
same kernels over the trainer's parameters, so the trainer's logprobs equal the engine's bit for bit.

    x [M, K] . W [N, K]^T:  program (pid_m, pid_n) owns a [BLOCK_M, BLOCK_N] tile of out and
    accumulates over K in BLOCK_K steps, in order, in float32; no split-K.

Elementwise and per-row kernels (RMSNorm, rotary, SiLU, the KV write, sampling) are already
independent of the batch. Not covered: the fused mixture-of-experts kernel (its expert GEMMs tile
by the tokens each expert got) and tensor-parallel all-reduces. The mode is process-wide, like
the attention backend. Measured on an H200 (tests/gpu/test_batch_invariant_gpu.py): tiny llama
and qwen3 in bf16 give the same greedy tokens alone, in a batch of 12, and with n-gram, own-draft
and other-draft speculation, where the default kernels flip near-ties in a few of 12 requests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels import cdiv, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

_ENABLED = False
# One tile shape for every call (changing it changes results, not only speed).
BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES = 64, 64, 64, 4, 3


def set_batch_invariant(enabled: bool) -> None:
    """Switches the mode for this process (the worker sets it from ModelConfig.batch_invariant)."""
    global _ENABLED
    _ENABLED = bool(enabled)


def batch_invariant() -> bool:
    return _ENABLED


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a linear call takes the invariant GEMM: mode on, CUDA, half precision, 2-D weight."""
    return (_ENABLED and use_triton(x) and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and weight.dtype == x.dtype and weight.dim() == 2 and x.shape[-1] == weight.shape[1])


if triton is not None:

    @triton.jit(do_not_specialize=["M"])
    def _matmul_kernel(
        out_ptr, x_ptr, w_ptr, b_ptr, M, N, K,
        stride_xm, stride_wn, stride_om,
        HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        pid_m = tl.program_id(1)
        pid_n = tl.program_id(0)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
        w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            offs_k = k + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def linear_invariant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) with the fixed-tile GEMM: each out[m, n] independent of M."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = weight if weight.stride(1) == 1 else weight.contiguous()
    M, K = x2.shape
    N = w.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M and N:
        _matmul_kernel[(cdiv(N, BLOCK_N), cdiv(M, BLOCK_M))](
            out, x2, w, bias if bias is not None else x2, M, N, K,
            x2.stride(0), w.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, DOT_PRECISION="ieee" if x.dtype == torch.float32 else None,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        )
    return out.reshape(*lead, N)


# Attention in this mode: one tile shape for every row shape, no split-KV (engine/kernels/attention.py).
ATTENTION_BLOCK_N = 64
