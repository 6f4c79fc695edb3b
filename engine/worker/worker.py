"""Worker: owns the device, the model and the KV cache tensors, and runs steps through its ModelRunner."""

from __future__ import annotations

import logging

import torch

from engine.attention.layer import Attention
from engine.config import EngineConfig
from engine.core.sched_output import SchedulerOutput
from engine.models.loader import load_hf_config, load_model
from engine.worker.model_runner import ModelRunner
from engine.worker.runner_output import ModelRunnerOutput
from engine.worker.weight_update import WeightUpdater

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# CPU default for the KV cache when no size is given: a few GiB at most.
_CPU_DEFAULT_KV_BYTES = 2 << 30


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def _available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


class Worker:
    def __init__(self, config: EngineConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.device = torch.device(config.device.resolve())
        if self.device.type == "cuda":
            if self.device.index is None:  # set_device needs an index; "cuda" means the current one
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        torch.manual_seed(config.model.seed)

        self.hf_config = load_hf_config(config.model.model)
        self.model = load_model(config.model.model, self.hf_config, self.dtype, self.device, config.model.load_format)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.model_runner = ModelRunner(
            config,
            self.model,
            self.device,
            architecture=self.hf_config.architectures[0],
            vocab_size=self.hf_config.vocab_size,
            max_model_len=max_model_len,
        )
        # Built while the weights are resident: it records their shapes (sleep mode may empty them).
        self.weight_updater = WeightUpdater(self.model, self.device, config.fault_tolerance.weight_update_rollback)

    @property
    def kv_bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        per_token = sum(2 * layer.num_kv_heads * layer.head_size for layer in self.attn_layers)
        return per_token * self.config.cache.block_size * elem

    def determine_num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        if cache.kv_cache_memory_bytes is not None:
            budget = cache.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = int(total * cache.gpu_memory_utilization) - used
        else:
            budget = min(_CPU_DEFAULT_KV_BYTES, _available_host_memory() // 2)
            # More blocks than every sequence at full length could use is wasted memory.
            blocks_per_seq = -(-self.max_model_len // cache.block_size)
            budget = min(budget, 2 * self.config.scheduler.max_num_seqs * blocks_per_seq * self.kv_bytes_per_block)
        num_blocks = budget // self.kv_bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv cache: {budget} bytes hold no block of {self.kv_bytes_per_block} bytes; "
                "raise kv_cache_memory_bytes or gpu_memory_utilization"
            )
        return int(num_blocks)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocates one [2, num_blocks, block_size, kv_heads, head_size] tensor per layer.

        Zero-filled so that never-written slots hold finite values.
        """
        block_size = self.config.cache.block_size
        for layer in self.attn_layers:
            layer.kv_cache = torch.zeros(
                2, num_blocks, block_size, layer.num_kv_heads, layer.head_size,
                dtype=self.dtype, device=self.device,
            )
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB)",
            num_blocks, block_size, num_blocks * self.kv_bytes_per_block / 2**20,
        )
        # Graphs record the KV tensors' addresses, so they are captured after allocation.
        self.model_runner.capture_cuda_graphs()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def reset_requests(self) -> None:
        """Drops every request's state (after a failed step); weights and KV tensors stay."""
        self.model_runner.reset_requests()

    # ---- weight updates: engine/worker/weight_update.py owns the state machine and validation ----

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.weight_updater.init_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self.weight_updater.start_update()

    def update_weights(self, update_info: dict) -> int:
        return self.weight_updater.update_weights(update_info)

    def finish_weight_update(self) -> None:
        self.weight_updater.finish_update()

    def abort_weight_update(self) -> bool:
        return self.weight_updater.abort_update()

    def shutdown_weight_transfer_engine(self) -> None:
        self.weight_updater.shutdown()

    def weight_info(self) -> dict:
        return self.weight_updater.weight_info()

    def weight_checker(self, baseline: dict | None = None) -> dict:
        return self.weight_updater.weight_checker(baseline)

    # ---- sleep / wake-up: engine/worker/sleep.py frees and restores the memory ----

    @property
    def sleeper(self):
        sleeper = self.__dict__.get("_sleeper")
        if sleeper is None:
            from engine.worker.sleep import WorkerSleeper

            sleeper = self._sleeper = WorkerSleeper(self)
        return sleeper

    def sleep(self, level: int) -> None:
        self.sleeper.sleep(level)

    def wake_up(self, tags: list[str]) -> None:
        self.sleeper.wake_up(tags)

    def synchronize(self) -> None:
        """Waits for every queued device operation (a no-op on CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
