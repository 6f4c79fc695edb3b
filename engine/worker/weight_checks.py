"""The checks a weight update passes before it may serve: each tensor's HF name, shape and dtype against the model, and finite values."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from engine.models.hf_layout import IGNORED_SUFFIXES, dtype_name
from weight_transfer.base import SparseWeightPatch

_MAX_SHOWN = 20  # problems one error lists; the rest are counted

FullShape = Callable[[str], "tuple[int, ...] | None"]  # hf name -> the model's full shape of it, None: no such weight


def check_weights(weights: Iterable[tuple[str, torch.dtype, Sequence[int]]], full_shape: FullShape) -> None:
    """Raises one ValueError listing every (name, dtype, shape) that cannot land, as `'name': reason`:
    a name sent twice, one the model does not have (HF naming), a shape other than the model's full
    one, a dtype that is not floating point. Names ending in IGNORED_SUFFIXES always pass."""
    problems: list[str] = []
    seen: set[str] = set()
    for name, dtype, shape in weights:
        if name in seen:
            problems.append(f"{name!r}: sent twice in one update")
            continue
        seen.add(name)
        if name.endswith(IGNORED_SUFFIXES):
            continue
        expected = full_shape(name)
        if expected is None:
            problems.append(f"{name!r}: matches no parameter of the model (HF naming expected)")
            continue
        if tuple(shape) != expected:
            problems.append(f"{name!r}: shape {list(shape)} does not match the model's {list(expected)}")
        if not dtype.is_floating_point:
            problems.append(f"{name!r}: dtype {dtype_name(dtype)} is not a floating-point dtype")
    if problems:
        more = len(problems) - _MAX_SHOWN
        raise ValueError("; ".join(problems[:_MAX_SHOWN] + ([f"... and {more} more"] if more > 0 else [])))


def check_received(received: Sequence[tuple[str, torch.Tensor | SparseWeightPatch]], full_shape: FullShape) -> None:
    """check_weights of what a backend delivered (a patch as its full tensor's shape and its values'
    dtype), then each patch's own checks (indices in range and unique, values finite). A dense
    tensor's values are FiniteChecks' business: reading them is a host sync."""
    check_weights(
        [(n, t.values.dtype, t.full_shape) if isinstance(t, SparseWeightPatch) else (n, t.dtype, t.shape) for n, t in received],
        full_shape,
    )
    for _, t in received:
        if isinstance(t, SparseWeightPatch):
            t.validate()


class FiniteChecks:
    """The NaN/inf checks of one call's received tensors: queued on their devices as they arrive, read together.

    The max-abs norm is NaN or inf exactly when a tensor holds one, so a group of tensors costs one
    kernel and no sync; check() reads every flag queued so far, one host sync per device.
    """

    def __init__(self) -> None:
        self._names: dict[torch.device, list[str]] = {}
        self._flags: dict[torch.device, list[torch.Tensor]] = {}  # per device, per group: bool [tensors of the group there]
        self._order: dict[str, int] = {}  # name -> position in the call, to name the first bad one

    def add(self, received: Sequence[tuple[str, torch.Tensor | SparseWeightPatch]]) -> None:
        by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
        for name, t in received:
            self._order.setdefault(name, len(self._order))
            if isinstance(t, torch.Tensor) and t.dtype.is_floating_point and t.numel():
                by_device.setdefault(t.device, []).append((name, t))
        for device, group in by_device.items():
            norms = torch._foreach_norm([t for _, t in group], float("inf"))
            self._flags.setdefault(device, []).append(torch.isfinite(torch.stack(norms)))
            self._names.setdefault(device, []).extend(name for name, _ in group)

    def check(self) -> None:
        """Raises ValueError naming the first tensor queued so far that holds a NaN or inf (and how many
        more do); the flags read are dropped either way."""
        bad: list[str] = []
        for device, flags in self._flags.items():
            ok = torch.cat(flags).cpu().tolist()
            bad += [name for name, good in zip(self._names[device], ok) if not good]
        self._names, self._flags = {}, {}
        if bad:
            bad.sort(key=self._order.__getitem__)
            raise ValueError(f"{bad[0]!r}: contains NaN or inf" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))
