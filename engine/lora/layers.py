"""LoRALinear: the stacked adapter slots of one tensor-parallel linear layer and the delta they add to its output.

A LoRA-capable layer (ColumnParallelLinear and its fused QKVLinear / MergedLinear, RowParallelLinear)
calls `self.lora(x, y)` after its base product when a LoRALinear is attached; nothing else in the
model knows about adapters. Per slice of the layer's output (q, k, v of a fused qkv; gate, up of a
fused gate/up; the whole output otherwise) there is one pair of stacked tensors:

    lora_a[i]: [max_loras, max_rank, in]     (rows past an adapter's rank are zero)
    lora_b[i]: [max_loras, out_i, max_rank]  (scaling folded in; columns past the rank are zero)

and y[:, slice i] += (x @ A[slot]^T) @ B[slot]^T for each token's slot. The slices' tensors are views
of two stacked ones (A's along the rank, B's along the output), so on GPU the whole layer's delta is
one shrink and one expand launch (engine/kernels/lora.py; the shrink split along the input width); on
CPU the torch references of engine/lora/ops.py run per slice over the step's token segments.

Invariant: a (slot, slice) whose adapter has no weights there holds zeros (set_slot and clear_slot
keep it), so the GPU kernels may run every slice for every slot and a CUDA graph captured before
any adapter was loaded serves every adapter paged in later (writes land in the same storage).

Tensor parallelism: a column-parallel layer's input is whole on every rank, so A is whole and B
holds this rank's output rows; a row-parallel layer's input is this rank's slice, so A holds
this rank's input columns, the shrunk [T, rank] partial sums are all-reduced, and B is whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.distributed import all_reduce
from engine.forward_context import get_forward_context
from engine.kernels import use_triton
from engine.kernels.lora import lora_expand, lora_num_splits, lora_shrink
from engine.lora.ops import lora_expand_ref, lora_shrink_ref
from engine.models.layers import ColumnParallelLinear, RowParallelLinear


@dataclass(frozen=True)
class LoRATarget:
    """One HF module an adapter may target (e.g. model.layers.0.self_attn.k_proj): where it lives in the engine."""

    module_name: str  # the engine module holding it, e.g. model.layers.0.self_attn.qkv_proj
    slice_index: int  # which slice of that module's output it is (k: 1)
    in_features: int  # the HF module's full shape: A is [rank, in_features], B [out_features, rank]
    out_features: int


def lora_targets(model: nn.Module) -> dict[str, LoRATarget]:
    """Every HF module name of `model` that LoRA can target, e.g. "model.layers.0.self_attn.q_proj".

    Fused engine modules are named back through the model's packed_modules_mapping (qkv_proj ->
    q_proj, k_proj, v_proj); their HF shapes come from the weight's hf_parts (full, not per rank).
    """
    packed: dict[str, list[str]] = getattr(model, "packed_modules_mapping", {})
    targets: dict[str, LoRATarget] = {}
    for name, module in model.named_modules():
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        parent, _, leaf = name.rpartition(".")
        hf_leaves = packed.get(leaf, [leaf])
        parts = module.weight.hf_parts
        assert len(parts) == len(hf_leaves), f"{name}: {len(parts)} fused tensors, mapping names {hf_leaves}"
        for index, (hf_leaf, part) in enumerate(zip(hf_leaves, parts)):
            out_features, in_features = part.full_shape
            hf_name = f"{parent}.{hf_leaf}" if parent else hf_leaf
            targets[hf_name] = LoRATarget(name, index, in_features, out_features)
    return targets


class LoRALinear:
    """Adapter slots of one linear layer; called by the layer as `y = self.lora(x, y)`.

    Not an nn.Module on purpose: its tensors are not model parameters (checkpoint loading, weight sync,
    checksums and sleep mode walk the parameters and must not see them).
    """

    def __init__(self, base: ColumnParallelLinear | RowParallelLinear, max_loras: int, max_rank: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.row_parallel = isinstance(base, RowParallelLinear)
        self.tp_size = getattr(base, "tp_size", 1)
        out_sizes = [base.output_size] if self.row_parallel else list(base.local_sizes)  # this rank's, per slice
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        self.parts = base.weight.hf_parts  # per slice: this rank's share of the HF tensor (slice_of)
        self.slice_widths = tuple(out_sizes)
        self.num_splits = lora_num_splits(base.input_size)  # the GPU shrink's input-width ranges
        num_slices = len(out_sizes)
        # [max_loras, num_slices * max_rank, in] and [max_loras, sum(out_sizes), max_rank]; the per-slice
        # tensors below are views of them (slot writes land here, where the GPU kernels read).
        self.lora_a_stacked = torch.zeros(max_loras, num_slices * max_rank, base.input_size, device=device,
                                          dtype=dtype)
        self.lora_b_stacked = torch.zeros(max_loras, sum(out_sizes), max_rank, device=device, dtype=dtype)
        self.lora_a = [self.lora_a_stacked[:, i * max_rank:(i + 1) * max_rank] for i in range(num_slices)]
        self.lora_b = [self.lora_b_stacked[:, offset:offset + n] for offset, n in zip(self.offsets, out_sizes)]
        # Per slice, the slots whose adapter has weights there: the CPU path skips the others (their A and B are zero).
        self.filled: list[frozenset[int]] = [frozenset() for _ in out_sizes]

    def clear_slot(self, slot: int) -> None:
        """Forgets the adapter in `slot` and zeroes its tensors (the GPU kernels read every slice of every slot)."""
        filled = [index for index, slots in enumerate(self.filled) if slot in slots]
        if filled:  # one multi-tensor launch for the layer, not two per slice
            torch._foreach_zero_([t[index][slot] for index in filled for t in (self.lora_a, self.lora_b)])
        self.filled = [slots - {slot} for slots in self.filled]

    def set_slot(self, slot: int, slice_index: int, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
        """Writes one HF module's adapter into `slot`: lora_a [rank, in], lora_b [out, rank] (scaled), full HF shapes."""
        rank = lora_a.shape[0]
        a, b = self.lora_a[slice_index][slot], self.lora_b[slice_index][slot]
        a.zero_()
        b.zero_()
        self.slot_region(slot, slice_index, "A", rank).copy_(self.shard(slice_index, "A", lora_a))
        self.slot_region(slot, slice_index, "B", rank).copy_(self.shard(slice_index, "B", lora_b))
        self.filled[slice_index] = self.filled[slice_index] | {slot}

    def slot_region(self, slot: int, slice_index: int, which: str, rank: int) -> torch.Tensor:
        """Where a rank-`rank` module's lora_A ("A": its first rank rows, [rank, in (local)]) or lora_B ("B": its
        first rank columns, [out (local), rank]) lives in `slot` (a view of the stacked tensor the kernels read).
        Writing a (slot, slice) that is filled by an adapter of the same rank keeps the invariant: the rows and
        columns past the rank are zero already and stay so (a weight sync rewrites just these regions)."""
        if which == "A":
            return self.lora_a[slice_index][slot].narrow(0, 0, rank)
        return self.lora_b[slice_index][slot].narrow(1, 0, rank)

    def shard(self, slice_index: int, which: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's share (a view) of a full HF lora_A [rank, in] ("A") or lora_B [out, rank] ("B") of the
        slice: a row-parallel layer's A keeps its input columns, a column-parallel layer's B its output rows."""
        if (which == "A") == self.row_parallel:
            return self.parts[slice_index].slice_of(full)
        return full

    def shards(self, slice_index: int, which: str) -> bool:
        """Whether shard() cuts anything (tensor parallelism): the full tensor is not already this rank's."""
        return (which == "A") == self.row_parallel and self.parts[slice_index].dim is not None

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # x [T, in (local)], y [T, out (local)]
        mapping = get_forward_context().lora_mapping
        if mapping is None:  # no token of this pass has an adapter (or a warm-up / dummy pass)
            return y
        if use_triton(x):
            # Every slice of every slot, whatever is loaded: no branch on host state, so a CUDA graph can hold it.
            # Split-K partial sums, float32: [num_splits, T, num_slices * max_rank] (the expand adds them up).
            buf = torch.empty(self.num_splits, x.shape[0], self.lora_a_stacked.shape[1], dtype=torch.float32,
                              device=x.device)
            lora_shrink(x, self.lora_a_stacked, mapping.token_slots, buf, mapping.token_order)
            if self.row_parallel and self.tp_size > 1:
                buf = all_reduce(buf)  # each rank shrank its input columns: partial sums
            lora_expand(buf, self.lora_b_stacked, mapping.token_slots, y, 0, self.slice_widths, mapping.token_order)
            return y
        for index, filled in enumerate(self.filled):
            if not filled:
                continue
            buf = lora_shrink_ref(x, self.lora_a[index], mapping, filled)  # [T, max_rank]
            if self.row_parallel and self.tp_size > 1:
                buf = all_reduce(buf)  # each rank shrank its input columns: partial sums
            lora_expand_ref(buf, self.lora_b[index], mapping, y, self.offsets[index], filled)
        return y
