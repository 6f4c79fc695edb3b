"""The HF-name view of a model: which parameter (rows, tensor-parallel slice, expert entry) holds each HF-named tensor."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn

from engine.models.layers import HFPart, hf_parts_of

# Recomputed from the config by every implementation: accepted in an update, never loaded.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class HFSlot:
    """Where one HF-named tensor lives in the engine on this rank: a whole parameter, or rows of a
    fused (or vocab-padded) one; and, under tensor parallelism, which slice of the full HF tensor
    those hold.

        full HF tensor (shape)  --narrow(shard_dim, shard_start, shard_size)-->  tensor()  (local_shape)
    """

    param: nn.Parameter
    param_shape: tuple[int, ...]  # the parameter's shape when resident (sleep mode may swap its data for an empty tensor)
    index: int | None = None  # a stacked parameter's (MoE experts) entry on dim 0 that holds the tensor; None: not stacked
    offset: int | None = None  # first row (dim 0) of the local view in the parameter (in the entry); None: all of it
    size: int | None = None  # number of rows of the local view
    alias_of: str | None = None  # tied weights: the HF name that owns the shared parameter
    full_shape: tuple[int, ...] | None = None  # the HF tensor's shape; None: the local view's
    shard_dim: int | None = None  # the full tensor's dim this rank holds a slice of; None: all of it (replicated)
    shard_start: int | None = None
    shard_size: int | None = None

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = self.param_shape if self.index is None else self.param_shape[1:]
        if self.offset is None:
            return shape
        return (self.size, *shape[1:])

    @property
    def shape(self) -> tuple[int, ...]:
        """The full HF tensor's shape: what a trainer sends and validation checks."""
        return self.full_shape if self.full_shape is not None else self.local_shape

    def tensor(self) -> torch.Tensor:
        """This rank's view of the weight in the parameter (local_shape)."""
        data = self.param.data
        if self.index is not None:
            data = data.select(0, self.index)
        return data if self.offset is None else data.narrow(0, self.offset, self.size)

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """The slice of a full HF tensor that lands in tensor() (a view; the tensor itself when replicated)."""
        return full if self.shard_dim is None else full.narrow(self.shard_dim, self.shard_start, self.shard_size)

    def local_indices(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat int64 positions in the full tensor of a sharded slot -> (positions in tensor() of those
        this rank holds, the mask of which of `indices` those are).

        With the full tensor viewed as [outer, full_shape[dim], inner], position i is at
        (i // (n * inner), (i // inner) % n, i % inner); the rank holds the middle coordinates
        [start, start + size).
        """
        n = self.shape[self.shard_dim]
        inner = math.prod(self.shape[self.shard_dim + 1:])
        coord = (indices // inner) % n
        held = (coord >= self.shard_start) & (coord < self.shard_start + self.shard_size)
        indices, coord = indices[held], coord[held]
        local = (indices // (n * inner)) * (self.shard_size * inner) + (coord - self.shard_start) * inner + indices % inner
        return local, held


def _slot(param: nn.Parameter, part: HFPart) -> HFSlot:
    slot = HFSlot(
        param, tuple(param.shape), index=part.index,
        offset=None if part.rows is None else part.offset, size=part.rows,
        full_shape=part.full_shape, shard_dim=part.dim,
        shard_start=None if part.dim is None else part.start, shard_size=None if part.dim is None else part.size,
    )
    if slot.local_shape != part.local_shape:  # a layer's parts disagree with its parameter
        raise TypeError(f"parameter of shape {list(param.shape)}: its HF part {part} has local shape {list(part.local_shape)}, "
                        f"but the view is {list(slot.local_shape)}")
    return slot


def hf_weight_layout(model: nn.Module) -> dict[str, HFSlot]:
    """{hf_name: HFSlot} for every weight of `model`, the inverse of load_weights_with_mapping's renaming.

    A fused parameter `...qkv_proj.weight` appears as `...q_proj.weight`, `...k_proj.weight`,
    `...v_proj.weight` (its row blocks, in the mapping's order); a parameter shared under a
    second name (a tied lm_head.weight) appears under both, the second as an alias. Each
    parameter says which slices of which HF tensors it holds (engine.models.layers.hf_parts_of);
    parts that name themselves (a MoE layer's stacked experts: `...experts.w13_weight` holds
    `...experts.{e}.gate_proj.weight` and `...experts.{e}.up_proj.weight` for every expert e)
    appear under `<module path>.<part name>`.
    """
    mapping: dict[str, list[str]] = getattr(model, "packed_modules_mapping", {})
    layout: dict[str, HFSlot] = {}
    owner_of: dict[int, str] = {}  # id(param) -> the HF name it was first seen under
    for param_name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in owner_of:
            owner = owner_of[id(param)]
            layout[param_name] = dataclasses.replace(layout[owner], alias_of=owner)
            continue
        owner_of[id(param)] = param_name
        module_path = param_name.rpartition(".")[0]
        packed = module_path.rpartition(".")[2]
        sources = mapping.get(packed)
        parts = hf_parts_of(param)
        if parts[0].name is not None:  # the parts name their HF tensors themselves
            for part in parts:
                layout[f"{module_path}.{part.name}"] = _slot(param, part)
            continue
        if sources is None:
            if len(parts) != 1:
                raise TypeError(f"{param_name} fuses {len(parts)} tensors but is not in packed_modules_mapping")
            layout[param_name] = _slot(param, parts[0])
            continue
        if len(parts) != len(sources):
            raise TypeError(f"{param_name}: packed_modules_mapping lists {sources}, but the parameter holds {len(parts)} tensors")
        for source, part in zip(sources, parts):
            layout[param_name.replace(f".{packed}.", f".{source}.")] = _slot(param, part)
    return layout


def hf_remote_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """{hf_name: shape} of the expert tensors other expert-parallel ranks hold (empty without expert
    parallelism): the stacked parameters with `local_experts` / `num_experts` (engine.models.moe.FusedExperts)
    hold the same tensors, of the same shapes, for every expert; this lists the experts they lack."""
    remote: dict[str, tuple[int, ...]] = {}
    for param_name, param in model.named_parameters():
        local_experts = getattr(param, "local_experts", None)
        if local_experts is None or len(local_experts) == param.num_experts:
            continue
        module_path = param_name.rpartition(".")[0]
        parts = hf_parts_of(param)
        first_expert = parts[: len(parts) // len(local_experts)]  # one expert's tensors, e.g. gate_proj and up_proj
        for expert_id in range(param.num_experts):
            if expert_id in local_experts:
                continue
            for part in first_expert:  # part.name is "{e}.gate_proj.weight": swap in this expert's id
                remote[f"{module_path}.{expert_id}.{part.name.partition('.')[2]}"] = part.full_shape
    return remote


def full_shape(layout: dict[str, HFSlot], remote: dict[str, tuple[int, ...]], name: str) -> tuple[int, ...] | None:
    """The full HF shape of a weight of the model (held here, in `layout`, or by another EP rank, in
    `remote`); None: the model has no such weight."""
    slot = layout.get(name)
    return slot.shape if slot is not None else remote.get(name)


def landing_name(layout: dict[str, HFSlot], remote: dict[str, tuple[int, ...]], name: str) -> str | None:
    """The layout name a weight the model has lands under (a tied alias lands in its owner); None: it
    does not land here (IGNORED_SUFFIXES, or an expert another EP rank holds)."""
    if name.endswith(IGNORED_SUFFIXES) or name in remote:
        return None
    return layout[name].alias_of or name


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as weight_info and error messages name it: "bfloat16", not "torch.bfloat16"."""
    return str(dtype).removeprefix("torch.")
