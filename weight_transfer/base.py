"""The engine-side WeightTransferEngine interface and the lazy registry of backends by name.

A backend moves HF-named tensors from a trainer into one engine worker. The worker
(engine/worker/weight_update.py) drives it through one lifecycle:

    parse_init_info -> init_transfer            once, when the transfer engine is created
    start_update                                 once per weight update
    parse_update_info -> receive_weights         once per update_weights call (any number)
    finish_update                                once per weight update
    shutdown                                     when the transfer engine goes away

parse_update_info returns the names, dtypes and shapes the call will deliver, so the worker
can reject a bad update before a single byte moves; receive_weights then yields the tensors.
Backends never touch model parameters: the worker validates everything a call delivered and
only then lands it through the model's weight loaders.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class WeightUpdateInfo:
    """What one update_weights call will deliver: per tensor its HF name, dtype and shape (same order)."""

    names: list[str]
    dtypes: list[torch.dtype]
    shapes: list[tuple[int, ...]]
    # Backend-specific extras (e.g. the decoded tensors of the local backend, a packing plan).
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (len(self.names) == len(self.dtypes) == len(self.shapes)):
            raise ValueError(
                f"update_info: {len(self.names)} names, {len(self.dtypes)} dtypes and "
                f"{len(self.shapes)} shapes; they must have the same length"
            )


class WeightTransferEngine(ABC):
    """Engine side of one transfer backend, owned by a worker for the device it serves."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @abstractmethod
    def parse_init_info(self, init_info: dict) -> Any:
        """Checks and decodes init_info (as sent by a client); raises ValueError naming a bad field."""

    @abstractmethod
    def init_transfer(self, init_info: Any) -> None:
        """Sets the transport up (join a process group, open a handle, ...) with parsed init info."""

    def start_update(self) -> None:
        """Called once before the update_weights calls of one update."""

    @abstractmethod
    def parse_update_info(self, update_info: dict) -> WeightUpdateInfo:
        """Checks and decodes update_info; raises ValueError naming a bad field. Moves no weights."""

    @abstractmethod
    def receive_weights(self, info: WeightUpdateInfo) -> Iterable[tuple[str, torch.Tensor]]:
        """Yields the (hf_name, tensor) pairs that `info` announced, on any device and in any dtype."""

    def finish_update(self) -> None:
        """Called once after the last update_weights call of one update."""

    def shutdown(self) -> None:
        """Releases the transport; the object is not used afterwards."""


# ---------------------------------------------------------------------------------------
# Registry: name -> "module:Class", imported on first use so that a backend's dependencies
# (NCCL, Ray, NIXL) load only when someone asks for that backend.

_ENGINE_BACKENDS: dict[str, str | type[WeightTransferEngine]] = {
    "local": "weight_transfer.local:LocalWeightTransferEngine",
}


def register_engine_backend(name: str, target: str | type[WeightTransferEngine]) -> None:
    """Registers (or replaces) backend `name` as a class or a lazy "module:Class" path."""
    if not isinstance(name, str) or not name:
        raise ValueError("backend name must be a non-empty string")
    if isinstance(target, str) and ":" not in target:
        raise ValueError(f"backend {name!r}: target {target!r} must look like 'package.module:ClassName'")
    _ENGINE_BACKENDS[name] = target


def known_engine_backends() -> list[str]:
    return sorted(_ENGINE_BACKENDS)


def get_engine_backend(name: str) -> type[WeightTransferEngine]:
    """The WeightTransferEngine class registered as `name`; ValueError listing the known ones if none is."""
    target = _ENGINE_BACKENDS.get(name) if isinstance(name, str) else None
    if target is None:
        raise ValueError(f"backend: unknown weight transfer backend {name!r}; known: {known_engine_backends()}")
    if isinstance(target, str):
        module_name, _, class_name = target.partition(":")
        cls = getattr(importlib.import_module(module_name), class_name)
        if not (isinstance(cls, type) and issubclass(cls, WeightTransferEngine)):
            raise TypeError(f"backend {name!r}: {target} is not a WeightTransferEngine subclass")
        _ENGINE_BACKENDS[name] = target = cls
    return target
