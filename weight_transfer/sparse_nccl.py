"""The "sparse_nccl" backend: the nccl transport carrying coordinate patches (SparseWeightPatch) beside dense tensors.

init_info: as for "nccl" (weight_transfer/nccl.py; vLLM's trainer sends no packed fields here).
update_info (SparseNCCLUpdateInfo, JSON): {"names", "dtype_names", "shapes"} as for "nccl", plus one of
    "num_updates_list": [int, ...]  vLLM's wire: every entry is a patch with this many coordinates;
                               per patch, in order, one broadcast of its int32 indices and one of
                               its values (never packed). A vLLM trainer sends this.
    "nnz": [int | null, ...]   ours (with "call_id"): per tensor the number of changed coordinates
                               of a patch, or null for a dense tensor.
dtype_names and shapes are the full tensor's.

On the wire with "nnz" (one packing plan over these items, as for "nccl"):

    [indices of every patch, concatenated: int32]  only if the call has patches
    [values of every patch, concatenated]           one item per dtype, in first-seen order
    [dense tensors, in order]

The engine receives the patch section first (it is small by construction: the sender keeps a
call's patches under one pack buffer), validates every patch before it yields anything, then
yields the pairs in the announced order: a SparseWeightPatch for a patch (the worker applies it
through the HF layout, so fused parameters get the right slice), a tensor for a dense entry.

The trainer side diffs each tensor against a DeltaTracker (weight_transfer/delta.py), so a sync
sends patches only where they are cheaper, and the engine ends bit-identical to a dense sync.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from weight_transfer.base import ParamMeta, SparseWeightPatch, SyncStats, WeightSource
from weight_transfer.delta import MAX_PATCH_NUMEL, DeltaTracker, patch_nbytes
from weight_transfer.messages import Fraction, int_in
from weight_transfer.nccl import (
    NCCLTrainerInitInfo,
    NCCLTrainerWeightTransferEngine,
    NCCLUpdateInfo,
    NCCLWeightTransferEngine,
    NCCLWeightUpdate,
    _in_metadata_order,
)
from weight_transfer.packing import dtype_name, dtype_names_list
from weight_transfer.process_group import TransferSettings, WireSpec

Entry = torch.Tensor | SparseWeightPatch


def _value_dtypes(dtypes: Sequence[torch.dtype], nnz: Sequence[int | None]) -> list[torch.dtype]:
    """The patches' value dtypes, in first-seen order (one wire item each)."""
    return list(dict.fromkeys(d for d, n in zip(dtypes, nnz) if n is not None))


def sparse_wire_specs(
    names: Sequence[str], dtypes: Sequence[torch.dtype], shapes: Sequence[tuple[int, ...]], nnz: Sequence[int | None]
) -> list[WireSpec]:
    """The call's wire items (see the module docstring); sender and receiver compute the same list."""
    specs = []
    if any(n is not None for n in nnz):
        specs.append(WireSpec("patch indices", torch.int32, (sum(n for n in nnz if n is not None),)))
        for dtype in _value_dtypes(dtypes, nnz):
            total = sum(n for d, n in zip(dtypes, nnz) if n is not None and d == dtype)
            specs.append(WireSpec(f"patch values ({dtype_name(dtype)})", dtype, (total,)))
    specs += [WireSpec(name, d, tuple(s)) for name, d, s, n in zip(names, dtypes, shapes, nnz) if n is None]
    return specs


# =======================================================================================
# Engine side
# =======================================================================================


class SparseNCCLUpdateInfo(NCCLUpdateInfo):
    """nccl's update_info plus, per tensor, its patch's coordinate count: vLLM's num_updates_list (all
    patches), or our nnz (None: a dense tensor)."""

    # Any 64-bit int here: its range, [0, the tensor's numel], depends on the tensor (check).
    nnz: list[int_in() | None] | None = None
    num_updates_list: list[int_in()] | None = None

    def check(self) -> None:
        super().check()
        if (self.nnz is None) == (self.num_updates_list is None):
            raise ValueError(".num_updates_list: give it (vLLM's) or nnz (ours), exactly one")
        field = "nnz" if self.nnz is not None else "num_updates_list"
        counts = self.nnz if self.nnz is not None else self.num_updates_list
        if not self.names:
            raise ValueError(f".{field}: a sparse update needs at least one tensor")
        if len(counts) != len(self.names):
            raise ValueError(
                f".{field}: expected a list with one entry per tensor (an int for a patch"
                f"{', null for a dense tensor' if field == 'nnz' else ''}), got {len(counts)} entries for "
                f"{len(self.names)} tensors"
            )
        for i, (name, dtype, shape, n) in enumerate(zip(self.names, self.dtype_names, self.shapes, counts)):
            if n is None:
                continue
            where = f".{field}[{i}] ({name!r})"
            numel = math.prod(shape)
            if not 0 <= n <= numel:
                raise ValueError(f"{where}: {n} is out of range (must be in [0, {numel}], the tensor's elements)")
            if not dtype.is_floating_point:
                raise ValueError(f"{where}: a patch needs a floating-point dtype, the tensor is {dtype_name(dtype)}")
            if numel > MAX_PATCH_NUMEL:
                raise ValueError(f"{where}: {numel} elements are more than int32 patch indices address; send it dense")


@dataclass(kw_only=True)
class SparseNCCLWeightUpdate(NCCLWeightUpdate):
    nnz: list[int | None]  # per tensor: a patch's changed coordinates, or None for a dense tensor
    vllm_wire: bool = False  # num_updates_list: per patch, its indices then its values, unpacked


class SparseNCCLWeightTransferEngine(NCCLWeightTransferEngine):
    """Receives patches and dense tensors; yields SparseWeightPatch objects for the patches."""

    update_info_type = SparseNCCLUpdateInfo

    def plan_update(self, update_info: SparseNCCLUpdateInfo) -> SparseNCCLWeightUpdate:
        if self.info is None:
            self._require_group()
        vllm_wire = update_info.num_updates_list is not None
        call_id = None if vllm_wire and update_info.call_id is None else self._call_id(update_info)
        self._require_group()
        nnz = list(update_info.num_updates_list if vllm_wire else update_info.nnz)
        return SparseNCCLWeightUpdate(list(update_info.names), list(update_info.dtype_names), list(update_info.shapes),
                                      call_id=call_id, nnz=nnz, vllm_wire=vllm_wire)

    def receive_weights(self, info: SparseNCCLWeightUpdate) -> Iterator[tuple[str, Entry]]:
        if info.vllm_wire:
            yield from self._receive_vllm(info)
            return
        stream = self._receive(info.call_id, sparse_wire_specs(info.names, info.dtypes, info.shapes, info.nnz))
        try:
            patches = _take_patches(info, stream)  # every patch checked before anything is yielded
            for name, n in zip(info.names, info.nnz):
                yield name, (next(stream) if n is None else patches[name])
            next(stream, None)  # runs the stream to its end (marks the call complete)
        finally:
            stream.close()  # after a failure or an early stop: aborts the group

    def _receive_vllm(self, info: SparseNCCLWeightUpdate) -> Iterator[tuple[str, Entry]]:
        """vLLM's sparse wire: per patch an int32 indices broadcast, then a values broadcast, never packed.
        Every patch is received and validated before the first is yielded (validate-then-land)."""
        specs = vllm_sparse_wire_specs(info.names, info.dtypes, info.nnz)
        settings = TransferSettings(False, self.info.settings.buffer_size, self.info.settings.num_buffers)
        stream = self._receive(info.call_id, specs, settings)
        try:
            patches = []
            for name, dtype, shape in zip(info.names, info.dtypes, info.shapes):
                patch = SparseWeightPatch(name, next(stream), next(stream), tuple(shape))
                patch.validate(dtype)  # ValueError naming the tensor; nothing has been yielded yet
                patches.append(patch)
            next(stream, None)
        finally:
            stream.close()
        for patch in patches:
            yield patch.name, patch


def vllm_sparse_wire_specs(
    names: Sequence[str], dtypes: Sequence[torch.dtype], counts: Sequence[int]
) -> list[WireSpec]:
    """vLLM's sparse wire items: per patch its indices (int32) and its values (the tensor's dtype), in order."""
    specs = []
    for name, dtype, n in zip(names, dtypes, counts):
        specs += [WireSpec(f"{name} (patch indices)", torch.int32, (n,)),
                  WireSpec(f"{name} (patch values)", dtype, (n,))]
    return specs


def _take_patches(info: SparseNCCLWeightUpdate, stream: Iterator[torch.Tensor]) -> dict[str, SparseWeightPatch]:
    """Reads the patch section off the stream (copied out: its buffer is reused) and validates each patch."""
    nnz = info.nnz
    if all(n is None for n in nnz):
        return {}
    indices = next(stream).clone()
    values = {dtype: next(stream).clone() for dtype in _value_dtypes(info.dtypes, nnz)}
    index_at = 0
    value_at = dict.fromkeys(values, 0)
    patches = {}
    for name, dtype, shape, n in zip(info.names, info.dtypes, info.shapes, nnz):
        if n is None:
            continue
        patch = SparseWeightPatch(
            name, indices[index_at : index_at + n], values[dtype][value_at[dtype] : value_at[dtype] + n], tuple(shape)
        )
        patch.validate(dtype)  # ValueError naming the tensor; nothing has been yielded yet
        patches[name] = patch
        index_at += n
        value_at[dtype] += n
    return patches


# =======================================================================================
# Trainer side
# =======================================================================================


class SparseNCCLTrainerInitInfo(NCCLTrainerInitInfo):
    """NCCLTrainerInitInfo plus the delta tracker's settings (trainer-only: the engine never sees them)."""

    backend: ClassVar[str] = "sparse_nccl"

    max_changed_fraction: Fraction = 0.25  # a tensor with more changed coordinates than this goes dense
    snapshot_device: str = "cpu"  # where the tracker keeps the last-synced copy of every tensor

    def check(self) -> None:
        super().check()
        try:
            DeltaTracker(self.max_changed_fraction, self.snapshot_device)  # a torch device? (its message names the field)
        except ValueError as e:
            raise ValueError(f".{e}") from None


def _entry_meta(name: str, entry: Entry) -> tuple[torch.dtype, tuple[int, ...], int | None]:
    if isinstance(entry, SparseWeightPatch):
        return entry.values.dtype, tuple(entry.full_shape), int(entry.indices.numel())
    if isinstance(entry, torch.Tensor):
        return entry.dtype, tuple(entry.shape), None
    raise ValueError(f"{name!r}: expected a tensor or a SparseWeightPatch, got {type(entry).__name__}")


def _wire_nbytes(dtype: torch.dtype, shape: tuple[int, ...], nnz: int | None) -> int:
    if nnz is not None:
        return patch_nbytes(nnz, dtype)
    return math.prod(shape) * dtype.itemsize


class SparseNCCLTrainerWeightTransferEngine(NCCLTrainerWeightTransferEngine):
    """Sends what changed since the last successful sync: patches where cheaper, dense tensors elsewhere."""

    backend = "sparse_nccl"
    init_info_type = SparseNCCLTrainerInitInfo

    def __init__(self, init_info: SparseNCCLTrainerInitInfo, client, source, rank: int) -> None:
        super().__init__(init_info, client, source, rank)
        self.tracker = DeltaTracker(init_info.max_changed_fraction, init_info.snapshot_device)

    def send_weights(self, source=None, *, weight_version: str | None = None) -> SyncStats:
        try:
            stats = super().send_weights(source, weight_version=weight_version)
        except BaseException:
            self.tracker.discard()  # the engine kept its weights: diff against them next time
            raise
        self.tracker.commit()  # the engine holds what was sent
        return stats

    def _send(self, source: WeightSource) -> SyncStats:
        metas = source.metadata
        # A patch is only chosen when cheaper than dense, so dense bytes bound each entry.
        return self._send_entries(self._diffs(metas, source.iter_full()), [m.nbytes for m in metas])

    def send_patches(self, pairs: Iterable[tuple[str, Entry]], *, weight_version: str | None = None) -> SyncStats:
        """Sends (hf_name, tensor or SparseWeightPatch) pairs made by the caller, as one update (rank 0 only).

        The engine's weights then differ from the tracker's snapshots, so the tracker forgets
        them: the next send_weights is dense.
        """
        if self.rank != 0:
            raise ValueError(f"send_patches: only trainer rank 0 sends (this is rank {self.rank})")
        pairs = list(pairs)
        for name, entry in pairs:
            _entry_meta(name, entry)
            if isinstance(entry, SparseWeightPatch):
                if entry.name != name:
                    raise ValueError(f"{name!r}: the patch is named {entry.name!r}")
                entry.validate()
        self.tracker.reset()
        bounds = [_wire_nbytes(*_entry_meta(name, entry)) for name, entry in pairs]
        started = self._begin_update()
        return self._update_in_phases(lambda: self._send_entries(iter(pairs), bounds), weight_version, started)

    def _diffs(self, metas: Sequence[ParamMeta], pairs) -> Iterator[tuple[str, Entry]]:
        tensors = _in_metadata_order(metas, pairs)
        for meta in metas:
            yield meta.name, self.tracker.diff(meta.name, next(tensors))
        next(tensors, None)  # lets the source check that it has nothing left

    def _send_entries(self, entries: Iterator[tuple[str, Entry]], bounds: Sequence[int]) -> SyncStats:
        """An update's entries, batched into update_weights calls of at most one pack buffer of wire bytes each.

        bounds[i] bounds entry i's wire bytes before it is produced, so a call goes out before
        producing (for a sharded source: gathering) an entry that would not fit: the trainer holds
        at most one buffer's worth (or one larger tensor), and the engine's copy of a call's
        patches stays as small.
        """
        stats = SyncStats(self.backend)
        stats.extra.update(num_patches=0, num_dense=0, num_calls=0)

        def flush(chunk: list[tuple[str, Entry]]) -> None:
            stats.bytes_sent += self._send_chunk(chunk)
            stats.extra["num_calls"] += 1
            chunk.clear()

        chunk: list[tuple[str, Entry]] = []
        chunk_bytes = 0
        for bound in bounds:
            if chunk and chunk_bytes + bound > self.settings.buffer_size:
                flush(chunk)
                chunk_bytes = 0
            name, entry = next(entries)
            dtype, shape, nnz = _entry_meta(name, entry)
            stats.num_tensors += 1
            stats.dense_bytes += _wire_nbytes(dtype, shape, None)
            stats.extra["num_dense" if nnz is None else "num_patches"] += 1
            chunk.append((name, entry))
            chunk_bytes += _wire_nbytes(dtype, shape, nnz)
        if chunk:
            flush(chunk)
        next(entries, None)  # lets the source check that it has nothing left
        return stats

    def _send_chunk(self, chunk: list[tuple[str, Entry]]) -> int:
        if self.init_info.wire == "vllm":
            return self._send_chunk_vllm(chunk)
        names = [name for name, _ in chunk]
        metas = [_entry_meta(name, entry) for name, entry in chunk]
        dtypes, shapes, nnz = [m[0] for m in metas], [m[1] for m in metas], [m[2] for m in metas]
        patches = [entry for _, entry in chunk if isinstance(entry, SparseWeightPatch)]
        items: list[torch.Tensor] = []
        if patches:
            items.append(torch.cat([p.indices.to(self.device) for p in patches]))
            for dtype in _value_dtypes(dtypes, nnz):
                items.append(torch.cat([p.values.to(self.device) for p in patches if p.values.dtype == dtype]))
        items += [entry for _, entry in chunk if not isinstance(entry, SparseWeightPatch)]
        update_info: dict[str, Any] = {**dtype_names_list(names, dtypes, shapes), "nnz": nnz}
        return self._send_call(update_info, sparse_wire_specs(names, dtypes, shapes, nnz), iter(items))

    def _send_chunk_vllm(self, chunk: list[tuple[str, Entry]]) -> int:
        update_info, specs, patches = vllm_sparse_call(chunk)
        items = (t.to(self.device) for p in patches for t in (p.indices, p.values))
        unpacked = TransferSettings(False, self.settings.buffer_size, self.settings.num_buffers)
        return self._send_call(update_info, specs, items, unpacked)


def vllm_sparse_call(chunk: Sequence[tuple[str, Entry]]) -> tuple[dict, list[WireSpec], list[SparseWeightPatch]]:
    """One call on vLLM's sparse wire (our trainer, wire="vllm"): its update_info, wire items and patches.

    Every entry is a patch, a dense tensor the patch of all its coordinates; on the wire, per
    patch, its int32 indices then its values, one broadcast each, never packed.
    """
    patches = [entry if isinstance(entry, SparseWeightPatch) else _full_patch(name, entry) for name, entry in chunk]
    dtypes = [p.values.dtype for p in patches]
    counts = [int(p.indices.numel()) for p in patches]
    update_info = {**dtype_names_list([p.name for p in patches], dtypes, [p.full_shape for p in patches]),
                   "num_updates_list": counts}
    return update_info, vllm_sparse_wire_specs([p.name for p in patches], dtypes, counts), patches


def _full_patch(name: str, tensor: torch.Tensor) -> SparseWeightPatch:
    """A dense tensor as a patch of every coordinate (vLLM's sparse wire has no dense entries)."""
    if tensor.numel() > MAX_PATCH_NUMEL:
        raise ValueError(f"{name!r}: {tensor.numel()} elements are more than int32 patch indices address")
    indices = torch.arange(tensor.numel(), dtype=torch.int32, device=tensor.device)
    return SparseWeightPatch(name, indices, tensor.detach().reshape(-1), tuple(tensor.shape))
