"""LoRAManager: the worker's adapters - host copies (LRU, max_cpu_loras), device slots (LRU, max_loras) and each step's token slots."""

from __future__ import annotations

import functools
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from engine.config import LoRAConfig
from engine.lora.layers import LoRALinear, lora_targets
from engine.lora.peft_loader import PEFTAdapter, load_peft_adapter
from engine.lora.request import LoRARequest
from engine.models.layers import ColumnParallelLinear, RowParallelLinear
from weight_transfer.checksums import lora_checksum_name, tensor_checksum

logger = logging.getLogger(__name__)


class LoRAManager:
    """Attaches a LoRALinear to every LoRA-capable layer of `model` and keeps adapters ready for steps.

    Two levels, both least-recently-used:
      host:  up to max_cpu_loras validated adapters (float32 copies, full HF shapes), read from disk once;
      slots: max_loras device slots per layer; a step's adapters are paged into slots before its forward.
    Invariant: every adapter in a slot has a host copy, or had one when it was paged in (a slot keeps
    serving after its host copy is evicted or removed; it is re-read from disk if it must be paged in again).
    Pinned adapters (pin_lora) never leave the host cache and do not count against max_cpu_loras
    (each is an operator's explicit call); their slots are the last to be reused.
    A synced adapter (install: a trainer's weight sync) is pinned: its weights are in no file to read again.
    Its host copy equals what was synced, but on CUDA it is filled by a copy from the device still running
    when install returns (PEFTAdapter.pending): every read of host values here goes through ready().
    Its slot, when it has one, is written from the synced tensors on the device (_rewrite_slot), not from
    the host copy; both hold the same values, so paging the host copy in later gives the slot it had.
    """

    def __init__(self, model: nn.Module, config: LoRAConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.max_loras = config.max_loras
        self.max_lora_rank = config.max_lora_rank
        self.max_cpu_loras = config.max_cpu_loras
        self.device = device
        self.targets = lora_targets(model)
        self.layers: dict[str, LoRALinear] = {}
        for name, module in model.named_modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                module.lora = self.layers[name] = LoRALinear(module, self.max_loras, self.max_lora_rank, device, dtype)
        self._host: OrderedDict[int, PEFTAdapter] = OrderedDict()  # lora_int_id -> adapter, oldest use first
        self._pinned: set[int] = set()
        self._names: dict[int, str] = {}  # lora_int_id -> lora_name of each host copy (checksums name adapters)
        self._slot_ids: list[int] = [0] * self.max_loras  # adapter id per slot; 0: empty
        self._slot_layouts: list[object | None] = [None] * self.max_loras  # the PEFTAdapter.layout in each slot
        self._rewrites: dict[tuple, _SlotRewrite] = {}  # (slot, layout, tensors) -> where a sync's tensors land
        self._slot_uses: OrderedDict[int, None] = OrderedDict((slot, None) for slot in range(self.max_loras))
        self.num_disk_loads = 0  # adapters read from disk (a paged-out host copy read again counts again)
        self.num_slot_loads = 0  # adapters written into a slot

    # ---- adapters (the engine's add_lora / remove_lora / pin_lora / list_loras) ----

    def add_lora(self, lora: LoRARequest) -> None:
        """Reads and validates the adapter into the host cache (ValueError naming the problem: nothing changes)."""
        if lora.lora_int_id in self._host:
            self._host.move_to_end(lora.lora_int_id)
            return
        adapter = load_peft_adapter(lora.lora_path, self.targets, self.max_lora_rank)
        self.num_disk_loads += 1
        self._make_host_room()
        self._host[lora.lora_int_id] = adapter
        self._names[lora.lora_int_id] = lora.lora_name

    def remove_lora(self, lora_id: int) -> bool:
        """Drops the adapter's host copy and slot; False if it held neither. A request still running with it
        reads it from disk again when it is next paged in (a synced adapter: its directory's weights)."""
        found = self._host.pop(lora_id, None) is not None
        self._names.pop(lora_id, None)
        self._pinned.discard(lora_id)
        if lora_id in self._slot_ids:
            self._free_slot(self._slot_ids.index(lora_id))
            found = True
        return found

    def pin_lora(self, lora: LoRARequest) -> bool:
        """Keeps the adapter's host copy for good (until remove_lora) and its slot as long as any other can go."""
        self.add_lora(lora)  # its host copy may have been paged out since it was validated
        self._pinned.add(lora.lora_int_id)
        return True

    def list_loras(self) -> list[int]:
        return sorted(self._host)

    def _make_host_room(self) -> None:
        """Evicts least recently used unpinned host copies until one more unpinned one fits."""
        unpinned = [lora_id for lora_id in self._host if lora_id not in self._pinned]  # oldest use first
        for victim in unpinned[: max(0, len(unpinned) + 1 - self.max_cpu_loras)]:
            del self._host[victim]
            del self._names[victim]

    # ---- weight sync (engine/worker/lora_weight_update.py) ----

    def host_adapter(self, lora: LoRARequest) -> PEFTAdapter:
        """The adapter's host copy (read from its directory again if it was paged out); ValueError as add_lora."""
        self.add_lora(lora)
        return self._host[lora.lora_int_id]

    def install(self, lora: LoRARequest, adapter: PEFTAdapter, synced: Sequence[tuple[str, str]] | None = None,
                sources: Sequence[torch.Tensor] | None = None, recurring: bool = False) -> None:
        """Makes `adapter` (a synced version, checked against the old one) the adapter's weights: its host copy,
        pinned, and its slot when it has one. Between steps: a request already running with it computes its
        next tokens with these weights over the KV cache the old ones computed (vLLM's behaviour for a
        re-added adapter); the EngineCore gives the adapter a new prefix-cache key so no new request reuses
        that KV.

        synced, sources: the tensors the sync changed, (module, "A" or "B") each and its values as synced
        (float32, full HF shapes, unscaled, on the slots' device). The slot is then rewritten from these where
        they are, with a few multi-tensor launches and no host round trip; without them, from the host copy.
        recurring: `sources` is a list the caller passes again at later installs (its buffers are reused), so
        what was resolved from it is kept; otherwise nothing of it is held after this call."""
        lora_id = lora.lora_int_id
        self._host[lora_id] = adapter
        self._host.move_to_end(lora_id)
        self._names[lora_id] = lora.lora_name
        self._pinned.add(lora_id)
        if lora_id in self._slot_ids:
            slot = self._slot_ids.index(lora_id)
            if synced is not None and self._slot_layouts[slot] is adapter.layout:
                self._rewrite_slot(slot, adapter, tuple(synced), sources, recurring)
            else:  # the slot holds another load of the adapter (other ranks, maybe): written whole
                self._write_slot(slot, lora_id, adapter)

    def _rewrite_slot(self, slot: int, adapter: PEFTAdapter, synced: tuple[tuple[str, str], ...],
                      sources: Sequence[torch.Tensor], recurring: bool = False) -> None:
        """Overwrites the synced tensors' regions of `slot`, which holds the same load of the adapter (so the
        same ranks: the rows and columns past them stay zero, LoRALinear.slot_region), B scaled as it lands."""
        key = (slot, adapter.layout, synced)
        plan = self._rewrites.get(key)
        if plan is None:
            if len(self._rewrites) >= _MAX_REWRITES:
                self._rewrites.clear()
            plan = self._rewrites[key] = self._plan_rewrite(slot, adapter, synced)
        a_srcs, b_srcs = plan.sources_of(sources, keep=recurring)
        if b_srcs and not plan.scale_in_place:  # scaled in float32, then cast into the slot: as set_slot writes it
            scaled = plan.b_scratch(b_srcs)
            torch._foreach_copy_(scaled, b_srcs)
            torch._foreach_mul_(scaled, plan.b_scales)
            b_srcs = scaled
        if a_srcs or b_srcs:
            torch._foreach_copy_(plan.a_dsts + plan.b_dsts, a_srcs + b_srcs)
        if b_srcs and plan.scale_in_place and plan.b_scales != 1.0:  # the same values, no scratch (_SlotRewrite)
            torch._foreach_mul_(plan.b_dsts, plan.b_scales)
        self.num_slot_loads += 1

    def _plan_rewrite(self, slot: int, adapter: PEFTAdapter, synced: tuple[tuple[str, str], ...]) -> _SlotRewrite:
        plan = _SlotRewrite([], [], [], [], [])
        scales = []
        for i, (module, which) in enumerate(synced):
            target, weights = self.targets[module], adapter.modules[module]
            layer = self.layers[target.module_name]
            dst = layer.slot_region(slot, target.slice_index, which, weights.rank)
            shard = None
            if layer.shards(target.slice_index, which):
                shard = functools.partial(layer.shard, target.slice_index, which)
            if which == "A":
                plan.a_dsts.append(dst)
                plan.a_srcs.append((i, shard))
            else:
                plan.b_dsts.append(dst)
                plan.b_srcs.append((i, shard))
                scales.append(weights.scaling)
        # One scalar when all modules share it (the usual adapter): the simplest multi-tensor launch.
        plan.b_scales = scales[0] if len(set(scales)) == 1 else scales
        slot_dtype = plan.b_dsts[0].dtype if plan.b_dsts else torch.float32
        plan.scale_in_place = isinstance(plan.b_scales, float) and (slot_dtype == torch.float32 or plan.b_scales == 1.0)
        return plan

    def checksums(self) -> dict[str, str]:
        """{"lora:<lora_name>:<PEFT tensor name>": checksum} of every adapter held in host memory: the float32
        copies that device slots are written from, unscaled, as PEFT saves them (lora_checksum_name). Adapters
        sharing one lora_name are told apart as "lora:<lora_name>#<lora_int_id>:..."."""
        counts = Counter(self._names.values())
        out = {}
        for lora_id, adapter in self._host.items():
            name = self._names[lora_id]
            label = name if counts[name] == 1 else f"{name}#{lora_id}"
            for tensor_name, tensor in adapter.ready().tensors().items():
                out[lora_checksum_name(label, tensor_name)] = tensor_checksum(tensor)
        return out

    # ---- steps ----

    def activate(self, token_lora_ids: np.ndarray, lora_requests: Mapping[int, LoRARequest]) -> np.ndarray | None:
        """Pages the step's adapters into slots and returns each token's slot, [T] int32 (-1: no adapter;
        None: no token has one): an eager step's make_lora_mapping input, or a CUDA graph replay's static buffer.
        Slots are written in place, so graphs captured before see the adapters paged in now.

        token_lora_ids: [T] each token's lora_int_id (0: none); lora_requests: every id in it -> its request.
        The scheduler runs at most max_loras adapters a step, so their slots never evict one another.
        """
        lora_ids = [int(i) for i in np.unique(token_lora_ids) if i != 0]
        if not lora_ids:
            return None
        if len(lora_ids) > self.max_loras:
            raise RuntimeError(f"a step with {len(lora_ids)} adapters, above max_loras ({self.max_loras})")
        slot_of_id = {lora_id: self._slot_for(lora_requests[lora_id], keep=lora_ids) for lora_id in lora_ids}
        ids = np.array([0, *slot_of_id])  # ids ascending (np.unique)
        slots = np.array([-1, *slot_of_id.values()], dtype=np.int32)
        return slots[np.searchsorted(ids, token_lora_ids)]  # [T] slot per token

    def _slot_for(self, lora: LoRARequest, keep: list[int]) -> int:
        """The slot holding `lora`, paging it in if needed over an empty slot or the least recently used one
        not in `keep` (unpinned first)."""
        lora_id = lora.lora_int_id
        if lora_id in self._slot_ids:
            slot = self._slot_ids.index(lora_id)
            self._slot_uses.move_to_end(slot)
            return slot
        # At most max_loras - 1 other adapters of this step are resident, so there is a candidate.
        candidates = [s for s in self._slot_uses if self._slot_ids[s] not in keep]  # least recently used first
        slot = next((s for s in candidates if self._slot_ids[s] == 0), None)
        if slot is None:
            slot = next((s for s in candidates if self._slot_ids[s] not in self._pinned), candidates[0])
        if lora_id not in self._host:
            # A validated adapter whose host copy was paged out (or removed while requests ran with it): read it
            # again. This fails only if its files changed or went away since; the step then fails like any other.
            logger.info("LoRA %d (%s): reading %s again (host copies are limited by max_cpu_loras=%d)",
                        lora_id, lora.lora_name, lora.lora_path, self.max_cpu_loras)
            self.add_lora(lora)
        self._host.move_to_end(lora_id)
        self._write_slot(slot, lora_id, self._host[lora_id])
        self._slot_uses.move_to_end(slot)
        return slot

    def _write_slot(self, slot: int, lora_id: int, adapter: PEFTAdapter) -> None:
        self._free_slot(slot)
        for hf_name, weights in adapter.ready().modules.items():
            target = self.targets[hf_name]
            self.layers[target.module_name].set_slot(slot, target.slice_index, weights.lora_a,
                                                     weights.lora_b * weights.scaling)
        self._slot_ids[slot] = lora_id
        self._slot_layouts[slot] = adapter.layout
        self.num_slot_loads += 1

    def _free_slot(self, slot: int) -> None:
        for layer in self.layers.values():
            layer.clear_slot(slot)
        # Its rewrite plans are for the adapter leaving it, and may hold that adapter's sync buffers (sources_of).
        self._rewrites = {key: plan for key, plan in self._rewrites.items() if key[0] != slot}
        self._slot_ids[slot] = 0
        self._slot_layouts[slot] = None


_MAX_REWRITES = 16  # slot-rewrite plans kept (one per slot and recurring sync of an adapter)


@dataclass
class _SlotRewrite:
    """Where one recurring sync's tensors land in one slot: the regions (views of the layers' stacked tensors)
    and, per region, the position of its source among the synced tensors and this rank's cut of it (None: whole).

    B lands scaled. scale_in_place: copied, then multiplied where it landed, with no temporaries, which gives the
    same values as scaling in float32 before the cast because the copy is exact (a float32 slot) or the scale is 1.
    (Not so for a power of two into bfloat16: values below bfloat16's normal range round differently.) Else each B
    is scaled in a float32 scratch made once for the plan: a temporary per B (a multi-tensor multiply's outputs,
    allocated every sync) cost about a millisecond of host time per sync of a 28-layer model on an H100."""

    a_dsts: list[torch.Tensor]
    a_srcs: list[tuple[int, Callable | None]]
    b_dsts: list[torch.Tensor]
    b_srcs: list[tuple[int, Callable | None]]
    b_scales: float | list[float]  # each B's scaling (PEFT's lora_alpha / rank), one float when all are equal
    scale_in_place: bool = False
    # The last two `sources` lists kept (a recurring sync stages into the same views each time, or into two sets
    # in turn): each with its A and B lists in region order, so that a repeat costs no per-tensor work here.
    _resolved: list[tuple[Sequence[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]] = field(
        default_factory=list)
    _b_scratch: list[torch.Tensor] | None = None  # per B region, float32, the region's shape (not scale_in_place)

    def b_scratch(self, b_srcs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Float32 views, one per B region in region order, of one buffer made at the first call: where the B
        sources are scaled before the cast into the slot. Reused by every rewrite of the plan: they are all queued
        on one stream, so a rewrite's scaling follows the previous one's cast."""
        if self._b_scratch is None:
            numels = [t.numel() for t in b_srcs]
            flat = torch.empty(sum(numels), dtype=torch.float32, device=self.b_dsts[0].device)
            self._b_scratch = [piece.view(t.shape) for piece, t in zip(flat.split(numels), b_srcs)]
        return self._b_scratch

    def sources_of(self, sources: Sequence[torch.Tensor], keep: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The A and B sources of the regions, in region order (this rank's cut of each); keep: remember them
        for the same `sources` list (held meanwhile, so its identity is not reused)."""
        for kept, a_srcs, b_srcs in self._resolved:
            if kept is sources:
                return a_srcs, b_srcs
        a_srcs = [sources[i] if shard is None else shard(sources[i]) for i, shard in self.a_srcs]
        b_srcs = [sources[i] if shard is None else shard(sources[i]) for i, shard in self.b_srcs]
        if keep:
            self._resolved = [(sources, a_srcs, b_srcs), *self._resolved[:1]]
        return a_srcs, b_srcs
