"""Packing plans: which tensors share which transfer buffer at which byte offset, computed identically on both sides.

A sender and a receiver that agree on the tensor list (names, dtypes, shapes, in order) and
the buffer size compute the same plan, so update_info only needs the list. Tensors go into
buffers in order, each at an offset aligned to ALIGN bytes (so a view of any dtype is
aligned); a tensor larger than one buffer gets a pack of its own, as large as it is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from weight_transfer.messages import Message, NonEmptyStr, NonNegInt

ALIGN = 256


@dataclass(frozen=True)
class PackSlot:
    index: int  # position in the tensor list
    offset: int  # byte offset in the pack's buffer
    nbytes: int


@dataclass(frozen=True)
class Pack:
    slots: tuple[PackSlot, ...]
    nbytes: int  # bytes of the buffer in use (end of the last slot)


def plan_packs(sizes: Sequence[int], buffer_size: int) -> list[Pack]:
    """Greedy in-order packing of tensors of `sizes` bytes into buffers of buffer_size bytes."""
    if buffer_size < ALIGN:
        raise ValueError(f"buffer size: {buffer_size} bytes is too small (at least {ALIGN})")
    packs: list[Pack] = []
    slots: list[PackSlot] = []
    used = 0
    for index, size in enumerate(sizes):
        start = _align(used)
        if slots and start + size > buffer_size:
            packs.append(Pack(tuple(slots), used))
            slots, start = [], 0
        slots.append(PackSlot(index, start, size))
        used = start + size
    if slots:
        packs.append(Pack(tuple(slots), used))
    return packs


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def nbytes_of(dtype: torch.dtype, shape: Sequence[int]) -> int:
    return math.prod(shape) * dtype.itemsize


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (a copy first if it is not contiguous)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def copy_into(buffer: torch.Tensor, slot: PackSlot, tensor: torch.Tensor) -> None:
    """Copies tensor's bytes into buffer[slot.offset : slot.offset + slot.nbytes] (any device to any device)."""
    src = as_bytes(tensor)
    if src.numel() != slot.nbytes:
        raise ValueError(f"pack slot {slot.index}: tensor has {src.numel()} bytes, the plan says {slot.nbytes}")
    buffer[slot.offset : slot.offset + slot.nbytes].copy_(src, non_blocking=True)


def view_of(buffer: torch.Tensor, slot: PackSlot, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """The tensor stored at `slot` of a uint8 buffer, as a view (no copy)."""
    return buffer[slot.offset : slot.offset + slot.nbytes].view(dtype).reshape(tuple(shape))


# ---- tensor lists on the wire (JSON): names, dtype names ("bfloat16", "float32", ...), shapes -----------


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class TensorList(Message):
    """{"names": [...], "dtypes": [...], "shapes": [[...], ...]}: the tensors of one call, in order
    (a part of several backends' update_info)."""

    names: list[NonEmptyStr]
    dtypes: list[torch.dtype]
    shapes: list[tuple[NonNegInt, ...]]

    def check(self) -> None:
        if not (len(self.names) == len(self.dtypes) == len(self.shapes)):
            raise ValueError(
                f"{len(self.names)} names, {len(self.dtypes)} dtypes, {len(self.shapes)} shapes; they must match"
            )


def tensor_list(names: Sequence[str], dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]) -> dict:
    """The JSON form TensorList reads."""
    return {"names": list(names), "dtypes": [dtype_name(d) for d in dtypes], "shapes": [list(s) for s in shapes]}
