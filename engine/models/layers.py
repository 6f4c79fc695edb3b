"""Building blocks shared by the model files: norms, rotary embedding, activations and self-loading linear layers."""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.activation import silu_and_mul
from engine.kernels.norm import rms_norm
from engine.kernels.rotary import rotary_embedding

# ---------------------------------------------------------------------------------------
# Weight loading: every parameter carries `weight_loader(param, loaded_weight[, shard_id])`,
# so checkpoint loading and weight sync land tensors the same way (and tensor parallelism
# can later shard inside the loaders).


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    """Copies a whole tensor into `param` after checking the shape."""
    if param.shape != loaded_weight.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)}, loaded {tuple(loaded_weight.shape)}")
    param.data.copy_(loaded_weight)


def _new_param(*shape: int, loader=default_weight_loader, fill: float = 0.0) -> nn.Parameter:
    param = nn.Parameter(torch.full(shape, fill), requires_grad=False)
    param.weight_loader = loader
    return param


def _param_index(module: nn.Module) -> dict[str, nn.Parameter]:
    """{name: parameter} of `module`, built once: a weight sync lands tensors one call at a time,
    and walking the module tree on each would cost more than the copy. The structure of a model
    never changes after construction (sleep mode swaps .data, not the Parameter objects)."""
    index = module.__dict__.get("_param_index")
    if index is None:
        index = module.__dict__["_param_index"] = dict(module.named_parameters())
    return index


def load_weights_with_mapping(
    module: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    packed_modules_mapping: dict[str, list[str]],
    skip: Iterable[str] = (),
) -> set[str]:
    """Loads HF-named tensors into `module`'s parameters through their weight_loaders.

    A name like `layers.0.self_attn.k_proj.weight` goes to `layers.0.self_attn.qkv_proj.weight`
    with shard id 1 (the index of k_proj in the mapping's list). Names in `skip` and rotary
    `inv_freq` buffers are ignored. Returns the parameter names whose every shard was loaded.
    """
    params = _param_index(module)
    skip = set(skip)
    shards_seen: dict[str, set] = {}
    loaded: set[str] = set()
    for name, tensor in weights:
        if name in skip or name.endswith("rotary_emb.inv_freq"):
            continue
        param_name, shard_id, num_shards = name, None, 1
        for packed, sources in packed_modules_mapping.items():
            for index, source in enumerate(sources):
                if f".{source}." in name:
                    param_name, shard_id, num_shards = name.replace(f".{source}.", f".{packed}."), index, len(sources)
                    break
            if shard_id is not None:
                break
        param = params.get(param_name)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} matches no model parameter")
        try:
            if shard_id is None:
                param.weight_loader(param, tensor)
            else:
                param.weight_loader(param, tensor, shard_id)
        except ValueError as e:
            raise ValueError(f"parameter {param_name!r} (from {name!r}): {e}") from None
        shards_seen.setdefault(param_name, set()).add(shard_id)
        if len(shards_seen[param_name]) == num_shards:
            loaded.add(param_name)
    return loaded


# ---------------------------------------------------------------------------------------
# Linear layers and embeddings.


class Linear(nn.Module):
    """y = x W^T (+ b), with per-parameter loaders."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.weight = _new_param(output_size, input_size, loader=self.weight_loader)
        self.bias = _new_param(output_size, loader=self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        default_weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several linears over the same input, fused along the output dim (e.g. gate/up); shard_id is the index."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int) -> None:
        if not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id {shard_id} out of range for {len(self.output_sizes)} shards")
        offset = sum(self.output_sizes[:shard_id])
        size = self.output_sizes[shard_id]
        default_weight_loader(param.data.narrow(0, offset, size), loaded_weight)


class QKVLinear(Linear):
    """Fused q/k/v projection: output rows are [q (Hq*D) | k (Hkv*D) | v (Hkv*D)]; shard_id "q"|"k"|"v" (or 0|1|2)."""

    _SHARDS = ("q", "k", "v")

    def __init__(self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        self.q_size = num_heads * head_size
        self.kv_size = num_kv_heads * head_size
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | int) -> None:
        if isinstance(shard_id, int):
            shard_id = self._SHARDS[shard_id]
        offset, size = {
            "q": (0, self.q_size),
            "k": (self.q_size, self.kv_size),
            "v": (self.q_size + self.kv_size, self.kv_size),
        }[shard_id]
        default_weight_loader(param.data.narrow(0, offset, size), loaded_weight)


class VocabEmbedding(nn.Module):
    """Token embedding table."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.weight = _new_param(num_embeddings, embedding_dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, dim]
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Projects hidden states to vocabulary logits; shares the embedding's parameter when tied."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tied_embedding: VocabEmbedding | None = None):
        super().__init__()
        if tied_embedding is not None:
            self.weight = tied_embedding.weight  # same Parameter: one copy, one loader
        else:
            self.weight = _new_param(num_embeddings, embedding_dim)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, dim] -> [N, vocab] float32
        return F.linear(hidden, self.weight).float()


# ---------------------------------------------------------------------------------------
# Norms and activations.


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 then cast back (HF numerics), with an optional fused residual add."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = _new_param(hidden_size, fill=1.0)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Returns norm(x), or (norm(x + residual), x + residual) when residual is given."""
        return rms_norm(x, self.weight, self.eps, residual)


class SiluAndMul(nn.Module):
    """silu(gate) * up for x = [gate | up] along the last dim."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2*I] -> [T, I]
        return silu_and_mul(x)


# ---------------------------------------------------------------------------------------
# Rotary embedding (neox style: rotate the two halves of each head).


def rope_parameters(hf_config) -> dict:
    """Returns {rope_type, rope_theta, ...} from a transformers v5 `rope_parameters` or v4 `rope_theta`/`rope_scaling`."""
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        params = dict(params)
    else:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", 10000.0)
    return params


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama-3 scaling: keep high frequencies, divide low ones by `factor`, blend the band between."""
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor  # longer wavelengths get divided by factor
    high_freq_wavelen = old_context_len / high_freq_factor  # shorter wavelengths are kept
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, out)


class RotaryEmbedding(nn.Module):
    """Applies rotary position embedding to q and k from a cos/sin cache indexed by position."""

    def __init__(self, head_size: int, max_position: int, params: dict):
        super().__init__()
        rope_type = params["rope_type"]
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"rope_parameters.rope_type: {rope_type!r} is not supported; supported: default, llama3")
        self.head_size = head_size
        exponents = torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size
        inv_freq = 1.0 / (params["rope_theta"] ** exponents)  # [D/2] float32
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, params)
        positions = torch.arange(max_position, dtype=torch.int64).float()
        freqs = torch.outer(positions, inv_freq)  # [max_position, D/2]
        # Kept in float32 whatever the model dtype; cast at use as HF does.
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)  # [max_position, D/2]
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def forward(
        self,
        positions: torch.Tensor,  # [T] int64
        q: torch.Tensor,  # [T, Hq * D]
        k: torch.Tensor,  # [T, Hkv * D]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_embedding(positions, q, k, self.cos_cache, self.sin_cache, self.head_size)


def get_rope(head_size: int, hf_config) -> RotaryEmbedding:
    """Builds the rotary embedding described by an HF config."""
    return RotaryEmbedding(head_size, hf_config.max_position_embeddings, rope_parameters(hf_config))
