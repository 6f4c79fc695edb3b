"""Fused RMSNorm (+ residual add): Triton kernel and its torch reference (HF numerics)."""

from __future__ import annotations

import torch

from engine.kernels import next_power_of_2, use_triton
from engine.kernels.pdl import pdl_args

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference is all there is
    triton = None
else:
    from engine.kernels.pdl import wait_inputs


def rms_norm_ref(
    x: torch.Tensor,  # [..., D]
    weight: torch.Tensor,  # [D]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., D], same shape as x
):
    """Returns norm(x), or (norm(x + residual), x + residual) when residual is given.

    HF numerics: the add in the input dtype, the norm in float32, cast back, then times weight.
    """
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(dtype)
    return out if residual is None else (out, x)


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(
        out_ptr, res_out_ptr, x_ptr, res_ptr, w_ptr,
        inner, stride_x0, stride_x1, stride_r0, stride_r1,
        D, eps,
        HAS_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
    ):
        wait_inputs(PDL)
        row = tl.program_id(0)
        # Row r of the flattened [..., D] view is (r // inner, r % inner) of a 3-d strided view.
        x_off = (row // inner).to(tl.int64) * stride_x0 + (row % inner) * stride_x1
        cols = tl.arange(0, BLOCK_D)
        mask = cols < D
        x = tl.load(x_ptr + x_off + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r_off = (row // inner).to(tl.int64) * stride_r0 + (row % inner) * stride_r1
            r = tl.load(res_ptr + r_off + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # add in input dtype
            tl.store(res_out_ptr + row.to(tl.int64) * D + cols, x, mask=mask)
        h = x.to(tl.float32)
        var = tl.sum(h * h, axis=0) / D
        h = (h * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        y = h.to(tl.float32) * w.to(tl.float32)
        tl.store(out_ptr + row.to(tl.int64) * D + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows_view(t: torch.Tensor) -> tuple[int, int, int, int]:
    """(num_rows, inner, stride0, stride1) of a 2-d or 3-d tensor whose last dim is contiguous."""
    if t.dim() == 2:
        return t.shape[0], 1, t.stride(0), 0
    return t.shape[0] * t.shape[1], t.shape[1], t.stride(0), t.stride(1)


def rms_norm_triton(x, weight, eps, residual=None):
    if x.dim() not in (2, 3) or x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        return rms_norm_ref(x, weight, eps, residual)
    D = x.shape[-1]
    num_rows, inner, sx0, sx1 = _rows_view(x)
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if residual is not None:
        res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        _, _, sr0, sr1 = _rows_view(residual)
    else:
        res_out, sr0, sr1 = out, 0, 0
    if num_rows:
        _rms_norm_kernel[(num_rows,)](
            out, res_out, x, residual if residual is not None else x, weight,
            inner, sx0, sx1, sr0, sr1, D, eps,
            HAS_RESIDUAL=residual is not None, BLOCK_D=next_power_of_2(D), num_warps=4 if D >= 1024 else 1,
            **pdl_args(),
        )
    return out if residual is None else (out, res_out)


def rms_norm(x, weight, eps, residual=None):
    """norm(x) or (norm(x + residual), x + residual); Triton on GPU, the reference on CPU."""
    if use_triton(x):
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_ref(x, weight, eps, residual)
