"""align_pairs: the (token, k) pairs grouped by expert and padded to whole blocks, as the Triton fused MoE reads them."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.moe import align_pairs


def test_the_docstring_example():
    pair_ids, block_expert = align_pairs(torch.tensor([[2, 0], [0, 2]]), num_experts=4, block_m=2)
    pad = 4  # T * K
    assert pair_ids.tolist()[:4] == [1, 2, 0, 3] and set(pair_ids.tolist()[4:]) == {pad}
    assert block_expert.tolist()[:2] == [0, 2] and set(block_expert.tolist()[2:]) == {-1}


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_every_held_pair_appears_once_in_a_block_of_its_expert(seed, block_m):
    gen = torch.Generator().manual_seed(seed)
    num_tokens, top_k, num_experts = 37, 3, 6
    ids = torch.randint(-1, num_experts + 2, (num_tokens, top_k), generator=gen)  # some not held here
    pair_ids, block_expert = align_pairs(ids, num_experts, block_m)
    num_pairs = num_tokens * top_k
    assert pair_ids.numel() == block_expert.numel() * block_m
    flat = ids.reshape(-1)
    held = [p for p in range(num_pairs) if 0 <= flat[p] < num_experts]
    placed = [p for p in pair_ids.tolist() if p < num_pairs]
    assert sorted(placed) == held  # each held pair once, nothing else
    for row, pair in enumerate(pair_ids.tolist()):
        if pair < num_pairs:
            assert block_expert[row // block_m] == flat[pair]  # its block runs its expert
    used = block_expert[block_expert >= 0]
    assert torch.all(used[1:] >= used[:-1])  # blocks in expert order, unused ones at the end
