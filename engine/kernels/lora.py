"""Multi-LoRA shrink/expand in Triton: one launch each for every token of every adapter in a step, beside the torch references in engine/lora/ops.py.

Each token reads its own adapter slot's A and B, named by a [T] int32 device tensor
token_slots (-1: no adapter), so the launches have the step's shapes only and a CUDA graph
replays them for any mix of adapters (engine/worker/cuda_graphs.py writes token_slots before
each replay). A fused layer's slices run in one launch each: their A's are stacked along the
rank (shrink sees one [max_loras, num_slices * max_rank, in] tensor) and their B's along the
output (expand walks the slices on a grid axis):

    shrink:  buf[t, :]        = x[t, :] @ A[slot_t]^T                     [T, num_slices * max_rank]
    expand:  y[t, cols of s] += buf[t, s-th rank block] @ B_s[slot_t]^T    (nothing where slot_t == -1)

A program owns BLOCK_T tokens (positions of token_order, a grouping of the step's tokens by
slot, when given: then most programs' tokens read one slot); it loops over the slots, and for
each slot that one of its tokens reads runs a tl.dot over those tokens' rows (the others masked to zero). A row's result
therefore has the same bits whatever the other tokens of the step are (a graph's padding rows,
a bigger batch): graph replays and eager steps agree, and adding zeros leaves y's bits alone.
No host reads and no branch on host state: the whole pair can be captured in a CUDA graph.

Split-K shrink: at decode sizes a layer has only T/16 x rank/16 shrink programs (16 at batch 256
for a rank-16 down projection), each walking the whole input width once per slot its tokens
read: a latency-bound handful. So the shrink may also split the input width into a fixed number
of ranges (one grid axis), each program writing float32 partial sums [num_splits, T, rank], and
the expand adds the partials up (in split order) as it loads them. The split count depends on
the layer's input width only (lora_num_splits), never on T, so the invariant above holds.
"""

from __future__ import annotations

import functools

import torch

from engine.kernels import next_power_of_2, use_triton
from engine.kernels.pdl import pdl_args
from engine.lora.ops import lora_expand_slots_ref, lora_shrink_slots_ref

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the references are all there is
    triton = None
else:
    from engine.kernels.pdl import wait_inputs

# Tokens per program: tl.dot's smallest M. Fixed, never chosen from T (see the module docstring).
BLOCK_T = 16
SHRINK_BLOCK_R = 16  # rank columns per shrink program: at decode sizes more programs beat re-reading x less
SHRINK_MAX_BLOCK_K = 256
EXPAND_MAX_BLOCK_N = 128
SHRINK_NUM_WARPS = 4
EXPAND_NUM_WARPS = 4
SHRINK_K_PER_SPLIT = 256  # input columns per split-K shrink program (rounded up to its BLOCK_K)
SHRINK_MAX_SPLITS = 16  # partials the expand adds up per token: bounds its extra reads at wide inputs


def lora_num_splits(in_features: int, k_per_split: int = SHRINK_K_PER_SPLIT, max_splits: int = SHRINK_MAX_SPLITS) -> int:
    """How many input-width ranges a layer's split-K shrink uses: fixed by the width alone (see the module docstring)."""
    return max(1, min(max_splits, -(-in_features // k_per_split)))

if triton is not None:

    @triton.jit
    def _program_tokens(order_ptr, num_tokens, HAS_ORDER: tl.constexpr, BLOCK_T: tl.constexpr):
        """This program's BLOCK_T token rows and which are real: positions program_id(0) * BLOCK_T + i of the
        step's tokens, taken through order (tokens grouped by slot) when there is one."""
        offs = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        mask = offs < num_tokens
        if HAS_ORDER:
            offs = tl.load(order_ptr + offs, mask=mask, other=0)
        return offs, mask

    # The token count changes every step: not specialized, so serving compiles one variant per layer shape.
    @triton.jit(do_not_specialize=["num_tokens"])
    def _lora_shrink_kernel(
        out_ptr, x_ptr, a_ptr, slots_ptr, order_ptr,
        num_tokens, num_slots, R, K, K_PER_SPLIT,
        stride_xt, stride_al, stride_ar, stride_os, stride_ot,
        DOT_PRECISION: tl.constexpr, PDL: tl.constexpr, HAS_ORDER: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """out[split, t, r] = sum over this split's k of x[t, k] * A[slot_t, r, k] for this program's tokens and
        rank columns (one split: the whole width; K_PER_SPLIT is a multiple of BLOCK_K)."""
        wait_inputs(PDL)
        split = tl.program_id(2)
        k_start = split * K_PER_SPLIT
        k_end = tl.minimum(K, k_start + K_PER_SPLIT)
        offs_t, mask_t = _program_tokens(order_ptr, num_tokens, HAS_ORDER, BLOCK_T)
        offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        slots = tl.load(slots_ptr + offs_t, mask=mask_t, other=-1)  # [BLOCK_T]
        x_rows = x_ptr + offs_t.to(tl.int64)[:, None] * stride_xt  # [BLOCK_T, 1]
        acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
        # Slot offsets stay int32: max_loras * rank * in is far below 2**31 for any served model.
        # Width outside, slots inside: each block of x is read once, whatever number of slots its tokens read.
        for k in range(k_start, k_end, BLOCK_K):
            offs_k = k + tl.arange(0, BLOCK_K)
            mask_k = offs_k < k_end
            x = tl.load(x_rows + offs_k[None, :], mask=(slots >= 0)[:, None] & mask_k[None, :], other=0.0)
            for slot in range(num_slots):
                rows = slots == slot  # this slot's tokens; each token is in at most one slot's rows
                if tl.max(rows.to(tl.int32), axis=0) > 0:
                    a_ptrs = a_ptr + slot * stride_al + offs_r[:, None] * stride_ar + offs_k[None, :]  # [BLOCK_R, BLOCK_K]
                    a = tl.load(a_ptrs, mask=mask_r[:, None] & mask_k[None, :], other=0.0)
                    acc += tl.dot(tl.where(rows[:, None], x, 0.0).to(x.dtype), tl.trans(a),
                                  input_precision=DOT_PRECISION)  # [BLOCK_T, BLOCK_R]
        out_ptrs = out_ptr + split * stride_os + offs_t.to(tl.int64)[:, None] * stride_ot + offs_r[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_r[None, :])

    @triton.jit(do_not_specialize=["num_tokens"])
    def _lora_expand_kernel(
        y_ptr, buf_ptr, b_ptr, slots_ptr, order_ptr, starts_ptr,
        num_tokens, num_slots, R, num_splits,
        stride_yt, stride_us, stride_ut, stride_bl, stride_bn,
        DOT_PRECISION: tl.constexpr, PDL: tl.constexpr, HAS_ORDER: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    ):
        """y[t, n] += sum over r of u[t, s * R + r] * B[slot_t, n, r] for slice s = program_id(2)'s
        columns n in [starts[s], starts[s + 1]) of this program's column block; y_ptr is at the offset.
        u is buf summed over its num_splits partials (buf [num_splits, T, slices * R]), in split order."""
        wait_inputs(PDL)
        s = tl.program_id(2)
        n_start = tl.load(starts_ptr + s)
        n_end = tl.load(starts_ptr + s + 1)
        n_block = n_start + tl.program_id(1) * BLOCK_N
        if n_block < n_end:  # the grid spans the widest slice: narrower ones have blocks past their end
            offs_n = n_block + tl.arange(0, BLOCK_N)
            mask_n = offs_n < n_end
            offs_t, mask_t = _program_tokens(order_ptr, num_tokens, HAS_ORDER, BLOCK_T)
            offs_r = tl.arange(0, BLOCK_R)  # BLOCK_R >= R: the whole rank in one dot (padded to tl.dot's 16)
            mask_r = offs_r < R
            slots = tl.load(slots_ptr + offs_t, mask=mask_t, other=-1)  # [BLOCK_T]
            u_ptrs = buf_ptr + offs_t.to(tl.int64)[:, None] * stride_ut + s * R + offs_r[None, :]  # [BLOCK_T, BLOCK_R]
            u_mask = (slots >= 0)[:, None] & mask_r[None, :]
            u_all = tl.load(u_ptrs, mask=u_mask, other=0.0).to(tl.float32)
            for split in range(1, num_splits):
                u_all += tl.load(u_ptrs + split * stride_us, mask=u_mask, other=0.0)
            u_all = u_all.to(b_ptr.dtype.element_ty)  # one split of bf16 partials: the same bits as loaded
            acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
            for slot in range(num_slots):
                rows = slots == slot
                if tl.max(rows.to(tl.int32), axis=0) > 0:
                    u = tl.where(rows[:, None], u_all, 0.0).to(b_ptr.dtype.element_ty)
                    b_ptrs = b_ptr + slot * stride_bl + offs_n[:, None] * stride_bn + offs_r[None, :]
                    b = tl.load(b_ptrs, mask=mask_n[:, None] & mask_r[None, :], other=0.0)  # [BLOCK_N, BLOCK_R]
                    acc += tl.dot(u, tl.trans(b), input_precision=DOT_PRECISION)  # [BLOCK_T, BLOCK_N]
            # Rows without an adapter are neither read nor written.
            mask = (slots >= 0)[:, None] & mask_n[None, :]
            y_ptrs = y_ptr + offs_t.to(tl.int64)[:, None] * stride_yt + offs_n[None, :]
            y = tl.load(y_ptrs, mask=mask, other=0.0)
            tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


def _check_order(token_order: torch.Tensor | None, num_tokens: int) -> None:
    assert token_order is None or (token_order.shape == (num_tokens,) and token_order.dtype == torch.int32), \
        "token_order: [T] int32, a permutation of the step's tokens"


def _dot_precision(dtype: torch.dtype) -> str | None:
    return "ieee" if dtype == torch.float32 else None  # float32 inputs: no tf32 rounding


def lora_shrink_triton(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor,
                       out: torch.Tensor, token_order: torch.Tensor | None = None) -> torch.Tensor:
    """lora_shrink_slots_ref's result through one launch: x [T, in], lora_a [max_loras, max_rank, in],
    token_slots [T] int32, out [T, max_rank] (written whole), or out [num_splits, T, max_rank] (float32
    partial sums over num_splits ranges of the input width, each written whole; lora_expand_triton adds them up).
    token_order: [T] int32, a permutation of the tokens grouping them by slot (LoRAMapping.token_order):
    programs take their rows in that order, so most read one adapter, not every one (the same results)."""
    num_tokens, k = x.shape
    num_slots, rank, _ = lora_a.shape
    partials = out.dim() == 3
    num_splits = out.shape[0] if partials else 1
    assert lora_a.shape[2] == k and out.shape[-2:] == (num_tokens, rank) and token_slots.shape == (num_tokens,)
    assert x.stride(1) == 1 and lora_a.stride(2) == 1 and out.stride(-1) == 1 and token_slots.dtype == torch.int32
    assert not partials or out.dtype == torch.float32, "split-K partial sums are float32"
    _check_order(token_order, num_tokens)
    if num_tokens == 0:
        return out
    k_per_split = -(-k // num_splits)
    block_k = min(SHRINK_MAX_BLOCK_K, max(16, next_power_of_2(k_per_split)))
    k_per_split = -(-k_per_split // block_k) * block_k  # whole blocks per split; the last split may be short or empty
    grid = (triton.cdiv(num_tokens, BLOCK_T), triton.cdiv(rank, SHRINK_BLOCK_R), num_splits)
    _lora_shrink_kernel[grid](
        out, x, lora_a, token_slots, token_slots if token_order is None else token_order,
        num_tokens, num_slots, rank, k, k_per_split,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), out.stride(0) if partials else 0, out.stride(-2),
        DOT_PRECISION=_dot_precision(x.dtype), HAS_ORDER=token_order is not None,
        BLOCK_T=BLOCK_T, BLOCK_R=SHRINK_BLOCK_R, BLOCK_K=block_k,
        num_warps=SHRINK_NUM_WARPS, num_stages=2, **pdl_args(),
    )
    return out


@functools.lru_cache(maxsize=256)
def slice_starts(slice_widths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """[num_slices + 1] int32 on `device`: where each slice's rows start in a stacked B, and the end.
    Cached, so a CUDA graph's capture finds it made by its warm-up pass (no host copy while capturing)."""
    starts = [0]
    for width in slice_widths:
        starts.append(starts[-1] + width)
    return torch.tensor(starts, dtype=torch.int32, device=device)


def lora_expand_triton(buf: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor, y: torch.Tensor,
                       offset: int, slice_widths: tuple[int, ...] | None = None,
                       token_order: torch.Tensor | None = None) -> None:
    """lora_expand_slots_ref's update through one launch (every slice of a fused layer): buf
    [T, num_slices * max_rank] or split-K partials [num_splits, T, num_slices * max_rank] (added up first),
    lora_b [max_loras, sum(slice_widths), max_rank], y [T, >= offset + sum]; token_order as lora_shrink_triton's."""
    num_tokens = buf.shape[-2]
    num_splits = buf.shape[0] if buf.dim() == 3 else 1
    num_slots, total, rank = lora_b.shape
    widths = slice_widths or (total,)
    assert sum(widths) == total and buf.shape[-1] == len(widths) * rank and y.shape[1] >= offset + total
    assert y.shape[0] == num_tokens and token_slots.shape == (num_tokens,) and token_slots.dtype == torch.int32
    assert y.stride(1) == 1 and buf.stride(-1) == 1 and lora_b.stride(2) == 1
    _check_order(token_order, num_tokens)
    if num_tokens == 0:
        return
    block_n = min(EXPAND_MAX_BLOCK_N, max(16, next_power_of_2(max(widths))))
    grid = (triton.cdiv(num_tokens, BLOCK_T), triton.cdiv(max(widths), block_n), len(widths))
    _lora_expand_kernel[grid](
        y[:, offset:], buf, lora_b, token_slots, token_slots if token_order is None else token_order,
        slice_starts(widths, y.device),
        num_tokens, num_slots, rank, num_splits,
        y.stride(0), buf.stride(0) if num_splits > 1 else 0, buf.stride(-2), lora_b.stride(0), lora_b.stride(1),
        DOT_PRECISION=_dot_precision(y.dtype), HAS_ORDER=token_order is not None,
        BLOCK_T=BLOCK_T, BLOCK_N=block_n, BLOCK_R=max(16, next_power_of_2(rank)),
        num_warps=EXPAND_NUM_WARPS, num_stages=1, **pdl_args(),
    )


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor, out: torch.Tensor,
                token_order: torch.Tensor | None = None) -> torch.Tensor:
    """out [T, max_rank] = each token's x @ A[slot]^T (zeros for slot -1); Triton on GPU, the reference otherwise
    (which has no use for token_order: it changes how the kernels walk the tokens, not the result)."""
    if use_triton(x):
        return lora_shrink_triton(x, lora_a, token_slots, out, token_order)
    return lora_shrink_slots_ref(x, lora_a, token_slots, out)


def lora_expand(buf: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor, y: torch.Tensor, offset: int,
                slice_widths: tuple[int, ...] | None = None, token_order: torch.Tensor | None = None) -> None:
    """y[:, offset:] += each token's buf @ B[slot]^T per slice, in place; Triton on GPU, the reference otherwise."""
    if use_triton(y):
        lora_expand_triton(buf, lora_b, token_slots, y, offset, slice_widths, token_order)
    else:
        lora_expand_slots_ref(buf, lora_b, token_slots, y, offset, slice_widths)
