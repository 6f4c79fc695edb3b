"""Per-tensor checksums in HF naming, computed the same way by the trainer (baseline) and the engine (checker).

A checksum is the sha256 hex digest of "dtype|shape|" followed by the tensor's raw bytes after
`.contiguous().cpu()`: exact (one flipped bit shows), independent of memory layout and device,
but dependent on dtype. So a trainer holding float32 master weights for a bfloat16 engine
passes `dtype=torch.bfloat16` (the engine's dtype, see EngineCore.weight_info()): the cast
rounds exactly as the engine's loader did when it copied the tensor in.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import torch

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
) -> dict[str, str]:
    """{hf_name: checksum} of an HF model's state_dict (or (name, tensor) pairs), cast to `dtype` first if given."""
    items = state_dict.items() if isinstance(state_dict, Mapping) else state_dict
    return {name: tensor_checksum(t, dtype) for name, t in items if not name.endswith(_IGNORED_SUFFIXES)}


def compare_checksums(
    engine: Mapping[str, str], baseline: Mapping[str, str], optional: Iterable[str] = ()
) -> dict:
    """Compares the engine's checksums with a baseline's (torch's load_state_dict wording, the engine as the model).

    mismatches: names in both whose checksums differ; missing: engine weights the baseline lacks
    (except `optional` ones, e.g. a tied lm_head.weight); unexpected: baseline names the engine
    does not have. match: all three are empty.
    """
    if not isinstance(baseline, Mapping):
        raise ValueError(f"baseline: expected a dict {{hf_name: checksum}}, got {type(baseline).__name__}")
    optional = set(optional)
    mismatches = sorted(n for n in engine if n in baseline and baseline[n] != engine[n])
    missing = sorted(n for n in engine if n not in baseline and n not in optional)
    unexpected = sorted(n for n in baseline if n not in engine and not n.endswith(_IGNORED_SUFFIXES))
    return {
        "match": not (mismatches or missing or unexpected),
        "mismatches": mismatches,
        "missing": missing,
        "unexpected": unexpected,
    }
