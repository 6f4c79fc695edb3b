"""Who drives an engine (EngineConfig.usage_context, vLLM's UsageContext): the server, a rollout worker, an LLM.

On a GPU it picks the default step budget (engine/core/scheduler.py default_max_num_batched_tokens); here the
entry points are checked to say who they are, and an explicit usage_context to win.
"""

from __future__ import annotations

import pytest

from engine.async_llm import AsyncLLM
from rollout import cli
from rollout.worker import RolloutWorker


def test_the_server_starts_its_engines_as_an_api_server(monkeypatch):
    """rollout launch's engine (one AsyncLLM, or a RolloutGroup's): usage_context api_server (vLLM's server: 8192
    tokens a step on an H100/H200-class GPU)."""
    seen = {}

    def capture(**kwargs):
        seen.update(kwargs)
        return "engine"

    monkeypatch.setattr(AsyncLLM, "from_engine_args", staticmethod(capture))
    assert cli._start_engine({"model": "m"}, "served", 1) == "engine"
    assert seen["usage_context"] == "api_server" and seen["model"] == "m"
    seen.clear()
    cli._start_engine({"model": "m", "usage_context": "engine"}, "served", 1)  # an explicit one is kept
    assert seen["usage_context"] == "engine"


@pytest.mark.parametrize("usage", [None, "engine"])
def test_a_rollout_worker_is_an_llm_class_engine_unless_told(tiny_checkpoint, usage):
    kwargs = {} if usage is None else {"usage_context": usage}
    worker = RolloutWorker(model=tiny_checkpoint("llama"), multiprocess=False, device="cpu", max_model_len=64,
                           num_gpu_blocks_override=16, **kwargs)
    try:
        assert worker.config.usage_context == (usage or "llm_class")
    finally:
        worker.shutdown()
