"""Reads a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) and checks it fits the model."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import safe_open

from engine.lora.layers import LoRATarget

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
_PREFIX = "base_model.model."  # PEFT's name for the wrapped model in a saved state dict
_TENSOR_NAME = re.compile(r"(?P<module>.+)\.lora_(?P<which>[AB])\.weight")

# adapter_config.json keys that change what the adapter computes beyond y += scale * B A x. Each must
# be unset (None, False or empty): an adapter that sets one is refused rather than served wrong.
_UNSUPPORTED_OPTIONS = (
    "use_dora",  # a learned magnitude per output (lora_magnitude_vector tensors)
    "lora_bias",  # a bias on B
    "fan_in_fan_out",  # weights stored transposed (GPT-2's Conv1D)
    "modules_to_save",  # whole modules replaced
    "trainable_token_indices",  # embedding rows replaced
    "target_parameters",  # LoRA on bare parameters (MoE experts)
    "layer_replication",  # layers duplicated
    "alora_invocation_tokens",  # activated LoRA: on only after given tokens
    "use_qalora",
    "use_bdlora",
    "arrow_config",
    "kasa_config",
    "velora_config",
    "monteclora_config",
)


@dataclass(frozen=True)
class LoRAModuleWeights:
    """One HF module's adapter, full HF shapes, float32 on the host: delta = scaling * x @ lora_a^T @ lora_b^T.

    lora_a and lora_b are PEFT's tensors as read (or synced), unscaled: their checksums are the trainer's."""

    lora_a: torch.Tensor  # [rank, in_features]
    lora_b: torch.Tensor  # [out_features, rank]
    scaling: float  # lora_alpha / rank (rslora: / sqrt(rank)), as PEFT computes it

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


@dataclass(frozen=True)
class PEFTAdapter:
    """A validated adapter: its modules by HF name (e.g. model.layers.0.self_attn.q_proj).

    A weight sync's host copy may still be filling from the device when it is installed (`pending`): its
    tensors' shapes are final, their values readable only after ready(). Every reader of values on the
    host (checksums, paging into a slot) calls ready() first; merely sharing tensors (with_tensors) does not.
    """

    rank: int  # the largest rank of its modules
    modules: dict[str, LoRAModuleWeights]
    # Which load this is: its modules, ranks and scalings. with_tensors keeps it (values change, shapes do not),
    # so whatever was planned for one version of the adapter (a sync's checks, its slot regions) fits the next.
    layout: object = field(default_factory=object, compare=False, repr=False)
    # A torch.cuda.Event that passes once a device-to-host copy into these tensors is complete; None: readable now.
    pending: Any = field(default=None, compare=False, repr=False)

    @property
    def num_bytes(self) -> int:
        return sum(w.lora_a.nbytes + w.lora_b.nbytes for w in self.modules.values())

    def ready(self) -> PEFTAdapter:
        """This adapter, once its tensors' values may be read on the host (waits for a pending copy)."""
        if self.pending is not None:
            self.pending.synchronize()
        return self

    def tensors(self) -> dict[str, torch.Tensor]:
        """{PEFT tensor name (base_model.model.<module>.lora_A.weight / .lora_B.weight): tensor}, as saved."""
        out = {}
        for module, weights in self.modules.items():
            out[peft_tensor_name(module, "A")] = weights.lora_a
            out[peft_tensor_name(module, "B")] = weights.lora_b
        return out

    def with_tensors(self, tensors: dict[str, torch.Tensor]) -> PEFTAdapter:
        """This adapter with some of its tensors replaced ({PEFT tensor name: float32 tensor of the same shape},
        already checked against it); the other modules' tensors are shared, not copied."""
        return self.replaced([split_peft_tensor_name(name) for name in tensors], list(tensors.values()))

    def replaced(self, targets: Sequence[tuple[str, str]], tensors: Sequence[torch.Tensor],
                 pending: Any = None) -> PEFTAdapter:
        """with_tensors by (module, "A" or "B") per tensor (a later entry for the same tensor wins); `pending`:
        the event of a copy still filling them (see the class docstring)."""
        new: dict[str, list[torch.Tensor | None]] = {}
        for (module, which), tensor in zip(targets, tensors, strict=True):
            new.setdefault(module, [None, None])[which == "B"] = tensor
        modules = dict(self.modules)
        for module, (lora_a, lora_b) in new.items():
            old = modules[module]
            modules[module] = LoRAModuleWeights(old.lora_a if lora_a is None else lora_a,
                                                old.lora_b if lora_b is None else lora_b, old.scaling)
        return PEFTAdapter(self.rank, modules, self.layout, self.pending if pending is None else pending)


def peft_tensor_name(module: str, which: str) -> str:
    """PEFT's saved name of a module's lora_A / lora_B ("A" / "B") weight."""
    return f"{_PREFIX}{module}.lora_{which}.weight"


def split_peft_tensor_name(name: str) -> tuple[str, str]:
    """(module, "A" or "B") of a PEFT saved tensor name; ValueError when `name` is not one."""
    match = _TENSOR_NAME.fullmatch(name.removeprefix(_PREFIX)) if name.startswith(_PREFIX) else None
    if match is None:
        raise ValueError(f"{name!r} is not a LoRA A/B weight ({_PREFIX}<module>.lora_A.weight / .lora_B.weight)")
    return match["module"], match["which"]


def _pattern_value(patterns: dict, module_name: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that matches the end of the module's name at a
    dot boundary (a key may be a regex), else `default`."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module_name):
            return value
    return default


def read_adapter_config(path: str, max_lora_rank: int) -> dict:
    """adapter_config.json of a PEFT LoRA adapter, checked for what the engine serves; ValueError naming the problem."""
    config_path = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(config_path):
        raise ValueError(f"lora_path: {path!r} is not a PEFT adapter directory (no {CONFIG_NAME})")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"lora_path: {config_path} is not readable JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{CONFIG_NAME}: expected a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"{CONFIG_NAME}: peft_type {peft_type!r} is not supported; only LORA adapters are served")
    for key in _UNSUPPORTED_OPTIONS:
        if config.get(key):
            raise ValueError(f"{CONFIG_NAME}: {key}={config[key]!r} is not supported (only plain LoRA: y += scale * B A x)")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{CONFIG_NAME}: bias={config['bias']!r} is not supported; only bias='none' adapters are served")
    ranks = [config.get("r"), *(config.get("rank_pattern") or {}).values()]
    alphas = [config.get("lora_alpha"), *(config.get("alpha_pattern") or {}).values()]
    for name, values in (("r", ranks), ("lora_alpha", alphas)):
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in values):
            raise ValueError(f"{CONFIG_NAME}: {name} (and its pattern values) must be positive numbers, got {values}")
    if max(ranks) > max_lora_rank:
        raise ValueError(f"{CONFIG_NAME}: rank {max(ranks)} is above max_lora_rank ({max_lora_rank}); "
                         "start the engine with a larger --max-lora-rank")
    return config


def load_peft_adapter(path: str, targets: dict[str, LoRATarget], max_lora_rank: int) -> PEFTAdapter:
    """Reads and validates the adapter at `path` against the model's LoRA targets (layers.lora_targets);
    ValueError naming the problem (nothing is kept on failure)."""
    config = read_adapter_config(path, max_lora_rank)
    supported_leaves = sorted({name.rpartition(".")[2] for name in targets})
    target_modules = config.get("target_modules")
    if isinstance(target_modules, list):  # a string is a regex (or "all-linear"): the tensors below are checked instead
        for target in target_modules:
            if str(target).rpartition(".")[2] not in supported_leaves:
                raise ValueError(f"{CONFIG_NAME}: target module {target!r} is not supported for LoRA; "
                                 f"supported: {', '.join(supported_leaves)}")
    weights_path = os.path.join(path, WEIGHTS_NAME)
    if not os.path.isfile(weights_path):
        raise ValueError(f"lora_path: {path!r} has no {WEIGHTS_NAME} (pickled adapter_model.bin is not read)")

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(weights_path, framework="pt") as f:
        for key in f.keys():
            try:
                module, which = split_peft_tensor_name(key)
            except ValueError as e:
                raise ValueError(f"{WEIGHTS_NAME}: tensor {e}; only plain LoRA is served") from None
            if module not in targets:
                raise ValueError(f"{WEIGHTS_NAME}: {key!r} targets {module!r}, which is not a module of this model "
                                 f"that LoRA supports (supported: {', '.join(supported_leaves)})")
            pairs.setdefault(module, {})[which] = f.get_tensor(key)

    use_rslora = bool(config.get("use_rslora", False))
    modules: dict[str, LoRAModuleWeights] = {}
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{WEIGHTS_NAME}: {module} has lora_{''.join(pair)} but not lora_{'B' if 'A' in pair else 'A'}")
        target = targets[module]
        rank = _pattern_value(config.get("rank_pattern") or {}, module, config["r"])
        alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config["lora_alpha"])
        lora_a, lora_b = pair["A"], pair["B"]
        if tuple(lora_a.shape) != (rank, target.in_features) or tuple(lora_b.shape) != (target.out_features, rank):
            raise ValueError(
                f"{WEIGHTS_NAME}: shape mismatch for {module}: lora_A {tuple(lora_a.shape)} and lora_B "
                f"{tuple(lora_b.shape)}, expected ({rank}, {target.in_features}) and ({target.out_features}, {rank}) "
                "(an adapter for another model?)")
        if not (torch.isfinite(lora_a).all() and torch.isfinite(lora_b).all()):
            raise ValueError(f"{WEIGHTS_NAME}: {module} has non-finite values")
        scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank  # PEFT's
        modules[module] = LoRAModuleWeights(lora_a.float().contiguous(), lora_b.float().contiguous(), scaling)
    if not modules:
        raise ValueError(f"{WEIGHTS_NAME}: the adapter has no LoRA weights")
    return PEFTAdapter(max(w.lora_a.shape[0] for w in modules.values()), modules)
