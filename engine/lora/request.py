"""LoRARequest: which adapter a request runs with, in vLLM's names; it crosses ZMQ inside EngineCoreRequest."""

from __future__ import annotations

from typing import Any

import msgspec

from engine.sampling_params import INT64_MAX


class LoRARequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A PEFT adapter directory and the id the engine knows it by (vLLM's LoRARequest(lora_name, lora_int_id, lora_path)).

    The id is the adapter's identity: an engine holds one adapter per id, and the same id must always
    name the same directory (ValueError otherwise, until remove_lora(id)).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name: expected a non-empty string, got {self.lora_name!r}")
        if type(self.lora_int_id) is not int or not 0 < self.lora_int_id <= INT64_MAX:
            raise ValueError(f"lora_int_id: expected an int in [1, 2**63 - 1] (0 means no adapter), got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path: expected a non-empty string (a PEFT adapter directory), got {self.lora_path!r}")

    # vLLM's aliases.
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


def lora_request_of(value: Any) -> LoRARequest:
    """A LoRARequest from itself, its dict (what a utility call over ZMQ delivers), or anything with
    vLLM's attributes lora_name / lora_int_id / lora_path; ValueError naming what is wrong."""
    if isinstance(value, LoRARequest):
        return value
    if isinstance(value, dict):
        try:
            return msgspec.convert(value, LoRARequest)
        except msgspec.ValidationError as e:
            raise ValueError(f"lora_request: {e}") from None
    if all(hasattr(value, name) for name in ("lora_name", "lora_int_id", "lora_path")):
        return LoRARequest(value.lora_name, value.lora_int_id, value.lora_path)
    raise ValueError(f"lora_request: expected a LoRARequest(lora_name, lora_int_id, lora_path), got {type(value).__name__}")


def split_lora_name(update_info: Any) -> tuple[str | None, Any]:
    """(the adapter a weight update call is for, update_info without "lora_name"): update_info is a dict, or
    vLLM's list of one dict per worker, whose entries must all name the same adapter or none. A value that is
    neither passes through unchanged (the backend says what is wrong with it). ValueError for a bad name."""
    entries = update_info if isinstance(update_info, list) else [update_info]
    if not all(isinstance(entry, dict) for entry in entries):
        return None, update_info
    names = [entry.get("lora_name") for entry in entries]
    if all(name is None for name in names):
        return None, update_info
    if len(set(names)) > 1:
        raise ValueError(f"update_info.lora_name: every worker's entry must name the same adapter, got {names}")
    name = names[0]
    if not isinstance(name, str) or not name:
        raise ValueError(f"update_info.lora_name: expected an adapter's lora_name (a non-empty string), got {name!r}")
    rest = [{k: v for k, v in entry.items() if k != "lora_name"} for entry in entries]
    return name, rest if isinstance(update_info, list) else rest[0]
