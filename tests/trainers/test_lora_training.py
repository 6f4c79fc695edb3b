"""LoRA training with real parts: GRPO and PPO train a PEFT adapter on the frozen base under FSDP2 (gloo), sync only the adapter into a RolloutWorker, and generate with it."""

from __future__ import annotations

import json
import os

import pytest
import torch

from engine.lora.request import LoRARequest
from engine.sampling_params import SamplingParams
from trainers.common import single_reward
from trainers.config import (
    AlgorithmConfig, LoggingConfig, LoRAConfig, ModelConfig, OptimConfig, RolloutConfig, TrainerConfig,
)
from trainers.grpo import GRPOTrainer
from trainers.lora import AdapterWorker
from trainers.ppo import PPOAlgorithmConfig, PPOTrainer, PPOTrainerConfig
from trainers.rollouts import generate_rollouts
from weight_transfer.checksums import lora_state_checksums
from weight_transfer.lora import adapter_source

LORA = LoRAConfig(rank=8, alpha=16.0, name="policy")


def _rollout() -> RolloutConfig:
    return RolloutConfig(num_prompts_per_step=2, num_samples_per_prompt=4, max_tokens=8, max_model_len=128)


def _common(path: str, tmp_path) -> dict:
    return dict(model=ModelConfig(path=path), rollout=_rollout(), lora=LORA,
                optim=OptimConfig(lr=1e-2, weight_decay=0.0),  # a high rate: B leaves zero visibly in two steps
                logging=LoggingConfig(output_dir=str(tmp_path / "run"), save_final=False), num_steps=2)


def _split_checksums(report: dict) -> tuple[dict, dict]:
    """(the base model's checksums, the adapters' lora:<name>:<tensor> checksums) of a weight_checker report."""
    sums = report["checksums"]
    return ({k: v for k, v in sums.items() if not k.startswith("lora:")},
            {k: v for k, v in sums.items() if k.startswith("lora:")})


def _adapter_tensors(trainer) -> dict[str, torch.Tensor]:
    return dict(adapter_source(trainer.policy.model, LORA.name).iter_full())


def _check_served_adapter(trainer, prompts, version: str) -> None:
    """The engine serves the trainer's adapter bit for bit, under `version`, on the unchanged base; fresh
    samples carry that version and score alike in engine and trainer."""
    worker = trainer.worker
    assert isinstance(worker, AdapterWorker)
    assert worker.get_weight_version() == version
    assert worker.engine.get_weight_version() == "default"  # the base model was never synced
    _, served = _split_checksums(worker.engine.weight_checker())
    assert served == lora_state_checksums(LORA.name, _adapter_tensors(trainer))
    batch = generate_rollouts(worker, prompts, n=2, max_tokens=8, seed=99)
    assert all(v == {version} for v in batch.sample_versions())
    with torch.no_grad():
        logprobs, _ = trainer.policy.response_logprobs(batch.input_ids, batch.prompt_lens, batch.response_ids)
    delta = ((logprobs - batch.rollout_logprobs).abs() * batch.response_mask).sum() / batch.response_mask.sum()
    assert float(delta) < 1e-4


def test_lora_grpo_trains_the_adapter_only_and_syncs_it_into_the_worker(process_group, tiny_checkpoint, tmp_path,
                                                                        prompts, vowel_reward):
    path = tiny_checkpoint("llama")
    config = TrainerConfig(**_common(path, tmp_path), algorithm=AlgorithmConfig(kl_coef=0.05))
    with GRPOTrainer(config, single_reward(vowel_reward)) as trainer:
        engine = trainer.worker.engine
        base_served, adapters = _split_checksums(engine.weight_checker())
        assert set(engine.list_loras()) == {1} and adapters  # the initial adapter, saved and loaded at start
        params = dict(trainer.policy.model.named_parameters())
        trained = {n for n, p in params.items() if p.requires_grad}
        assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
        before = {n: p.full_tensor().clone() for n, p in params.items()}
        greedy = SamplingParams(max_tokens=6, temperature=0.0)
        base_before = [o.outputs[0].token_ids for o in engine.generate(prompts, greedy)]
        history = trainer.train(prompts)

        after = {n: p.full_tensor() for n, p in trainer.policy.model.named_parameters()}
        assert all(torch.equal(before[n], after[n]) for n in before if n not in trained)  # the base stays frozen
        assert any(not torch.equal(before[n], after[n]) for n in trained if ".lora_B." in n)
        for metrics in history:
            assert metrics["mismatch/abs"] < 1e-4 and metrics["stale_fraction"] == 0.0
        # The reference is the base (adapter off): no KL at step 1 (B = 0), some once the adapter has moved.
        assert history[0]["kl"] == pytest.approx(0.0, abs=1e-6)
        assert history[1]["kl"] > 0
        assert _split_checksums(engine.weight_checker())[0] == base_served  # only adapter bytes moved
        assert trainer.sync.source.num_bytes == sum(t.numel() * 4 for t in _adapter_tensors(trainer).values())
        _check_served_adapter(trainer, prompts, "step-2")

        # The base model is still served unchanged beside it: a request without the adapter gets no delta.
        assert [o.outputs[0].token_ids for o in engine.generate(prompts, greedy)] == base_before
        adapter_out = trainer.worker.generate(prompts, greedy)
        saved = str(tmp_path / "saved")
        trainer.policy.save(saved)
        # The saved PEFT directory is the adapter the engine serves: loaded anew it gives the same tokens.
        engine.add_lora(LoRARequest("saved", 2, saved))
        again = engine.generate(prompts, greedy, lora_request=LoRARequest("saved", 2, saved))
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in adapter_out]
    with open(os.path.join(saved, "adapter_config.json")) as f:
        assert json.load(f)["r"] == LORA.rank


def test_lora_ppo_trains_the_adapter_and_syncs_it(process_group, tiny_checkpoint, tmp_path, prompts, vowel_reward):
    path = tiny_checkpoint("llama")
    config = PPOTrainerConfig(**_common(path, tmp_path), algorithm=PPOAlgorithmConfig(kl_coef=0.05))
    with PPOTrainer(config, single_reward(vowel_reward)) as trainer:
        base_served, _ = _split_checksums(trainer.worker.engine.weight_checker())
        history = trainer.train(prompts)
        assert all(m["mismatch/abs"] < 1e-4 for m in history)
        assert _split_checksums(trainer.worker.engine.weight_checker())[0] == base_served
        _check_served_adapter(trainer, prompts, "step-2")


def test_lora_settings_are_checked_by_name(tiny_checkpoint, tmp_path):
    with pytest.raises(ValueError, match="lora.rank"):
        LoRAConfig(rank=-1)
    with pytest.raises(ValueError, match="lora.target_modules"):
        LoRAConfig(rank=8, target_modules="q_proj,embed_tokens")
    with pytest.raises(ValueError, match="lora.name"):
        LoRAConfig(rank=8, name="")
    path = tiny_checkpoint("llama")
    with pytest.raises(ValueError, match="sharded_rdt"):
        TrainerConfig(model=ModelConfig(path=path), rollout=RolloutConfig(engine="ray"), lora=LORA)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned_reward(completion: str, item) -> float:
    return sum(ch in "aeiou" for ch in completion) / max(len(completion), 1)  # spawned ranks lack the conftest's


def _lora_rank_main(rank: int, path: str, port: int, out_dir: str, prompts: list[str]) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    from pathlib import Path

    config = TrainerConfig(**_common(path, Path(out_dir)))
    with GRPOTrainer(config, single_reward(_spawned_reward)) as trainer:
        lora_a = next(n for n, p in trainer.policy.model.named_parameters() if ".lora_A." in n and "q_proj" in n)
        shard = tuple(dict(trainer.policy.model.named_parameters())[lora_a].to_local().shape)
        trainer.step(prompts[:2])
        tensors = {n: t.clone() for n, t in _adapter_tensors(trainer).items()}  # gathers on every rank
        report = {"rank": rank, "shard": shard, "full": list(tensors[next(iter(tensors))].shape)}
        if rank == 0:
            _, served = _split_checksums(trainer.worker.engine.weight_checker())
            report["served_match"] = served == lora_state_checksums(LORA.name, tensors)
            report["version"] = trainer.worker.get_weight_version()
        torch.save(tensors, os.path.join(out_dir, f"rank{rank}.pt"))
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_rank_fsdp2_lora_step_shards_the_adapter_and_syncs_the_gathered_tensors(tiny_checkpoint, tmp_path, prompts):
    import torch.multiprocessing as mp

    path = tiny_checkpoint("llama")
    mp.start_processes(_lora_rank_main, args=(path, _free_port(), str(tmp_path), prompts), nprocs=2,
                       start_method="spawn", join=True)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    tensors = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert reports[0]["shard"][0] * 2 == reports[0]["full"][0]  # each rank holds half of every adapter tensor
    assert tensors[0].keys() == tensors[1].keys() and all(torch.equal(tensors[0][n], tensors[1][n]) for n in tensors[0])
    assert reports[0]["served_match"] and reports[0]["version"] == "step-1"


@pytest.mark.slow
def test_lora_grpo_against_a_rollout_server_over_http(process_group, launch_server, tiny_checkpoint, tmp_path, prompts,
                                                      vowel_reward):
    """The adapter is loaded by name over /v1/load_lora_adapter, requests select it as their `model`, and nccl syncs
    only its tensors into the server; the served base model stays as launched."""
    from trainers.engines import HTTPRolloutEngine

    path = tiny_checkpoint("llama")
    server = launch_server(path, "--enable-rl-routes", "--logprobs-mode", "processed_logprobs", "--enable-lora",
                           "--max-lora-rank", str(LORA.rank), "--allow-runtime-lora-updating",
                           "--allowed-lora-paths", str(tmp_path))
    common = _common(path, tmp_path)
    common["rollout"] = RolloutConfig(num_prompts_per_step=2, num_samples_per_prompt=4, max_tokens=8, max_model_len=128,
                                      engine="http", server_url=server.url)
    with GRPOTrainer(TrainerConfig(**common), single_reward(vowel_reward)) as trainer:
        assert isinstance(trainer.worker.engine, HTTPRolloutEngine) and trainer.sync.backend == "nccl"
        base_served, _ = _split_checksums(trainer.worker.engine.weight_checker())
        history = trainer.train(prompts)
        assert all(m["mismatch/abs"] < 1e-4 and m["stale_fraction"] == 0.0 for m in history)
        assert _split_checksums(trainer.worker.engine.weight_checker())[0] == base_served
        _check_served_adapter(trainer, prompts, "step-2")
    import httpx

    models = [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]]
    assert LORA.name in models and server.served_model in models
