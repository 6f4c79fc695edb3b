"""The torch shrink/expand references (segment form and token-slot form) against a per-token loop on random data,
LoRALinear's stacked slot tensors, and LoRA's config and CLI flags."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.config import LoRAConfig
from engine.forward_context import set_forward_context
from engine.kernels.lora import lora_expand, lora_shrink
from engine.lora.layers import LoRALinear
from engine.lora.ops import (
    lora_expand_ref,
    lora_expand_slots_ref,
    lora_shrink_ref,
    lora_shrink_slots_ref,
    make_lora_mapping,
)
from engine.models.layers import QKVLinear, RowParallelLinear

MAX_LORAS, MAX_RANK, IN, OUT = 3, 8, 24, 10


def _per_token(x, lora_a, lora_b, token_slots, y, offset):
    """What the ops must compute, one token at a time."""
    want = y.clone()
    for t, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            want[t, offset:offset + OUT] += (x[t] @ lora_a[slot].T) @ lora_b[slot].T
    return want


@pytest.mark.parametrize("token_slots", [
    [2, 2, -1, 0, 0, 2, 1, -1, 1],  # mixed, with tokens of no adapter
    [1, 1, 1, 1],  # one adapter for every token (no gather)
    [-1, 0],
])
def test_shrink_expand_equal_a_per_token_loop(token_slots):
    g = torch.Generator().manual_seed(0)
    token_slots = np.array(token_slots)
    x = torch.randn(len(token_slots), IN, generator=g, dtype=torch.float64)
    lora_a = torch.randn(MAX_LORAS, MAX_RANK, IN, generator=g, dtype=torch.float64)
    lora_b = torch.randn(MAX_LORAS, OUT, MAX_RANK, generator=g, dtype=torch.float64)
    y = torch.randn(len(token_slots), 3 * OUT, generator=g, dtype=torch.float64)  # a fused output: expand the middle
    want = _per_token(x, lora_a, lora_b, token_slots, y, OUT)
    mapping = make_lora_mapping(token_slots, torch.device("cpu"))
    lora_expand_ref(lora_shrink_ref(x, lora_a, mapping), lora_b, mapping, y, OUT)
    torch.testing.assert_close(y, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("token_slots", [
    [2, 2, -1, 0, 0, 2, 1, -1, 1],
    [1, 1, 1, 1],
    [-1, 0],
])
def test_the_token_slot_form_equals_the_segment_form_on_a_fused_layer(token_slots):
    """The Triton pair's signature (stacked slices, token_slots) against the segment form run slice by slice."""
    g = torch.Generator().manual_seed(1)
    widths = (OUT, 4, 6)  # q, k, v of different widths
    token_slots = np.array(token_slots)
    num_tokens = len(token_slots)
    x = torch.randn(num_tokens, IN, generator=g, dtype=torch.float64)
    lora_a = torch.randn(MAX_LORAS, len(widths) * MAX_RANK, IN, generator=g, dtype=torch.float64)
    lora_b = torch.randn(MAX_LORAS, sum(widths), MAX_RANK, generator=g, dtype=torch.float64)
    y = torch.randn(num_tokens, sum(widths) + 5, generator=g, dtype=torch.float64)
    offset = 2
    mapping = make_lora_mapping(token_slots, torch.device("cpu"))
    assert mapping.token_slots.dtype == torch.int32 and mapping.token_slots.tolist() == token_slots.tolist()
    want, start = y.clone(), 0
    for s, width in enumerate(widths):
        a = lora_a[:, s * MAX_RANK:(s + 1) * MAX_RANK]
        lora_expand_ref(lora_shrink_ref(x, a, mapping), lora_b[:, start:start + width], mapping, want, offset + start)
        start += width
    buf = lora_shrink_slots_ref(x, lora_a, mapping.token_slots, torch.full((num_tokens, lora_a.shape[1]), np.nan,
                                                                             dtype=torch.float64))
    assert (buf[torch.from_numpy(token_slots) < 0] == 0).all()
    got = y.clone()
    lora_expand_slots_ref(buf, lora_b, mapping.token_slots, got, offset, widths)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("row_parallel", [False, True])
def test_lora_linear_slots_are_views_of_the_stacked_tensors_the_kernels_read(row_parallel):
    """What the GPU path computes from the stacked tensors (here through the references) is what the CPU path
    computes slice by slice; a cleared slot is zero in every slice (the kernels read them all)."""
    g = torch.Generator().manual_seed(2)
    base = RowParallelLinear(24, 16) if row_parallel else QKVLinear(32, 8, 4, 2)  # qkv: slices of 32, 16, 16
    layer = LoRALinear(base, max_loras=3, max_rank=8, device=torch.device("cpu"), dtype=torch.float64)
    storage = (layer.lora_a_stacked.data_ptr(), layer.lora_b_stacked.data_ptr())

    def put(slot, slices, rank):
        for s in slices:
            out_features, in_features = base.weight.hf_parts[s].full_shape
            layer.set_slot(slot, s, torch.randn(rank, in_features, generator=g, dtype=torch.float64),
                           torch.randn(out_features, rank, generator=g, dtype=torch.float64))

    slices = [0] if row_parallel else [0, 1, 2]
    put(0, slices, 8)
    put(1, slices[-1:], 3)  # v only (or the one slice), rank 3
    put(2, slices, 5)
    layer.clear_slot(2)
    put(2, slices[:1], 2)  # a new adapter over an old one: q only, the old k and v must be gone
    for s in slices[1:]:  # k and v of slot 2: zero since the clear
        assert not layer.lora_a[s][2].any() and not layer.lora_b[s][2].any()
    token_slots = np.array([1, 0, -1, 2, 2, 0, -1, 1])
    x = torch.randn(len(token_slots), base.input_size, generator=g, dtype=torch.float64)
    y = torch.randn(len(token_slots), base.output_size, generator=g, dtype=torch.float64)
    mapping = make_lora_mapping(token_slots, torch.device("cpu"))
    with set_forward_context(None, mapping):
        want = layer(x, y.clone())  # the CPU path: segments, per filled slice
    buf = lora_shrink(x, layer.lora_a_stacked, mapping.token_slots, torch.empty(len(token_slots), 8 * len(slices),
                                                                                   dtype=torch.float64))
    got = y.clone()
    lora_expand(buf, layer.lora_b_stacked, mapping.token_slots, got, 0, layer.slice_widths)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert not torch.equal(want[token_slots >= 0], y[token_slots >= 0])
    assert torch.equal(want[token_slots < 0], y[token_slots < 0])
    assert (layer.lora_a_stacked.data_ptr(), layer.lora_b_stacked.data_ptr()) == storage  # written in place


def test_no_adapter_in_the_step_is_no_mapping():
    assert make_lora_mapping(np.array([-1, -1]), torch.device("cpu")) is None


def test_lora_config_is_validated():
    assert LoRAConfig(enable_lora=True, max_loras=3).max_cpu_loras == 3
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LoRAConfig(max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="max_lora_rank"):
        LoRAConfig(max_lora_rank=0)
    with pytest.raises(ValueError, match="max_loras"):
        LoRAConfig(max_loras=0)


def test_rollout_launch_takes_vllms_lora_flags(base_model):
    from engine.engine_args import create_engine_config
    from rollout.cli import build_parser
    from rollout.cli_args import dataclass_kwargs

    args = build_parser().parse_args(["launch", "--model", base_model, "--enable-lora", "--max-loras", "4",
                                      "--max-lora-rank", "16", "--max-cpu-loras", "8"])
    config = create_engine_config(**dataclass_kwargs(args, LoRAConfig), model=base_model).lora
    assert (config.enable_lora, config.max_loras, config.max_lora_rank, config.max_cpu_loras) == (True, 4, 16, 8)


@pytest.mark.parametrize("token_slots,grouped", [
    ([2, 2, -1, 0, 0, 2, 1, -1, 1], False),  # a decode batch: the kernels take the tokens grouped by slot
    ([1, 1, 0, 0, 0, -1], True),  # one run per slot (a prefill step of whole prompts): as they are
    ([0, 1, 0], False),
])
def test_token_order_groups_the_tokens_by_slot_unless_they_are(token_slots, grouped):
    mapping = make_lora_mapping(np.array(token_slots), torch.device("cpu"))
    if grouped:
        assert mapping.token_order is None
        return
    order = mapping.token_order
    assert order.dtype == torch.int32 and sorted(order.tolist()) == list(range(len(token_slots)))
    in_order = [token_slots[i] for i in order.tolist()]
    assert in_order == sorted(token_slots)  # grouped by slot, ascending
    for slot in set(token_slots):  # stable: each slot's tokens ascending
        ids = [i for i in order.tolist() if token_slots[i] == slot]
        assert ids == sorted(ids)
