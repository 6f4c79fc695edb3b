"""The engine packaged as a rollout worker: `RolloutWorker` (Python API, also a Ray actor), `RolloutGroup` (data parallel), the HTTP server and the CLI."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollout.group import RolloutGroup
    from rollout.worker import RolloutWorker

__all__ = ["RolloutGroup", "RolloutWorker"]


def __getattr__(name: str) -> Any:
    # Lazy, so that `rollout --help` does not load torch and transformers.
    if name == "RolloutWorker":
        from rollout.worker import RolloutWorker

        return RolloutWorker
    if name == "RolloutGroup":
        from rollout.group import RolloutGroup

        return RolloutGroup
    raise AttributeError(f"module 'rollout' has no attribute {name!r}")
