"""UniProcExecutor: one Worker in the engine core's own process, called directly."""

from __future__ import annotations

import os
from typing import Any

from engine.config import EngineConfig
from engine.executor.base import Executor


class UniProcExecutor(Executor):
    """One worker (tensor_parallel_size 1) in this process; its exceptions propagate unchanged."""

    def __init__(self, config: EngineConfig, max_model_len: int) -> None:
        super().__init__(config, max_model_len)
        if self.world_size != 1:
            raise ValueError(
                f"UniProcExecutor runs one worker; tensor_parallel_size={self.world_size} needs the mp or ray backend"
            )
        from engine.worker.worker import Worker  # torch enters here, not in engine/core

        self.worker = Worker(config, max_model_len)
        self.worker_pids = [os.getpid()]

    supports_async_steps = True

    def launch_model(self, scheduler_output):
        return self.worker.model_runner.launch_step(scheduler_output)

    def finish_model(self, handle):
        return self.worker.model_runner.finish_step(handle)

    def collective_rpc(
        self, method: str, args: tuple = (), kwargs: dict | None = None, unique_reply_rank: int | None = None
    ) -> list[Any]:
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def is_alive(self) -> bool:
        return True  # an in-process worker cannot die without the engine

    def shutdown(self) -> None:
        self.worker.shutdown()  # leaves its groups (an expert-parallel one; tensor parallelism is size 1 here)
