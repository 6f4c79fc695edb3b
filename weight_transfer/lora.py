"""AdapterSource: one LoRA adapter of a trainer (a peft.PeftModel, or a dict of its tensors) as a WeightSource that names the engine's adapter.

    trainer = trainer_init(init_info, client=client, source=adapter_source(peft_model, "policy"))
    trainer.send_weights(weight_version="step-3")      # only the adapter's tensors move

The engine must hold an adapter named "policy" already (add_lora / LoRARequest of a PEFT directory
saved for the same base model, e.g. the trainer's save_pretrained at step 0): its rank, target modules
and scaling come from there, and every synced tensor is checked against them. send_weights sees the
source's lora_name and sends through client.for_lora (update_info "lora_name"), with any backend.

Tensors are named as PEFT saves them (base_model.model.<module>.lora_A.weight / .lora_B.weight);
they are read from the model's parameters on every pass, so a source built once follows training.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from weight_transfer.base import ParamMeta, WeightSource, _is_dtensor, _placements

# A PeftModel's live parameter names carry the adapter's name: ...q_proj.lora_A.<adapter>.weight. PEFT's
# saved names drop it (get_peft_model_state_dict), and those are what engines read.
_LIVE_NAME = re.compile(r"(?P<module>.+)\.(?P<kind>lora_[^.]+)\.(?P<adapter>[^.]+)(?P<rest>(\.[^.]+)*)")
_SAVED_NAME = re.compile(r"base_model\.model\..+\.lora_[AB]\.weight")


class AdapterSource(WeightSource):
    """The tensors of one LoRA adapter under PEFT's saved names; `lora_name` is the engine's adapter they sync into.

    `dtype` casts each tensor as it is yielded (the engine keeps adapters in float32 either way).
    """

    def __init__(self, tensors: list[tuple[str, torch.Tensor]], lora_name: str, *, dtype: torch.dtype | None = None) -> None:
        if not isinstance(lora_name, str) or not lora_name:
            raise ValueError(f"lora_name: expected the engine adapter's lora_name, got {lora_name!r}")
        if not tensors:
            raise ValueError("adapter_source: no LoRA tensors")
        for name, _ in tensors:
            if not _SAVED_NAME.fullmatch(name):
                raise ValueError(f"adapter_source: {name!r} is not a PEFT LoRA weight name "
                                 "(base_model.model.<module>.lora_A.weight / .lora_B.weight)")
        self.lora_name = lora_name
        self.dtype = dtype
        self._tensors = tensors  # (saved name, parameter or tensor): read at every pass
        self._plain: bool | None = None  # plain_tensors: whether the list is yielded as it is

    def _metadata(self) -> list[ParamMeta]:
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        return [ParamMeta(name, self.dtype or t.dtype, tuple(t.shape),
                          owners=tuple(range(world)) if _is_dtensor(t) else None, placements=_placements(t))
                for name, t in self._tensors]

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        return t.to(self.dtype) if self.dtype is not None and t.dtype != self.dtype else t

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self._tensors:
            yield name, self._cast(t.full_tensor() if _is_dtensor(t) else t)

    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self._tensors:
            yield name, self._cast(t.to_local() if _is_dtensor(t) else t)

    def plain_tensors(self) -> list[tuple[str, torch.Tensor]] | None:
        if self._plain is None:  # decided once: the list and its tensors' kinds do not change
            self._plain = (type(self).iter_full is AdapterSource.iter_full and self.dtype is None
                           and not any(_is_dtensor(t) for _, t in self._tensors))
        return self._tensors if self._plain else None

    @property
    def num_bytes(self) -> int:
        """The bytes one sync of it moves."""
        return sum(m.nbytes for m in self.metadata)


def adapter_source(model: nn.Module | Mapping[str, torch.Tensor], lora_name: str, *, adapter_name: str | None = None,
                   dtype: torch.dtype | None = None) -> AdapterSource:
    """The adapter `adapter_name` of a peft.PeftModel (default: its active adapter), or a {PEFT saved name: tensor}
    dict (e.g. peft.get_peft_model_state_dict's), as the source of a sync into the engine's adapter `lora_name`.

    Only plain LoRA is synced: an adapter with other trained tensors of its own (DoRA magnitudes, embedding
    LoRA, modules_to_save) is refused naming the first one, as the engine would refuse to load it."""
    if isinstance(model, Mapping):
        return AdapterSource(list(model.items()), lora_name, dtype=dtype)
    if not isinstance(model, nn.Module):
        raise ValueError(f"adapter_source: expected a peft.PeftModel or a {{name: tensor}} dict, got {type(model).__name__}")
    adapter = adapter_name if adapter_name is not None else getattr(model, "active_adapter", None)
    if not isinstance(adapter, str):
        raise ValueError("adapter_name: the model names no single active adapter (a PeftModel's active_adapter); "
                         "pass adapter_name")
    tensors = []
    for name, param in model.named_parameters():
        match = _LIVE_NAME.fullmatch(name)
        if match is None or match["adapter"] != adapter:
            if f".modules_to_save.{adapter}." in name:
                raise ValueError(f"adapter_source: {name!r}: modules_to_save is not plain LoRA; engines do not serve it")
            continue
        if match["kind"] not in ("lora_A", "lora_B") or match["rest"] != ".weight":
            raise ValueError(f"adapter_source: {name!r} is not a plain LoRA A/B weight (DoRA, embedding LoRA and "
                             "LoRA biases are not served)")
        tensors.append((f"{match['module']}.{match['kind']}.weight", param))
    if not tensors:
        raise ValueError(f"adapter_name: the model has no LoRA weights for adapter {adapter!r}")
    return AdapterSource(tensors, lora_name, dtype=dtype)
