"""The torch shrink/expand reference against a per-token loop on random data, and LoRA's config and CLI flags."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.config import LoRAConfig
from engine.lora.ops import lora_expand_ref, lora_shrink_ref, make_lora_mapping

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
