"""GRPO with the rollout engine outside the trainer's process: a real `rollout launch` server over HTTP (nccl sync) and a RolloutWorker Ray actor (sharded_rdt sync), plus the config rules that pick them."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest
import torch

from engine import SamplingParams
from trainers.common import single_reward
from trainers.config import LoggingConfig, ModelConfig, OptimConfig, RolloutConfig, TrainerConfig
from trainers.engines import HTTPRolloutEngine, RayRolloutEngine, completion_body, request_output
from trainers.grpo import GRPOTrainer
from trainers.rollouts import generate_rollouts
from weight_transfer import hf_state_checksums

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- config -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"engine": "grpc"}, "rollout.engine"),
        ({"weight_sync": "gloo"}, "rollout.weight_sync"),
        ({"engine": "http"}, "rollout.server_url"),
        ({"engine": "http", "server_url": "127.0.0.1:8000"}, "rollout.server_url"),  # no scheme
        ({"server_url": "http://127.0.0.1:8000"}, "rollout.server_url"),  # inprocess has no server
        ({"engine": "ray", "weight_sync": "ipc"}, "rollout.weight_sync"),
        ({"engine": "http", "server_url": "http://h:1", "weight_sync": "local"}, "rollout.weight_sync"),
        ({"engine": "ray", "colocate": True}, "rollout.colocate"),
        ({"colocate": True, "weight_sync": "nccl"}, "rollout.weight_sync"),
        ({"engine": "http", "server_url": "http://h:1", "multiprocess": True}, "rollout.multiprocess"),
    ],
)
def test_bad_engine_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        RolloutConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, backend",
    [
        ({}, "local"),
        ({"colocate": True}, "ipc"),
        ({"engine": "http", "server_url": "http://127.0.0.1:8000"}, "nccl"),
        ({"engine": "ray"}, "sharded_rdt"),
        ({"engine": "ray", "weight_sync": "nccl"}, "nccl"),
        ({"engine": "http", "server_url": "https://rollout.example:443", "weight_sync": "sharded_rdt"}, "sharded_rdt"),
        ({"weight_sync": "nccl"}, "nccl"),
    ],
)
def test_auto_weight_sync_follows_the_engine(kwargs, backend):
    assert RolloutConfig(**kwargs).weight_sync_backend == backend


# ---- the HTTP adapter's wire format ---------------------------------------------------------------


def test_completion_body_carries_the_sampling_params_and_token_prompts():
    params = SamplingParams(n=4, temperature=0.7, max_tokens=8, logprobs=0, seed=11, stop_token_ids=[2],
                            logit_bias={5: -1.0})
    body = completion_body("m", {"prompt_token_ids": [3, 4, 5]}, params)
    assert body["prompt"] == [3, 4, 5] and body["model"] == "m" and body["return_token_ids"] is True
    assert (body["n"], body["temperature"], body["max_tokens"], body["logprobs"], body["seed"]) == (4, 0.7, 8, 0, 11)
    assert body["stop_token_ids"] == [2] and body["logit_bias"] == {"5": -1.0}  # JSON keys are strings
    assert "output_kind" not in body and "detokenize" not in body
    assert completion_body("m", "text", SamplingParams())["prompt"] == "text"
    assert completion_body("m", "text", SamplingParams(prompt_logprobs=1))["prompt_logprobs"] == 1
    with pytest.raises(ValueError, match="prompt"):
        completion_body("m", {"text": "x"}, SamplingParams())


def test_request_output_rebuilds_tokens_logprobs_and_versions_in_sample_order():
    def choice(index, ids, lps, versions):
        return {"index": index, "text": "t" * len(ids), "finish_reason": "length", "stop_reason": None,
                "prompt_token_ids": [7, 8], "token_ids": ids, "weight_versions": versions,
                "logprobs": {"tokens": ["t"] * len(ids), "token_logprobs": lps, "top_logprobs": [], "text_offset": []}}

    def span(version, start, end):  # vLLM's return_weight_versions shape
        return {"version": version, "start": start, "end": end}

    body = {"id": "cmpl-1", "choices": [choice(1, [9], [-0.5], [span("v1", 0, 1)]),
                                        choice(0, [4, 5], [-1.0, -2.0], [span("v0", 0, 1), span("v1", 1, 2)])]}
    out = request_output(body, "a prompt")
    assert out.prompt_token_ids == [7, 8] and out.finished and out.prompt == "a prompt"
    assert [c.index for c in out.outputs] == [0, 1]
    first = out.outputs[0]
    assert first.token_ids == [4, 5] and [pos[t].logprob for pos, t in zip(first.logprobs, first.token_ids)] == [-1.0, -2.0]
    assert first.cumulative_logprob == -3.0
    assert first.weight_versions == [("v0", 0, 1), ("v1", 1, 2)]
    assert out.prompt_logprobs is None
    with pytest.raises(ValueError, match="return_token_ids"):
        request_output({"id": "x", "choices": [{"index": 0, "text": "", "token_ids": None}]}, "p")
    # Prompt logprobs come keyed by token id as text; they become Logprobs keyed by int.
    with_prompt = choice(0, [4], [-1.0], [])
    with_prompt["prompt_logprobs"] = [None, {"8": {"logprob": -0.25, "rank": 1, "decoded_token": "b"}}]
    out = request_output({"id": "cmpl-2", "choices": [with_prompt]}, [7, 8])
    assert out.prompt_logprobs[0] is None
    assert out.prompt_logprobs[1][8].logprob == -0.25 and out.prompt_logprobs[1][8].rank == 1


# ---- end to end ---------------------------------------------------------------------------------


def make_config(path: str, tmp_path, **rollout) -> TrainerConfig:
    return TrainerConfig(
        model=ModelConfig(path=path),
        rollout=RolloutConfig(num_prompts_per_step=2, num_samples_per_prompt=4, max_tokens=8, max_model_len=128,
                              **rollout),
        optim=OptimConfig(lr=1e-3),
        logging=LoggingConfig(output_dir=str(tmp_path / "run"), save_final=False),
        num_steps=2,
    )


def check_two_steps_then_engine_serves_trainer_weights(trainer, prompts):
    """Two steps leave the engine on step-2 with the trainer's exact weights, scoring samples as the trainer does."""
    worker = trainer.worker
    before = {n: p.full_tensor().clone() for n, p in trainer.policy.model.named_parameters()}
    history = trainer.train(prompts)

    assert worker.get_weight_version() == "step-2"
    for metrics in history:
        assert metrics["mismatch/abs"] < 1e-4  # step 1: initial weights; step 2: the synced step-1 weights
        assert metrics["stale_fraction"] == 0.0 and metrics["num_samples_trained"] == 8
        assert metrics["reward/std"] > 0
    after = {n: p.full_tensor() for n, p in trainer.policy.model.named_parameters()}
    assert all(not torch.equal(before[n], after[n]) for n in before)
    report = worker.weight_checker(hf_state_checksums(after))
    assert report["match"], report
    batch = generate_rollouts(worker, prompts, n=2, max_tokens=8, seed=99)
    assert all(v == {"step-2"} for v in batch.sample_versions())
    with torch.no_grad():
        logprobs, _ = trainer.policy.response_logprobs(batch.input_ids, batch.prompt_lens, batch.response_ids)
    delta = ((logprobs - batch.rollout_logprobs).abs() * batch.response_mask).sum() / batch.response_mask.sum()
    assert float(delta) < 1e-4
    # The async form (what rollout.async_mode's producer awaits) gives the same seeded samples.
    params = SamplingParams(n=2, max_tokens=8, logprobs=0, seed=5)
    [sync_out] = worker.generate([prompts[0]], params, use_tqdm=False)
    async_out = asyncio.run(worker.agenerate(prompts[0], params))
    assert [c.token_ids for c in async_out.outputs] == [c.token_ids for c in sync_out.outputs]
    assert async_out.prompt_token_ids == sync_out.prompt_token_ids


@pytest.mark.slow
def test_grpo_against_a_rollout_server_over_http_with_nccl_sync(process_group, launch_server, tiny_checkpoint,
                                                                tmp_path, prompts, vowel_reward):
    path = tiny_checkpoint("llama")
    server = launch_server(path, "--enable-rl-routes", "--logprobs-mode", "processed_logprobs")
    config = make_config(path, tmp_path, engine="http", server_url=server.url)
    with GRPOTrainer(config, single_reward(vowel_reward)) as trainer:
        assert isinstance(trainer.worker, HTTPRolloutEngine)
        assert trainer.sync.backend == "nccl"  # auto's choice for http
        check_two_steps_then_engine_serves_trainer_weights(trainer, prompts)
        scored = trainer.worker.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=1, prompt_logprobs=0))
        assert scored[0].prompt_logprobs[0] is None and len(scored[0].prompt_logprobs) == 3
        assert scored[0].prompt_logprobs[2][7].logprob <= 0.0  # the prompt token's own logprob, by id
    # The server itself, asked directly, serves step-2 and keeps serving after the trainer is gone.
    assert httpx.get(server.url + "/weight_info").json()["weight_version"] == "step-2"
    r = httpx.post(server.url + "/v1/completions", json={"model": server.served_model, "prompt": "Hi", "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster (2 CPUs, no dashboard) shared by this module's Ray tests; its workers import this repository."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {
        "PYTHONPATH": REPO_ROOT, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    }})
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("weight_sync, backend", [("auto", "sharded_rdt"), ("nccl", "nccl")])
def test_grpo_with_a_ray_actor_engine(weight_sync, backend, process_group, ray_cluster, tiny_checkpoint, tmp_path,
                                      prompts, vowel_reward):
    if backend == "sharded_rdt":
        pytest.importorskip("nixl_cu12")
    path = tiny_checkpoint("llama")
    config = make_config(path, tmp_path, engine="ray", weight_sync=weight_sync)
    with GRPOTrainer(config, single_reward(vowel_reward)) as trainer:
        assert isinstance(trainer.worker, RayRolloutEngine)
        assert trainer.sync.backend == backend
        check_two_steps_then_engine_serves_trainer_weights(trainer, prompts)
        actor = trainer.worker.actor
    # The trainer started the actor, so closing it ended the actor too.
    with pytest.raises(ray_cluster.exceptions.RayActorError):
        ray_cluster.get(actor.get_weight_version.remote(), timeout=60)
