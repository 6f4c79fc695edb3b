"""WeightUpdater: the worker's weight-update lifecycle, validation, rollback, checksums and HF-name view of the model.

Lifecycle (enforced; misuse raises WeightUpdateStateError, bad input ValueError):

    init_transfer_engine(init_info)     -> ready      (again when ready: replaces the transfer engine; its
                                                       rendezvous runs in the background, transfer_init.py,
                                                       and every other call is refused until it is over)
    start_update()                      -> updating
    update_weights(update_info) * N        (each call atomic, see below)
    finish_update()                     -> ready      (the new weights serve)
    abort_update()                      -> ready      (the weights of before start_update serve)
    shutdown()                          -> not initialized (an update in progress is aborted)

Landing streams: the call's announced metadata is checked before anything is received; then
each (name, tensor or SparseWeightPatch) the backend yields is checked (known HF name, that
name's shape, a floating dtype, finite values) and landed through the model's own weight
loaders (`model.load_weights`, which maps q/k/v and gate/up onto the fused parameters, and a
MoE layer's per-expert tensors onto its stacked expert parameters) before the next one is
pulled, so a backend can reuse its receive buffer and memory stays bounded.
Before a weight is first overwritten in an update its old value is kept (on the device, on
the CPU, or not at all: `weight_update_rollback`), which makes two guarantees possible:
  - a call that fails validation restores what it changed ("no weight was changed") and the
    update stays in progress;
  - a transfer that fails (the backend raises: dead peer, timeout) restores every weight the
    update changed and ends the update (WeightTransferError names the tensor it was on).
Copies are in place, so parameter addresses (and CUDA graphs that recorded them) stay valid.

Tensor parallelism: every rank receives the FULL HF tensors (names, shapes and validation are
those of the HF model) and lands only the slice it holds (HFSlot.shard_of; the loaders narrow
the same way). weight_info() says which slice each rank holds; checksums() are of that slice.

Expert parallelism: every engine receives every expert's tensor too. Those of experts another EP
rank holds (hf_remote_shapes) are validated like the rest (name, the full model's shape, dtype,
finite values: every rank accepts or rejects an update alike) and then dropped; weight_info()
and checksums() list only the experts this rank holds, and weight_checker() does not count a
baseline's other-rank experts as unexpected.

Speculative decoding with a draft model: the worker has a second WeightUpdater, the draft's, and
WeightUpdaters gives both one lifecycle. init_info and update_info name the model they are for
("model": "target", the default, or "draft"); start, finish and abort act on every model with a
transfer engine, so one update may change the target, the draft or both, and a failed transfer
restores both.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch
from torch import nn

from engine.allowed_hosts import LOOPBACK_HOSTS, AllowedHosts
from engine.distributed import get_tp
from engine.exceptions import WeightTransferError, WeightUpdateStateError
from engine.models.layers import HFPart, hf_parts_of
from engine.worker.transfer_init import PendingInit
from weight_transfer.base import SparseWeightPatch, WeightTransferEngine, get_engine_backend
from weight_transfer.checksums import compare_checksums, tensor_checksum

logger = logging.getLogger(__name__)

# Recomputed from the config by every implementation: accepted in an update, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


_MAX_PLANS = 64  # landing plans kept (one per recurring call: a model's packs)

# The models a weight-update call may name (init_info / update_info "model", weight_info and
# weight_checker's model): the served model, and speculative decoding's draft model.
TARGET_MODEL, DRAFT_MODEL = "target", "draft"
WEIGHT_MODELS = (TARGET_MODEL, DRAFT_MODEL)


@dataclass
class _LandingPlan:
    """How one update_weights call of a views_stable backend lands: built (and validated) on the
    first call with a reuse_key, used again by every later call with the same key."""

    names: list[str]  # every received name, in order
    checked: list[torch.Tensor] = field(default_factory=list)  # received floating tensors: the finite check
    checked_names: list[str] = field(default_factory=list)
    targets: list[str] = field(default_factory=list)  # landing names of dsts
    # Flat views of the parameters (or fused rows) and of the received tensors (this rank's slice),
    # same order; a slice that is not contiguous (a row-parallel weight's columns) is kept as a view of equal shape.
    dsts: list[torch.Tensor] = field(default_factory=list)
    srcs: list[torch.Tensor] = field(default_factory=list)
    rest: list[tuple[str, "torch.Tensor | SparseWeightPatch"]] = field(default_factory=list)  # via the loaders


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

    @property
    def shard(self) -> dict | None:
        """{"dim", "start", "size"} of the full tensor this rank holds; None when it holds all of it."""
        if self.shard_dim is None:
            return None
        return {"dim": self.shard_dim, "start": self.shard_start, "size": self.shard_size}

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


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class WeightUpdater:
    """Owns the transfer engine, the update state and the rollback copies of one worker's model."""

    def __init__(self, model: nn.Module, device: torch.device, rollback: str = "device",
                 name: str = TARGET_MODEL, allowed_hosts: AllowedHosts | None = None) -> None:
        self.model = model
        self.name = name  # which of the worker's models (WEIGHT_MODELS) this updates
        self.device = device
        self.rollback = rollback
        # Where a backend may connect (WeightTransferConfig.weight_transfer_allowed_hosts); default loopback only.
        self.allowed_hosts = allowed_hosts if allowed_hosts is not None else AllowedHosts.parse(LOOPBACK_HOSTS)
        self.layout = hf_weight_layout(model)
        self.remote = hf_remote_shapes(model)  # other EP ranks' experts: validated, never landed
        self.transfer_engine: WeightTransferEngine | None = None
        self.backend: str | None = None
        self.updating = False
        # False after a failed transfer that could not be rolled back (rollback "none"): the
        # weights are a mix and must not serve until an update finishes.
        self.consistent = True
        self._saved: dict[str, torch.Tensor] = {}  # hf name -> value before this update (flat rollback copies)
        self._plans: dict[Hashable, _LandingPlan] = {}  # reuse_key -> how that recurring call lands
        self._plans_for: tuple[int, ...] = ()  # the parameter addresses the plans' views point into

    # ---- lifecycle ---------------------------------------------------------------------------

    def begin_transfer_engine(self, init_info: dict) -> PendingInit:
        """A new transfer engine for init_info, its rendezvous started in the background (transfer_init.py);
        install_transfer_engine() it once ready. ValueError naming a bad field, or a peer outside the
        allowed hosts, before anything starts; the current transfer engine is untouched either way."""
        if not isinstance(init_info, dict):
            raise ValueError(f"init_info: expected a dict, got {type(init_info).__name__}")
        if self.updating:
            raise WeightUpdateStateError("init_weight_transfer_engine: a weight update is in progress; finish it first")
        backend = init_info.get("backend")
        if not isinstance(backend, str):
            raise ValueError(f"init_info.backend: expected a backend name, got {backend!r}")
        engine = get_engine_backend(backend)(self.device)
        tp = get_tp()
        engine.bind_worker(tp.rank, tp.size)  # every tensor-parallel worker receives the full tensors itself
        engine.bind_model(self.model)
        return PendingInit(engine, engine.parse_init_info(init_info), backend, self.allowed_hosts, self.device)

    def install_transfer_engine(self, pending: PendingInit) -> None:
        """Makes a ready PendingInit's transfer engine this model's; the previous one is shut down."""
        if self.transfer_engine is not None:
            self.transfer_engine.shutdown()
        self.transfer_engine, self.backend = pending.engine, pending.backend
        self._plans = {}  # keys are the old engine's

    def init_transfer_engine(self, init_info: dict) -> None:
        """begin, wait, install: for callers holding this WeightUpdater alone (a worker goes through WeightUpdaters)."""
        pending = self.begin_transfer_engine(init_info)
        pending.wait()
        self.install_transfer_engine(pending)

    def start_update(self) -> None:
        engine = self._require_engine("start_weight_update")
        if self.updating:
            raise WeightUpdateStateError("start_weight_update: a weight update is already in progress; call finish_weight_update first")
        engine.start_update()
        addresses = tuple(slot.param.data_ptr() for slot in self.layout.values())
        if addresses != self._plans_for:  # the weights moved (sleep and wake_up): the plans' views are stale
            self._plans, self._plans_for = {}, addresses
        self._saved = {}
        self.updating = True

    def update_weights(self, update_info: dict) -> int:
        """Receives, validates and lands one batch of tensors or patches; returns how many were received."""
        engine = self._require_engine("update_weights")
        if not self.updating:
            raise WeightUpdateStateError("update_weights: no weight update in progress; call start_weight_update first")
        self._require_resident("update_weights")
        info = engine.parse_update_info(update_info)
        plan = self._plans.get(info.reuse_key) if info.reuse_key is not None else None
        if plan is None:  # a reused plan was validated when it was built
            self._validate(list(zip(info.names, info.dtypes, info.shapes)))  # before anything moves
        if engine.views_stable_per_call and self.rollback != "none":
            return self._update_together(engine, info, plan)
        if info.group_sizes and self.rollback != "none":
            return self._update_in_groups(engine, info)
        first_saved_here: list[str] = []  # rollback copies this call made (restored if it fails)
        resaved: dict[str, torch.Tensor] = {}  # call-start values of weights an earlier call changed
        # NaN/inf checks are queued on the device and read once per call (one host sync, not one per tensor).
        finite_checks: list[tuple[str, torch.Tensor]] = []
        name = None
        count = 0
        try:
            for name, item in engine.receive_weights(info):
                self._check_received(name, item, finite_checks)
                target = self._landing_name(name)
                if target is not None:
                    if target not in self._saved:
                        self._save(target)
                        first_saved_here.append(target)
                    elif target not in resaved and self.rollback != "none":
                        resaved[target] = self.layout[target].tensor().clone()
                    self._land(target, item)
                count += 1
            _raise_if_not_finite([n for n, _ in finite_checks], finite_checks)
        except ValueError as e:  # a received tensor failed validation: undo this call only
            self._restore(first_saved_here, resaved)
            raise ValueError(f"weight update rejected, no weight was changed: {e}") from None
        except Exception as e:  # the transfer failed: undo the whole update and end it
            where = f" at {name!r}" if name is not None else " before the first tensor arrived"
            restored = self._abort()
            raise WeightTransferError(
                f"update_weights: the transfer failed{where}: {type(e).__name__}: {e}; "
                + ("the update was aborted and the previous weights restored" if restored
                   else "the update was aborted; weights are partly updated (weight_update_rollback=none) "
                        "and the engine serves nothing until an update finishes")
            ) from e
        return count

    def _update_together(self, engine: WeightTransferEngine, info, plan: "_LandingPlan | None") -> int:
        """update_weights for backends whose tensors stay valid for the whole call: receive them all,
        check them all (one finite check, one host sync), then land them with one multi-tensor copy.

        Per-tensor Python and kernel launches dominate small models' syncs; this path has a few
        per call, and none per tensor when the backend marks the call as a repeat (reuse_key):
        the plan built and validated the first time is used again.
        """
        name = None
        try:
            received = []
            for name, item in engine.receive_weights(info):
                received.append((name, item))
        except ValueError as e:
            raise ValueError(f"weight update rejected, no weight was changed: {e}") from None
        except Exception as e:  # the transfer failed: undo the whole update and end it
            raise self._transfer_failed(e, name) from e
        try:
            if plan is None:
                plan = self._plan(received)
                if info.reuse_key is not None:
                    if len(self._plans) >= _MAX_PLANS:
                        self._plans.clear()
                    self._plans[info.reuse_key] = plan
            elif len(received) != len(plan.names):
                raise ValueError(f"the backend delivered {len(received)} tensors for a call of {len(plan.names)}")
            _check_finite(plan)
        except ValueError as e:  # nothing has landed yet
            raise ValueError(f"weight update rejected, no weight was changed: {e}") from None
        self._save_many([(t, d) for t, d in zip(plan.targets, plan.dsts) if t not in self._saved])
        self._save_many([(t, self.layout[t].tensor()) for t, _ in plan.rest if t not in self._saved])
        self._land_plan(plan)
        if plan.srcs and plan.srcs[0].is_cuda:  # the backend's buffer is reused once this call returns
            torch.cuda.current_stream(plan.srcs[0].device).synchronize()
        return len(received)

    def _update_in_groups(self, engine: WeightTransferEngine, info) -> int:
        """update_weights for backends that deliver runs of tensors valid together (info.group_sizes,
        e.g. nccl's packs): each run is checked (one finite check, one host sync) and landed with one
        multi-tensor copy before the next run is pulled, instead of a few kernels and checks per tensor.

        Rollback is the streamed path's: a bad tensor undoes this call's changes; a failed transfer
        restores everything since start_update and ends the update.
        """
        if sum(info.group_sizes) != len(info.names):
            raise ValueError(f"the backend's group_sizes cover {sum(info.group_sizes)} of {len(info.names)} tensors")
        first_saved_here: list[str] = []  # rollback copies this call made (restored if it fails)
        resaved: dict[str, torch.Tensor] = {}  # call-start values of weights an earlier call changed
        stream = engine.receive_weights(info)
        name = None
        count = 0
        try:
            for size in info.group_sizes:
                group = []
                for _ in range(size):
                    name, item = next(stream)
                    group.append((name, item))
                try:
                    plan = self._plan(group)
                    _check_finite(plan)
                except ValueError as e:
                    self._restore(first_saved_here, resaved)
                    raise ValueError(f"weight update rejected, no weight was changed: {e}") from None
                touched = list(dict.fromkeys([*plan.targets, *(t for t, _ in plan.rest)]))
                for target in touched:
                    if target in self._saved and target not in first_saved_here and target not in resaved:
                        resaved[target] = self.layout[target].tensor().clone()
                fresh = [t for t in touched if t not in self._saved]
                self._save_many([(t, self.layout[t].tensor()) for t in fresh])
                first_saved_here += fresh
                self._land_plan(plan)
                count += size
            next(stream, None)  # runs the backend's stream to its end (it marks the call complete)
        except ValueError:
            raise
        except Exception as e:  # the transfer failed: undo the whole update and end it
            raise self._transfer_failed(e, name) from e
        finally:
            stream.close()
        return count

    def _land_plan(self, plan: "_LandingPlan") -> None:
        """One multi-tensor copy for the plan's plain slices, the model's loaders for the rest."""
        with torch.no_grad():
            if plan.dsts:
                torch._foreach_copy_(plan.dsts, plan.srcs)
            for target, t in plan.rest:
                self._land(target, t)

    def _transfer_failed(self, error: Exception, name: str | None) -> WeightTransferError:
        """After a failed transfer: restores everything since start_update, ends the update, and gives the error to raise."""
        where = f" at {name!r}" if name is not None else " before the first tensor arrived"
        self._abort()
        return WeightTransferError(
            f"update_weights: the transfer failed{where}: {type(error).__name__}: {error}; "
            "the update was aborted and the previous weights restored"
        )

    def _plan(self, received: list[tuple[str, "torch.Tensor | SparseWeightPatch"]]) -> "_LandingPlan":
        """Checks one call's received tensors against the model (ValueError names the first bad one)
        and pairs each with the flat view of the parameter (rows) it lands in."""
        plan = _LandingPlan(names=[n for n, _ in received])
        for n, t in received:
            if isinstance(t, SparseWeightPatch):
                self._check_received(n, t, [])
            else:
                self._check_metadata(n, t)
                if t.dtype.is_floating_point and t.numel():
                    plan.checked.append(t)
                    plan.checked_names.append(n)
            target = self._landing_name(n)
            if target is None:
                continue
            slot = self.layout[target]
            dst = slot.tensor()
            if isinstance(t, SparseWeightPatch) or t.dtype != dst.dtype or t.device.type != dst.device.type:
                plan.rest.append((target, t))  # through the model's loaders
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

    def _check_metadata(self, name: str, tensor: torch.Tensor) -> None:
        problems = self._problems(name, tensor.dtype, tuple(tensor.shape))
        if problems:
            raise ValueError("; ".join(problems))

    def finish_update(self) -> None:
        engine = self._require_engine("finish_weight_update")
        if not self.updating:
            raise WeightUpdateStateError("finish_weight_update: no weight update in progress; call start_weight_update first")
        self.updating = False
        self._saved = {}
        self.consistent = True
        engine.finish_update()

    def abort_update(self) -> bool:
        """Ends an update in progress, restoring the weights of before start_update; False if none was in progress."""
        if not self.updating:
            return False
        self._abort()
        return True

    def shutdown(self) -> None:
        if self.updating:
            self._abort()
        if self.transfer_engine is not None:
            self.transfer_engine.shutdown()
        self.transfer_engine, self.backend, self.updating = None, None, False
        self._plans = {}

    # ---- landing and rollback ------------------------------------------------------------------

    def _landing_name(self, name: str) -> str | None:
        """The layout name a received tensor lands under (a tied alias lands in its owner); None: ignored."""
        if name.endswith(_IGNORED_SUFFIXES) or name in self.remote:
            return None
        return self.layout[name].alias_of or name

    def _save(self, name: str) -> None:
        self._save_many([(name, self.layout[name].tensor())])

    def _save_many(self, items: list[tuple[str, torch.Tensor]]) -> None:
        """Keeps the current value (given) of each named weight for rollback: one allocation and one
        multi-tensor copy per (dtype, device), not one clone per tensor. The copies are kept flat."""
        if self.rollback == "none":
            self._saved.update((name, None) for name, _ in items)  # touched, nothing kept
            return
        items = list(dict(items).items())  # a tied pair may name its owner twice
        groups: dict[tuple[torch.dtype, torch.device], list[tuple[str, torch.Tensor]]] = {}
        for name, current in items:
            groups.setdefault((current.dtype, current.device), []).append((name, current))
        for (dtype, device), group in groups.items():
            where = torch.device("cpu") if self.rollback == "cpu" else device
            flat = torch.empty(sum(t.numel() for _, t in group), dtype=dtype, device=where)
            copies = flat.split([t.numel() for _, t in group])
            currents = [t.view(-1) if t.is_contiguous() else t.reshape(-1) for _, t in group]
            with torch.no_grad():
                if where == device:
                    torch._foreach_copy_(copies, currents)
                else:  # device to host: plain copies (multi-tensor copies stay on one device)
                    for c, t in zip(copies, currents):
                        c.copy_(t)
            self._saved.update((name, c) for (name, _), c in zip(group, copies))

    def _land(self, name: str, item: torch.Tensor | SparseWeightPatch) -> None:
        with torch.no_grad():
            if isinstance(item, SparseWeightPatch):
                # The HF slot is the loaders' inverse: the patched coordinates (of the full tensor) land in
                # the right rows of a fused parameter, and only those of this rank's slice land at all.
                slot = self.layout[name]
                flat = slot.tensor().view(-1)
                indices = item.indices.to(flat.device, torch.long)
                values = item.values.to(flat.device, flat.dtype)
                if slot.shard_dim is not None:
                    indices, held = slot.local_indices(indices)
                    values = values[held]
                flat[indices] = values
            else:
                self.model.load_weights([(name, item)])

    def _restore(self, first_saved: list[str], resaved: dict[str, torch.Tensor]) -> bool:
        """Puts back the given weights; False when rollback copies were not kept."""
        if self.rollback == "none" and first_saved:
            return False
        with torch.no_grad():
            for name in first_saved:
                dst = self.layout[name].tensor()
                dst.copy_(self._saved.pop(name).view(dst.shape))  # kept flat
            for name, value in resaved.items():
                self.layout[name].tensor().copy_(value)
        return True

    def _abort(self) -> bool:
        """Restores every weight changed since start_update and ends the update; False if it could not."""
        restored = self._restore(list(self._saved), {})
        self.consistent = restored or not self._saved
        self._saved = {}
        self.updating = False
        if self.transfer_engine is not None:
            self.transfer_engine.abort_update()
        return restored

    def _require_resident(self, method: str) -> None:
        if any(tuple(slot.param.shape) != slot.param_shape for slot in self.layout.values()):
            raise WeightUpdateStateError(f"{method}: the weights are not in device memory (engine asleep?); wake_up the weights first")

    def _require_engine(self, method: str) -> WeightTransferEngine:
        if self.transfer_engine is None:
            if self.name != TARGET_MODEL:
                raise WeightUpdateStateError(f"{method}: the {self.name} model has no weight transfer engine; call "
                                             f"init_weight_transfer_engine with init_info \"model\": {self.name!r} first")
            raise WeightUpdateStateError(f"{method}: no weight transfer engine; call init_weight_transfer_engine first")
        return self.transfer_engine

    # ---- validation ----------------------------------------------------------------------------

    def _validate(self, metadata: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        """Raises one ValueError listing every bad announced tensor as `name: reason`."""
        problems: list[str] = []
        seen: set[str] = set()
        for name, dtype, shape in metadata:
            if name in seen:
                problems.append(f"{name!r}: sent twice in one update")
                continue
            seen.add(name)
            problems += self._problems(name, dtype, shape)
        if problems:
            shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
            raise ValueError("weight update rejected, no weight was changed: " + "; ".join(shown))

    def _problems(self, name: str, dtype: torch.dtype, shape: tuple[int, ...], tensor: torch.Tensor | None = None) -> list[str]:
        if name.endswith(_IGNORED_SUFFIXES):
            return []
        expected = self._full_shape(name)
        if expected is None:
            return [f"{name!r}: matches no parameter of the model (HF naming expected)"]
        problems = []
        if tuple(shape) != expected:
            problems.append(f"{name!r}: shape {list(shape)} does not match the model's {list(expected)}")
        if not dtype.is_floating_point:
            problems.append(f"{name!r}: dtype {_dtype_name(dtype)} is not a floating-point dtype")
        elif tensor is not None and not bool(torch.isfinite(tensor).all()):
            problems.append(f"{name!r}: contains NaN or inf")
        return problems

    def _full_shape(self, name: str) -> tuple[int, ...] | None:
        """The full HF shape of a weight of the model (held here or by another EP rank); None: no such weight."""
        slot = self.layout.get(name)
        return slot.shape if slot is not None else self.remote.get(name)

    def _check_received(
        self, name: str, item: torch.Tensor | SparseWeightPatch, finite_checks: list[tuple[str, torch.Tensor]]
    ) -> None:
        """Checks one received tensor or patch against the model (ValueError names it); a dense
        tensor's NaN/inf check is appended to finite_checks, for _raise_if_not_finite."""
        if isinstance(item, SparseWeightPatch):
            expected = self._full_shape(name)
            if expected is None:
                raise ValueError(f"{name!r}: matches no parameter of the model (HF naming expected)")
            if tuple(item.full_shape) != expected:
                raise ValueError(f"{name!r}: patch shape {list(item.full_shape)} does not match the model's {list(expected)}")
            item.validate()
            return
        problems = self._problems(name, item.dtype, tuple(item.shape))
        if problems:
            raise ValueError("; ".join(problems))
        if item.dtype.is_floating_point and item.numel():
            finite_checks.append((name, torch.isfinite(item).all()))
            if self.rollback == "none":  # nothing to restore from: check before it lands
                _raise_if_not_finite([name], finite_checks[-1:])

    # ---- inspection ----------------------------------------------------------------------------

    def weight_info(self) -> dict[str, dict]:
        """{hf_name: {"shape": [...], "dtype": "bfloat16", "shard": {"dim", "start", "size"} | None}} for
        every weight this rank holds (under expert parallelism: its own experts, not the other ranks'),
        aliases included: shape is the full HF tensor's, shard the slice this rank holds (None: all of it). weight_transfer.checksums.hf_state_checksums(state, shards=this) gives the
        checksums this rank should report."""
        return {
            name: {"shape": list(slot.shape), "dtype": _dtype_name(slot.param.dtype), "shard": slot.shard}
            for name, slot in self.layout.items()
        }

    def checksums(self) -> dict[str, str]:
        """{hf_name: checksum} (weight_transfer.checksums.tensor_checksum) of every weight as this rank
        holds it: fused ones per shard, tensor-parallel ones of this rank's slice only."""
        self._require_resident("weight_checker")
        return {name: tensor_checksum(slot.tensor()) for name, slot in self.layout.items()}

    def weight_checker(self, baseline: dict | None = None) -> dict:
        """{"checksums": {...}}, plus match/mismatches/missing/unexpected against `baseline` when given."""
        checksums = self.checksums()
        result: dict = {"checksums": checksums}
        if baseline is not None:
            aliases = [n for n, s in self.layout.items() if s.alias_of is not None]
            result.update(compare_checksums(checksums, baseline, optional=aliases, held_elsewhere=self.remote))
        return result


class WeightUpdaters:
    """A worker's WeightUpdaters by model (the target's, and the draft model's when speculative
    decoding runs one) behind the worker's weight-update calls: one lifecycle for both.

    Each model has its own transfer engine: init_weight_transfer_engine with init_info "model"
    names it ("target" when absent). start_update, finish_update and abort_update act on every
    model that has one, so one update may land tensors in either model (update_info "model")
    and no step ever sees a half-done update of either. A transfer that fails in one model
    ends the update and restores both. The "model" key is removed before a backend sees the dict.
    """

    def __init__(self, target: WeightUpdater, draft: WeightUpdater | None = None) -> None:
        self.target = target
        self.draft = draft  # None: the engine runs no draft model
        # An init_weight_transfer_engine whose rendezvous runs (begin_init .. commit_init or its failure),
        # and the updater it is for. While it runs, every other weight-update call is refused.
        self._pending: tuple[WeightUpdater, PendingInit] | None = None

    def all(self) -> list[WeightUpdater]:
        return [self.target] if self.draft is None else [self.target, self.draft]

    def select(self, model: str, where: str = "model") -> WeightUpdater:
        """The updater of `model` ("target" or "draft"); ValueError naming `where` when there is no such model."""
        if model == TARGET_MODEL:
            return self.target
        if model == DRAFT_MODEL:
            if self.draft is None:
                raise ValueError(f"{where}: 'draft' names the draft model, but this engine has none (speculative "
                                 "decoding with method 'draft_model' loads one); nothing was changed")
            return self.draft
        raise ValueError(f"{where}: expected one of {list(WEIGHT_MODELS)}, got {model!r}")

    def _split(self, info, where: str) -> tuple[WeightUpdater, dict]:
        """(the updater `info` names, info without its "model" key); a non-dict goes to the target
        unchanged, whose backend says what is wrong with it."""
        if not isinstance(info, dict) or "model" not in info:
            return self.target, info
        rest = dict(info)
        return self.select(rest.pop("model"), f"{where}.model"), rest

    # ---- init: begin_init, then poll_init until True, then commit_init (or cancel_init) -------------
    # The engine core drives these across every rank, so that all of them install their new transfer
    # engine together, or none does (a failed or timed-out init changes nothing).

    def begin_init(self, init_info: dict) -> None:
        """Validates init_info and starts its rendezvous in the background; ValueError: nothing started."""
        self._refuse_while_init_pending("init_weight_transfer_engine")
        updater, init_info = self._split(init_info, "init_info")
        if any(u.updating for u in self.all()):  # a model joining mid-update would miss its start
            raise WeightUpdateStateError("init_weight_transfer_engine: a weight update is in progress; finish it first")
        self._pending = (updater, updater.begin_transfer_engine(init_info))

    def poll_init(self) -> bool:
        """True once the pending init is ready to commit; raises its error (it is then dropped)."""
        if self._pending is None:
            raise WeightUpdateStateError("poll_weight_transfer_init: no init_weight_transfer_engine in progress")
        try:
            return self._pending[1].poll()
        except BaseException:
            self._pending = None
            raise

    def commit_init(self) -> None:
        """Installs the ready pending init's transfer engine (the previous one is shut down)."""
        if not self.poll_init():
            raise WeightUpdateStateError("commit_weight_transfer_init: the init's rendezvous is still running")
        updater, pending = self._pending
        self._pending = None
        updater.install_transfer_engine(pending)

    def cancel_init(self) -> None:
        """Drops a pending init (its transfer engine is shut down, now or when its rendezvous ends); a no-op without one."""
        if self._pending is not None:
            self._pending[1].cancel()
            self._pending = None

    def init_transfer_engine(self, init_info: dict) -> None:
        """begin_init, wait, commit_init: for callers that can block (a worker used directly)."""
        self.begin_init(init_info)
        while not self.poll_init():
            time.sleep(0.01)
        self.commit_init()

    def _refuse_while_init_pending(self, method: str) -> None:
        if self._pending is not None:
            rendezvous = self._pending[1].rendezvous
            raise WeightUpdateStateError(
                f"{method}: init_weight_transfer_engine is still waiting for {rendezvous.peer} (up to timeout_s="
                f"{rendezvous.timeout_s:g}); call again once it has answered"
            )

    # ---- one update ----------------------------------------------------------------------------

    def start_update(self) -> None:
        self._refuse_while_init_pending("start_weight_update")
        ready = [u for u in self.all() if u.transfer_engine is not None]
        if not ready:
            self.target.start_update()  # raises: no transfer engine
        started: list[WeightUpdater] = []
        try:
            for updater in ready:
                updater.start_update()
                started.append(updater)
        except BaseException:
            for updater in started:
                updater.abort_update()
            raise

    def update_weights(self, update_info: dict) -> int:
        self._refuse_while_init_pending("update_weights")
        updater, update_info = self._split(update_info, "update_info")
        try:
            return updater.update_weights(update_info)
        except WeightTransferError:  # this model's update is over and restored: so is the other's
            for other in self.all():
                if other is not updater:
                    other.abort_update()
            raise

    def finish_update(self) -> None:
        self._refuse_while_init_pending("finish_weight_update")
        updating = [u for u in self.all() if u.updating]
        if not updating:  # raises: no transfer engine, or no update in progress
            ready = [u for u in self.all() if u.transfer_engine is not None]
            (ready or [self.target])[0].finish_update()
        for updater in updating:
            updater.finish_update()

    def abort_update(self) -> bool:
        """Restores every model an update in progress changed; False if none was in progress."""
        self._refuse_while_init_pending("abort_weight_update")
        aborted = [u.abort_update() for u in self.all()]  # every one, not up to the first that was updating
        return any(aborted)

    def shutdown(self) -> None:
        self._refuse_while_init_pending("shutdown_weight_transfer_engine")
        for updater in self.all():
            updater.shutdown()

    @property
    def consistent(self) -> bool:
        return all(u.consistent for u in self.all())


def _check_finite(plan: _LandingPlan) -> None:
    """ValueError naming the first of the plan's received tensors that holds a NaN or inf.

    The max-abs norm is NaN or inf exactly when a tensor holds one: one kernel per group, one sync."""
    if plan.checked:
        norms = torch._foreach_norm(plan.checked, float("inf"))
        _raise_if_not_finite(plan.checked_names, torch.isfinite(torch.stack(norms)))


def _raise_if_not_finite(names: list[str], ok: torch.Tensor | list[tuple[str, torch.Tensor]]) -> None:
    """Raises ValueError naming the first of `names` whose flag in `ok` (a bool tensor, or the
    queued (name, isfinite().all()) checks) came out False; reading the flags is the one host sync."""
    if not names:
        return
    if isinstance(ok, list):
        ok = torch.stack([flag for _, flag in ok])
    ok = ok.cpu()
    if not bool(ok.all()):
        bad = [name for name, good in zip(names, ok.tolist()) if not good]
        raise ValueError(f"{bad[0]!r}: contains NaN or inf" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))
