"""RayExecutor on a local Ray cluster (2 CPUs): TP=1 and TP=2 match the in-process engine, a killed actor is a clear error."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.exceptions import EngineDeadError, WeightUpdateStateError
from engine.executor import RayExecutor

ray = pytest.importorskip("ray")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENGINE_ARGS = dict(device="cpu", dtype="float32", max_model_len=128, disable_log_stats=True)


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster (2 CPUs, no dashboard) for this module; its workers import this repository."""
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={
            "env_vars": {
                "PYTHONPATH": REPO_ROOT,
                "TOKENIZERS_PARALLELISM": "false",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
            }
        },
    )
    try:
        yield ray
    finally:
        ray.shutdown()


def _greedy(llm: LLM) -> list[list[int]]:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 400, n).tolist() for n in (5, 21, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def expected(tiny_checkpoint) -> list[list[int]]:
    uni = LLM(tiny_checkpoint("llama"), **ENGINE_ARGS)
    try:
        return _greedy(uni)
    finally:
        uni.shutdown()


def test_tp1_ray_matches_uni(ray_cluster, tiny_checkpoint, expected):
    llm = LLM(tiny_checkpoint("llama"), distributed_executor_backend="ray", **ENGINE_ARGS)
    try:
        executor = llm.engine_core.executor
        assert isinstance(executor, RayExecutor) and executor.worker_pids[0] != os.getpid()
        assert _greedy(llm) == expected
        with pytest.raises(WeightUpdateStateError) as caught:  # a worker's error keeps its type, names its rank
            llm.engine_core.update_weights({"names": []})
        assert "worker rank 0" in "\n".join(caught.value.__notes__)
        assert executor.is_alive()
    finally:
        llm.shutdown()
    assert not executor.is_alive()
    assert ray.util.placement_group_table() and all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values()
    )


def test_tp2_ray_matches_uni_and_a_killed_actor_is_a_clear_error(ray_cluster, tiny_checkpoint, expected):
    llm = LLM(tiny_checkpoint("llama"), tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE_ARGS)
    try:
        executor = llm.engine_core.executor
        assert len(executor.worker_pids) == 2
        assert _greedy(llm) == expected
        os.kill(executor.worker_pids[1], signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="rank 1"):
            _greedy(llm)
        assert not executor.is_alive()
        with pytest.raises(EngineDeadError, match="rank 1"):  # and every later request
            _greedy(llm)
    finally:
        llm.shutdown()
