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
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        torch.manual_seed(config.model.seed)

        self.hf_config = load_hf_config(config.model.model)
        self.model = load_model(config.model.model, self.hf_config, self.dtype, self.device)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.model_runner = ModelRunner(
            config,
            self.model,
            self.device,
            architecture=self.hf_config.architectures[0],
            vocab_size=self.hf_config.vocab_size,
            max_model_len=max_model_len,
        )

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

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)
