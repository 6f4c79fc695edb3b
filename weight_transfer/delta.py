"""DeltaTracker: the trainer's copy of what the engine last received, turning each sync into exact bitwise-diff patches.

A coordinate counts as changed when its raw bits differ (so -0.0 vs +0.0 and NaN payloads
count, and a patch applied to the old tensor reproduces the new one bit for bit). A tensor
goes dense instead when it has no snapshot yet (first sync, new name, new shape or dtype),
when its changed fraction is above max_changed_fraction, or when the patch (int32 index +
value per changed coordinate) would cost at least as many bytes as the dense tensor.

The snapshot advances only on commit(), which the sender calls after the engine finished the
update; a failed sync calls discard(), so the next one diffs against what the engine still
holds and re-sends everything that changed since.
"""

from __future__ import annotations

import torch

from weight_transfer.base import SparseWeightPatch
from weight_transfer.messages import Fraction, parse_message

# Patches index with int32: tensors with more elements always go dense.
MAX_PATCH_NUMEL = 2**31 - 1
_INDEX_BYTES = 4
_BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bits of a tensor as a flat integer tensor of the same width (a view when contiguous)."""
    return tensor.contiguous().view(_BITS_DTYPE[tensor.element_size()]).reshape(-1)


def bitwise_patch(name: str, old: torch.Tensor, new: torch.Tensor) -> SparseWeightPatch:
    """The coordinates whose bits differ between old and new (same dtype, shape, device), with new's values."""
    changed = torch.nonzero(_bits(old) != _bits(new)).reshape(-1)  # [nnz] int64, ascending, unique
    values = new.contiguous().reshape(-1)[changed]
    return SparseWeightPatch(name, changed.to(torch.int32), values, tuple(new.shape))


def patch_nbytes(nnz: int, dtype: torch.dtype) -> int:
    return nnz * (_INDEX_BYTES + dtype.itemsize)


class DeltaTracker:
    """Per-tensor snapshots of the last committed sync (on snapshot_device, CPU by default)."""

    def __init__(self, max_changed_fraction: float = 0.25, snapshot_device: str | torch.device = "cpu") -> None:
        self.max_changed_fraction: float = parse_message(max_changed_fraction, Fraction, "max_changed_fraction")
        try:
            self.snapshot_device = torch.device(snapshot_device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"snapshot_device: {snapshot_device!r} is not a torch device: {e}") from None
        self._snapshots: dict[str, torch.Tensor] = {}
        self._staged: dict[str, torch.Tensor | SparseWeightPatch] = {}

    def diff(self, name: str, tensor: torch.Tensor) -> torch.Tensor | SparseWeightPatch:
        """What to send: a patch against the snapshot, or the tensor itself (dense). Stages the new state."""
        tensor = tensor.detach()
        old = self._snapshots.get(name)
        if old is not None and self._patchable(old, tensor):
            patch = bitwise_patch(name, old, tensor.to(self.snapshot_device))
            nnz = patch.indices.numel()
            dense_nbytes = tensor.numel() * tensor.element_size()
            if nnz <= self.max_changed_fraction * tensor.numel() and patch_nbytes(nnz, tensor.dtype) < dense_nbytes:
                self._staged[name] = patch
                return patch
        # Our own copy: the trainer goes on changing its tensor in place.
        self._staged[name] = tensor.to(self.snapshot_device, memory_format=torch.contiguous_format, copy=True)
        return tensor

    @staticmethod
    def _patchable(old: torch.Tensor, new: torch.Tensor) -> bool:
        return (
            old.dtype == new.dtype
            and old.shape == new.shape
            and new.dtype.is_floating_point
            and new.element_size() in _BITS_DTYPE
            and new.numel() <= MAX_PATCH_NUMEL
        )

    def commit(self) -> None:
        """The engine holds what was staged: it becomes the snapshot."""
        for name, staged in self._staged.items():
            if isinstance(staged, SparseWeightPatch):
                snapshot = self._snapshots[name]
                snapshot.view(-1)[staged.indices.to(device=snapshot.device, dtype=torch.long)] = staged.values.to(
                    snapshot.device
                )
            else:
                self._snapshots[name] = staged
        self._staged.clear()

    def discard(self) -> None:
        """The sync failed: the engine still holds the snapshot, so the next diff is against it."""
        self._staged.clear()

    def reset(self) -> None:
        """Forgets everything (the engine's weights changed behind our back): the next sync is dense."""
        self._snapshots.clear()
        self._staged.clear()

    def has_snapshot(self, name: str) -> bool:
        return name in self._snapshots

    @property
    def snapshot_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._snapshots.values())
