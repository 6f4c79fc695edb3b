"""The small-M linear kernel on CPU: its configs, its dispatch, and the kernel itself under Triton's interpreter."""

from __future__ import annotations

import importlib.util

import pytest
from interpreter_run import LOOP_PROBE, run_interpreted
import torch
import torch.nn.functional as F

from engine.kernels import next_power_of_2
from engine.kernels.gemv import CONFIG_TABLE, MAX_M, linear, measured_faster, pick_config, split_k_range


# (N, K) of the Qwen3-0.6B, Qwen2.5-1.5B and Qwen2.5-7B linears (lm_head included).
SHAPES = [
    (4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024),
    (2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960),
    (4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944), (152064, 3584),
]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16])
def test_pick_config_is_launchable(m, n, k):
    cfg = pick_config(m, n, k)
    for block in (cfg.block_n, cfg.block_k):
        assert block == next_power_of_2(block)
    if cfg.use_dot:  # tl.dot needs every tile dim >= 16
        assert cfg.block_n >= 16 and cfg.block_k >= 16
    k_per_split, split = split_k_range(k, cfg.block_k, cfg.split_k)
    assert k_per_split % cfg.block_k == 0 and (split - 1) * k_per_split < k <= split * k_per_split


def test_the_kernel_takes_one_row_always_and_more_rows_only_where_it_was_measured_faster():
    assert all(measured_faster(1, n, k) for n, k in SHAPES)
    assert measured_faster(8, 3584, 18944) and measured_faster(3, 1024, 2048)  # listed: buckets 8 and 4
    assert not measured_faster(8, 4608, 3584)  # Qwen2.5-7B qkv: cuBLAS was faster at 4-16 rows
    assert not measured_faster(16, 4096, 1024)  # Qwen3-0.6B qkv: likewise
    assert all(cfg.use_dot and m > 1 for (m, _, _), cfg in CONFIG_TABLE.items())  # M > 1 runs the dot tile


def test_split_k_range_whole_tiles():
    assert split_k_range(18944, 512, 4) == (10 * 512, 4)  # 37 tiles: 10, 10, 10, 7
    assert split_k_range(3072, 256, 4) == (3 * 256, 4)
    assert split_k_range(1024, 512, 8) == (512, 2)  # more splits asked than tiles
    assert split_k_range(100, 64, 1) == (128, 1)


@pytest.mark.parametrize("m", [1, MAX_M, MAX_M + 1])
def test_cpu_linear_is_f_linear(m):
    # On CPU the dispatcher must be exactly F.linear (the model-equivalence tests rely on it).
    x, w, b = torch.randn(m, 24, dtype=torch.bfloat16), torch.randn(40, 24, dtype=torch.bfloat16), torch.randn(40, dtype=torch.bfloat16)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(linear(x, w), F.linear(x, w))


# Run in a child: TRITON_INTERPRET must be set before triton is first imported.
_INTERPRETER_SCRIPT = LOOP_PROBE + r"""
import torch.nn.functional as F

from engine.kernels.gemv import GemvConfig, linear_triton

torch.manual_seed(0)
cases = [
    # (M, N, K, bias, config): odd N, K off the tile grid, bias, split-K, both inner products
    (1, 37, 100, True, None),
    (3, 50, 384, False, GemvConfig(16, 64, split_k=3)),
    (1, 50, 37 * 16, True, GemvConfig(16, 16, split_k=4)),  # 37 tiles: splits of 10, 10, 10, 7
    (2, 29, 250, True, GemvConfig(8, 64, split_k=2)),
    (1, 45, 250, True, GemvConfig(8, 64, split_k=2)),
    (4, 16, 64, True, GemvConfig(4, 16)),
    (5, 33, 200, True, GemvConfig(16, 64, split_k=2, use_dot=True)),
    (16, 40, 130, True, GemvConfig(16, 32, use_dot=True)),
    (8, 70, 96, False, GemvConfig(32, 32, split_k=3, use_dot=True)),
]
for m, n, k, has_bias, cfg in cases:
    x, w = torch.randn(m, k), torch.randn(n, k)
    b = torch.randn(n) if has_bias else None
    out = linear_triton(x, w, b, cfg)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    # A row view with a stride past K (x is a slice of a wider buffer).
    wide = torch.randn(m, k + 8)
    torch.testing.assert_close(linear_triton(wide[:, :k], w, b, cfg), F.linear(wide[:, :k], w, b), rtol=1e-5, atol=1e-4)
print("ok", len(cases))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_kernel_under_interpreter():
    assert run_interpreted(_INTERPRETER_SCRIPT, timeout=300).strip().startswith("ok")
