"""Plain-torch reference attention over a paged KV cache; GPU kernels in engine/kernels/ keep these signatures."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionMetadata


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_slots] int64; num_slots <= num_tokens, slot < 0 means "skip"
) -> None:
    """Stores each token's key and value at its slot (slot = block_id * block_size + offset)."""
    num_slots = slot_mapping.shape[0]
    _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
    flat_cache = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_size)
    key, value = key[:num_slots], value[:num_slots]  # tokens past the slots are padding
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
    flat_cache[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat_cache[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
    """Causal attention of every request's new tokens over its cached context, for a mixed batch.

    Rows with query_len == 1 (decodes) run together as one padded batch; longer rows
    (prefill chunks, possibly over a cached prefix) run one at a time, since each costs
    a matmul anyway. Tokens past num_actual_tokens (padding) get zeros.
    """
    output = torch.zeros_like(query)
    query_lens, seq_lens = metadata.query_lens_cpu, metadata.seq_lens_cpu
    starts = [0]
    for query_len in query_lens:
        starts.append(starts[-1] + query_len)

    decode_rows = [i for i, n in enumerate(query_lens) if n == 1]
    if decode_rows:
        token_ids = torch.tensor([starts[i] for i in decode_rows], device=query.device)
        output[token_ids] = _decode_attention(
            query[token_ids], kv_cache, metadata, decode_rows, [seq_lens[i] for i in decode_rows], scale
        )
    for i, query_len in enumerate(query_lens):
        if query_len > 1:
            start, end = starts[i], starts[i + 1]
            output[start:end] = _prefill_attention(
                query[start:end], kv_cache, metadata.block_table[i], seq_lens[i], scale
            )
    return output


def _gather_context(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (keys, values), each [..., num_blocks_gathered * block_size, num_kv_heads, head_size]."""
    key = kv_cache[0][block_ids]  # [..., n, block_size, Hkv, D]
    value = kv_cache[1][block_ids]
    return key.flatten(-4, -3), value.flatten(-4, -3)


def _prefill_attention(
    query: torch.Tensor,  # [query_len, Hq, D]
    kv_cache: torch.Tensor,
    block_row: torch.Tensor,  # [max_num_blocks_per_req] int32
    seq_len: int,
    scale: float,
) -> torch.Tensor:  # [query_len, Hq, D]
    query_len, num_heads, _ = query.shape
    block_size = kv_cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    key, value = _gather_context(kv_cache, block_row[:num_blocks].long())
    # Slice to exactly seq_len keys: stale slots past the context are never touched.
    key, value = key[:seq_len], value[:seq_len]  # [seq_len, Hkv, D]
    # Query j sits at position (seq_len - query_len + j) and sees keys 0..that position:
    #   keys:    0 1 2 3 4 5      (seq_len 6, query_len 2, prefix 4)
    #   query 0: x x x x x .
    #   query 1: x x x x x x
    query_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)
    key_pos = torch.arange(seq_len, device=query.device)
    mask = key_pos[None, :] <= query_pos[:, None]  # [query_len, seq_len], True = attend
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1),  # [Hq, query_len, D]
        key.transpose(0, 1),  # [Hkv, seq_len, D]
        value.transpose(0, 1),
        attn_mask=mask,
        scale=scale,
        enable_gqa=num_heads != key.shape[1],
    )
    return out.transpose(0, 1)


def _decode_attention(
    query: torch.Tensor,  # [B, Hq, D], one new token per row
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    rows: list[int],
    seq_lens: list[int],
    scale: float,
) -> torch.Tensor:  # [B, Hq, D]
    num_rows, num_heads, head_size = query.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    max_ctx = max(seq_lens)
    num_blocks = -(-max_ctx // block_size)
    row_ids = torch.tensor(rows, device=query.device)
    block_ids = metadata.block_table[row_ids, :num_blocks].long().clamp_(min=0)  # [B, num_blocks]
    key, value = _gather_context(kv_cache, block_ids)  # [B, num_blocks * block_size, Hkv, D]
    lens = torch.tensor(seq_lens, device=query.device)
    valid = torch.arange(key.shape[1], device=query.device)[None, :] < lens[:, None]  # [B, ctx]
    # Zero stale values: a zero softmax weight times a NaN would still be NaN.
    value = value.masked_fill(~valid[:, :, None, None], 0.0)

    group = num_heads // num_kv_heads
    q = query.float().view(num_rows, num_kv_heads, group, head_size)  # [B, Hkv, G, D]
    scores = torch.einsum("bhgd,bkhd->bhgk", q, key.float()) * scale  # [B, Hkv, G, ctx]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgk,bkhd->bhgd", probs, value.float())  # [B, Hkv, G, D]
    return out.reshape(num_rows, num_heads, head_size).to(query.dtype)
