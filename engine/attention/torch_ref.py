"""Plain-torch reference attention over a paged KV cache; GPU kernels in engine/kernels/ keep these signatures."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionMetadata


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_slots] int64; num_slots <= num_tokens, slot < 0 means "skip"
    k_scale: float = 1.0,  # fp8 caches: stored = key / k_scale (see to_cache_dtype)
    v_scale: float = 1.0,
) -> None:
    """Stores each token's key and value at its slot (slot = block_id * block_size + offset)."""
    num_slots = slot_mapping.shape[0]
    _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
    flat_cache = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_size)
    key, value = key[:num_slots], value[:num_slots]  # tokens past the slots are padding
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
    if is_fp8(kv_cache.dtype):  # index ops on float8 are CPU-incomplete: copy the bytes
        flat_cache = flat_cache.view(torch.uint8)
        key, value = to_cache_dtype(key, kv_cache.dtype, k_scale), to_cache_dtype(value, kv_cache.dtype, v_scale)
        key, value = key.view(torch.uint8), value.view(torch.uint8)
    flat_cache[0].index_copy_(0, slot_mapping, key.to(flat_cache.dtype))
    flat_cache[1].index_copy_(0, slot_mapping, value.to(flat_cache.dtype))


FP8_MAX = 448.0  # float8 e4m3fn's largest finite value


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == torch.float8_e4m3fn


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x as an fp8 cache stores it: x * float32(1 / scale) (as the GPU kernel computes it), saturated at +-448,
    rounded to nearest even."""
    return (x.to(torch.float32) * (1.0 / scale)).clamp_(-FP8_MAX, FP8_MAX).to(dtype)


# Decode rows are sorted by context length and padded per group of this many rows, so a
# short context never pays for the longest one in the batch.
_DECODE_GROUP_SIZE = 32


@dataclass
class _PrefillGroup:
    """Prefill rows of one shape (the same query_len q and seq_len), run as one batch of g rows: no padding."""

    tokens: torch.Tensor  # [g, q] token indices of each row's queries
    block_ids: torch.Tensor  # [g, num_blocks]
    seq_len: int
    # [q, seq_len] bool, True = attend: keys 0..the query's position; None when the row has no cached
    # prefix (q == seq_len): then SDPA's own causal mask is the same one, without a mask tensor to convert.
    mask: torch.Tensor | None


@dataclass
class _Plan:
    """How one step's rows are split; built on the first layer, reused by the others."""

    # (token indices [g], block ids [g, num_blocks], additive mask [g, 1, 1, ctx]) per decode group.
    decode_groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    # Rows with more than one query token, by shape.
    prefill_groups: list[_PrefillGroup]


def _make_prefill_group(rows: list[int], starts: list[int], metadata: AttentionMetadata, block_size: int,
                        device: torch.device) -> _PrefillGroup:
    query_len, seq_len = metadata.query_lens_cpu[rows[0]], metadata.seq_lens_cpu[rows[0]]
    first = torch.tensor([starts[i] for i in rows], device=device)  # [g]
    tokens = first[:, None] + torch.arange(query_len, device=device)[None, :]  # [g, q]
    # Query j sits at position (seq_len - query_len + j) and sees keys 0..that position:
    #   keys:    0 1 2 3 4 5      (seq_len 6, query_len 2, prefix 4)
    #   query 0: x x x x x .
    #   query 1: x x x x x x
    query_pos = torch.arange(seq_len - query_len, seq_len, device=device)
    key_pos = torch.arange(seq_len, device=device)
    row_ids = torch.tensor(rows, device=device)
    return _PrefillGroup(
        tokens=tokens, block_ids=metadata.block_table[row_ids, : -(-seq_len // block_size)].long(), seq_len=seq_len,
        mask=None if query_len == seq_len else key_pos[None, :] <= query_pos[:, None],
    )


def make_plan(metadata: AttentionMetadata, block_size: int, device: torch.device,
              rows: list[int] | None = None) -> _Plan:
    """Splits the step's rows (or only `rows`, for a backend that runs the others itself) into batches."""
    query_lens, seq_lens = metadata.query_lens_cpu, metadata.seq_lens_cpu
    starts = [0]
    for query_len in query_lens:
        starts.append(starts[-1] + query_len)
    rows = range(len(query_lens)) if rows is None else rows
    decode_rows = sorted((i for i in rows if query_lens[i] == 1), key=lambda i: seq_lens[i])
    groups = []
    for g in range(0, len(decode_rows), _DECODE_GROUP_SIZE):
        group = decode_rows[g : g + _DECODE_GROUP_SIZE]
        lens = torch.tensor([seq_lens[i] for i in group], device=device)
        num_blocks = -(-seq_lens[group[-1]] // block_size)  # rows are sorted: the last is longest
        row_ids = torch.tensor(group, device=device)
        block_ids = metadata.block_table[row_ids, :num_blocks].long()  # [g, num_blocks]
        valid = torch.arange(num_blocks * block_size, device=device)[None, :] < lens[:, None]  # [g, ctx]
        bias = torch.zeros(valid.shape, device=device).masked_fill_(~valid, float("-inf"))
        tokens = torch.tensor([starts[i] for i in group], device=device)
        groups.append((tokens, block_ids, bias[:, None, None, :]))
    # Prefill rows grouped by exact shape: a row's result then never depends on the others in its
    # batch (no padding; SDPA computes each batch entry alike), and an RL step's n samples of a
    # prompt, or many prompts of one length, share one call per layer.
    shapes: dict[tuple[int, int], list[int]] = {}
    for i in rows:
        if query_lens[i] > 1:
            shapes.setdefault((query_lens[i], seq_lens[i]), []).append(i)
    prefill = [_make_prefill_group(rows, starts, metadata, block_size, device) for rows in shapes.values()]
    return _Plan(groups, prefill)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    metadata: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,  # fp8 caches: key = stored * k_scale
    v_scale: float = 1.0,
) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
    """Causal attention of every request's new tokens over its cached context, for a mixed batch.

    Decode rows (query_len 1) run as a few padded batches of similar context length; longer
    rows (prefill chunks, possibly over a cached prefix) run as one batch per shape (query
    length, context length). Tokens past num_actual_tokens (padding) get zeros.
    """
    plan = metadata.backend_plan
    if not isinstance(plan, _Plan):
        plan = metadata.backend_plan = make_plan(metadata, kv_cache.shape[2], query.device)
    output = torch.zeros_like(query)
    run_plan(query, Cache(kv_cache, query.dtype, k_scale, v_scale), plan, scale, output)
    return output


def run_plan(query: torch.Tensor, cache: "Cache", plan: _Plan, scale: float, output: torch.Tensor) -> None:
    """Writes the attention output of the plan's rows into output (other rows are left as they are)."""
    for tokens, block_ids, mask in plan.decode_groups:
        output[tokens] = _decode_attention(query[tokens], cache, block_ids, mask, scale)
    for group in plan.prefill_groups:
        tokens = group.tokens.reshape(-1)
        output[tokens] = _prefill_attention(query[tokens].view(*group.tokens.shape, *query.shape[1:]), cache, group,
                                            scale).flatten(0, 1)


@dataclass
class Cache:
    """The paged KV tensor and how to read it: its values in the query's dtype (fp8: times the scales)."""

    kv: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_size]
    dtype: torch.dtype
    k_scale: float
    v_scale: float


def _gather_context(cache: Cache, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (keys, values), each [*block_ids.shape[:-1], num_blocks * block_size, Hkv, D], in the query's dtype."""
    kv_cache = cache.kv
    _, _, block_size, num_kv_heads, head_size = kv_cache.shape
    shape = (*block_ids.shape[:-1], block_ids.shape[-1] * block_size, num_kv_heads, head_size)
    flat_ids = block_ids.reshape(-1)
    fp8 = is_fp8(kv_cache.dtype)
    if fp8:
        kv_cache = kv_cache.view(torch.uint8)
    # index_select on the block dimension is a plain strided copy (faster than fancy indexing).
    key = kv_cache[0].index_select(0, flat_ids).view(shape)
    value = kv_cache[1].index_select(0, flat_ids).view(shape)
    if fp8:
        key = key.view(cache.kv.dtype).to(torch.float32).mul_(cache.k_scale).to(cache.dtype)
        value = value.view(cache.kv.dtype).to(torch.float32).mul_(cache.v_scale).to(cache.dtype)
    return key, value


def _prefill_attention(
    query: torch.Tensor,  # [g, q, Hq, D]
    kv_cache: Cache,
    group: _PrefillGroup,
    scale: float,
) -> torch.Tensor:  # [g, q, Hq, D]
    """Causal attention of g prefill rows of one shape, each over its own cached context."""
    num_heads = query.shape[2]
    key, value = _gather_context(kv_cache, group.block_ids)  # [g, num_blocks * block_size, Hkv, D]
    # Slice to exactly seq_len keys: stale slots past the context are never touched.
    key, value = key[:, : group.seq_len], value[:, : group.seq_len]  # [g, seq_len, Hkv, D]
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2),  # [g, Hq, q, D]
        key.transpose(1, 2),  # [g, Hkv, seq_len, D]
        value.transpose(1, 2),
        attn_mask=group.mask,
        is_causal=group.mask is None,
        scale=scale,
        enable_gqa=num_heads != key.shape[2],
    )
    return out.transpose(1, 2)


def _decode_attention(
    query: torch.Tensor,  # [g, Hq, D], one new token per row
    kv_cache: Cache,
    block_ids: torch.Tensor,  # [g, num_blocks]
    mask: torch.Tensor,  # [g, 1, 1, num_blocks * block_size] float: 0 inside the context, -inf past it
    scale: float,
) -> torch.Tensor:  # [g, Hq, D]
    """Decode rows as one padded batch; keys past a row's context are masked out.

    Invariant relied on: every cache slot holds finite values (the worker zero-fills the
    cache and only finite keys/values are written), so a masked stale value times a zero
    attention weight stays zero.
    """
    num_rows, num_heads, head_size = query.shape
    key, value = _gather_context(kv_cache, block_ids)  # [g, ctx, Hkv, D]
    num_kv_heads = key.shape[2]
    # The query heads sharing one KV head act as that head's "query positions" (GQA
    # without expanding K/V): [g, Hkv, Hq / Hkv, D].
    q = query.view(num_rows, num_kv_heads, num_heads // num_kv_heads, head_size)
    out = F.scaled_dot_product_attention(
        q, key.transpose(1, 2), value.transpose(1, 2), attn_mask=mask, scale=scale
    )  # [g, Hkv, Hq / Hkv, D]
    return out.reshape(num_rows, num_heads, head_size)
