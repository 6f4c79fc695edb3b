"""Triton paged attention for mixed batches and the KV-cache write; signatures of engine.attention.torch_ref.

One kernel serves every row shape: prefill chunks over a cached prefix, whole prompts and
decodes. A program owns one KV head and a tile of one request's query tokens; the query
heads sharing that KV head (GQA) are packed into the tile's rows, so K/V are read once for
all of them:

    tile rows m = 0 .. BLOCK_M-1:   token  = m // group,  q head = kv_head * group + m % group
    (group = num_heads / num_kv_heads; BLOCK_Q = BLOCK_M // group tokens per tile)

Programs find their request by binary search over query_start_loc, with the grid sized
from the token and request counts alone (request i gets tiles starting at
query_start_loc[i] // BLOCK_Q + i), so the launch needs no host copy of per-request lengths
and replays under a CUDA graph. The tile shape is chosen once per shape class: decode-only
steps (max_query_len == 1) use small tiles, steps with prefill rows large ones. Batch-invariant
mode takes one launch shape for every step, with query tiles at absolute positions
(paged_attention_invariant, at the end of this file).
"""

from __future__ import annotations

import torch

from engine.attention import torch_ref
from engine.attention.metadata import AttentionMetadata
from engine.kernels import batch_invariant, next_power_of_2, use_triton
from engine.kernels.pdl import pdl_args

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None
else:
    from engine.kernels.pdl import wait_inputs

# The runner may capture this backend's decode steps in CUDA graphs (no host reads per call).
SUPPORTS_CUDA_GRAPHS = True

write_kv_cache_ref = torch_ref.write_kv_cache
paged_attention_ref = torch_ref.paged_attention


if triton is not None:

    @triton.jit
    def _write_kv_kernel(
        k_cache_ptr, v_cache_ptr, key_ptr, value_ptr, slot_ptr,
        stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
        stride_c_slot, stride_c_head, num_kv_heads, inv_k_scale, inv_v_scale,
        HEAD_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
        PDL: tl.constexpr,
    ):
        wait_inputs(PDL)
        token = tl.program_id(0)
        slot = tl.load(slot_ptr + token)
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        # slot < 0 marks a padding token: nothing is stored.
        mask = (h[:, None] < num_kv_heads) & (d[None, :] < HEAD_SIZE) & (slot >= 0)
        tok = token.to(tl.int64)
        k = tl.load(key_ptr + tok * stride_k_tok + h[:, None] * stride_k_head + d[None, :], mask=mask)
        v = tl.load(value_ptr + tok * stride_v_tok + h[:, None] * stride_v_head + d[None, :], mask=mask)
        dst = slot * stride_c_slot + h[:, None] * stride_c_head + d[None, :]
        if FP8:  # as torch_ref.to_cache_dtype: x * (1 / scale) in float32, saturated, rounded to nearest even
            k = tl.clamp(k.to(tl.float32) * inv_k_scale, -448.0, 448.0)
            v = tl.clamp(v.to(tl.float32) * inv_v_scale, -448.0, 448.0)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)

    # Per-step ints are not specialized (Triton would otherwise compile a variant per value == 1 or
    # divisibility by 16 class while serving): num_reqs, and stride_bt, the block table's width,
    # which follows the step's longest request.
    @triton.jit(do_not_specialize=["num_reqs", "stride_bt"])
    def _paged_attention_kernel(
        out_ptr, part_acc_ptr, part_ml_ptr,
        q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, query_start_loc_ptr, order_ptr,
        scale_log2, v_scale, num_reqs, num_heads,
        stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
        stride_c_block, stride_c_off, stride_c_head, stride_bt,
        GROUP: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
        DOT_PRECISION: tl.constexpr, LONGEST_FIRST: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr,
        INVARIANT: tl.constexpr, TILE_PAD: tl.constexpr,
    ):
        wait_inputs(PDL)
        split = tl.program_id(2)
        if LONGEST_FIRST:
            # Decode only: one tile per request. Programs start in grid order (axis 0 fastest), so
            # the KV heads of one request come together and requests in order_ptr's order (longest
            # context first): the last programs to start are the shortest.
            kv_head = tl.program_id(0)
            req = tl.load(order_ptr + tl.program_id(1))
            q_start = tl.load(query_start_loc_ptr + req)
            q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
            q_tile = 0
        else:
            tile = tl.program_id(0)
            kv_head = tl.program_id(1)
            # Request of this tile: the last i with query_start_loc[i] // BLOCK_Q + TILE_PAD * i <= tile
            # (TILE_PAD: the tiles a request may need beyond query_len // BLOCK_Q; 2 when aligned, INVARIANT).
            lo = 0
            hi = num_reqs
            while lo < hi:
                mid = (lo + hi) // 2
                first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + TILE_PAD * mid
                if first_tile <= tile:
                    lo = mid + 1
                else:
                    hi = mid
            req = lo - 1
            q_start = tl.load(query_start_loc_ptr + req)
            q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
            q_tile = tile - (q_start // BLOCK_Q + TILE_PAD * req)
        m = tl.arange(0, BLOCK_M)
        if INVARIANT:
            # Query tiles at absolute positions: tile j of a request holds positions [j BQ, (j+1) BQ), so
            # the token at position p always sits in tile row (p % BQ) * GROUP + its head, whatever
            # the step's first position was (a prefix hit, a chunk boundary, a decode):
            #   positions   | cached ... c-1 | c ... c+q_len-1 |      c = context_len
            #   tiles       |  ...  | c // BQ | ... |            q_tile 0 is the one holding c
            # Rows outside [c, c + q_len) are masked; a request spans at most q_len // BQ + 2 tiles.
            full_len = tl.load(seq_lens_ptr + req)
            shift = (full_len - q_len) % BLOCK_Q  # the first new token's row in its tile
            tok = q_tile * BLOCK_Q - shift + m // GROUP  # query token within the request (< 0: cached)
            seq_len = tl.where((q_tile * BLOCK_Q - shift < q_len) & (q_len > 0), full_len, 0)
            context_len = seq_len - q_len
            row_valid = (m < BLOCK_Q * GROUP) & (tok >= 0) & (tok < q_len)
        else:
            # Tiles past the request's tokens (the grid is an upper bound) see no keys, store nothing.
            seq_len = tl.where(q_tile * BLOCK_Q < q_len, tl.load(seq_lens_ptr + req), 0)
            context_len = seq_len - q_len  # tokens cached before this step's
            tok = q_tile * BLOCK_Q + m // GROUP  # query token within the request
            row_valid = (m < BLOCK_Q * GROUP) & (tok < q_len)
        head = kv_head * GROUP + m % GROUP
        d = tl.arange(0, BLOCK_D)
        d_mask = d < HEAD_SIZE
        tok64 = (q_start + tok).to(tl.int64)
        q = tl.load(
            q_ptr + tok64[:, None] * stride_q_tok + head[:, None] * stride_q_head + d[None, :],
            mask=row_valid[:, None] & d_mask[None, :], other=0.0,
        )  # [BLOCK_M, BLOCK_D]
        q_pos = context_len + tok  # absolute position of each row's token

        # Keys this tile can see: up to its last token's position (causal), within the context.
        if INVARIANT:
            kv_end = tl.maximum(tl.minimum(seq_len, context_len - shift + (q_tile + 1) * BLOCK_Q), 0)
        else:
            kv_end = tl.maximum(tl.minimum(seq_len, context_len + (q_tile + 1) * BLOCK_Q), 0)
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite, so fully masked rows stay NaN-free
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
        # Split-KV (decode with few rows): this program takes one contiguous share of the keys.
        split_len = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_lo = split * split_len
        kv_hi = tl.minimum(kv_end, kv_lo + split_len)
        for start in range(kv_lo, kv_hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_valid = n < kv_hi
            block_ids = tl.load(bt_row + n // KV_BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
            kv_off = block_ids * stride_c_block + (n % KV_BLOCK_SIZE) * stride_c_off + kv_head * stride_c_head
            kv_mask = n_valid[:, None] & d_mask[None, :]
            k = tl.load(k_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
            v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
            if FP8:  # stored / scale: k_scale rides in scale_log2, v_scale is applied to acc at the end
                k = k.to(q.dtype)
                v = v.to(q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N], log2 units
            visible = (n[None, :] <= q_pos[:, None]) & n_valid[None, :]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            if INVARIANT:
                # A tile with no key visible to a row must leave that row's state bit for bit as it was
                # (the tiles a query tile walks past a row's own position depend on the rows beside it):
                # alpha exactly 1 where the maximum did not move and p exactly 0 off the visible keys,
                # whatever exp2 rounds 0 and -inf to.
                alpha = tl.where(m_new == m_i, 1.0, alpha)
                p = tl.where(visible, p, 0.0)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        if FP8:
            acc = acc * v_scale
        if NUM_SPLITS == 1:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # rows with no keys (padding) give zeros
            tl.store(
                out_ptr + tok64[:, None] * stride_o_tok + head[:, None] * stride_o_head + d[None, :],
                out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_mask[None, :],
            )
        else:
            # Partials [token, head, split]: unnormalised acc, running max and sum; see _combine_splits.
            part = (tok64 * num_heads + head) * NUM_SPLITS + split  # [BLOCK_M]
            tl.store(part_acc_ptr + part[:, None] * BLOCK_D + d[None, :], acc, mask=row_valid[:, None])
            tl.store(part_ml_ptr + part * 2, m_i, mask=row_valid)
            tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_valid)

    @triton.jit
    def _combine_splits_kernel(
        out_ptr, part_acc_ptr, part_ml_ptr, stride_o_tok, stride_o_head, num_heads,
        HEAD_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, PDL: tl.constexpr,
    ):
        wait_inputs(PDL)
        tok = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        s = tl.arange(0, NUM_SPLITS)
        part = (tok * num_heads + head) * NUM_SPLITS + s  # [S]
        m = tl.load(part_ml_ptr + part * 2)
        l = tl.load(part_ml_ptr + part * 2 + 1)
        m_max = tl.max(m, axis=0)
        w = tl.exp2(m - m_max)  # empty splits (m = -1e30, l = 0) weigh nothing
        total = tl.sum(l * w, axis=0)
        d = tl.arange(0, BLOCK_D)
        acc = tl.load(part_acc_ptr + part[:, None] * BLOCK_D + d[None, :])  # [S, BLOCK_D]
        out = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + tok * stride_o_tok + head * stride_o_head + d, out.to(out_ptr.dtype.element_ty),
                 mask=d < HEAD_SIZE)


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_slots] int64; slot < 0 means "skip"
    k_scale: float = 1.0,  # fp8 caches: stored = key / k_scale
    v_scale: float = 1.0,
) -> None:
    """Stores each token's key and value at its slot; Triton on GPU, the reference on CPU."""
    if not use_triton(kv_cache) or key.stride(-1) != 1 or value.stride(-1) != 1 or not kv_cache.is_contiguous():
        return write_kv_cache_ref(key, value, kv_cache, slot_mapping, k_scale, v_scale)
    num_slots = slot_mapping.shape[0]
    if num_slots == 0:
        return
    _, _, _, num_kv_heads, head_size = kv_cache.shape
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _write_kv_kernel[(num_slots,)](
        k_cache, v_cache, key, value, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(1), k_cache.stride(2), num_kv_heads, 1.0 / k_scale, 1.0 / v_scale,
        HEAD_SIZE=head_size, BLOCK_H=next_power_of_2(num_kv_heads), BLOCK_D=next_power_of_2(head_size),
        FP8=torch_ref.is_fp8(kv_cache.dtype), num_warps=4, **pdl_args(),
    )


# Programs that fill the GPU a few times over; decode steps with fewer (small batches) split
# each row's keys into up to _MAX_SPLITS shares (flash-decoding) and combine the partials.
_TARGET_PROGRAMS = 1024
_MAX_SPLITS = 16


def _num_splits(max_query_len: int, num_programs: int) -> int:
    if max_query_len > 1 or num_programs >= _TARGET_PROGRAMS // 2:
        return 1
    return min(_MAX_SPLITS, next_power_of_2(-(-_TARGET_PROGRAMS // num_programs)))


# Decode tile shape; benchmarks/attention_configs.py times the alternatives.
DECODE_CONFIG = dict(BLOCK_N=64, num_warps=4, num_stages=3)
# Decode steps start their programs longest context first (one argsort of seq_lens per step),
# so a long row does not run alone at the end of the kernel. On the H200 this took decode attention
# at 128 mixed-length rows from 174 to 144 us and the offline run from 24,829 to 25,939 tok/s
# (h200-attention-configs.json, h200-offline-throughput-longest-first.json); one length is unchanged.
LONGEST_FIRST = True


def _tile_config(max_query_len: int, group: int, head_size: int) -> dict:
    """Tile shape per shape class: decode-only steps, or steps with prefill rows (batch-invariant mode has
    one shape for all: invariant_tile_config)."""
    if max_query_len <= 1:
        block_m = max(16, next_power_of_2(group))
        cfg = dict(DECODE_CONFIG)
        if head_size > 128:
            cfg["BLOCK_N"] = min(cfg["BLOCK_N"], 32)
        return dict(BLOCK_M=block_m, **cfg)
    block_m = max(64 if head_size > 128 else 128, next_power_of_2(group))
    return dict(BLOCK_M=block_m, BLOCK_N=64 if head_size <= 128 else 32, num_warps=8 if block_m >= 128 else 4,
                num_stages=2)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    metadata: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,  # fp8 caches: key = stored * k_scale
    v_scale: float = 1.0,
) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
    """Causal attention of every request's new tokens over its cached context, for a mixed batch.

    Tokens past query_start_loc[-1] (padding) get zeros.
    """
    if not use_triton(query) or query.stride(-1) != 1 or not kv_cache.is_contiguous():
        return paged_attention_ref(query, kv_cache, metadata, scale, k_scale, v_scale)
    if batch_invariant.batch_invariant():
        return paged_attention_invariant(query, kv_cache, metadata, scale, k_scale, v_scale)
    fp8 = torch_ref.is_fp8(kv_cache.dtype)
    num_tokens, num_heads, head_size = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    num_reqs = metadata.query_start_loc.shape[0] - 1
    out = torch.zeros_like(query) if num_tokens > metadata.num_actual_tokens else torch.empty_like(query)
    if num_reqs == 0 or num_tokens == 0:
        return out
    cfg = _tile_config(metadata.max_query_len, group, head_size)
    block_q = cfg["BLOCK_M"] // group
    block_d = next_power_of_2(max(head_size, 16))
    # Upper bound on tiles, from counts alone (see the module docstring).
    num_tiles = num_tokens // block_q + num_reqs
    num_splits = _num_splits(metadata.max_query_len, num_tiles * num_kv_heads)
    longest_first = LONGEST_FIRST and metadata.max_query_len <= 1 and num_tokens == num_reqs
    if longest_first:
        if metadata.longest_first_order is None:  # once per forward pass; the other layers reuse it
            metadata.longest_first_order = torch.argsort(metadata.seq_lens, descending=True).to(torch.int32)
        order = metadata.longest_first_order
        grid = (num_kv_heads, num_reqs, num_splits)
    else:
        order = metadata.seq_lens  # unused
        grid = (num_tiles, num_kv_heads, num_splits)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    if num_splits > 1:
        part_acc = torch.empty(num_tokens * num_heads * num_splits, block_d, dtype=torch.float32, device=query.device)
        part_ml = torch.empty(num_tokens * num_heads * num_splits, 2, dtype=torch.float32, device=query.device)
    else:
        part_acc = part_ml = out  # unused
    _paged_attention_kernel[grid](
        out, part_acc, part_ml,
        query, k_cache, v_cache, metadata.block_table, metadata.seq_lens, metadata.query_start_loc, order,
        scale * 1.4426950408889634 * (k_scale if fp8 else 1.0), v_scale, num_reqs, num_heads,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), metadata.block_table.stride(0),
        GROUP=group, KV_BLOCK_SIZE=block_size, HEAD_SIZE=head_size, BLOCK_D=block_d,
        BLOCK_Q=block_q, NUM_SPLITS=num_splits,
        # float32 models mean float32: Triton's default for fp32 dots is TF32 (10-bit mantissa), which
        # made a TP=2 float32 run differ from one GPU by ~1e-3 in the logits. None: Triton's default (bf16/fp16).
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else None,
        LONGEST_FIRST=longest_first,
        FP8=fp8, INVARIANT=False, TILE_PAD=1,
        **pdl_args(),
        **cfg,
    )
    if num_splits > 1:
        _combine_splits_kernel[(metadata.num_actual_tokens, num_heads)](
            out, part_acc, part_ml, out.stride(0), out.stride(1), num_heads,
            HEAD_SIZE=head_size, BLOCK_D=block_d, NUM_SPLITS=num_splits, num_warps=4, **pdl_args(),
        )
    return out


# ---- batch-invariant mode ------------------------------------------------------------------------
#
# One launch shape for every step: the kernel above with one tile shape, no split-KV, programs in
# grid order (no longest-first variant) and INVARIANT on. A query row at absolute position p then
# goes through the same arithmetic in every step that holds it, prefill, chunk, decode or verify:
#
#     KV tiles  [0, BN) [BN, 2 BN) ... [j BN, (j+1) BN)   j = p // BN, at absolute positions from 0
#     each tile: s = q . k^T over the head dim, masked to keys <= p, one online-softmax update
#
# in that order, whichever of its keys came from the prefix cache, from earlier chunks or from this
# step, wherever the blocks lie (the block table only addresses), and whatever row of its query tile
# it landed in. The tiles a query tile walks past p (its later rows see further) are exact no-ops
# for row p (see INVARIANT in the kernel).


def invariant_tile_config(group: int, head_size: int) -> dict:
    """The one tile shape of batch-invariant mode (changing it changes results, not only speed)."""
    return dict(BLOCK_M=max(16, next_power_of_2(group)),
                BLOCK_N=batch_invariant.ATTENTION_BLOCK_N if head_size <= 128 else 32, num_warps=4, num_stages=2)


def paged_attention_invariant(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size], last dim contiguous
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size], contiguous
    metadata: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
    """paged_attention in batch-invariant mode: each row's result depends on its query and its keys alone.

    Launches the Triton kernel without the device check (Triton's interpreter runs it on CPU tensors
    in the tests); paged_attention calls it for CUDA tensors when the mode is on.
    """
    fp8 = torch_ref.is_fp8(kv_cache.dtype)
    num_tokens, num_heads, head_size = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    num_reqs = metadata.query_start_loc.shape[0] - 1
    out = torch.zeros_like(query) if num_tokens > metadata.num_actual_tokens else torch.empty_like(query)
    if num_reqs == 0 or num_tokens == 0:
        return out
    cfg = invariant_tile_config(group, head_size)
    block_q = cfg["BLOCK_M"] // group
    grid = (num_tokens // block_q + 2 * num_reqs, num_kv_heads, 1)  # an upper bound on tiles (TILE_PAD = 2)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _paged_attention_kernel[grid](
        out, out, out,
        query, k_cache, v_cache, metadata.block_table, metadata.seq_lens, metadata.query_start_loc, metadata.seq_lens,
        scale * 1.4426950408889634 * (k_scale if fp8 else 1.0), v_scale, num_reqs, num_heads,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), metadata.block_table.stride(0),
        GROUP=group, KV_BLOCK_SIZE=block_size, HEAD_SIZE=head_size, BLOCK_D=next_power_of_2(max(head_size, 16)),
        BLOCK_Q=block_q, NUM_SPLITS=1,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else None,
        LONGEST_FIRST=False, FP8=fp8, INVARIANT=True, TILE_PAD=2,
        **pdl_args(),
        **cfg,
    )
    return out
