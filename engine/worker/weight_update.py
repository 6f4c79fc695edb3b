"""WeightUpdater: the worker's weight-update lifecycle, validation, checksums and HF-name view of the model.

Lifecycle (enforced; misuse raises RuntimeError, bad input ValueError):

    init_transfer_engine(init_info)     -> ready      (again when ready: replaces the transfer engine)
    start_update()                      -> updating
    update_weights(update_info) * N        (each call is atomic, see below)
    finish_update()                     -> ready
    shutdown()                          -> not initialized (an update in progress is abandoned)

Atomicity is per update_weights call: the call's tensor metadata is checked before anything is
received, then every received tensor is checked (known HF name, the HF shape of that name,
a floating dtype, finite values), and only if all pass do they land through the model's own
weight loaders (`model.load_weights`, which maps q/k/v and gate/up onto the fused parameters).
A rejected call changes no weight and names every bad tensor with its reason. The copies are
in place, so parameter addresses (and CUDA graphs that recorded them) stay valid.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from engine.exceptions import WeightUpdateStateError
from engine.models.layers import MergedLinear, QKVLinear
from weight_transfer.base import WeightTransferEngine, get_engine_backend
from weight_transfer.checksums import compare_checksums, tensor_checksum

logger = logging.getLogger(__name__)

# Recomputed from the config by every implementation: accepted in an update, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class HFSlot:
    """Where one HF-named tensor lives in the engine: a whole parameter, or rows of a fused one."""

    param: nn.Parameter
    param_shape: tuple[int, ...]  # the parameter's shape when resident (sleep mode may swap its data for an empty tensor)
    offset: int | None = None  # first row (dim 0) of the shard in a fused parameter; None: the whole parameter
    size: int | None = None  # number of rows of the shard
    alias_of: str | None = None  # tied weights: the HF name that owns the shared parameter

    @property
    def shape(self) -> tuple[int, ...]:
        if self.offset is None:
            return self.param_shape
        return (self.size, *self.param_shape[1:])

    def tensor(self) -> torch.Tensor:
        data = self.param.data
        return data if self.offset is None else data.narrow(0, self.offset, self.size)


def _shard_sizes(module: nn.Module) -> list[int]:
    if isinstance(module, QKVLinear):
        return [module.q_size, module.kv_size, module.kv_size]
    if isinstance(module, MergedLinear):
        return list(module.output_sizes)
    raise TypeError(f"{type(module).__name__} is in packed_modules_mapping but has no known shard layout")


def hf_weight_layout(model: nn.Module) -> dict[str, HFSlot]:
    """{hf_name: HFSlot} for every weight of `model`, the inverse of load_weights_with_mapping's renaming.

    A fused parameter `...qkv_proj.weight` appears as `...q_proj.weight`, `...k_proj.weight`,
    `...v_proj.weight` (its row blocks, in the mapping's order); a parameter shared under a
    second name (a tied lm_head.weight) appears under both, the second as an alias.
    """
    mapping: dict[str, list[str]] = getattr(model, "packed_modules_mapping", {})
    modules = dict(model.named_modules())
    layout: dict[str, HFSlot] = {}
    owner_of: dict[int, str] = {}  # id(param) -> the HF name it was first seen under
    for param_name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in owner_of:
            layout[param_name] = HFSlot(param, tuple(param.shape), alias_of=owner_of[id(param)])
            continue
        owner_of[id(param)] = param_name
        module_path = param_name.rpartition(".")[0]
        packed = module_path.rpartition(".")[2]
        sources = mapping.get(packed)
        if sources is None:
            layout[param_name] = HFSlot(param, tuple(param.shape))
            continue
        offset = 0
        for source, size in zip(sources, _shard_sizes(modules[module_path]), strict=True):
            layout[param_name.replace(f".{packed}.", f".{source}.")] = HFSlot(param, tuple(param.shape), offset, size)
            offset += size
    return layout


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class WeightUpdater:
    """Owns the transfer engine and the update state of one worker's model."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.layout = hf_weight_layout(model)
        self.transfer_engine: WeightTransferEngine | None = None
        self.backend: str | None = None
        self.updating = False

    # ---- lifecycle ---------------------------------------------------------------------------

    def init_transfer_engine(self, init_info: dict) -> None:
        if not isinstance(init_info, dict):
            raise ValueError(f"init_info: expected a dict, got {type(init_info).__name__}")
        if self.updating:
            raise WeightUpdateStateError("init_weight_transfer_engine: a weight update is in progress; finish it first")
        backend = init_info.get("backend")
        if not isinstance(backend, str):
            raise ValueError(f"init_info.backend: expected a backend name, got {backend!r}")
        engine = get_engine_backend(backend)(self.device)
        engine.init_transfer(engine.parse_init_info(init_info))
        if self.transfer_engine is not None:
            self.transfer_engine.shutdown()
        self.transfer_engine, self.backend = engine, backend

    def start_update(self) -> None:
        engine = self._require_engine("start_weight_update")
        if self.updating:
            raise WeightUpdateStateError("start_weight_update: a weight update is already in progress; call finish_weight_update first")
        engine.start_update()
        self.updating = True

    def update_weights(self, update_info: dict) -> int:
        """Receives, validates and lands one batch of tensors; returns how many were received."""
        engine = self._require_engine("update_weights")
        if not self.updating:
            raise WeightUpdateStateError("update_weights: no weight update in progress; call start_weight_update first")
        self._require_resident("update_weights")
        info = engine.parse_update_info(update_info)
        self._validate(list(zip(info.names, info.dtypes, info.shapes)))  # before anything moves
        weights = list(engine.receive_weights(info))
        self._validate([(n, t.dtype, tuple(t.shape)) for n, t in weights], tensors=[t for _, t in weights])
        try:
            with torch.no_grad():
                self.model.load_weights(self._resolve_aliases(weights))
        except Exception as e:  # validation should make this unreachable (short of running out of memory)
            raise RuntimeError(f"update_weights: loading failed after validation; weights may be partly updated: {e}") from e
        return len(weights)

    def finish_update(self) -> None:
        engine = self._require_engine("finish_weight_update")
        if not self.updating:
            raise WeightUpdateStateError("finish_weight_update: no weight update in progress; call start_weight_update first")
        self.updating = False
        engine.finish_update()

    def shutdown(self) -> None:
        if self.transfer_engine is not None:
            self.transfer_engine.shutdown()
        self.transfer_engine, self.backend, self.updating = None, None, False

    def _require_resident(self, method: str) -> None:
        if any(tuple(slot.param.shape) != slot.param_shape for slot in self.layout.values()):
            raise WeightUpdateStateError(f"{method}: the weights are not in device memory (engine asleep?); wake_up the weights first")

    def _require_engine(self, method: str) -> WeightTransferEngine:
        if self.transfer_engine is None:
            raise WeightUpdateStateError(f"{method}: no weight transfer engine; call init_weight_transfer_engine first")
        return self.transfer_engine

    # ---- validation ----------------------------------------------------------------------------

    def _validate(
        self, metadata: list[tuple[str, torch.dtype, tuple[int, ...]]], tensors: list[torch.Tensor] | None = None
    ) -> None:
        """Raises one ValueError listing every bad tensor as `name: reason`; checks values when given tensors."""
        problems: list[str] = []
        seen: set[str] = set()
        for i, (name, dtype, shape) in enumerate(metadata):
            if name in seen:
                problems.append(f"{name!r}: sent twice in one update")
                continue
            seen.add(name)
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            slot = self.layout.get(name)
            if slot is None:
                problems.append(f"{name!r}: matches no parameter of the model (HF naming expected)")
                continue
            if tuple(shape) != slot.shape:
                problems.append(f"{name!r}: shape {list(shape)} does not match the model's {list(slot.shape)}")
            if not dtype.is_floating_point:
                problems.append(f"{name!r}: dtype {_dtype_name(dtype)} is not a floating-point dtype")
            elif tensors is not None and not bool(torch.isfinite(tensors[i]).all()):
                problems.append(f"{name!r}: contains NaN or inf")
        if problems:
            shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
            raise ValueError("weight update rejected, no weight was changed: " + "; ".join(shown))

    def _resolve_aliases(self, weights: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """A tied alias (lm_head.weight) lands in its owner unless the owner came in the same call."""
        names = {n for n, _ in weights}
        resolved = []
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            owner = self.layout[name].alias_of
            if owner is None:
                resolved.append((name, tensor))
            elif owner not in names:
                resolved.append((owner, tensor))
        return resolved

    # ---- inspection ----------------------------------------------------------------------------

    def weight_info(self) -> dict[str, dict]:
        """{hf_name: {"shape": [...], "dtype": "bfloat16"}} for every weight, aliases included."""
        return {
            name: {"shape": list(slot.shape), "dtype": _dtype_name(slot.param.dtype)}
            for name, slot in self.layout.items()
        }

    def checksums(self) -> dict[str, str]:
        """{hf_name: checksum} (weight_transfer.checksums.tensor_checksum) of every weight, fused ones per shard."""
        self._require_resident("weight_checker")
        return {name: tensor_checksum(slot.tensor()) for name, slot in self.layout.items()}

    def weight_checker(self, baseline: dict | None = None) -> dict:
        """{"checksums": {...}}, plus match/mismatches/missing/unexpected against `baseline` when given."""
        checksums = self.checksums()
        result: dict = {"checksums": checksums}
        if baseline is not None:
            aliases = [n for n, s in self.layout.items() if s.alias_of is not None]
            result.update(compare_checksums(checksums, baseline, optional=aliases))
        return result

