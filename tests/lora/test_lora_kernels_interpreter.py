"""The LoRA shrink/expand Triton pair on CPU under Triton's interpreter, against the torch references on mixed slots."""

from __future__ import annotations

import importlib.util

import pytest
from interpreter_run import LOOP_PROBE, run_interpreted


# Run in a child: TRITON_INTERPRET must be set before triton is first imported. Small shapes: the
# interpreter runs every program in Python, and CI has two cores.
_INTERPRETER_SCRIPT = LOOP_PROBE + r"""

from engine.kernels.lora import lora_expand_triton, lora_shrink_triton
from engine.lora.ops import lora_expand_slots_ref, lora_shrink_slots_ref

g = torch.Generator().manual_seed(0)
cases = [
    # (token_slots, max_loras, per-slice rank, in, slice widths, y offset, ranks of each slot)
    ([2, 2, -1, 0, 0, 2, 1, -1, 1] + [1] * 12 + [-1, 0], 3, 8, 40, (24, 8, 8), 0, (3, 8, 5)),  # qkv, 2 token blocks
    ([-1, 1, 1, -1, 3], 4, 16, 33, (20,), 7, (16, 4, 1, 16)),  # one slice at an offset, K off the tile
    ([-1, -1, -1], 2, 4, 16, (10, 6), 2, (4, 2)),  # no adapter in the step: y untouched
    ([0] * 5, 1, 16, 300, (17, 17), 0, (9,)),  # one adapter for all, K over two tiles
]
for token_slots, num_slots, rank, k, widths, offset, ranks in cases:
    slots = torch.tensor(token_slots, dtype=torch.int32)
    t, n = len(token_slots), sum(widths)
    x = torch.randn(t, k, generator=g)
    # Each slot's adapter has its own rank below the maximum: rows of A / columns of B past it are zero.
    a = torch.randn(num_slots, len(widths) * rank, k, generator=g)
    b = torch.randn(num_slots, n, rank, generator=g)
    for slot, r in enumerate(ranks):
        for s in range(len(widths)):
            a[slot, s * rank + r:(s + 1) * rank] = 0
        b[slot, :, r:] = 0
    out = lora_shrink_triton(x, a, slots, torch.full((t, len(widths) * rank), float("nan")))  # written whole
    ref = lora_shrink_slots_ref(x, a, slots, torch.empty(t, len(widths) * rank))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
    assert (out[slots < 0] == 0).all()
    y = torch.randn(t, offset + n + 3, generator=g)
    want = y.clone()
    lora_expand_slots_ref(ref, b, slots, want, offset, widths)
    got = y.clone()
    lora_expand_triton(ref, b, slots, got, offset, widths)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert torch.equal(got[slots < 0], y[slots < 0])  # rows without an adapter: not touched
    assert torch.equal(got[:, :offset], y[:, :offset]) and torch.equal(got[:, offset + n:], y[:, offset + n:])
    # Split-K: float32 partial sums over ranges of the width (short or empty last ranges), added up by the expand.
    for num_splits in (2, 3):
        parts = lora_shrink_triton(x, a, slots, torch.full((num_splits, t, len(widths) * rank), float("nan")))
        torch.testing.assert_close(parts.sum(0), ref, rtol=1e-5, atol=1e-4)
        got = y.clone()
        lora_expand_triton(parts, b, slots, got, offset, widths)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        assert torch.equal(got[slots < 0], y[slots < 0])
        # Programs walking the tokens grouped by slot (LoRAMapping.token_order), or in any other order: same results.
        for order in (torch.argsort(slots, stable=True), torch.randperm(t, generator=g)):
            order = order.to(torch.int32)
            parts_o = lora_shrink_triton(x, a, slots, torch.full_like(parts, float("nan")), order)
            torch.testing.assert_close(parts_o, parts, rtol=1e-6, atol=1e-5)
            got_o = y.clone()
            lora_expand_triton(parts_o, b, slots, got_o, offset, widths, order)
            torch.testing.assert_close(got_o, got, rtol=1e-6, atol=1e-5)
            assert torch.equal(got_o[slots < 0], y[slots < 0])
print("ok", len(cases))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_kernel_pair_under_interpreter():
    assert run_interpreted(_INTERPRETER_SCRIPT, timeout=300).strip().startswith("ok")
