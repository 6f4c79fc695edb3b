"""The LoRA shrink/expand pair in plain torch (the references engine/kernels/lora.py's Triton pair sits beside), and the per-step token map they read."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.host_copy import to_device


@dataclass(frozen=True)
class LoRASegment:
    """The tokens of one step that run with the adapter in `slot`."""

    slot: int
    token_ids: torch.Tensor | None  # [n] int64 on the device, ascending; None: every token of the step


@dataclass(frozen=True)
class LoRAMapping:
    """Which adapter slot each token of one forward pass reads, in two forms:

      segments:     grouped by slot, one segment per adapter in the step (at most max_loras), so the
                    torch references loop over adapters, never over tokens (the CPU path);
      token_slots:  [T] int32 on the device, the slot of each token (-1: none), read by the Triton pair
                    (engine/kernels/lora.py). Its shape is the step's token count only, so a CUDA graph's
                    mapping is a static buffer written before each replay; such a mapping has no segments.
      token_order:  [T] int32 on the device, the tokens grouped by slot (a stable argsort of token_slots;
                    None: as they are, e.g. already grouped), the order the Triton pair's programs take
                    them in: a decode batch of requests with different adapters then has programs of one
                    adapter each.

    Tokens of requests without an adapter belong to no segment, have slot -1 and get no delta."""

    num_tokens: int
    segments: tuple[LoRASegment, ...]
    token_slots: torch.Tensor | None = None  # [T] int32, device
    token_order: torch.Tensor | None = None  # [T] int32, device


def make_lora_mapping(token_slots: np.ndarray, device: torch.device) -> LoRAMapping | None:
    """The mapping of a step whose token i reads slot token_slots[i] (-1: no adapter); None when no token has one.

        token_slots:  [ 1  1 -1  0  0  1 ]   ->  segments: slot 0: tokens [3, 4]
                                                           slot 1: tokens [0, 1, 5]
    """
    num_tokens = len(token_slots)
    slots = np.unique(token_slots)
    slots = slots[slots >= 0]
    if not len(slots):
        return None
    device_slots = to_device(torch.from_numpy(np.asarray(token_slots, dtype=np.int32)), device)  # [T] int32
    if len(slots) == 1 and token_slots[0] >= 0 and (token_slots == slots[0]).all():
        # One adapter for all: no gather.
        return LoRAMapping(num_tokens, (LoRASegment(int(slots[0]), None),), device_slots)
    order = np.argsort(token_slots, kind="stable")  # tokens grouped by slot, ascending within each
    starts = np.searchsorted(token_slots[order], slots)
    ends = np.append(starts[1:], num_tokens)
    sorted_ids = to_device(torch.from_numpy(order.astype(np.int64)), device)  # one copy for every segment
    # Already grouped (one run per slot, as a prefill step of whole prompts mostly is): the kernels take the
    # tokens as they are, sparing the gather.
    runs = 1 + int(np.count_nonzero(token_slots[1:] != token_slots[:-1]))
    grouped = runs == len(np.unique(token_slots))
    return LoRAMapping(num_tokens, tuple(
        LoRASegment(int(slot), sorted_ids[start:end]) for slot, start, end in zip(slots, starts, ends)), device_slots,
        None if grouped else sorted_ids.to(torch.int32))


def lora_shrink_ref(x: torch.Tensor, lora_a: torch.Tensor, mapping: LoRAMapping,
                    slots: frozenset[int] | None = None) -> torch.Tensor:
    """x [T, in] and the stacked A of one (sub)module, lora_a [max_loras, max_rank, in] -> [T, max_rank]:
    row t is x[t] @ A[slot of t]^T, zeros for tokens without an adapter.

    slots: the slots whose adapter has weights here (None: all); others are skipped (their A is zero)."""
    out = x.new_zeros(x.shape[0], lora_a.shape[1])
    for seg in mapping.segments:
        if slots is not None and seg.slot not in slots:
            continue
        a = lora_a[seg.slot]  # [max_rank, in]
        if seg.token_ids is None:
            torch.matmul(x, a.t(), out=out)
        else:
            out.index_copy_(0, seg.token_ids, x.index_select(0, seg.token_ids) @ a.t())
    return out


def lora_expand_ref(buf: torch.Tensor, lora_b: torch.Tensor, mapping: LoRAMapping, y: torch.Tensor, offset: int,
                    slots: frozenset[int] | None = None) -> None:
    """Adds buf [T, max_rank] @ B[slot of t]^T into columns [offset, offset + out) of y [T, >= offset + out],
    in place, for the stacked B of one (sub)module, lora_b [max_loras, out, max_rank] (scaling folded in).

        y:  | q | k | v |      a fused q/k/v output: the k slice is expanded at offset = q's width
    """
    y_slice = y.narrow(1, offset, lora_b.shape[1])  # a view: writes land in y
    for seg in mapping.segments:
        if slots is not None and seg.slot not in slots:
            continue
        b = lora_b[seg.slot]  # [out, max_rank]
        if seg.token_ids is None:
            y_slice.add_(buf @ b.t())
        else:
            y_slice.index_add_(0, seg.token_ids, buf.index_select(0, seg.token_ids) @ b.t())


# ---- the same pair over token_slots: the signature of engine/kernels/lora.py's Triton kernels ----

def lora_shrink_slots_ref(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor,
                          out: torch.Tensor) -> torch.Tensor:
    """Writes out [T, max_rank] = x [T, in] @ A[token_slots[t]]^T row by row, zeros where the slot is -1;
    lora_a [max_loras, max_rank, in]. Fixed shapes and no host reads: one full product per slot, each
    row kept only where it is the token's own slot (a reference: it computes max_loras times the work)."""
    out.zero_()
    for slot in range(lora_a.shape[0]):
        rows = (token_slots == slot).unsqueeze(1)  # [T, 1]
        out.add_(torch.where(rows, x @ lora_a[slot].t(), 0))
    return out


def lora_expand_slots_ref(buf: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor, y: torch.Tensor,
                          offset: int, slice_widths: tuple[int, ...] | None = None) -> None:
    """Adds buf @ B[token_slots[t]]^T into y's columns from `offset`, in place, nothing where the slot is -1.

    lora_b [max_loras, sum(slice_widths), max_rank] holds the B's of a fused layer's slices one after
    another (slice_widths None: one slice, all of lora_b's rows); slice s reads buf's columns
    [s * max_rank, (s + 1) * max_rank) and adds into y's columns [offset + start_s, offset + start_s + width_s):

        buf:     | r_q | r_k | r_v |        lora_b rows:  | q rows | k rows | v rows |
        y:  offset -> | q cols | k cols | v cols |
    """
    rank = lora_b.shape[2]
    widths = slice_widths or (lora_b.shape[1],)
    start = 0
    for s, width in enumerate(widths):
        y_slice = y.narrow(1, offset + start, width)  # a view: writes land in y
        u = buf.narrow(1, s * rank, rank)  # [T, max_rank]
        for slot in range(lora_b.shape[0]):
            rows = (token_slots == slot).unsqueeze(1)  # [T, 1]
            y_slice.add_(torch.where(rows, u @ lora_b[slot, start:start + width].t(), 0))
        start += width
