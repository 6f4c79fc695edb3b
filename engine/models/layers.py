"""Building blocks shared by the model files: norms, rotary embedding, activations and self-loading, tensor-parallel linear layers."""

from __future__ import annotations

import inspect
import math
import weakref
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import all_gather, all_reduce, get_tp
from engine.kernels import batch_invariant, cpu_linear
from engine.kernels.activation import silu_and_mul
from engine.kernels.gemv import linear
from engine.kernels.norm import rms_norm
from engine.kernels.rotary import rotary_embedding

# ---------------------------------------------------------------------------------------
# Weight loading: every parameter carries `weight_loader(param, loaded_weight[, shard_id])`,
# so checkpoint loading and weight sync land tensors the same way. A loader always takes the
# FULL HF tensor; under tensor parallelism it copies out the slice this rank holds.


@dataclass(frozen=True)
class HFPart:
    """Where one HF tensor lands in a parameter on this rank.

    Rows [offset, offset + rows) of the parameter (dim 0; rows None: the whole parameter) hold
    full.narrow(dim, start, size) of the HF tensor, whose shape is full_shape. dim None: the rank
    holds the whole tensor (a replicated weight, or no tensor parallelism).

    A stacked parameter (the experts of a MoE layer, [num_experts, ...]) holds one HF tensor per
    entry of its dim 0: `index` picks that entry first, and offset/rows then count rows of the
    entry. Such a part also says its HF name relative to the parameter's module (`name`, e.g.
    "3.gate_proj.weight"), because it cannot be derived from the parameter's own name.
    """

    full_shape: tuple[int, ...]
    offset: int = 0
    rows: int | None = None
    dim: int | None = None
    start: int = 0
    size: int = 0
    index: int | None = None
    name: str | None = None

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of this rank's slice (== full_shape when dim is None)."""
        if self.dim is None:
            return self.full_shape
        return tuple(self.size if d == self.dim else n for d, n in enumerate(self.full_shape))

    def local_view(self, data: torch.Tensor) -> torch.Tensor:
        """The part of a parameter's data this HF tensor lands in."""
        if self.index is not None:
            data = data.select(0, self.index)
        return data if self.rows is None else data.narrow(0, self.offset, self.rows)

    def slice_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full HF tensor (a view)."""
        return full if self.dim is None else full.narrow(self.dim, self.start, self.size)


def make_part(
    full_shape: tuple[int, ...], dim: int | None = None, start: int = 0, size: int | None = None,
    offset: int = 0, rows: int | None = None, index: int | None = None, name: str | None = None,
) -> HFPart:
    """An HFPart; a "slice" that covers the whole dimension is stored as dim None (nothing to cut)."""
    full_shape = tuple(int(n) for n in full_shape)
    if dim is not None:
        size = full_shape[dim] if size is None else size
        if start == 0 and size == full_shape[dim]:
            dim, size = None, 0
    return HFPart(full_shape, offset, rows, dim, start if dim is not None else 0, size if dim is not None else 0,
                  index, name)


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    """Copies a whole tensor into `param` after checking the shape."""
    if param.shape != loaded_weight.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)}, loaded {tuple(loaded_weight.shape)}")
    param.data.copy_(loaded_weight)


def load_part(param: nn.Parameter, part: HFPart, loaded_weight: torch.Tensor) -> None:
    """Copies this rank's slice of a full HF tensor into its place in `param` (shape checked against the full tensor)."""
    if tuple(loaded_weight.shape) != part.full_shape:
        raise ValueError(f"shape mismatch: expected {tuple(part.full_shape)}, loaded {tuple(loaded_weight.shape)}")
    part.local_view(param.data).copy_(part.slice_of(loaded_weight))


def hf_parts_of(param: nn.Parameter) -> tuple[HFPart, ...]:
    """The HF tensors a parameter holds, in packed-mapping order (one for an unfused parameter).

    Parameters that do not say (norms, anything outside this file) hold one whole, replicated tensor.
    """
    parts = getattr(param, "hf_parts", None)
    return parts if parts is not None else (make_part(tuple(param.shape)),)


def sharded_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    """The loader of an unfused parameter: its one HF tensor's slice for this rank."""
    load_part(param, hf_parts_of(param)[0], loaded_weight)


def _new_param(*shape: int, loader=default_weight_loader, fill: float = 0.0, parts: tuple[HFPart, ...] | None = None) -> nn.Parameter:
    param = nn.Parameter(torch.full(shape, fill), requires_grad=False)
    param.weight_loader = _weak_loader(loader) if inspect.ismethod(loader) else loader
    if parts is not None:
        param.hf_parts = parts
    return param


def _weak_loader(method):
    """A module's bound weight_loader as its parameter's loader, without holding the module: the bound method
    itself would make module -> parameter -> method -> module a cycle, which only the cyclic collector
    frees, so a dropped model's fused weights would stay in memory until it ran."""
    method_ref = weakref.WeakMethod(method)

    def loader(*args, **kwargs):
        bound = method_ref()
        if bound is None:
            raise RuntimeError("weight_loader: the module that owns this parameter is gone")
        return bound(*args, **kwargs)

    return loader


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
# Tensor-parallel linear layers and embeddings. Each reads get_tp() once, when it is built,
# and sizes its parameters to this rank's shard; with one rank every layer is the plain one
# (same parameter names and shapes, same numerics).
#
#   column parallel (W: [out, in]):  rank r holds rows    [r*out/tp, (r+1)*out/tp)  -> local outputs
#   row parallel    (W: [out, in]):  rank r holds columns [r*in/tp,  (r+1)*in/tp)   -> partial sums, all_reduce


def divide(numerator: int, denominator: int, what: str) -> int:
    """numerator / denominator, or a ValueError naming `what` when it does not divide."""
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b) with the output dim split across ranks: each rank returns its slice of y.

    `output_sizes` are the full sizes of the outputs fused along dim 0 (one entry: a plain linear);
    `shard_ranges` says, per output, which (start, size) of its rows this rank holds (default:
    an even split). The parameter is the concatenation of the local slices, in order.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 shard_ranges: list[tuple[int, int]] | None = None):
        super().__init__()
        tp = get_tp()
        self.output_sizes = list(output_sizes)
        if shard_ranges is None:
            shard_ranges = []
            for i, n in enumerate(self.output_sizes):
                local = divide(n, tp.size, f"output size {i} of a column-parallel linear")
                shard_ranges.append((tp.rank * local, local))
        self.shard_ranges = list(shard_ranges)
        self.local_sizes = [size for _, size in self.shard_ranges]
        self.input_size, self.output_size = input_size, sum(self.local_sizes)
        offsets = [sum(self.local_sizes[:i]) for i in range(len(self.local_sizes))]

        def parts(*tail: int) -> tuple[HFPart, ...]:
            fused = len(self.output_sizes) > 1
            return tuple(
                make_part((n, *tail), 0, start, size, offset=offset if fused else 0, rows=size if fused else None)
                for n, (start, size), offset in zip(self.output_sizes, self.shard_ranges, offsets)
            )

        self.weight = _new_param(self.output_size, input_size, loader=self.weight_loader, parts=parts(input_size))
        self.bias = _new_param(self.output_size, loader=self.weight_loader, parts=parts()) if bias else None
        self.lora = None  # an engine/lora/layers.LoRALinear when LoRA serving is on: adds each token's adapter delta

    def _shard_index(self, shard_id: int | str | None) -> int:
        if shard_id is None:
            if len(self.output_sizes) != 1:
                raise ValueError(f"a shard id is needed for a parameter fusing {len(self.output_sizes)} tensors")
            return 0
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id {shard_id!r} out of range for {len(self.output_sizes)} shards")
        return shard_id

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | str | None = None) -> None:
        load_part(param, param.hf_parts[self._shard_index(shard_id)], loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, local out]
        y = linear(x, self.weight, self.bias)
        return y if self.lora is None else self.lora(x, y)


class MergedLinear(ColumnParallelLinear):
    """Several column-parallel linears over the same input, fused along the output dim (e.g. gate/up); shard_id is the index.

    Each rank holds its slice of every output: [gate_r | up_r], so the activation stays local.
    """


class QKVLinear(ColumnParallelLinear):
    """Fused q/k/v projection, split by heads: output rows are [q (Hq/tp*D) | k (Hkv_local*D) | v (Hkv_local*D)];
    shard_id "q"|"k"|"v" (or 0|1|2).

    Query heads are split evenly across ranks. KV heads are split too when there are at least as
    many as ranks; with fewer, each rank holds the one KV head its query heads read (replicated
    on tp / num_kv_heads ranks).
    """

    _SHARDS = ("q", "k", "v")

    def __init__(self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        tp = get_tp()
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads
        self.num_heads = divide(num_heads, tp.size, "num_attention_heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads = divide(num_kv_heads, tp.size, "num_key_value_heads")
            first_kv_head = tp.rank * self.num_kv_heads
        else:
            if tp.size % num_kv_heads != 0:
                raise ValueError(
                    f"num_key_value_heads ({num_kv_heads}) is smaller than tensor_parallel_size ({tp.size}) "
                    "and does not divide it, so KV heads cannot be replicated evenly"
                )
            self.num_kv_heads = 1
            first_kv_head = tp.rank // (tp.size // num_kv_heads)
        self.head_size = head_size
        self.q_size = self.num_heads * head_size  # per rank
        self.kv_size = self.num_kv_heads * head_size
        q_range = (tp.rank * self.q_size, self.q_size)
        kv_range = (first_kv_head * head_size, self.kv_size)
        super().__init__(
            hidden_size, [num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size], bias,
            shard_ranges=[q_range, kv_range, kv_range],
        )

    def _shard_index(self, shard_id: int | str | None) -> int:
        if isinstance(shard_id, str):
            if shard_id not in self._SHARDS:
                raise ValueError(f"shard_id {shard_id!r} is not one of {self._SHARDS}")
            return self._SHARDS.index(shard_id)
        return super()._shard_index(shard_id)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with the input dim split across ranks: x is this rank's slice, the partial
    products are summed over ranks (all_reduce) and the bias is added once, after the sum."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        tp = get_tp()
        self.tp_size = tp.size
        local = divide(input_size, tp.size, "input size of a row-parallel linear")
        self.input_size, self.output_size = local, output_size
        weight_part = make_part((output_size, input_size), 1, tp.rank * local, local)
        self.weight = _new_param(output_size, local, loader=sharded_weight_loader, parts=(weight_part,))
        self.bias = _new_param(output_size, loader=sharded_weight_loader) if bias else None  # replicated
        self.lora = None  # an engine/lora/layers.LoRALinear when LoRA serving is on: adds each token's adapter delta

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in / tp] -> [T, out]
        if self.tp_size == 1:
            out = linear(x, self.weight, self.bias)  # exactly the unsharded op
        else:
            out = all_reduce(linear(x, self.weight))
            out = out if self.bias is None else out + self.bias
        return out if self.lora is None else self.lora(x, out)


def _vocab_parallel_weight(num_embeddings: int, embedding_dim: int) -> tuple[nn.Parameter, int, int]:
    """This rank's rows of a [vocab, dim] table split by vocabulary: (parameter, vocab_start, vocab_end).

    The vocab is padded to a multiple of tp, so every rank's parameter has the same shape:

        vocab 10, tp 4:  rank 0 ids [0, 3)  rank 1 [3, 6)  rank 2 [6, 9)  rank 3 [9, 10) + 2 padding rows

    Padding rows are never looked up and their logits are dropped.
    """
    tp = get_tp()
    per_rank = -(-num_embeddings // tp.size)
    start = min(tp.rank * per_rank, num_embeddings)
    end = min(start + per_rank, num_embeddings)
    part = make_part((num_embeddings, embedding_dim), 0, start, end - start,
                     rows=None if end - start == per_rank else end - start)
    return _new_param(per_rank, embedding_dim, loader=sharded_weight_loader, parts=(part,)), start, end


class VocabEmbedding(nn.Module):
    """Token embedding table, split by vocabulary across ranks (see _vocab_parallel_weight).

    Each rank embeds the ids in its range and zeros the others; the all_reduce then sums the one
    non-zero row each token has.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_size = get_tp().size
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight, self.vocab_start, self.vocab_end = _vocab_parallel_weight(num_embeddings, embedding_dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, dim]
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)  # [T]
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)  # [T, dim]
        return all_reduce(out)


class LMHead(nn.Module):
    """Projects hidden states to vocabulary logits; shares the embedding's parameter when tied.

    Split by vocabulary like VocabEmbedding: each rank computes the logits of its rows and an
    all_gather gives every rank the full [N, vocab] logits (padding dropped), so every rank
    samples the same tokens. On GPU the logits stay in the weight's dtype (bf16): the sampler
    upcasts in registers or in the one float32 copy it makes, so a float32 [N, vocab] pass here
    would be written and read for nothing; GPU callers that need float32 math upcast themselves.
    On CPU they are float32 and contiguous, as the reference path has always had them.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tied_embedding: VocabEmbedding | None = None):
        super().__init__()
        self.tp_size = get_tp().size
        self.num_embeddings = num_embeddings
        if tied_embedding is not None:
            if tied_embedding.num_embeddings != num_embeddings:
                raise ValueError(
                    f"tie_word_embeddings: the embedding has {tied_embedding.num_embeddings} rows, the LM head {num_embeddings}"
                )
            self.weight = tied_embedding.weight  # same Parameter: one copy, one loader, the same vocab range
        else:
            self.weight, _, _ = _vocab_parallel_weight(num_embeddings, embedding_dim)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, dim] -> [N, vocab]; see the class docstring for dtype
        if batch_invariant.applies(hidden, self.weight):
            logits = batch_invariant.linear_invariant(hidden, self.weight)  # [N, padded vocab / tp]
        elif cpu_linear.applies(hidden):
            logits = cpu_linear.linear(hidden, self.weight)
        else:
            logits = F.linear(hidden, self.weight)  # [N, padded vocab / tp]
        on_gpu = logits.is_cuda
        if not on_gpu:
            logits = logits.float()  # no copy for a float32 model
        if self.tp_size == 1:
            return logits
        logits = all_gather(logits, dim=-1)  # [N, padded vocab], in rank (= vocab) order
        if logits.shape[-1] != self.num_embeddings:
            # On GPU a view without the padding columns: rows keep the padded stride, which
            # every GPU consumer (torch ops, the sampling kernel) accepts, so no copy.
            logits = logits[:, : self.num_embeddings]
            if not on_gpu:
                logits = logits.contiguous()
        return logits


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
