"""The LoRA shrink/expand pair in plain torch (the reference a Triton kernel pair will sit beside), and the per-step token map they read."""

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
    """Which adapter slot each token of one forward pass reads, grouped by slot: one segment per
    adapter in the step (at most max_loras), so the ops loop over adapters, never over tokens.
    Tokens of requests without an adapter belong to no segment and get no delta."""

    num_tokens: int
    segments: tuple[LoRASegment, ...]


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
    if len(slots) == 1 and token_slots[0] >= 0 and (token_slots == slots[0]).all():
        return LoRAMapping(num_tokens, (LoRASegment(int(slots[0]), None),))  # one adapter for all: no gather
    order = np.argsort(token_slots, kind="stable")  # tokens grouped by slot, ascending within each
    starts = np.searchsorted(token_slots[order], slots)
    ends = np.append(starts[1:], num_tokens)
    sorted_ids = to_device(torch.from_numpy(order.astype(np.int64)), device)  # one copy for every segment
    return LoRAMapping(num_tokens, tuple(
        LoRASegment(int(slot), sorted_ids[start:end]) for slot, start, end in zip(slots, starts, ends)))


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
