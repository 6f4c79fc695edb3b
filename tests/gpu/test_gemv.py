"""GPU tier: the small-M linear kernel against float32 F.linear on the model shapes, and inside CUDA graphs."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import override_kernels
from engine.kernels.gemv import MAX_M, GemvConfig, linear, linear_triton

pytestmark = pytest.mark.gpu
DEV = "cuda"

# (N, K) of the Qwen3-0.6B, Qwen2.5-1.5B and Qwen2.5-7B linears (lm_head included).
SHAPES = [
    (4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024),
    (2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960),
    (4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944), (152064, 3584),
]
# Output rounding to bf16 alone gives ~1.1e-3 relative RMS error; fp32 accumulation adds little.
BF16_REL = 4e-3


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "NaN in kernel output"
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


@functools.lru_cache(maxsize=1)
def _weights(n: int, k: int, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """Random W [n, k] (scaled like a trained layer) and bias [n], kept across the M/bias cases of one shape."""
    g = torch.Generator(device=DEV).manual_seed(n * 7 + k)
    w = (torch.randn(n, k, device=DEV, generator=g) / k**0.5).to(dtype)
    b = (0.1 * torch.randn(n, device=DEV, generator=g)).to(dtype)
    return w, b


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize("n,k", SHAPES)  # the bottom decorator varies slowest: _weights is built once per shape
def test_linear_matches_fp32(n, k, m, with_bias):
    w, b = _weights(n, k)
    b = b if with_bias else None
    x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    out = linear_triton(x, w, b)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert rel_err(out, ref) < BF16_REL


FMA_CONFIGS = [GemvConfig(16, 512), GemvConfig(8, 256, split_k=4), GemvConfig(4, 1024, split_k=2)]
DOT_CONFIGS = [GemvConfig(32, 256, use_dot=True), GemvConfig(64, 128, split_k=8, use_dot=True, num_warps=8),
               GemvConfig(128, 128, split_k=2, use_dot=True, num_warps=8, num_stages=4)]


@pytest.mark.parametrize("cfg", FMA_CONFIGS + DOT_CONFIGS)
@pytest.mark.parametrize("m", [1, 4, 13])  # M > 1 with an fma config runs dot (tiles raised to 16)
def test_explicit_configs(m, cfg):
    # Every config kind the benchmark may put in CONFIG_TABLE, on a K that is not a multiple of the tile.
    n, k = 1000, 3000
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) / k**0.5
    b = torch.randn(n, device=DEV, dtype=torch.bfloat16)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    ref = F.linear(x.float(), w.float(), b.float())
    assert rel_err(linear_triton(x, w, b, cfg), ref) < BF16_REL


def test_fp16_and_dispatch():
    w = torch.randn(1536, 8960, device=DEV, dtype=torch.float16) / 8960**0.5
    x = torch.randn(2, 3, 8960, device=DEV, dtype=torch.float16)  # [..., K] inputs are flattened
    with override_kernels(True):
        out = linear(x, w)
        assert out.shape == (2, 3, 1536)
        assert rel_err(out, F.linear(x.float(), w.float())) < BF16_REL
        big = torch.randn(MAX_M + 1, 8960, device=DEV, dtype=torch.float16)
        assert torch.equal(linear(big, w), F.linear(big, w))  # past MAX_M: cuBLAS, untouched
        w_qkv = torch.randn(4608, 3584, device=DEV, dtype=torch.float16) / 3584**0.5  # cuBLAS won at 4-16 rows
        x8 = torch.randn(8, 3584, device=DEV, dtype=torch.float16)
        assert torch.equal(linear(x8, w_qkv), F.linear(x8, w_qkv))  # not in CONFIG_TABLE: cuBLAS, untouched
        x32 = torch.randn(2, 8960, device=DEV)
        assert torch.equal(linear(x32, w.float()), F.linear(x32, w.float()))  # fp32: cuBLAS


@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("n,k", [(1024, 3072), (4096, 1024), (151936, 1024)])
def test_cuda_graph_replay_matches_eager(n, k, m):
    w, b = _weights(n, k)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    with override_kernels(True):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compile and warm up outside the capture
            linear(x, w, b)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = linear(x, w, b)
        for _ in range(2):  # new inputs in place, as the model runner feeds a captured graph
            x.copy_(torch.randn(m, k, device=DEV, dtype=torch.bfloat16))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, linear(x, w, b))
        assert rel_err(out, F.linear(x.float(), w.float(), b.float())) < BF16_REL
