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

    def reset_requests(self) -> None:
        """Drops every request's state in the workers (after a failed step)."""
        self.worker.reset_requests()

    # ---- weight updates (one worker: its answer is the answer) ----

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.worker.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self.worker.start_weight_update()

    def update_weights(self, update_info: dict) -> int:
        return self.worker.update_weights(update_info)

    def finish_weight_update(self) -> None:
        self.worker.finish_weight_update()

    def abort_weight_update(self) -> bool:
        return self.worker.abort_weight_update()

    def weights_consistent(self) -> bool:
        return self.worker.weight_updater.consistent

    def shutdown_weight_transfer_engine(self) -> None:
        self.worker.shutdown_weight_transfer_engine()

    def weight_info(self) -> dict:
        return self.worker.weight_info()

    def weight_checker(self, baseline: dict | None = None) -> dict:
        return self.worker.weight_checker(baseline)

    def is_alive(self) -> bool:
        """False once a worker is gone for good (an in-process worker never is)."""
        return True

    # ---- sleep / wake-up (engine/worker/sleep.py) ----

    def sleep(self, level: int) -> None:
        self.worker.sleep(level)

    def wake_up(self, tags: list[str]) -> None:
        self.worker.wake_up(tags)

    def synchronize(self) -> None:
        self.worker.synchronize()

    def shutdown(self) -> None:
        pass
