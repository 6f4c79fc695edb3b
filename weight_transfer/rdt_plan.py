"""Planning for the sharded_rdt backend: the group/pack layout both sides compute, and the engine's one-time BAKE.

Layout (identical on trainer and engine, computed from the tensor list, the group sizes and
chunk_bytes). Tensors go in metadata order into groups (consecutive runs, one per decoder
layer, see group_sizes); group g belongs to trainer rank g % num_ranks, which publishes it
into slot (g // num_ranks) % num_slots of its producer. Inside a slot the group's tensors
are packed into chunks of at most chunk_bytes (packing.plan_packs), laid end to end:

    slot:  | pack 0: t0 t1 t2 | pack 1: t3 | pack 2: t4 t5 |  ...unused up to slot_bytes
             ^ pack_offsets[0]  ^ pack_offsets[1]

An engine worker READs one pack at a time into one of its receive buffers (a ring), so a
receive buffer is as large as the largest pack.

BAKE: an engine worker runs its model's load_weights once against placeholder tensors (meta
tensors that remember which source tensor they view) and records which elements each
weight loader copies out of each source tensor. REPLAY pulls only those byte ranges, so a
worker that consumes a slice of a tensor (tensor parallelism) never moves the rest.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from weight_transfer.packing import ALIGN, Pack, nbytes_of, plan_packs

_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")
# A consumed region that breaks into more row runs than this is pulled as its hull (one range).
MAX_RANGES_PER_TENSOR = 4096

ByteRanges = list[tuple[int, int]]  # [(start, end), ...] byte offsets inside one tensor, sorted, disjoint


def group_sizes(names: Sequence[str]) -> list[int]:
    """Tensors per group: maximal consecutive runs of names in the same decoder layer (or outside any layer).

    Equals base.layerwise_groups for HF models (embeddings, layer 0, ..., final norm and
    lm_head), but never reorders: a group is always a consecutive run of the metadata order,
    so a trainer can publish while it iterates its source once.
    """
    sizes: list[int] = []
    previous: object = object()
    for name in names:
        m = _LAYER.match(name)
        key = m.group(1) if m else None
        if sizes and key == previous:
            sizes[-1] += 1
        else:
            sizes.append(1)
        previous = key
    return sizes


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class GroupLayout:
    start: int  # index of the group's first tensor in the tensor list
    end: int  # one past its last
    packs: tuple[Pack, ...]  # slot indices in the packs are positions in the whole tensor list
    pack_offsets: tuple[int, ...]  # byte offset of each pack inside the slot
    nbytes: int  # bytes of the slot in use


@dataclass(frozen=True)
class SyncPlan:
    """Where every tensor of one sync travels: group, owner rank, slot, pack, byte offset."""

    names: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]
    groups: tuple[GroupLayout, ...]
    chunk_bytes: int

    @property
    def slot_bytes(self) -> int:
        """The slot size a producer needs: the largest group."""
        return max((g.nbytes for g in self.groups), default=ALIGN)

    @property
    def max_pack_bytes(self) -> int:
        """The receive-buffer size an engine worker needs: the largest pack."""
        return max((p.nbytes for g in self.groups for p in g.packs), default=ALIGN)

    @property
    def total_bytes(self) -> int:
        return sum(nbytes_of(d, s) for d, s in zip(self.dtypes, self.shapes))

    def owner(self, group: int, num_ranks: int) -> int:
        return group % num_ranks

    def slot(self, group: int, num_ranks: int, num_slots: int) -> int:
        return (group // num_ranks) % num_slots

    def groups_of(self, rank: int, num_ranks: int) -> list[int]:
        return [g for g in range(len(self.groups)) if g % num_ranks == rank]


def build_plan(
    names: Sequence[str],
    dtypes: Sequence[torch.dtype],
    shapes: Sequence[Sequence[int]],
    sizes: Sequence[int],
    chunk_bytes: int,
) -> SyncPlan:
    """The layout for a tensor list split into groups of `sizes` tensors (ValueError if they do not add up)."""
    if sum(sizes) != len(names) or any(s <= 0 for s in sizes):
        raise ValueError(f"group_sizes: {list(sizes)} must be positive and add up to the {len(names)} tensors")
    tensor_bytes = [nbytes_of(d, s) for d, s in zip(dtypes, shapes)]
    groups = []
    start = 0
    for size in sizes:
        end = start + size
        local = plan_packs(tensor_bytes[start:end], chunk_bytes)
        packs, offsets, used = [], [], 0
        for pack in local:
            # Renumber slots to positions in the whole list, so a pack names its tensors directly.
            packs.append(Pack(tuple(type(s)(s.index + start, s.offset, s.nbytes) for s in pack.slots), pack.nbytes))
            offsets.append(_align(used))
            used = offsets[-1] + pack.nbytes
        groups.append(GroupLayout(start, end, tuple(packs), tuple(offsets), used))
        start = end
    return SyncPlan(tuple(names), tuple(dtypes), tuple(tuple(s) for s in shapes), tuple(groups), chunk_bytes)


# ---------------------------------------------------------------------------------------
# BAKE: which bytes of each source tensor the model's weight loaders consume.


class _Placeholder(torch.Tensor):
    """A meta tensor standing for (a view of) source tensor `source`; copy_ out of it is recorded, not done.

    Views taken by a loader (narrow, slicing, chunk, view) stay placeholders that know their
    offset and strides into the source. Anything that is not a view (a dtype cast, arithmetic)
    loses track of positions, so its copies count as consuming the whole source tensor.
    """

    source: str
    exact: bool
    log: list

    @staticmethod
    def __new__(cls, elem: torch.Tensor, source: str, exact: bool, log: list):
        r = torch.Tensor._make_subclass(cls, elem)
        r.source, r.exact, r.log = source, exact, log
        return r

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ph = next(a for a in (*args, *kwargs.values()) if isinstance(a, _Placeholder))
        if func is torch.Tensor.copy_ and isinstance(args[1], _Placeholder):
            _record(args[1])
            return args[0]
        if func is torch.Tensor.__setitem__ and isinstance(args[2], _Placeholder):
            _record(args[2])
            return None
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.device.type == "meta":
            return _Placeholder(out, ph.source, ph.exact and (out._is_view() or out is ph), ph.log)
        if isinstance(out, (tuple, list)):  # chunk / split / unbind: views
            return type(out)(
                _Placeholder(o, ph.source, ph.exact and o._is_view(), ph.log)
                if isinstance(o, torch.Tensor) and o.device.type == "meta" else o
                for o in out
            )
        return out


def _record(src: _Placeholder) -> None:
    if src.exact:
        src.log.append((src.source, src.storage_offset(), tuple(src.shape), tuple(src.stride())))
    else:
        src.log.append((src.source, None, None, None))


def element_runs(offset: int, shape: Sequence[int], stride: Sequence[int]) -> list[tuple[int, int]]:
    """The elements a strided view covers, as sorted disjoint [start, end) runs of flat source positions."""
    if any(d == 0 for d in shape):
        return []
    dims = [(d, s) for d, s in zip(shape, stride) if d != 1]
    # Fold the trailing dims that are contiguous in the source into one block of `block` elements.
    block = 1
    while dims and dims[-1][1] == block:
        block *= dims.pop()[0]
    starts = [offset]
    for d, s in dims:
        starts = [b + i * s for b in starts for i in range(d)]
        if len(starts) > MAX_RANGES_PER_TENSOR:
            return [(min(starts), offset + sum((d - 1) * s for d, s in zip(shape, stride)) + 1)]
    return merge_runs([(b, b + block) for b in starts])


def merge_runs(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(runs):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def bake_consumed_ranges(
    model: nn.Module,
    names: Sequence[str],
    dtypes: Sequence[torch.dtype],
    shapes: Sequence[Sequence[int]],
) -> dict[str, ByteRanges]:
    """{name: byte ranges the model's loaders read from that tensor} for each tensor of the list.

    A tensor no loader reads (a tied lm_head, a rotary buffer) maps to its whole range: the
    worker may still land it elsewhere (a tied alias lands in its owner), so it is never
    left half-filled. The model's parameters are not changed.
    """
    consumed: dict[str, ByteRanges] = {}
    for name, dtype, shape in zip(names, dtypes, shapes):
        log: list = []
        placeholder = _Placeholder(torch.empty(tuple(shape), dtype=dtype, device="meta"), name, True, log)
        itemsize = placeholder.element_size()
        whole = [(0, nbytes_of(dtype, shape))] if nbytes_of(dtype, shape) else []
        try:
            with torch.no_grad():
                model.load_weights([(name, placeholder)])
        except Exception:  # the worker will reject this tensor itself; plan to pull all of it
            consumed[name] = whole
            continue
        if not log or any(offset is None for _, offset, _, _ in log):
            consumed[name] = whole
            continue
        runs = merge_runs([r for _, offset, shape_, stride in log for r in element_runs(offset, shape_, stride)])
        consumed[name] = [(s * itemsize, e * itemsize) for s, e in runs]
    return consumed
