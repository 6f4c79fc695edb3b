"""Per-tensor checksums in HF naming, computed the same way by the trainer (baseline) and the engine (checker).

A checksum is the sha256 hex digest of "dtype|shape|" followed by the tensor's raw bytes after
`.contiguous().cpu()`: exact (one flipped bit shows), independent of memory layout and device,
but dependent on dtype. So a trainer holding float32 master weights for a bfloat16 engine
passes `dtype=torch.bfloat16` (the engine's dtype, see EngineCore.weight_info()): the cast
rounds exactly as the engine's loader did when it copied the tensor in. Under tensor
parallelism each engine rank checksums the slice it holds; hf_state_checksums(state,
shards=<that rank's weight_info()>) cuts the full tensors the same way.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import torch

from weight_transfer.messages import Message, NonNegInt, parse_message

# Not weights: recomputed by every implementation, absent from the engine.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def tensor_checksum(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> str:
    t = tensor.detach()
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    t = t.contiguous().cpu()
    digest = hashlib.sha256(f"{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}|".encode())
    digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def hf_state_checksums(
    state_dict: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype | None = None,
    shards: Mapping[str, Mapping] | None = None,
) -> dict[str, str]:
    """{hf_name: checksum} of an HF model's state_dict (or (name, tensor) pairs), cast to `dtype` first if given.

    shards: one engine rank's weight_info() ({hf_name: {"shard": {"dim", "start", "size"} or None, ...}});
    each tensor is then cut to the slice that rank holds, giving the checksums that rank's
    weight_checker() reports under tensor parallelism. Names it does not list are kept whole.
    """
    items = state_dict.items() if isinstance(state_dict, Mapping) else state_dict
    if shards is not None and not isinstance(shards, Mapping):
        raise ValueError(f"shards: expected a rank's weight_info() {{hf_name: {{'shard': ...}}}}, got {type(shards).__name__}")
    out = {}
    for name, t in items:
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if shards is not None and name in shards:
            t = shard_of(t, shards[name], name)
        out[name] = tensor_checksum(t, dtype)
    return out


LORA_CHECKSUM_PREFIX = "lora:"  # no HF parameter name has a colon: adapter entries never clash with the model's


def lora_checksum_name(lora_name: str, tensor_name: str) -> str:
    """The key of an adapter tensor in weight_checker's checksums: "lora:<lora_name>:<PEFT tensor name>"."""
    return f"{LORA_CHECKSUM_PREFIX}{lora_name}:{tensor_name}"


def lora_state_checksums(lora_name: str, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """The checksums an engine's weight_checker reports for adapter `lora_name` holding these PEFT-named tensors
    (weight_transfer.lora.adapter_source yields them): of float32 copies, the dtype the engine keeps adapters
    in (a bfloat16 tensor widens exactly). Merge them into a model baseline, or compare them alone."""
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    return {lora_checksum_name(lora_name, name): tensor_checksum(t, torch.float32) for name, t in items}


class Shard(Message):
    """A weight_info() entry's "shard": the rows start .. start + size - 1 along dim of the full tensor."""

    dim: NonNegInt
    start: NonNegInt
    size: NonNegInt


def shard_of(tensor: torch.Tensor, info: Mapping | None, name: str = "tensor") -> torch.Tensor:
    """The slice of a full tensor that a weight_info() entry's "shard" names (the tensor itself for None)."""
    raw = info.get("shard") if isinstance(info, Mapping) else None
    if raw is None:
        return tensor
    shard = parse_message(raw, Shard, f"shards[{name!r}].shard")
    if shard.dim >= tensor.dim() or shard.start + shard.size > tensor.shape[shard.dim]:
        raise ValueError(
            f"shards[{name!r}].shard: {raw} is outside the tensor of shape {list(tensor.shape)}"
        )
    return tensor.narrow(shard.dim, shard.start, shard.size)


def compare_checksums(
    engine: Mapping[str, str], baseline: Mapping[str, str], optional: Iterable[str] = (),
    held_elsewhere: Iterable[str] = (),
) -> dict:
    """Compares the engine's checksums with a baseline's (torch's load_state_dict wording, the engine as the model).

    mismatches: names in both whose checksums differ; missing: engine weights the baseline lacks
    (except `optional` ones, e.g. a tied lm_head.weight); unexpected: baseline names the engine
    does not have, except `held_elsewhere` ones (under expert parallelism, the experts other ranks
    hold: a trainer's full checksums compare with each engine over the weights it holds).
    match: all three are empty.
    """
    baseline = parse_message(baseline, dict[str, str], "baseline")  # {hf_name: checksum}
    optional, held_elsewhere = set(optional), set(held_elsewhere)
    mismatches = sorted(n for n in engine if n in baseline and baseline[n] != engine[n])
    missing = sorted(n for n in engine if n not in baseline and n not in optional)
    unexpected = sorted(
        n for n in baseline if n not in engine and n not in held_elsewhere and not n.endswith(_IGNORED_SUFFIXES)
    )
    return {
        "match": not (mismatches or missing or unexpected),
        "mismatches": mismatches,
        "missing": missing,
        "unexpected": unexpected,
    }


def engine_weight_digests(model: torch.nn.Module, prefix: str = "") -> dict[str, str]:
    """{prefix + parameter name: sha256 hex of its raw bytes} of an engine's model as it holds it (fused
    layout, this rank's shards): vLLM's compute_weight_checksums digests, with no dtype or shape mixed in."""
    out = {}
    for name, param in model.named_parameters():
        raw = param.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        out[prefix + name] = hashlib.sha256(raw).hexdigest()
    return out


def worker_checksum_prefix(data_parallel_rank: int, tensor_parallel_rank: int) -> str:
    """vLLM's per-worker key prefix "dp<i>:pp<j>:pcp<k>:tp<r>:" (no pipeline or context parallelism here: 0)."""
    return f"dp{data_parallel_rank}:pp0:pcp0:tp{tensor_parallel_rank}:"
