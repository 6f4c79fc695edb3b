"""The worker's kernel warm-up passes (run at GPU start-up) touch no KV cache contents, request state or generator."""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.worker.worker import Worker


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_warm_up_passes_leave_state_alone(tiny_checkpoint, arch):
    cfg = EngineConfig(model=ModelConfig(model=tiny_checkpoint(arch)), device=DeviceConfig("cpu"),
                       cache=CacheConfig(block_size=4),
                       scheduler=SchedulerConfig(max_num_seqs=20, max_num_batched_tokens=64))
    worker = Worker(cfg, max_model_len=96)
    try:
        worker.initialize_kv_cache(64)  # on CPU: no warm-up
        for layer in worker.attn_layers:
            layer.kv_cache.normal_()  # stands for other requests' KV
        before = [layer.kv_cache.clone() for layer in worker.attn_layers]
        gen_state = worker.model_runner.sampler.generator.get_state()
        # Prefill, mixed, and decode sizes 1, 2, 3, 4, 6, 9, 13, 19, 20 (no CUDA graphs on CPU).
        assert worker.run_warm_up_passes() == 11
        assert all(torch.equal(b, layer.kv_cache) for b, layer in zip(before, worker.attn_layers))
        assert torch.equal(gen_state, worker.model_runner.sampler.generator.get_state())
        assert not worker.model_runner.state.req_id_to_slot
    finally:
        worker.shutdown()
