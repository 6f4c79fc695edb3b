"""Bucketed half-precision linears on CPU (engine/kernels/cpu_linear.py): the buckets and the results."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import cpu_linear
from engine.kernels.gemv import linear


def test_buckets_cover_every_row_count_with_bounded_padding():
    buckets = set()
    for n in range(1, 8193):
        b = cpu_linear.bucket_rows(n)
        assert b >= n
        assert b - n <= max(n // 4, 0) or b <= 64 and b < 2 * n  # <= 25% above 64 rows, a power of two below
        buckets.add(b)
    assert len(buckets) <= 40
    assert all(cpu_linear.bucket_rows(b) == b for b in buckets)  # a bucket maps to itself: no second padding


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_rows", [1, 3, 64, 65, 100, 513])
def test_half_precision_linear_matches_float32_math(dtype, num_rows):
    gen = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, 48, generator=gen).to(dtype)
    weight = torch.randn(40, 48, generator=gen).to(dtype)
    bias = torch.randn(40, generator=gen).to(dtype)
    out = linear(x, weight, bias)
    assert out.shape == (num_rows, 40) and out.dtype == dtype
    expected = F.linear(x.float(), weight.float(), bias.float())
    torch.testing.assert_close(out.float(), expected, atol=0.1, rtol=2e-2)
    # Each row is the row's own product: the padding rows never leak into the result.
    torch.testing.assert_close(out[:1].float(), F.linear(x[:1].float(), weight.float(), bias.float()), atol=0.1,
                               rtol=2e-2)


def test_float32_and_three_dimensional_inputs_are_left_to_f_linear():
    x = torch.randn(5, 8)
    weight = torch.randn(3, 8)
    assert not cpu_linear.applies(x)
    assert not cpu_linear.applies(x.bfloat16().view(5, 1, 8))
    assert torch.equal(linear(x, weight), F.linear(x, weight))
