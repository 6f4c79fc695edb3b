"""Half-precision linears on CPU at a bounded set of row counts, because oneDNN builds a kernel per new shape.

A bfloat16 (or float16) matmul on CPU goes to oneDNN, which JIT-compiles a primitive the first
time it sees a shape (about 2 ms for a [M, 64] x [64, 192] product on an AMX Xeon, against
0.1 ms to run it) and caches it. An engine step's token count changes nearly every step, so
without care almost every linear call pays the compilation. Rows are padded up to a bucket
(powers of two up to 64, then four buckets per octave: at most 25% extra rows, about 35 shapes
up to 8192 tokens) and the padding's output rows are dropped. Each output row is still
x[row] @ weight.T; float32 needs none of this (its GEMM has no per-shape compilation).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

HALF_DTYPES = (torch.bfloat16, torch.float16)
# Four buckets per octave above this many rows; powers of two up to it.
_FINE_FROM = 64


def bucket_rows(num_rows: int) -> int:
    """The padded row count for num_rows: the smallest bucket >= num_rows."""
    if num_rows <= _FINE_FROM:
        return 1 << max(0, (num_rows - 1).bit_length())
    step = 1 << ((num_rows - 1).bit_length() - 3)  # an octave [2^k, 2^(k+1)) in steps of 2^(k-2)
    return -(-num_rows // step) * step


def applies(x: torch.Tensor) -> bool:
    return x.dtype in HALF_DTYPES and x.device.type == "cpu" and x.dim() == 2


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for 2-D CPU x, computed at a bucketed row count."""
    num_rows = x.shape[0]
    padded = bucket_rows(num_rows)
    if padded == num_rows:
        return F.linear(x, weight, bias)
    x_padded = x.new_zeros(padded, x.shape[1])
    x_padded[:num_rows] = x
    return F.linear(x_padded, weight, bias)[:num_rows]
