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

        if config.device.resolve() == "cpu":
            from engine.executor.cpu_threads import apply_cpu_threads, engine_owns_process

            # Pinned only in the engine's own process: an in-process LLM's process is the caller's.
            apply_cpu_threads(pin=engine_owns_process())
        self.worker = Worker(config, max_model_len)
        self.worker_pids = [os.getpid()]

    supports_async_steps = True

    def launch_model(self, scheduler_output):
        self.check_alive()
        return self.worker.model_runner.launch_step(scheduler_output)

    def finish_model(self, handle):
        self.check_alive()
        return self.worker.model_runner.finish_step(handle)

    def collective_rpc(
        self, method: str, args: tuple = (), kwargs: dict | None = None, unique_reply_rank: int | None = None
    ) -> list[Any]:
        self.check_alive()  # a shut-down worker holds no weights: nothing may run on it
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def is_alive(self) -> bool:
        return self.dead_reason is None  # an in-process worker cannot die without the engine; it is shut down

    def shutdown(self) -> None:
        """Leaves the worker's groups and gives back its device memory (Worker.shutdown); idempotent."""
        if self.dead_reason is None:
            self.dead_reason = "the executor was shut down"
        self.worker.shutdown()
