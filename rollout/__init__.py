"""The engine packaged as a rollout worker: `RolloutWorker` (Python API), the HTTP server and the CLI."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollout.worker import RolloutWorker

__all__ = ["RolloutWorker"]


def __getattr__(name: str) -> Any:
    # Lazy, so that `rollout --help` does not load torch and transformers.
    if name == "RolloutWorker":
        from rollout.worker import RolloutWorker

        return RolloutWorker
    raise AttributeError(f"module 'rollout' has no attribute {name!r}")
