"""WeightUpdater: one model's weight-update lifecycle in the worker (validation, rollback and landing in their own modules).

Lifecycle (enforced; misuse raises WeightUpdateStateError, bad input ValueError):

    init_transfer_engine(init_info)     -> ready      (again when ready: replaces the transfer engine; its
                                                       rendezvous runs in the background, transfer_init.py,
                                                       and every other call is refused until it is over)
    start_update()                      -> updating
    update_weights(update_info) * N        (each call atomic, see below)
    finish_update()                     -> ready      (the new weights serve)
    abort_update()                      -> ready      (the weights of before start_update serve)
    shutdown()                          -> not initialized (an update in progress is aborted)

One landing path for every backend. A call's announced names, shapes and dtypes are checked before
anything is received (weight_checks.py); then its tensors (or SparseWeightPatches) arrive in groups,
and each group is checked, saved for rollback (weight_rollback.py) and landed through the model's
own weight loaders (weight_landing.py), its plain slices by one multi-tensor copy. The groups are
what the backend promises about its views:
  - streaming, one tensor a group: landed before the next is pulled, so a backend can reuse its
    receive buffer and memory stays bounded;
  - packed (WeightUpdateInfo.group_sizes, nccl's packs): a pack's views are valid together;
  - whole call (views_stable_per_call, ipc): every view is valid until the call returns, so the call
    is one group, landed once the stream ended and everything was checked; a call the backend marks
    as a repeat (reuse_key) lands by the plan built (and validated) the first time.
NaN/inf checks are queued on the device and read once per call, after the backend's stream ended
(so a rejected call leaves its transport usable); with weight_update_rollback "none" before each
group lands, since nothing could undo it. The rollback copies make two guarantees possible:
  - a call that fails validation restores what it changed ("no weight was changed") and the
    update stays in progress;
  - a transfer that fails (the backend raises: dead peer, timeout) restores every weight the
    update changed and ends the update (WeightTransferError names the tensor it was on).

Tensor parallelism: every rank receives the FULL HF tensors (names, shapes and validation are
those of the HF model) and lands only the slice it holds (HFSlot.shard_of; the loaders narrow
the same way). weight_info() says which slice each rank holds; checksums() are of that slice.

Expert parallelism: every engine receives every expert's tensor too. Those of experts another EP
rank holds (hf_remote_shapes) are validated like the rest (name, the full model's shape, dtype,
finite values: every rank accepts or rejects an update alike) and then dropped; weight_info()
and checksums() list only the experts this rank holds, and weight_checker() does not count a
baseline's other-rank experts as unexpected.

Speculative decoding with a draft model: the worker has a second WeightUpdater, the draft's, and
WeightUpdaters (weight_updaters.py) gives both one lifecycle.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections.abc import Hashable

import torch
from torch import nn

from engine.allowed_hosts import LOOPBACK_HOSTS, AllowedHosts
from engine.distributed import get_tp
from engine.exceptions import WeightTransferError, WeightUpdateStateError
from engine.models.hf_layout import full_shape, hf_remote_shapes, hf_weight_layout
from engine.worker import weight_report
from engine.worker.transfer_init import PendingInit
from engine.worker.weight_checks import FiniteChecks, check_received, check_weights
from engine.worker.weight_landing import LandingPlan, land, plan_landing
from engine.worker.weight_rollback import WeightRollback
from weight_transfer.base import SparseWeightPatch, WeightTransferEngine, WeightUpdateInfo, get_engine_backend

logger = logging.getLogger(__name__)

_MAX_PLANS = 64  # landing plans kept (one per recurring call: a model's packs)

# The models a weight-update call may name (init_info / update_info "model", weight_info and
# weight_checker's model): the served model, and speculative decoding's draft model.
TARGET_MODEL, DRAFT_MODEL = "target", "draft"
WEIGHT_MODELS = (TARGET_MODEL, DRAFT_MODEL)


class WeightUpdater:
    """Owns the transfer engine, the update state and the rollback copies of one worker's model."""

    def __init__(self, model: nn.Module, device: torch.device, rollback: str = "device",
                 name: str = TARGET_MODEL, allowed_hosts: AllowedHosts | None = None,
                 allow_pickled_ipc_handles: bool = False) -> None:
        self.model = model
        self.name = name  # which of the worker's models (WEIGHT_MODELS) this updates
        self.device = device
        # Where a backend may connect (WeightTransferConfig.weight_transfer_allowed_hosts); default loopback only.
        self.allowed_hosts = allowed_hosts if allowed_hosts is not None else AllowedHosts.parse(LOOPBACK_HOSTS)
        self.allow_pickled_ipc_handles = allow_pickled_ipc_handles  # WeightTransferConfig's, for the ipc backend
        # The HF-name view of the model (elastic EP replaces both when this rank's experts change).
        self.layout = hf_weight_layout(model)
        self.remote = hf_remote_shapes(model)  # other EP ranks' experts: validated, never landed
        self.transfer_engine: WeightTransferEngine | None = None
        self.backend: str | None = None
        self.updating = False
        # False after a failed transfer that could not be rolled back (rollback "none"): the
        # weights are a mix and must not serve until an update finishes.
        self.consistent = True
        # Layout names whose values sleep(2) discarded (wake_up without reload_weights zero-fills them) and no
        # finished update has written since: while any is left the engine refuses to generate.
        self.unwritten: set[str] = set()
        self._written_in_update: set[str] = set()  # dense writes of the update in progress
        self._written_in_call: set[str] = set()  # ... of its call in progress (undone with the call)
        # The rollback reads the current layout through a weak reference: a closure over self, kept in
        # self, would be a cycle that keeps the model's weights alive until the collector runs.
        updater = weakref.ref(self)
        self._rollback = WeightRollback(rollback, lambda hf_name: updater().layout[hf_name].tensor())
        self._plans: dict[Hashable, LandingPlan] = {}  # reuse_key -> how that recurring call lands
        self._plans_for: tuple[int, ...] = ()  # the parameter addresses the plans' views point into
        self._plans_checked = False  # whether the update in progress checked those addresses yet

    # ---- lifecycle ---------------------------------------------------------------------------

    def begin_transfer_engine(self, init_info: dict) -> PendingInit:
        """A new transfer engine for init_info, its rendezvous started in the background (transfer_init.py);
        install_transfer_engine() it once ready. ValueError naming a bad field, or a peer outside the
        allowed hosts, before anything starts; the current transfer engine is untouched either way."""
        if not isinstance(init_info, dict):
            raise ValueError(f"init_info: expected a dict, got {type(init_info).__name__}")
        if self.updating:
            raise WeightUpdateStateError("init_weight_transfer_engine: a weight update is in progress; finish it first")
        # vLLM's trainers send no "backend" (its server is configured with one, nccl by default; ours fills
        # it from --weight-transfer-backend / --weight-transfer-config before the call gets here).
        backend = init_info.get("backend", "nccl")
        if not isinstance(backend, str):
            raise ValueError(f"init_info.backend: expected a backend name, got {backend!r}")
        engine = get_engine_backend(backend)(self.device)
        tp = get_tp()
        engine.bind_worker(tp.rank, tp.size)  # every tensor-parallel worker receives the full tensors itself
        engine.bind_model(self.model)
        engine.allow_pickled_ipc_handles = self.allow_pickled_ipc_handles
        engine.allowed_hosts = self.allowed_hosts  # nccl: the bootstrap address inside a unique id, when it is read
        try:
            parsed = engine.parse_init_info(init_info)
        except ValueError as e:
            if "backend" in init_info:
                raise
            raise ValueError(f"{e} (init_info.backend: not given, so nccl, vLLM's default)") from None
        return PendingInit(engine, parsed, backend, self.allowed_hosts, self.device)

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
        self._plans_checked = False  # by the update's first call that lands weights (an adapter's update has none)
        self._rollback.clear()
        self._written_in_update = set()
        self.updating = True

    def update_weights(self, update_info: dict) -> int:
        """Receives, validates and lands one call's tensors or patches (see the module docstring);
        returns how many were received."""
        engine = self._require_engine("update_weights")
        if not self.updating:
            raise WeightUpdateStateError("update_weights: no weight update in progress; call start_weight_update first")
        self._require_resident("update_weights")
        if not self._plans_checked:
            addresses = tuple(slot.param.data_ptr() for slot in self.layout.values())
            if addresses != self._plans_for:  # the weights moved (sleep and wake_up): the plans' views are stale
                self._plans, self._plans_for = {}, addresses
            self._plans_checked = True
        info = engine.parse_update_info(update_info)
        whole_call = engine.views_stable_per_call
        reused = self._plans.get(info.reuse_key) if whole_call and info.reuse_key is not None else None
        finite = FiniteChecks()
        after_stream: list[LandingPlan] = []  # groups whose views outlive the stream: landed once all is checked
        self._rollback.start_call()
        self._written_in_call = set()
        stream = None
        name = None  # the last tensor received, for the error of a failed transfer
        count = 0
        try:
            if reused is None:  # a reused plan was validated when it was built
                check_weights(zip(info.names, info.dtypes, info.shapes), self._full_shape)  # before anything is received
            elif reused.num_tensors != len(info.names):
                raise ValueError(f"the backend delivered {len(info.names)} tensors for a call of {reused.num_tensors}")
            stream = iter(engine.receive_weights(info))
            for size in self._group_sizes(info, whole_call):
                group = []
                for name, item in itertools.islice(stream, size):
                    group.append((name, item))
                count += len(group)
                if len(group) < size:
                    raise ValueError(f"the backend delivered {count} tensors for a call of {len(info.names)}")
                plan = reused or self._plan(group, info.reuse_key if whole_call else None)
                finite.add(group)
                if whole_call:
                    after_stream.append(plan)
                else:  # its views end with the next pull: it lands now
                    if self._rollback.mode == "none":  # nothing could undo it: no NaN may land
                        finite.check()
                    self._land(plan)
            if next(stream, None) is not None:  # runs the backend's stream to its end (it marks the call complete)
                raise ValueError(f"the backend delivered more than the {len(info.names)} tensors of the call")
            finite.check()
            for plan in after_stream:
                self._land(plan)
                if plan.srcs and plan.srcs[0].is_cuda:  # the backend refills its buffer once the call returns
                    torch.cuda.current_stream(plan.srcs[0].device).synchronize()
        except ValueError as e:  # a tensor failed validation (or the backend refused one): undo this call only
            self._rollback.undo_call()
            self._written_in_update -= self._written_in_call
            raise ValueError(f"weight update rejected, no weight was changed: {e}") from None
        except Exception as e:  # the transfer failed: undo the whole update and end it
            raise self._transfer_failed(e, name) from e
        finally:
            if hasattr(stream, "close"):  # a generator: stopped early, it releases what it holds
                stream.close()
        return count

    def _group_sizes(self, info: WeightUpdateInfo, whole_call: bool) -> list[int]:
        """How many tensors of the call arrive together, group by group (see the module docstring)."""
        if whole_call:
            return [len(info.names)]
        if info.group_sizes:
            if sum(info.group_sizes) != len(info.names):
                raise ValueError(f"the backend's group_sizes cover {sum(info.group_sizes)} of {len(info.names)} tensors")
            return info.group_sizes
        return [1] * len(info.names)

    def _plan(self, group: list[tuple[str, torch.Tensor | SparseWeightPatch]], reuse_key: Hashable | None) -> LandingPlan:
        """Validates a received group (ValueError naming each bad tensor) and plans its landing; kept
        under reuse_key for the backend's repeats of the call."""
        check_received(group, self._full_shape)
        plan = plan_landing(self.layout, self.remote, group)
        if reuse_key is not None:
            if len(self._plans) >= _MAX_PLANS:
                self._plans.clear()
            self._plans[reuse_key] = plan
        return plan

    def _full_shape(self, name: str) -> tuple[int, ...] | None:
        return full_shape(self.layout, self.remote, name)

    def _land(self, plan: LandingPlan) -> None:
        self._rollback.save(plan.touched)  # before anything is overwritten
        land(self.model, self.layout, plan)
        # Whole tensors only: a sparse patch on discarded (zeroed) weights does not make them the trainer's.
        written = [*plan.targets, *(target for target, item in plan.rest if isinstance(item, torch.Tensor))]
        self._written_in_call.update(written)
        self._written_in_update.update(written)

    def discard(self) -> None:
        """Every weight's value is gone (sleep(2), woken without reading the checkpoint): unwritten until updated."""
        self.unwritten = {name for name, slot in self.layout.items() if slot.alias_of is None}  # a tied alias lands in its owner

    def _transfer_failed(self, error: Exception, name: str | None) -> WeightTransferError:
        """After a failed transfer: restores everything since start_update, ends the update, and gives the error to raise."""
        where = f" at {name!r}" if name is not None else " before the first tensor arrived"
        restored = self._abort()
        return WeightTransferError(
            f"update_weights: the transfer failed{where}: {type(error).__name__}: {error}; "
            + ("the update was aborted and the previous weights restored" if restored
               else "the update was aborted; weights are partly updated (weight_update_rollback=none) "
                    "and the engine serves nothing until an update finishes")
        )

    def finish_update(self) -> None:
        engine = self._require_engine("finish_weight_update")
        if not self.updating:
            raise WeightUpdateStateError("finish_weight_update: no weight update in progress; call start_weight_update first")
        self.updating = False
        self._rollback.clear()
        self.consistent = True
        self.unwritten -= self._written_in_update
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

    def release(self) -> None:
        """The worker shuts down: the transfer engine is shut down (a failure is logged, not raised) and the
        rollback copies and landing plans are dropped. An update in progress is abandoned, not rolled
        back: the weights are about to be freed."""
        engine, self.transfer_engine, self.backend, self.updating = self.transfer_engine, None, None, False
        self._rollback.clear()
        self._plans = {}
        if engine is not None:
            try:
                engine.shutdown()
            except Exception as e:  # the worker's memory is released all the same
                logger.warning("shutting down the %s model's %s transfer engine: %s", self.name,
                               type(engine).__name__, e)

    def _abort(self) -> bool:
        """Restores every weight changed since start_update and ends the update; False if it could not."""
        self.consistent = self._rollback.undo_update()
        self.updating = False
        if self.transfer_engine is not None:
            self.transfer_engine.abort_update()
        return self.consistent

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

    # ---- inspection (engine/worker/weight_report.py) -------------------------------------------

    def weight_info(self) -> dict[str, dict]:
        """{hf_name: {"shape": [...], "dtype": "bfloat16", "shard": {"dim", "start", "size"} | None}} for
        every weight this rank holds (under expert parallelism: its own experts, not the other ranks'),
        aliases included: shape is the full HF tensor's, shard the slice this rank holds (None: all of it).
        weight_transfer.checksums.hf_state_checksums(state, shards=this) gives the checksums this rank should report."""
        return weight_report.weight_info(self.layout)

    def checksums(self) -> dict[str, str]:
        """{hf_name: checksum} (weight_transfer.checksums.tensor_checksum) of every weight as this rank
        holds it: fused ones per shard, tensor-parallel ones of this rank's slice only."""
        self._require_resident("weight_checker")
        return weight_report.checksums(self.layout)

    def weight_checker(self, baseline: dict | None = None, adapters: dict[str, str] | None = None) -> dict:
        """{"checksums": {...}}, plus match/mismatches/missing/unexpected against `baseline` when given;
        `adapters`: the LoRA adapters' checksums, reported too (weight_report.weight_checker)."""
        self._require_resident("weight_checker")
        return weight_report.weight_checker(self.layout, self.remote, baseline, adapters)
