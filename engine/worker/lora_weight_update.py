"""LoRAWeightUpdater: a weight update's adapter tensors (update_info "lora_name"), checked and staged until the update finishes.

An adapter sync rides the target model's update lifecycle and its transfer engine (any backend):
the EngineCore resolves update_info's "lora_name" to the loaded adapter and sends the call here
instead of to the model's WeightUpdater. A call delivers PEFT-named tensors
(base_model.model.<module>.lora_A.weight / .lora_B.weight) of that adapter:

    update(...)   every announced name, shape and dtype is checked against the adapter as loaded
                  (its modules, ranks) before anything is received; the stream is then read to its
                  end into float32 staging on the slots' device (so a rejected call leaves the
                  transport usable), the values checked finite, and the call staged: nothing serves it yet
    commit()      at finish_weight_update: each staged adapter becomes its host copy and slot
                  (LoRAManager.install), all between two steps
    discard()     at abort, a failed transfer, shutdown: the staged tensors are dropped, so the
                  adapter's previous tensors serve on, untouched

A rejected call (ValueError) drops only its own tensors; earlier calls of the update stay staged.
Calls are taken one at a time: an in-process engine (LLM) is called from the trainer's threads at once
(ipc posts a call per ring buffer before filling it), and each call adds to the adapter staged so far.
Only the adapter's bytes move: the model's parameters are never read or written here.

Cost: a call is a handful of launches and one host sync, whatever its number of tensors. A recurring call
(same adapter load, names, dtypes, shapes: every sync of a training run) is checked and laid out once
(_CallPlan), and a backend's repeat of the very same views (reuse_key) is not looked at again. Its tensors
are copied by one copy when the backend hands the call over as one flat tensor (WeightUpdateInfo.flat: ipc),
else by multi-tensor copies, group by group as the backend's views allow (WeightUpdateInfo.group_sizes,
views_stable_per_call), into one float32 buffer on the slots' device (a backend may reuse its buffers once
the next tensor is pulled); the sum of that buffer, finite unless a value is not, is read once the stream
ended. At commit the slot is rewritten from that buffer on the device (LoRAManager.install), and the host copy
is one copy of the buffer to pinned memory on a side stream, still running when commit returns
(PEFTAdapter.pending: host readers wait for it). On CPU the buffer is the host copy itself. A recurring call
that carries the whole adapter stages into one of two versions made once (_Recurring: buffers, views, host
copy and PEFTAdapter), the one not serving, so a sync makes no tensor objects per tensor at all.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.exceptions import WeightTransferError, WeightUpdateStateError
from engine.lora.manager import LoRAManager
from engine.lora.peft_loader import PEFTAdapter, split_peft_tensor_name
from engine.lora.request import LoRARequest
from engine.worker.weight_update import WeightUpdater
from weight_transfer.base import SparseWeightPatch, WeightTransferEngine, WeightUpdateInfo

_MAX_SHOWN = 20  # problems one error lists; the rest are counted
# Backends whose engine side plans each call against the model's own weights, and why adapters do not fit.
_WHOLE_MODEL_BACKENDS = {"sharded_rdt": "it plans which slices to pull through the model's weight loaders"}
_MAX_PLANS = 16  # recurring calls' plans kept (_CallPlan); all are dropped when one more comes


def check_adapter_tensors(adapter: PEFTAdapter, lora_name: str,
                          tensors: Iterable[tuple[str, torch.dtype, Sequence[int]]]) -> None:
    """Raises one ValueError listing every (name, dtype, shape) that cannot land in `adapter`: a name that is
    not a PEFT LoRA A/B weight, a module the adapter does not have (its targets are fixed when it is loaded),
    a shape other than its rank's, a dtype that is not floating point, a name sent twice."""
    problems: list[str] = []
    seen: set[str] = set()
    for name, dtype, shape in tensors:
        if name in seen:
            problems.append(f"{name!r}: sent twice in one call")
            continue
        seen.add(name)
        try:
            module, which = split_peft_tensor_name(name)
        except ValueError as e:
            problems.append(str(e))
            continue
        weights = adapter.modules.get(module)
        if weights is None:
            problems.append(f"{name!r}: adapter {lora_name!r} has no LoRA weights for {module!r} (its modules are "
                            "those it was loaded with)")
            continue
        expected = tuple((weights.lora_a if which == "A" else weights.lora_b).shape)
        if tuple(shape) != expected:
            problems.append(f"{name!r}: shape {list(shape)} does not match adapter {lora_name!r}'s {list(expected)} "
                            f"(rank {weights.rank})")
        if not dtype.is_floating_point:
            problems.append(f"{name!r}: dtype {str(dtype).removeprefix('torch.')} is not a floating-point dtype")
    if problems:
        more = len(problems) - _MAX_SHOWN
        raise ValueError("; ".join(problems[:_MAX_SHOWN] + ([f"... and {more} more"] if more > 0 else [])))


@dataclass(frozen=True)
class _CallPlan:
    """One recurring call checked against one load of an adapter (PEFTAdapter.layout) and laid out in a flat
    float32 buffer: the tensors end to end in the call's order, as a packing backend lays them (so a backend
    that hands over the whole call as one flat tensor, WeightUpdateInfo.flat, lands it in one copy)."""

    names: tuple[str, ...]
    targets: tuple[tuple[str, str], ...]  # per tensor, in the call's order: (HF module, "A" or "B")
    shapes: tuple[torch.Size, ...]
    numels: tuple[int, ...]
    numel: int

    @staticmethod
    def build(names: Sequence[str], shapes: Sequence[Sequence[int]]) -> _CallPlan:
        sizes = tuple(torch.Size(s) for s in shapes)
        numels = tuple(s.numel() for s in sizes)
        return _CallPlan(tuple(names), tuple(split_peft_tensor_name(n) for n in names), sizes, numels, sum(numels))

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor's view of `flat` (a buffer of numel elements laid out as above), in the call's order."""
        return [piece.view(shape) for piece, shape in zip(flat.split(self.numels), self.shapes)]


@dataclass
class _Version:
    """One of a recurring call's two versions of its adapter, made once: its staging (float32, laid out by the plan,
    on the slots' device), its host copy and the PEFTAdapter whose tensors are views of that. On CPU the staging
    is the host copy; on CUDA the host copy is pinned and filled from the staging on a side stream."""

    staging: torch.Tensor  # [plan.numel] float32 on the slots' device
    staging_views: list[torch.Tensor]  # plan.views(staging)
    host: torch.Tensor  # [plan.numel] float32 on the host (CPU: staging itself)
    adapter: PEFTAdapter  # the adapter as loaded, every tensor replaced by its view of `host` (no pending copy)
    copied: Any = None  # CUDA: a torch.cuda.Event that passes once the last host copy out of `staging` is done


@dataclass
class _Recurring:
    """The buffers of a recurring call that carries a whole adapter (every sync of a training run), made once.

    Its two versions take turns: one is the adapter serving now (the manager's host copy), the next sync stages
    into the other. A sync thus never waits for the host copy the sync before it started (CUDA), and a fill of a
    staging waits (on the device) only for the copy out of it two syncs ago."""

    layout: object  # PEFTAdapter.layout of the load it was made for
    plan: _CallPlan
    versions: tuple[_Version, _Version]

    def next_version(self, serving: PEFTAdapter) -> _Version:
        """The version that is not the adapter serving now."""
        return self.versions[1] if serving.modules is self.versions[0].adapter.modules else self.versions[0]


@dataclass
class _StagedCall:
    plan: _CallPlan
    flat: torch.Tensor  # [plan.numel] float32 on the slots' device: the call's tensors as received
    views: list[torch.Tensor]  # plan.views(flat)
    version: _Version | None = None  # the recurring version the call staged into (flat is its staging)


@dataclass
class _Staged:
    """An adapter's tensors staged in one update: its calls in order (a later call's tensor wins)."""

    lora: LoRARequest
    base: PEFTAdapter  # the adapter when the update's first call for it came (its shapes are every call's)
    calls: list[_StagedCall] = field(default_factory=list)


class LoRAWeightUpdater:
    """The adapter half of one worker's weight updates: stages each adapter's synced tensors until finish."""

    def __init__(self, manager: LoRAManager, target: WeightUpdater) -> None:
        self.manager = manager
        self.target = target  # its transfer engine carries the adapter tensors; its state is the update's
        self._staged: dict[int, _Staged] = {}  # lora_int_id -> the adapter's tensors of this update
        self._plans: dict[Hashable, _CallPlan] = {}  # (layout, names, dtypes, shapes) -> the call, checked
        self._checked: dict[Hashable, _CallPlan] = {}  # (layout, reuse_key) -> the plan of a call whose views passed
        self._recurring: dict[int, _Recurring] = {}  # lora_int_id -> its recurring call's buffers
        self._copy_stream = None  # CUDA: the side stream of the host copies made at commit
        # Held for a whole call: two calls staging at once would each add to the same old adapter, and the
        # later one would drop the earlier one's tensors. Uncontended in an engine process (calls arrive in turn).
        # No deadlock with ipc's ring: the trainer fills a call's buffer without waiting for any call in flight.
        self._call_lock = threading.Lock()

    def update(self, update_info: dict, lora: LoRARequest) -> int:
        """Receives, checks and stages one call's tensors for adapter `lora`; returns how many were received.
        ValueError naming the bad tensors (this call staged nothing); WeightTransferError when the transfer
        failed (the whole update, the model's part included, is then aborted)."""
        with self._call_lock:
            return self._update(update_info, lora)

    def _update(self, update_info: dict, lora: LoRARequest) -> int:
        engine = self.target.transfer_engine
        if engine is None:
            raise WeightUpdateStateError("update_weights: no weight transfer engine; call init_weight_transfer_engine first")
        if not self.target.updating:
            raise WeightUpdateStateError("update_weights: no weight update in progress; call start_weight_update first")
        if self.target.backend in _WHOLE_MODEL_BACKENDS:
            raise ValueError(f"update_info.lora_name: the {self.target.backend} backend cannot sync adapters yet "
                             f"({_WHOLE_MODEL_BACKENDS[self.target.backend]}); use nccl, ipc or local")
        info = engine.parse_update_info(update_info)
        staged = self._staged.get(lora.lora_int_id)
        base = staged.base if staged is not None else self.manager.host_adapter(lora)
        # A repeat of a call whose views were checked (the backend's reuse_key: the very same views again, for
        # backends whose views last the call) is planned and checked by what was built the first time.
        repeat = (base.layout, info.reuse_key) if engine.views_stable_per_call and info.reuse_key is not None else None
        plan = self._checked.get(repeat) if repeat is not None else None
        trusted = plan is not None
        if plan is None:
            try:
                plan = self._plan(base, lora.lora_name, info)
            except ValueError as e:
                raise ValueError(f"adapter update rejected, nothing was changed: {e}") from None
        # The first call of an adapter in an update stages into its recurring buffers (when it carries the whole
        # adapter); a later one would overwrite them, so the first is moved out of them then (a rare update).
        recurring = self._recurring_for(lora.lora_int_id, plan, base) if staged is None else None
        call, problems = self._receive(engine, info, plan, base, lora.lora_name, trusted, recurring)
        if problems:
            raise ValueError(f"adapter update rejected, nothing was changed: {'; '.join(problems[:_MAX_SHOWN])}")
        if staged is not None and staged.calls[0].version is not None:  # a second call: the first one moves out
            staged.calls[0] = _own_buffer(staged.calls[0])
        if repeat is not None and not trusted:
            if len(self._checked) >= _MAX_PLANS:
                self._checked.clear()
            self._checked[repeat] = plan
        if staged is None:
            staged = self._staged[lora.lora_int_id] = _Staged(lora, base)
        staged.calls.append(call)
        return len(plan.names)

    def _plan(self, base: PEFTAdapter, lora_name: str, info: WeightUpdateInfo) -> _CallPlan:
        """The call checked against `base` (ValueError listing every problem) and laid out; kept for its repeats."""
        key = (base.layout, tuple(info.names), tuple(info.dtypes), tuple(map(tuple, info.shapes)))
        plan = self._plans.get(key)
        if plan is None:
            check_adapter_tensors(base, lora_name, zip(info.names, info.dtypes, info.shapes))
            if len(self._plans) >= _MAX_PLANS:
                self._plans.clear()
            plan = self._plans[key] = _CallPlan.build(info.names, info.shapes)
        return plan

    def _recurring_for(self, lora_id: int, plan: _CallPlan, base: PEFTAdapter) -> _Recurring | None:
        """The recurring buffers of a call `plan` of this load of the adapter, made now if need be; None when the
        call does not carry every tensor of the adapter (its other tensors would be the buffers' stale values)."""
        recurring = self._recurring.get(lora_id)
        if recurring is not None and recurring.layout is base.layout and recurring.plan is plan:
            return recurring
        self._recurring.pop(lora_id, None)  # another load, or another call: its buffers go
        whole = {(module, which) for module in base.modules for which in "AB"}
        if len(plan.targets) != len(whole) or set(plan.targets) != whole:
            return None
        device = self.manager.device
        versions = []
        for _ in range(2):
            staging = torch.empty(plan.numel, dtype=torch.float32, device=device)
            staging_views = plan.views(staging)
            host, host_views = staging, staging_views
            if device.type == "cuda":
                host = torch.empty(plan.numel, dtype=torch.float32, pin_memory=True)
                host_views = plan.views(host)
            adapter = dataclasses.replace(base.replaced(plan.targets, host_views), pending=None)
            versions.append(_Version(staging, staging_views, host, adapter))
        recurring = self._recurring[lora_id] = _Recurring(base.layout, plan, tuple(versions))
        return recurring

    def _receive(self, engine: WeightTransferEngine, info: WeightUpdateInfo, plan: _CallPlan, base: PEFTAdapter,
                 lora_name: str, trusted: bool = False,
                 recurring: _Recurring | None = None) -> tuple[_StagedCall, list[str]]:
        """The call's tensors copied into float32 staging on the slots' device (a backend may reuse its buffers
        once the next is pulled), the stream read to its end; and what was wrong with what arrived (trusted: the
        views are those checked before, so only their values are). The staging is the recurring buffers' when
        given (the version that does not serve now), else a new buffer."""
        version = None
        if recurring is None:
            flat = torch.empty(plan.numel, dtype=torch.float32, device=self.manager.device)
            views = plan.views(flat)
        else:
            version = recurring.next_version(base)
            if version.copied is not None:  # CUDA: overwritten once the host copy out of it is done
                torch.cuda.current_stream(version.staging.device).wait_event(version.copied)
            flat, views = version.staging, version.staging_views
        problems: list[str] = []
        received: list[str | None] = []  # the names delivered, in order
        name = None
        finite = None
        stream = iter(engine.receive_weights(info))
        try:
            for size in _group_sizes(engine, info):
                group = list(itertools.islice(stream, size))
                start = len(received)
                names, items = [n for n, _ in group], [t for _, t in group]
                received += names
                name = received[-1] if received else None
                if not problems and not trusted:
                    problems += _check_group(base, lora_name, plan, start, names, items)
                if not problems and items:  # queued on the device: one copy (and cast) of the whole call when the
                    # backend hands it over flat, laid out as the staging is; else one multi-tensor copy for the group
                    if start == 0 and info.flat is not None and info.flat.numel() == plan.numel:
                        flat.copy_(info.flat)
                    else:
                        torch._foreach_copy_(views[start:len(received)], items)
                if len(group) < size:
                    break
            if not problems:  # queued before the stream ends (ipc synchronizes the device there): read at no wait
                # NaN and inf survive a sum, so a finite sum means finite values: one reduction (isfinite over the
                # whole buffer cost ~5 ms a sync on CPU). A sum that overflowed only sends it to the exact check.
                finite = torch.isfinite(flat.sum())
            for extra, _ in stream:  # runs the backend's stream to its end (it marks the call complete)
                received.append(extra)
            if not problems and len(received) != len(plan.names):
                problems.append(f"the backend delivered {len(received)} tensors for a call of {len(plan.names)}")
        except Exception as e:  # the transport failed: the update is over, the model's part restored
            self.discard()
            restored = self.target.abort_update() and self.target.consistent
            where = f" at {name!r}" if name is not None else " before the first tensor arrived"
            raise WeightTransferError(
                f"update_weights: the adapter transfer failed{where}: {type(e).__name__}: {e}; the update was aborted "
                + ("and the previous weights and adapters restored" if restored else
                   "(weights partly updated: weight_update_rollback=none)")) from e
        finally:
            if hasattr(stream, "close"):
                stream.close()
        if not problems and not bool(finite):  # the call's one host sync; the exact check names the tensors
            problems += [f"{n!r}: contains NaN or inf" for n, t in zip(plan.names, views)
                         if t.numel() and not bool(torch.isfinite(t).all())]
        return _StagedCall(plan, flat, views, version), problems

    def commit(self) -> list[int]:
        """Every staged adapter serves its new tensors (between steps); the lora_int_ids committed."""
        committed = []
        for lora_id, staged in self._staged.items():
            call = staged.calls[0]
            if len(staged.calls) == 1 and call.version is not None:
                self._install_recurring(staged.lora, call)
            else:
                synced, sources, hosts, pending = self._host_copies(staged.calls)
                self.manager.install(staged.lora, staged.base.replaced(synced, hosts, pending), synced, sources)
            committed.append(lora_id)
        self._staged = {}
        return committed

    def _install_recurring(self, lora: LoRARequest, call: _StagedCall) -> None:
        """A recurring call's version becomes the adapter, its tensors and PEFTAdapter made once: no per-tensor
        work here. CUDA: its host copy is one copy of its staging on the side stream (as _host_copies)."""
        version = call.version
        adapter = version.adapter
        if version.host is not version.staging:
            side = self._side_stream(version.staging.device)
            with torch.cuda.stream(side):
                version.host.copy_(version.staging, non_blocking=True)
            version.copied = torch.cuda.Event()
            version.copied.record(side)
            adapter = dataclasses.replace(adapter, pending=version.copied)
        self.manager.install(lora, adapter, call.plan.targets, call.views, recurring=True)

    def _side_stream(self, device: torch.device):
        """The side stream of the host copies, behind everything queued on the device so far."""
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device)
        self._copy_stream.wait_stream(torch.cuda.current_stream(device))
        return self._copy_stream

    def _host_copies(self, calls: list[_StagedCall]):
        """(module, which) per synced tensor, its staged values, its host copy, and the event the host copies
        pass once complete (None: on CPU, where the staging is the host copy). One copy per call's buffer, on a
        side stream behind everything queued so far: the next step does not wait for it."""
        pending = None
        hosts = [call.views for call in calls]
        device = calls[0].flat.device
        if device.type == "cuda":
            side = self._side_stream(device)
            hosts = []
            with torch.cuda.stream(side):
                for call in calls:
                    host = torch.empty(call.flat.shape, dtype=call.flat.dtype, pin_memory=True)
                    host.copy_(call.flat, non_blocking=True)
                    call.flat.record_stream(side)  # its memory is not reused before the copy read it
                    hosts.append(call.plan.views(host))
            pending = torch.cuda.Event()
            pending.record(side)
        if len(calls) == 1:
            return calls[0].plan.targets, calls[0].views, hosts[0], pending
        merged: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for call, host_views in zip(calls, hosts):
            merged.update(zip(call.plan.targets, zip(call.views, host_views)))
        return tuple(merged), [v for v, _ in merged.values()], [h for _, h in merged.values()], pending

    def discard(self, lora_id: int | None = None) -> bool:
        """Drops the staged tensors (of one adapter when given, e.g. one removed mid-update, with its recurring
        buffers); True if there were any."""
        if lora_id is not None:
            self._recurring.pop(lora_id, None)
            return self._staged.pop(lora_id, None) is not None
        had = bool(self._staged)
        self._staged = {}
        return had


def _own_buffer(call: _StagedCall) -> _StagedCall:
    """The staged call with its tensors moved out of the recurring buffers into a buffer of its own."""
    flat = call.flat.clone()
    return _StagedCall(call.plan, flat, call.plan.views(flat))


def _group_sizes(engine: WeightTransferEngine, info: WeightUpdateInfo) -> list[int]:
    """How many tensors of the call arrive together (their views valid at once), group by group: the whole call
    (views_stable_per_call), the backend's groups (group_sizes), else one at a time."""
    if engine.views_stable_per_call:
        return [len(info.names)]
    if info.group_sizes and sum(info.group_sizes) == len(info.names):
        return info.group_sizes
    return [1] * len(info.names)


def _check_group(base: PEFTAdapter, lora_name: str, plan: _CallPlan, start: int, names: list[str],
                 items: list) -> list[str]:
    """What is wrong with a group of tensors delivered from position `start` of the call: not those announced,
    a sparse patch, a shape or dtype the adapter does not take."""
    end = start + len(names)
    shapes = [getattr(t, "shape", None) for t in items]
    if (tuple(names) == plan.names[start:end] and shapes == list(plan.shapes[start:end])
            and all(isinstance(t, torch.Tensor) and t.dtype.is_floating_point for t in items)):
        return []  # as announced (and checked): the usual case, without a look at each tensor
    not_tensors = [f"{n!r}: a sparse patch; adapters are synced as whole tensors" if isinstance(t, SparseWeightPatch)
                   else f"{n!r}: a {type(t).__name__}, not a tensor"
                   for n, t in zip(names, items) if not isinstance(t, torch.Tensor)]
    if not_tensors:
        return not_tensors
    if tuple(names) != plan.names[start:end]:
        return [f"the backend delivered {names} at positions {start}..{end - 1} of a call announcing "
                f"{list(plan.names[start:end])} there"]
    try:
        check_adapter_tensors(base, lora_name, [(n, t.dtype, t.shape) for n, t in zip(names, items)])
    except ValueError as e:
        return [str(e)]
    return ["the backend delivered tensors other than those the call announced"]
