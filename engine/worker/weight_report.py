"""What a worker reports about one model's weights: weight_info entries, checksums and the weight_checker report, as msgspec Structs turned into plain dicts at the edge."""

from __future__ import annotations

import msgspec

from engine.models.hf_layout import HFSlot, dtype_name
from weight_transfer.checksums import Shard, compare_checksums, tensor_checksum


class WeightInfoEntry(msgspec.Struct):
    """One weight in weight_info(): the full HF tensor's shape, the engine's dtype, this rank's slice (None: all of it)."""

    shape: list[int]
    dtype: str  # e.g. "bfloat16"
    shard: Shard | None  # the message a trainer's hf_state_checksums(shards=...) parses it with


class WeightCheckerReport(msgspec.Struct, omit_defaults=True):
    """weight_checker(): this rank's checksums, and with a baseline how they compare (compare_checksums' wording)."""

    checksums: dict[str, str]  # {hf_name: sha256 hex} (weight_transfer.checksums.tensor_checksum)
    # Present only when compared with a baseline:
    match: bool | None = None
    mismatches: list[str] | None = None
    missing: list[str] | None = None
    unexpected: list[str] | None = None


def weight_info(layout: dict[str, HFSlot]) -> dict[str, dict]:
    """{hf_name: {"shape", "dtype", "shard"}} (WeightInfoEntry) for every weight in `layout`."""
    entries = {
        name: WeightInfoEntry(list(slot.shape), dtype_name(slot.param.dtype),
                              None if slot.shard_dim is None else Shard(slot.shard_dim, slot.shard_start, slot.shard_size))
        for name, slot in layout.items()
    }
    return msgspec.to_builtins(entries)


def checksums(layout: dict[str, HFSlot]) -> dict[str, str]:
    """{hf_name: checksum} of every weight as this rank holds it: fused ones per part, sharded ones of this rank's slice."""
    return {name: tensor_checksum(slot.tensor()) for name, slot in layout.items()}


def weight_checker(layout: dict[str, HFSlot], remote: dict[str, tuple[int, ...]], baseline: object = None,
                   adapters: dict[str, str] | None = None) -> dict:
    """{"checksums": {...}}, plus match/mismatches/missing/unexpected against `baseline` ({hf_name: checksum},
    which compare_checksums parses strictly: ValueError naming what is wrong) when given. Tied aliases
    may be missing from the baseline; experts another EP rank holds (`remote`) are not unexpected in it.

    adapters: the LoRA adapters' checksums ("lora:<lora_name>:<PEFT tensor name>", LoRAManager.checksums),
    reported beside the weights'. A baseline may leave them out (a trainer of the base model knows no adapter);
    one that lists an adapter tensor compares it (one the engine does not hold is unexpected)."""
    sums = checksums(layout)
    optional = [name for name, slot in layout.items() if slot.alias_of is not None]
    if adapters:
        sums.update(adapters)
        optional += list(adapters)
    if baseline is None:
        return msgspec.to_builtins(WeightCheckerReport(sums))
    comparison = compare_checksums(sums, baseline, optional=optional, held_elsewhere=remote)
    return msgspec.to_builtins(WeightCheckerReport(sums, **comparison))
