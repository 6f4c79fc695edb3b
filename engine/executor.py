"""Executors hand a step to the workers; the in-process one calls a single Worker directly."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.core.sched_output import SchedulerOutput
from engine.worker.runner_output import ModelRunnerOutput


class UniProcExecutor:
    """One worker in the engine core's own process."""

    def __init__(self, config: EngineConfig, max_model_len: int) -> None:
        from engine.worker.worker import Worker  # torch enters here, not in engine/core

        self.worker = Worker(config, max_model_len)

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def shutdown(self) -> None:
        pass
