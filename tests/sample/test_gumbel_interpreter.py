"""The chunked Gumbel-max Triton kernel on CPU: its division trick, and the kernel under Triton's interpreter (float32)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

# Run in a child: TRITON_INTERPRET must be set before triton is first imported.
_INTERPRETER_SCRIPT = r"""
import torch
from engine.kernels.sampling import _BLOCK, gumbel_sample_ref, gumbel_sample_triton
from engine.sample.random_sampling import mix_seed

# The tokens pinned for the reference in tests/sample/test_sample_gumbel.py, for every chunking.
keys = torch.tensor([mix_seed(42, p) for p in range(6)])
for tiles in (None, 1):
    out = gumbel_sample_triton(torch.zeros(6, 1000), keys, tiles_per_chunk=tiles)
    assert out.tolist() == [367, 470, 404, 591, 967, 589], out.tolist()

gen = torch.Generator().manual_seed(0)
num_cases = 0
for num_rows, vocab in [(6, 3001), (4, 2048), (5, 1025), (3, 7), (4, 1)]:
    logits = torch.randn(num_rows, vocab, generator=gen) * 3
    logits[0, vocab // 3 :] = float("-inf")  # a masked tail
    logits[1] = logits[1].round()  # exact ties, in a greedy row
    logits[2] = float("-inf")  # nothing finite: index 0
    keys = torch.randint(0, 2**63 - 1, (num_rows,), generator=gen)
    keys[1] = -1
    temperature = torch.rand(num_rows, generator=gen) + 0.2
    num_tiles = -(-vocab // _BLOCK)
    for temp in (None, temperature):
        ref = gumbel_sample_ref(logits, keys, temp)
        first = gumbel_sample_triton(logits, keys, temp)
        # Same hash bits; numpy's and torch's float32 log could differ in a last ulp (a near tie).
        assert (first == ref).float().mean() >= 0.8, (first, ref)
        assert int(first[1]) == int(logits[1].argmax()) and int(first[2]) == 0
        for tiles in sorted({1, 2, 3, num_tiles, num_tiles + 2}):
            out = gumbel_sample_triton(logits, keys, temp, tiles_per_chunk=tiles)
            assert torch.equal(out, first), (tiles, out, first)  # any chunking: the same tokens
            num_cases += 1
print("ok", num_cases)
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_chunked_kernel_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", _INTERPRETER_SCRIPT],
        check=False,
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().startswith("ok")


def test_float64_reciprocal_gives_torch_division():
    """The kernel's x / T = float32(x * RN64(1 / T)) equals torch's float32 division, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 2**31 - 1, (1_000_000,), generator=gen, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)  # every exponent, subnormals included
    x = torch.where(torch.rand(x.shape, generator=gen) < 0.5, -x, x)
    x = x[torch.isfinite(x)]
    temperature = torch.empty(x.shape).uniform_(-11.5, 4.6, generator=gen).exp_()  # [1e-5, 100]
    ours = (x.double() * (1.0 / temperature.double())).float()
    assert torch.equal(ours, x / temperature)
