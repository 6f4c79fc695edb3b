"""RolloutWorker as Ray actors on a local cluster: one RayWeightSyncClient updates both; a killed actor is a clear error."""

from __future__ import annotations

import os
import time

import pytest
from safetensors.torch import load_file

from engine.sampling_params import SamplingParams
from engine.tiny_models import make_tiny_checkpoint
from rollout import RolloutWorker
from weight_transfer.clients import RayWeightSyncClient, WeightSyncError

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow  # a Ray cluster and two actors, each loading torch and an engine

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENGINE_ARGS = dict(device="cpu", dtype="float32", max_model_len=256, disable_log_stats=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {
        "PYTHONPATH": REPO_ROOT, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    }})
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def actors(ray_cluster, tiny_checkpoint):
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([{"CPU": 1}, {"CPU": 1}])
    ray.get(pg.ready(), timeout=TIMEOUT_S)
    handles = [
        RolloutWorker.as_ray_actor(tiny_checkpoint("llama"), num_cpus=1, placement_group=pg, bundle_index=i,
                                   ready_timeout_s=300, **ENGINE_ARGS)
        for i in range(2)
    ]
    yield handles
    for actor in handles:
        ray.kill(actor)
    remove_placement_group(pg)


def _greedy(actor, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in ray.get(actor.generate.remote(prompts, GREEDY), timeout=TIMEOUT_S)]


def test_as_ray_actor_refuses_bad_placement_before_starting_anything(ray_cluster, tiny_checkpoint):
    with pytest.raises(ValueError, match="bundle_index"):
        RolloutWorker.as_ray_actor(tiny_checkpoint("llama"), bundle_index=0)
    with pytest.raises(ValueError, match="num_gpus"):
        RolloutWorker.as_ray_actor(tiny_checkpoint("llama"), num_gpus=-1)


def test_one_client_updates_both_actors_then_a_killed_actor_is_a_clear_error(actors, tmp_path):
    from weight_transfer import hf_state_checksums
    from weight_transfer.local import make_update_info

    prompts = ["The quick brown fox", "Once upon a time"]
    before = _greedy(actors[0], prompts)
    assert _greedy(actors[1], prompts) == before
    client = RayWeightSyncClient(actors, timeout=TIMEOUT_S)
    assert client.num_engines() == 2 and client.engine_world_sizes() == [1, 1] and client.get_world_size() == 2

    new = load_file(os.path.join(make_tiny_checkpoint(tmp_path / "seed1", "llama", seed=1), "model.safetensors"))
    client.pause_generation("wait")
    client.init_weight_transfer_engine({"backend": "local"})
    client.start_weight_update()
    client.update_weights(make_update_info(new.items()))
    client.finish_weight_update("v1")
    client.resume_generation()
    assert client.get_weight_version() == "v1"
    baseline = hf_state_checksums(new)
    for actor in actors:  # each engine, not only the first answer
        assert ray.get(actor.weight_checker.remote(baseline), timeout=TIMEOUT_S)["match"] is True
        assert ray.get(actor.get_weight_version.remote(), timeout=TIMEOUT_S) == "v1"
    after = _greedy(actors[1], prompts)
    assert after != before and _greedy(actors[0], prompts) == after

    # Engines that disagree are an error, not an arbitrary answer.
    ray.get(actors[1].update_weight_version.remote("stray"), timeout=TIMEOUT_S)
    with pytest.raises(WeightSyncError, match="disagree"):
        client.get_weight_version()

    # A failing call names the actor it failed on (the first failure to arrive).
    with pytest.raises(WeightSyncError, match=r"pause_generation: engine actor [01]: mode"):
        client.pause_generation("later")

    ray.kill(actors[1])
    # ray.kill is asynchronous: a call that reaches the actor before it is gone still answers.
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        try:
            ray.get(actors[1].get_weight_version.remote(), timeout=TIMEOUT_S)
        except ray.exceptions.RayActorError:
            break
        assert time.monotonic() < deadline, "the killed actor kept answering"
        time.sleep(0.1)
    with pytest.raises(WeightSyncError, match=r"get_weight_version: engine actor 1 of 2 is dead"):
        client.get_weight_version()
    with pytest.raises(WeightSyncError, match="engine actor 1 of 2 is dead"):
        client.start_weight_update()
    # The live actor answered every call and still serves.
    assert ray.get(actors[0].abort_weight_update.remote(), timeout=TIMEOUT_S) is True
    assert _greedy(actors[0], prompts) == after
