"""Builds a model from a local HF checkpoint directory and loads its safetensors weights through the param loaders."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from engine.distributed import get_ep, get_tp
from engine.models.layers import hf_parts_of, load_part
from engine.models.registry import resolve_model_class


def load_hf_config(model_dir: str):
    """Reads config.json of a local checkpoint directory (never downloads)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir, local_files_only=True)


def iterate_safetensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) from every *.safetensors file in the directory, one tensor at a time."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model_dir: no *.safetensors files in {model_dir}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


@torch.no_grad()
def load_model(
    model_dir: str, hf_config, dtype: torch.dtype, device: torch.device | str, load_format: str = "auto"
) -> nn.Module:
    """Builds the model in `dtype` directly on `device`, loads all weights and checks none is missing.

    load_format "dummy" reads nothing: weights are random (normal, std 0.02; norms 1), seeded.
    """
    model_cls = resolve_model_class(hf_config)
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_cls(hf_config)
    finally:
        torch.set_default_dtype(previous_dtype)
    if load_format == "dummy":
        if get_tp().size == 1 and get_ep().size == 1:
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.fill_(1.0)
                else:
                    param.normal_(0.0, 0.02)
        else:
            _dummy_shards(model)
        return model.eval()
    loaded = model.load_weights(iterate_safetensors(model_dir))
    missing = sorted(set(dict(model.named_parameters())) - loaded)
    if missing:
        raise ValueError(f"checkpoint {model_dir} is missing parameters: {missing}")
    return model.eval()


def _dummy_shards(model: nn.Module) -> None:
    """Dummy weights under tensor or expert parallelism: each rank draws every FULL tensor, exactly as
    one rank would draw its parameter (same order, shape, device and seeded generator), and keeps its slice.

    So every rank agrees on replicated weights, and the model equals the one-rank dummy model.
    """
    for name, param in model.named_parameters():
        local_experts = getattr(param, "local_experts", None)
        if local_experts is not None:  # a MoE layer's stacked experts: every expert drawn, this rank's kept
            full = torch.empty((param.num_experts, *param.shape[1:]), dtype=param.dtype, device=param.device)
            full.normal_(0.0, 0.02)
            param.data.copy_(full[local_experts.start:local_experts.stop])
            continue
        parts = hf_parts_of(param)
        # A fused parameter (q/k/v, gate/up) is drawn whole, as one rank holds it: its parts stacked on dim 0.
        full_shape = (sum(p.full_shape[0] for p in parts), *parts[0].full_shape[1:])
        full = torch.empty(full_shape, dtype=param.dtype, device=param.device)
        if "norm" in name:
            full.fill_(1.0)
        else:
            full.normal_(0.0, 0.02)
        for part, piece in zip(parts, full.split([p.full_shape[0] for p in parts])):
            load_part(param, part, piece)
