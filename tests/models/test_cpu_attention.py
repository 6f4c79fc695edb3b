"""The C kernel for CPU paged attention (engine/kernels/cpu_attention.c) against the torch reference."""

from __future__ import annotations

import math
import random

import pytest
import torch

from engine.attention import torch_ref
from engine.attention.metadata import AttentionMetadata
from engine.kernels import cpu_attention

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="no C compiler: the kernel is not built")


def _case(seed: int, rows: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_size: int, block_size: int,
          dtype: torch.dtype):
    """(query, kv_cache, metadata) for rows of (query_len, seq_len), blocks scattered over the cache.

    The query is a view into a wider fused q/k/v buffer (as models pass it); unused cache slots hold
    large finite values, so a read past a row's context would show in the output."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // block_size) for _, s in rows) + 5
    free = list(range(num_blocks))
    rng.shuffle(free)
    table = [[free.pop() for _ in range(-(-s // block_size))] for _, s in rows]
    metadata = AttentionMetadata.build([q for q, _ in rows], [s for _, s in rows], table, block_size)
    kv_cache = (torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=gen) * 3).to(dtype)
    num_tokens = sum(q for q, _ in rows)
    fused = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, generator=gen).to(dtype)
    query = fused[:, : num_heads * head_size].view(num_tokens, num_heads, head_size)
    return query, kv_cache, metadata


def _both(query, kv_cache, metadata, scale, num_threads=1):
    expected = torch_ref.paged_attention(query, kv_cache, metadata, scale)
    metadata.backend_plan = None
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        actual = cpu_attention.paged_attention(query, kv_cache, metadata, scale)
    finally:
        torch.set_num_threads(previous)
    return expected, actual


# Decode rows, short multi-token rows (the kernel) and rows past MAX_KERNEL_QUERY_LEN (SDPA), mixed.
MIXED = [(1, 37), (1, 1), (3, 3), (5, 40), (1, 200), (16, 16), (17, 60), (1, 16), (40, 90), (2, 33)]


@pytest.mark.parametrize("head_size", [16, 32, 64, 80, 128])  # 16 and 80 take the generic-size path
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("block_size", [4, 5, 16])
def test_float32_matches_the_reference(head_size, num_heads, num_kv_heads, block_size):
    query, kv_cache, metadata = _case(head_size + num_heads + block_size, MIXED, num_heads, num_kv_heads, head_size,
                                      block_size, torch.float32)
    expected, actual = _both(query, kv_cache, metadata, 1 / math.sqrt(head_size))
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("head_size", [16, 32, 64, 80, 128])  # 16 and 80: the generic-size vector path
@pytest.mark.parametrize("block_size", [5, 16])  # 5: blocks that split the 8- and 16-key score chunks
def test_bfloat16_matches_the_reference(head_size, block_size):
    query, kv_cache, metadata = _case(head_size, MIXED, 8, 2, head_size, block_size, torch.bfloat16)
    expected, actual = _both(query, kv_cache, metadata, 1 / math.sqrt(head_size))
    assert actual.dtype == torch.bfloat16
    # Both accumulate in float32 and round once; they may differ by a rounding step of the output.
    torch.testing.assert_close(actual.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_threads_and_batch_do_not_change_a_rows_bits():
    """A row's result depends on its own context only: not on the other rows, nor the thread count."""
    rows = [(1, 300), (4, 120), (1, 5), (1, 77), (2, 64)] * 3
    query, kv_cache, metadata = _case(7, rows, 8, 2, 64, 16, torch.float32)
    _, one_thread = _both(query, kv_cache, metadata, 0.125, num_threads=1)
    _, two_threads = _both(query, kv_cache, metadata, 0.125, num_threads=2)
    assert torch.equal(one_thread, two_threads)
    # Row 0 alone (its own metadata, the same cache blocks) gives the same bits as in the batch.
    alone = AttentionMetadata.build([1], [300], [metadata.block_table[0, :19].tolist()], 16)
    _, single = _both(query[:1], kv_cache, alone, 0.125)
    assert torch.equal(single[0], one_thread[0])


def test_padding_tokens_are_zero_and_the_query_is_not_written():
    query, kv_cache, metadata = _case(3, [(1, 20), (3, 9)], 4, 2, 32, 4, torch.float32)
    padded = torch.cat([query, torch.randn(2, 4, 32)])  # two tokens past num_actual_tokens
    before = padded.clone()
    _, actual = _both(padded, kv_cache, metadata, 0.2)
    assert torch.equal(actual[4:], torch.zeros(2, 4, 32))
    assert torch.equal(padded, before)


def test_unsupported_inputs_run_the_reference():
    """fp8 caches and float16 go to torch_ref: the same numbers, not an error."""
    query, kv_cache, metadata = _case(5, [(1, 30), (2, 8)], 4, 2, 32, 16, torch.float16)
    expected, actual = _both(query, kv_cache, metadata, 0.2)
    assert torch.equal(actual, expected)
