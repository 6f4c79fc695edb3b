"""How a group of received HF tensors lands in a model: one multi-tensor copy into the parameter views they fill, the model's weight loaders for the rest."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from engine.models.hf_layout import HFSlot, landing_name
from weight_transfer.base import SparseWeightPatch


@dataclass
class LandingPlan:
    """Where each tensor of one received group goes. Built for one group (after it was validated), and
    kept for a views_stable backend's repeated call (reuse_key), whose tensors are the same views again."""

    num_tensors: int  # received tensors it was built for (ignored ones included)
    targets: list[str] = field(default_factory=list)  # landing names of dsts
    # Views of the parameters (or fused rows) and of the received tensors (this rank's slice), same
    # order: flat when both are contiguous; else (a row-parallel weight's columns) views of equal shape.
    dsts: list[torch.Tensor] = field(default_factory=list)
    srcs: list[torch.Tensor] = field(default_factory=list)
    rest: list[tuple[str, torch.Tensor | SparseWeightPatch]] = field(default_factory=list)  # (landing name, item): via the loaders

    @property
    def touched(self) -> list[str]:
        """The layout names it overwrites: what rollback saves first."""
        return [*self.targets, *(target for target, _ in self.rest)]


def plan_landing(layout: dict[str, HFSlot], remote: dict[str, tuple[int, ...]],
                 received: Sequence[tuple[str, torch.Tensor | SparseWeightPatch]]) -> LandingPlan:
    """Pairs each received (and already validated) tensor with the view of the parameter (rows) it lands in.

    A dense tensor of the parameter's dtype and device type lands by a plain copy of this rank's slice
    into its slot: what its weight loader would do (the HF layout is the loaders' inverse), batched.
    Anything else (another dtype, another device, a sparse patch) goes through the loaders one by one.
    """
    plan = LandingPlan(num_tensors=len(received))
    for name, t in received:
        target = landing_name(layout, remote, name)
        if target is None:
            continue
        slot = layout[target]
        dst = slot.tensor()
        if isinstance(t, SparseWeightPatch) or t.dtype != dst.dtype or t.device.type != dst.device.type:
            plan.rest.append((target, t))
            continue
        src = slot.shard_of(t)  # this rank's slice (t itself without tensor parallelism)
        plan.targets.append(target)
        if dst.is_contiguous() and src.is_contiguous():
            plan.dsts.append(dst.view(-1))
            plan.srcs.append(src.view(-1))
        else:  # e.g. a row-parallel weight's columns: a strided copy of the same shape
            plan.dsts.append(dst)
            plan.srcs.append(src)
    return plan


def land(model: nn.Module, layout: dict[str, HFSlot], plan: LandingPlan) -> None:
    """Copies the plan's tensors into the model, in place (parameter addresses, and CUDA graphs that recorded them, stay valid)."""
    with torch.no_grad():
        if plan.dsts:
            torch._foreach_copy_(plan.dsts, plan.srcs)
        for target, item in plan.rest:
            if isinstance(item, SparseWeightPatch):
                _land_patch(layout[target], item)
            else:  # the loaders map q/k/v and gate/up onto fused parameters, a MoE layer's experts onto stacked ones
                model.load_weights([(target, item)])


def _land_patch(slot: HFSlot, patch: SparseWeightPatch) -> None:
    """The patched coordinates (of the full tensor) land in the slot's rows of a fused parameter, and
    only those of this rank's slice land at all."""
    flat = slot.tensor().view(-1)
    indices = patch.indices.to(flat.device, torch.long)
    values = patch.values.to(flat.device, flat.dtype)
    if slot.shard_dim is not None:
        indices, held = slot.local_indices(indices)
        values = values[held]
    flat[indices] = values
