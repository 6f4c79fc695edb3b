"""Test helpers for weight sync over Ray: a local Ray cluster per test module, RolloutWorker engines as Ray actors."""

from __future__ import annotations

import os

import pytest
from weight_helpers import MAX_TOKENS, PROMPTS

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENGINE_ARGS = dict(device="cpu", dtype="float32", max_model_len=256, disable_log_stats=True)


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster (2 CPUs, no dashboard) for one test module; its workers import this repository."""
    import ray

    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={
            "env_vars": {
                "PYTHONPATH": os.pathsep.join([REPO_ROOT, os.path.join(REPO_ROOT, "tests", "weights")]),
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


def start_engine(model_path: str, **engine_args):
    """A RolloutWorker (engine in the actor's own process, multiprocess=False) as a Ray actor; waits until it serves."""
    import ray

    from rollout.worker import RolloutWorker

    actor = ray.remote(RolloutWorker).options(num_cpus=1).remote(model_path, multiprocess=False,
                                                                 **{**ENGINE_ARGS, **engine_args})
    ray.get(actor.get_world_size.remote(), timeout=300)
    return actor


def engine_greedy(actor, prompts=PROMPTS, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """Greedy token ids of an engine actor for token-id prompts (ignore_eos, like weight_helpers.hf_greedy)."""
    import ray

    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = ray.get(actor.generate.remote([{"prompt_token_ids": p} for p in prompts], params), timeout=300)
    return [list(o.outputs[0].token_ids) for o in outputs]


def stop_engine(actor) -> None:
    """Shuts an engine actor down and ends its process (it may be dead already)."""
    import ray

    try:
        ray.get(actor.shutdown.remote(), timeout=60)
    except Exception:  # already gone (a test killed it)
        pass
    ray.kill(actor)
