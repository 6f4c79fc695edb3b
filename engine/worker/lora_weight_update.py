"""LoRAWeightUpdater: a weight update's adapter tensors (update_info "lora_name"), checked and staged until the update finishes.

An adapter sync rides the target model's update lifecycle and its transfer engine (any backend):
the EngineCore resolves update_info's "lora_name" to the loaded adapter and sends the call here
instead of to the model's WeightUpdater. A call delivers PEFT-named tensors
(base_model.model.<module>.lora_A.weight / .lora_B.weight) of that adapter:

    update(...)   every announced name, shape and dtype is checked against the adapter as loaded
                  (its modules, ranks) before anything is received; the stream is then read to its
                  end into float32 host copies (so a rejected call leaves the transport usable),
                  the values checked finite, and the call staged: nothing serves it yet
    commit()      at finish_weight_update: each staged adapter becomes its host copy and slot
                  (LoRAManager.install), all between two steps
    discard()     at abort, a failed transfer, shutdown: the staged tensors are dropped, so the
                  adapter's previous tensors serve on, untouched

A rejected call (ValueError) drops only its own tensors; earlier calls of the update stay staged.
Calls are taken one at a time: an in-process engine (LLM) is called from the trainer's threads at once
(ipc posts a call per ring buffer before filling it), and each call adds to the adapter staged so far.
Only the adapter's bytes move: the model's parameters are never read or written here.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Sequence

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


class LoRAWeightUpdater:
    """The adapter half of one worker's weight updates: stages each adapter's synced tensors until finish."""

    def __init__(self, manager: LoRAManager, target: WeightUpdater) -> None:
        self.manager = manager
        self.target = target  # its transfer engine carries the adapter tensors; its state is the update's
        self._staged: dict[int, tuple[LoRARequest, PEFTAdapter]] = {}  # lora_int_id -> the adapter with this update's tensors
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
        base = self._staged[lora.lora_int_id][1] if lora.lora_int_id in self._staged else self.manager.host_adapter(lora)
        try:
            check_adapter_tensors(base, lora.lora_name, zip(info.names, info.dtypes, info.shapes))
        except ValueError as e:
            raise ValueError(f"adapter update rejected, nothing was changed: {e}") from None
        received, problems = self._receive(engine, info)
        if not problems:
            problems = _check_received(base, lora.lora_name, info.names, received)
        if problems:
            raise ValueError(f"adapter update rejected, nothing was changed: {'; '.join(problems[:_MAX_SHOWN])}")
        self._staged[lora.lora_int_id] = (lora, base.with_tensors(received))
        return len(received)

    def _receive(self, engine: WeightTransferEngine, info: WeightUpdateInfo) -> tuple[dict[str, torch.Tensor], list[str]]:
        """The call's tensors as float32 host copies (a backend may reuse its buffers once the next is pulled),
        the stream read to its end; and what was wrong with what arrived."""
        received: dict[str, torch.Tensor] = {}
        problems: list[str] = []
        name = None
        stream = iter(engine.receive_weights(info))
        try:
            for name, item in stream:
                if isinstance(item, SparseWeightPatch):
                    problems.append(f"{name!r}: a sparse patch; adapters are synced as whole tensors")
                    continue
                received[name] = item.detach().to("cpu", torch.float32, copy=True)
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
        if len(received) + len(problems) != len(info.names):
            problems.append(f"the backend delivered {len(received) + len(problems)} tensors for a call of {len(info.names)}")
        return received, problems

    def commit(self) -> list[int]:
        """Every staged adapter serves its new tensors (between steps); the lora_int_ids committed."""
        committed = []
        for lora_id, (lora, adapter) in self._staged.items():
            self.manager.install(lora, adapter)
            committed.append(lora_id)
        self._staged = {}
        return committed

    def discard(self, lora_id: int | None = None) -> bool:
        """Drops the staged tensors (of one adapter when given, e.g. one removed mid-update); True if there were any."""
        if lora_id is not None:
            return self._staged.pop(lora_id, None) is not None
        had = bool(self._staged)
        self._staged = {}
        return had


def _check_received(base: PEFTAdapter, lora_name: str, announced: list[str], received: dict[str, torch.Tensor]) -> list[str]:
    """What is wrong with the tensors a call delivered: not those announced, a shape the adapter does not have,
    or a NaN / inf."""
    if list(received) != announced:
        return [f"the backend delivered {sorted(received)} for a call announcing {sorted(announced)}"]
    try:
        check_adapter_tensors(base, lora_name, [(n, t.dtype, t.shape) for n, t in received.items()])
    except ValueError as e:
        return [str(e)]
    bad = [n for n, t in received.items() if t.numel() and not math.isfinite(float(t.abs().max()))]
    return [f"{n!r}: contains NaN or inf" for n in bad]
