"""The torch reference paged attention against naive per-row causal attention on random inputs."""

from __future__ import annotations

import math

import pytest
import torch

from engine.attention.layer import Attention
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_ref import paged_attention, write_kv_cache
from engine.forward_context import get_forward_context, set_forward_context


def naive_attention(q, k, v, scale):
    """q [L, Hq, D] at the last L positions of k, v [S, Hkv, D]; causal, GQA by repeating kv heads."""
    query_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
    v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [Hq, L, S]
    query_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > query_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("head_size", [32, 64, 128])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1)])
def test_mixed_batch_matches_naive(head_size, block_size, num_heads, num_kv_heads):
    gen = torch.Generator().manual_seed(head_size * 7 + block_size + num_heads)
    # (query_len, seq_len): fresh prefill, chunk over a cached prefix, decodes of varied lengths.
    rows = [(9, 9), (1, 37), (5, 21), (1, 1), (1, 16), (17, 50), (2, 2)]
    num_blocks = 64
    scale = 1 / math.sqrt(head_size)
    # Unused slots hold large finite garbage (stale KV of finished requests): masking must
    # keep it out of the output. (Slots are never NaN: the worker zero-fills the cache.)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size) * 1e4
    perm = torch.randperm(num_blocks, generator=gen).tolist()

    block_table, contexts, queries, expected = [], [], [], []
    for query_len, seq_len in rows:
        n = -(-seq_len // block_size)
        block_table.append([perm.pop() for _ in range(n)])
        k = torch.randn(seq_len, num_kv_heads, head_size, generator=gen)
        v = torch.randn(seq_len, num_kv_heads, head_size, generator=gen)
        q = torch.randn(query_len, num_heads, head_size, generator=gen)
        contexts.append((k, v))
        queries.append(q)
        expected.append(naive_attention(q, k, v, scale))

    # The cached prefix of each row is written by an earlier "step".
    prefix = AttentionMetadata.build([s - q for q, s in rows], [s - q for q, s in rows], block_table, block_size)
    write_kv_cache(
        torch.cat([k[: s - q] for (k, _), (q, s) in zip(contexts, rows)]),
        torch.cat([v[: s - q] for (_, v), (q, s) in zip(contexts, rows)]),
        kv_cache,
        prefix.slot_mapping,
    )
    metadata = AttentionMetadata.build([q for q, _ in rows], [s for _, s in rows], block_table, block_size)
    write_kv_cache(
        torch.cat([k[s - q :] for (k, _), (q, s) in zip(contexts, rows)]),
        torch.cat([v[s - q :] for (_, v), (q, s) in zip(contexts, rows)]),
        kv_cache,
        metadata.slot_mapping,
    )
    out = paged_attention(torch.cat(queries), kv_cache, metadata, scale)
    torch.testing.assert_close(out, torch.cat(expected), atol=1e-5, rtol=1e-5)


def test_padding_tokens_are_ignored():
    gen = torch.Generator().manual_seed(0)
    kv_cache = torch.zeros(2, 8, 4, 2, 32)
    metadata = AttentionMetadata.build([3], [3], [[5]], 4)
    k, v = torch.randn(2, 5, 2, 32, generator=gen)  # 3 real tokens + 2 padding
    write_kv_cache(k, v, kv_cache, metadata.slot_mapping)
    assert torch.equal(kv_cache[0, 5, :3], k[:3]) and kv_cache[:, 5, 3].eq(0).all()
    out = paged_attention(torch.randn(5, 4, 32, generator=gen), kv_cache, metadata, 0.1)
    assert out[3:].eq(0).all()


def test_attention_layer_reads_forward_context():
    gen = torch.Generator().manual_seed(3)
    layer = Attention(num_heads=4, head_size=16, scale=0.25, num_kv_heads=2)
    layer.kv_cache = torch.zeros(2, 4, 4, 2, 16)
    metadata = AttentionMetadata.build([6], [6], [[2, 0]], 4)
    q, k, v = torch.randn(6, 64, generator=gen), torch.randn(6, 32, generator=gen), torch.randn(6, 32, generator=gen)
    with pytest.raises(RuntimeError, match="forward context"):
        get_forward_context()
    with set_forward_context(metadata):
        out = layer(q, k, v)
    expected = naive_attention(q.view(6, 4, 16), k.view(6, 2, 16), v.view(6, 2, 16), 0.25)
    torch.testing.assert_close(out, expected.reshape(6, 64), atol=1e-5, rtol=1e-5)


def _fill_rows(rows, block_size, num_kv_heads, num_heads, head_size, gen):
    """(kv_cache, metadata, query) of `rows` [(query_len, seq_len)], every row's context written to its own blocks."""
    num_blocks = sum(-(-s // block_size) for _, s in rows) + 1
    kv_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_size)
    block_table, next_block = [], 1
    for _, seq_len in rows:
        n = -(-seq_len // block_size)
        block_table.append(list(range(next_block, next_block + n)))
        next_block += n
    full = AttentionMetadata.build([s for _, s in rows], [s for _, s in rows], block_table, block_size)
    total = sum(s for _, s in rows)
    k, v = torch.randn(2, total, num_kv_heads, head_size, generator=gen)
    write_kv_cache(k, v, kv_cache, full.slot_mapping)
    metadata = AttentionMetadata.build([q for q, _ in rows], [s for _, s in rows], block_table, block_size)
    query = torch.randn(sum(q for q, _ in rows), num_heads, head_size, generator=gen)
    return kv_cache, metadata, query


def test_prefill_row_gives_the_same_bits_alone_and_batched():
    """Prefill rows of one shape share an SDPA call: each row's output is bit-identical to its output alone
    (the engine's seeded samples must not depend on the batch), and still matches naive attention."""
    gen = torch.Generator().manual_seed(11)
    block_size, num_heads, num_kv_heads, head_size = 4, 4, 2, 32
    # 12 rows of one shape (an RL prompt's n samples), some of another, a chunk over a prefix, decodes.
    rows = [(6, 6)] * 12 + [(5, 5)] * 3 + [(3, 10), (1, 7), (6, 6), (2, 2)]
    kv_cache, metadata, query = _fill_rows(rows, block_size, num_kv_heads, num_heads, head_size, gen)
    scale = 0.2
    batched = paged_attention(query, kv_cache, metadata, scale)
    start = 0
    for i, (query_len, seq_len) in enumerate(rows):
        table = metadata.block_table[i, : -(-seq_len // block_size)].tolist()
        alone = AttentionMetadata.build([query_len], [seq_len], [table], block_size)
        out = paged_attention(query[start : start + query_len], kv_cache, alone, scale)
        assert torch.equal(out, batched[start : start + query_len]), i
        keys = kv_cache[:, table].flatten(1, 2)[:, :seq_len]  # [2, seq_len, Hkv, D]
        torch.testing.assert_close(out, naive_attention(query[start : start + query_len], keys[0], keys[1], scale),
                                   atol=1e-5, rtol=1e-5)
        start += query_len


def test_fp8_cache_stores_scaled_saturated_e4m3_and_attends_over_its_values():
    """An fp8 cache holds clamp(x / scale) in e4m3 (saturating at 448), and attention over it is attention over
    the stored values times the scales: the same as a float32 cache holding those dequantized values."""
    from engine.attention.torch_ref import to_cache_dtype

    gen = torch.Generator().manual_seed(3)
    block_size, num_kv_heads, head_size, seq_len = 4, 2, 32, 11
    k = torch.randn(seq_len, num_kv_heads, head_size, generator=gen) * 3
    v = torch.randn(seq_len, num_kv_heads, head_size, generator=gen)
    k[0, 0, 0], v[1, 1, 1] = 5000.0, -1e6  # beyond e4m3's range: saturated, never NaN
    k_scale, v_scale = 2.0, 0.5
    metadata = AttentionMetadata.build([seq_len], [seq_len], [[3, 0, 5]], block_size)
    fp8 = torch.zeros(2, 8, block_size, num_kv_heads, head_size, dtype=torch.float8_e4m3fn)
    write_kv_cache(k, v, fp8, metadata.slot_mapping, k_scale, v_scale)
    stored_k = fp8[0].view(-1, num_kv_heads, head_size)[metadata.slot_mapping]
    assert torch.equal(stored_k.view(torch.uint8), to_cache_dtype(k, fp8.dtype, k_scale).view(torch.uint8))
    assert float(stored_k[0, 0, 0]) == 448.0 and float(fp8[1].view(-1, num_kv_heads, head_size)[metadata.slot_mapping][1, 1, 1]) == -448.0
    dequant_k = stored_k.float() * k_scale
    # e4m3 keeps 3 mantissa bits: within 1/16 relative wherever it did not saturate (or flush a tiny value).
    inside = (k.abs() < 448 * k_scale) & (k.abs() > 2**-6 * k_scale)
    assert bool(((dequant_k - k).abs() <= k.abs() / 16)[inside].all())

    full = torch.zeros(2, 8, block_size, num_kv_heads, head_size)
    dequant_v = fp8[1].view(-1, num_kv_heads, head_size)[metadata.slot_mapping].float() * v_scale
    write_kv_cache(dequant_k, dequant_v, full, metadata.slot_mapping)
    q = torch.randn(seq_len, 4, head_size, generator=gen)
    out = paged_attention(q, fp8, metadata, 0.2, k_scale, v_scale)
    torch.testing.assert_close(out, paged_attention(q, full, metadata, 0.2), atol=0, rtol=0)
    torch.testing.assert_close(out, naive_attention(q, dequant_k, dequant_v, 0.2), atol=1e-5, rtol=1e-5)
