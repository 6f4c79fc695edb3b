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


def plan_nccl_packs(sizes: Sequence[int], buffer_size: int) -> list[Pack]:
    """vLLM's packed NCCL layout (its packed_tensor producer and consumer), which nccl and sparse_nccl use.

    Tensors are laid end to end with no padding, in order; a pack takes tensors until its
    bytes exceed buffer_size, the tensor that crosses the line included, then the next pack
    starts. So a pack may be larger than buffer_size (by at most one tensor), and a pack's
    bytes are exactly torch.cat of its tensors' bytes. Offsets are not aligned: a receiver
    viewing a slot as a wider dtype must copy when the offset is not a multiple of its size
    (view_or_copy).
    """
    if buffer_size < 1:
        raise ValueError(f"buffer size: {buffer_size} bytes is too small (at least 1)")
    packs: list[Pack] = []
    slots: list[PackSlot] = []
    used = 0
    for index, size in enumerate(sizes):
        slots.append(PackSlot(index, used, size))
        used += size
        if used > buffer_size:
            packs.append(Pack(tuple(slots), used))
            slots, used = [], 0
    if slots:
        packs.append(Pack(tuple(slots), used))
    return packs


def view_or_copy(buffer: torch.Tensor, slot: PackSlot, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """view_of when slot.offset suits dtype's alignment, else a copy of the slot's bytes (plan_nccl_packs)."""
    if slot.offset % dtype.itemsize == 0 and buffer.storage_offset() % dtype.itemsize == 0:
        return view_of(buffer, slot, dtype, shape)
    return buffer[slot.offset : slot.offset + slot.nbytes].clone().view(dtype).reshape(tuple(shape))


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


class DtypeNamesTensorList(Message):
    """vLLM's spelling of a call's tensors: {"names", "dtype_names", "shapes"} (nccl, sparse_nccl update_info).

    All three empty means "the same tensors as this model's last call" (vLLM's trainer sends the
    metadata once and empty lists while it stays the same); a backend resolves that.
    """

    names: list[NonEmptyStr] = []
    dtype_names: list[torch.dtype] = []
    shapes: list[tuple[NonNegInt, ...]] = []

    def check(self) -> None:
        if not (len(self.names) == len(self.dtype_names) == len(self.shapes)):
            raise ValueError(
                f"{len(self.names)} names, {len(self.dtype_names)} dtype_names, {len(self.shapes)} shapes; "
                "they must match"
            )


def dtype_names_list(names: Sequence[str], dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]) -> dict:
    """The JSON form DtypeNamesTensorList reads (vLLM's update_info fields)."""
    return {"names": list(names), "dtype_names": [dtype_name(d) for d in dtypes], "shapes": [list(s) for s in shapes]}


def tensor_list(names: Sequence[str], dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]) -> dict:
    """The JSON form TensorList reads."""
    return {"names": list(names), "dtypes": [dtype_name(d) for d in dtypes], "shapes": [list(s) for s in shapes]}
