"""SiLU-and-mul (the gated MLP's activation): Triton kernel and its torch reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels import use_triton
from engine.kernels.pdl import pdl_args

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None
else:
    from engine.kernels.pdl import wait_inputs


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:  # [T, 2*I] -> [T, I]
    """silu(gate) * up for x = [gate | up] along the last dim."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


if triton is not None:

    @triton.jit
    def _silu_and_mul_kernel(out_ptr, x_ptr, stride_x, I, BLOCK: tl.constexpr, PDL: tl.constexpr):
        wait_inputs(PDL)
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < I
        base = x_ptr + row.to(tl.int64) * stride_x
        gate = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(base + I + cols, mask=mask, other=0.0)
        # torch rounds silu(gate) to the input dtype before the product; so do we.
        act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty)
        out = act.to(tl.float32) * up.to(tl.float32)
        tl.store(out_ptr + row.to(tl.int64) * I + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2 or x.stride(-1) != 1:
        return silu_and_mul_ref(x)
    num_tokens, two_i = x.shape
    I = two_i // 2
    out = torch.empty(num_tokens, I, dtype=x.dtype, device=x.device)
    if num_tokens:
        BLOCK = 1024
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(I, BLOCK))](out, x, x.stride(0), I, BLOCK=BLOCK, num_warps=4,
                                                                    **pdl_args())
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)
