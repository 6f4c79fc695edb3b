"""Executors hand the engine core's calls to its workers: in this process (uni), one process per rank (mp), or Ray actors (ray)."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.executor.base import Executor, WorkerDiedError
from engine.executor.multiproc import MultiprocExecutor
from engine.executor.ray_executor import RayExecutor  # imports ray only when one is built
from engine.executor.uniproc import UniProcExecutor


def get_executor_class(config: EngineConfig) -> type[Executor]:
    """The executor for ParallelConfig.executor_backend (uni, mp or ray; None means uni for one rank, mp for more)."""
    executors: dict[str, type[Executor]] = {"uni": UniProcExecutor, "mp": MultiprocExecutor, "ray": RayExecutor}
    backend = config.parallel.executor_backend
    if backend not in executors:
        raise ValueError(f"distributed_executor_backend: unknown backend {backend!r}; expected uni, mp or ray")
    return executors[backend]


__all__ = ["Executor", "MultiprocExecutor", "RayExecutor", "UniProcExecutor", "WorkerDiedError", "get_executor_class"]
