"""EngineArgs: the flat, vLLM-named engine arguments, turned into a validated EngineConfig."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import (
    CacheConfig,
    DeviceConfig,
    DTypeName,
    EngineConfig,
    LogprobsMode,
    ModelConfig,
    SchedulerConfig,
    SchedulingPolicy,
)


@dataclass
class EngineArgs:
    model: str
    tokenizer: str | None = None
    dtype: DTypeName = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    device: str = "auto"
    logprobs_mode: LogprobsMode = "raw_logprobs"
    scheduling_policy: SchedulingPolicy = "fcfs"

    def create_engine_config(self) -> EngineConfig:
        model = ModelConfig(
            model=self.model,
            tokenizer=self.tokenizer,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            seed=self.seed,
            logprobs_mode=self.logprobs_mode,
        )
        hf = model.hf_config_dict()
        limit = hf.get("max_position_embeddings")
        if model.max_model_len is None:
            if limit is None:
                raise ValueError("max_model_len: config.json has no max_position_embeddings; pass max_model_len")
            model.max_model_len = int(limit)
        elif limit is not None and model.max_model_len > limit:
            raise ValueError(
                f"max_model_len: {model.max_model_len} exceeds the model's max_position_embeddings={limit}"
            )
        return EngineConfig(
            model=model,
            cache=CacheConfig(
                block_size=self.block_size,
                enable_prefix_caching=self.enable_prefix_caching,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                gpu_memory_utilization=self.gpu_memory_utilization,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                policy=self.scheduling_policy,
                enable_chunked_prefill=self.enable_chunked_prefill,
            ),
            device=DeviceConfig(device=self.device),
        )
