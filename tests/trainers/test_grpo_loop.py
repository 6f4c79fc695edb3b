"""The sync GRPO loop with real parts: a RolloutWorker, FSDP2 on gloo (1 and 2 ranks), the losses, and weight sync into the worker."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainers.common import single_reward
from trainers.config import AlgorithmConfig, LoggingConfig, ModelConfig, OptimConfig, RolloutConfig, TrainerConfig
from trainers.grpo import GRPOTrainer, make_loss
from trainers.logging import METRICS
from trainers.losses import DAPOLoss, DrGRPOLoss, GRPOLoss
from trainers.rollouts import generate_rollouts
from weight_transfer import hf_state_checksums


def make_config(path: str, tmp_path, **algorithm) -> TrainerConfig:
    return TrainerConfig(
        model=ModelConfig(path=path),
        rollout=RolloutConfig(num_prompts_per_step=2, num_samples_per_prompt=4, max_tokens=8, max_model_len=128),
        algorithm=AlgorithmConfig(**algorithm),
        optim=OptimConfig(lr=1e-3, weight_decay=0.0),  # no decay: only real gradients move a parameter
        logging=LoggingConfig(output_dir=str(tmp_path / "run"), save_final=False),
        num_steps=2,
    )


def test_two_grpo_steps_sync_weights_and_log_the_metrics(process_group, tiny_checkpoint, tmp_path, prompts,
                                                         vowel_reward):
    path = tiny_checkpoint("llama")
    logged: list[tuple[dict, int]] = []
    config = make_config(path, tmp_path, kl_coef=0.01)
    with GRPOTrainer(config, single_reward(vowel_reward), log=lambda m, s: logged.append((m, s))) as trainer:
        worker = trainer.worker
        assert worker.get_weight_version() == trainer.weight_version  # not "step-*" yet
        before = {n: p.full_tensor().clone() for n, p in trainer.policy.model.named_parameters()}
        history = trainer.train(prompts)

        assert worker.get_weight_version() == "step-2"
        assert [s for _, s in logged] == [1, 2]
        for metrics in history:
            for key in METRICS:
                assert key in metrics, key
            assert "is_weight_mean" in metrics and "loss" in metrics
            assert metrics["reward/std"] > 0 and metrics["grad_norm"] > 0
            assert metrics["stale_fraction"] == 0.0  # sync mode: every sample came from the latest weights
            assert metrics["num_samples_trained"] == 8
        # Step 1 ran on the initial weights in both engine and trainer: no mismatch, no KL yet.
        assert history[0]["mismatch/abs"] < 1e-4
        assert history[0]["kl"] == pytest.approx(0.0, abs=1e-6)
        # Step 2's samples came from the synced step-1 weights: still no mismatch; now the policy has left the reference.
        assert history[1]["mismatch/abs"] < 1e-4
        assert history[1]["kl"] > 0

        after = {n: p.full_tensor() for n, p in trainer.policy.model.named_parameters()}
        assert all(not torch.equal(before[n], after[n]) for n in before)
        # The engine serves exactly the trainer's weights...
        report = worker.weight_checker(hf_state_checksums(after))
        assert report["match"], report
        # ...and so scores fresh samples as the trainer does.
        batch = generate_rollouts(worker, prompts, n=2, max_tokens=8, seed=99)
        assert all(v == {"step-2"} for v in batch.sample_versions())
        with torch.no_grad():
            logprobs, _ = trainer.policy.response_logprobs(batch.input_ids, batch.prompt_lens, batch.response_ids)
        delta = ((logprobs - batch.rollout_logprobs).abs() * batch.response_mask).sum() / batch.response_mask.sum()
        assert float(delta) < 1e-4


def test_dapo_drops_groups_with_equal_rewards(process_group, tiny_checkpoint, tmp_path, prompts, vowel_reward):
    path = tiny_checkpoint("llama")
    config = make_config(path, tmp_path, loss="dapo")

    def first_prompt_only(completions, items):  # group 0 spreads, group 1 is all zeros
        return [vowel_reward(c, i) if i == prompts[0] else 0.0 for c, i in zip(completions, items)]

    with GRPOTrainer(config, first_prompt_only, log=lambda m, s: None) as trainer:
        metrics = trainer.step(prompts[:2])
        assert metrics["num_samples_trained"] == 4
        assert trainer.worker.get_weight_version() == "step-1"


def test_reward_rises_over_twenty_steps(process_group, tiny_checkpoint, tmp_path, prompts, vowel_reward):
    # Signs end to end: advantages, ratio, loss and weight sync all have to point the right way for this to climb.
    config = make_config(tiny_checkpoint("llama"), tmp_path)
    config.rollout = RolloutConfig(num_prompts_per_step=4, num_samples_per_prompt=8, max_tokens=8, max_model_len=128)
    config.optim = OptimConfig(lr=3e-3)
    with GRPOTrainer(config, single_reward(vowel_reward), log=lambda m, s: None) as trainer:
        history = trainer.train(prompts, num_steps=20)
    rewards = [m["reward/mean"] for m in history]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.15, rewards
    assert all(m["mismatch/abs"] < 1e-4 for m in history)  # every sync kept engine and trainer in agreement


def test_command_line_run_writes_the_run_record_and_a_servable_checkpoint(tiny_checkpoint, tmp_path):
    import glob
    import subprocess
    import sys

    from engine import LLM
    from trainers.logging import read_history

    out = tmp_path / "cli-run"
    cmd = [sys.executable, "-m", "trainers.grpo", "--model.path", tiny_checkpoint("llama"), "--num-steps", "2",
           "--rollout.num-prompts-per-step", "2", "--rollout.max-tokens", "6", "--task.num-train-problems", "8",
           "--task.num-eval-problems", "4", "--logging.output-dir", str(out), "--logging.console", "lines"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 2:" in result.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert 0.0 <= summary["accuracy_before"] <= 1.0 and 0.0 <= summary["accuracy_after"] <= 1.0  # top level
    assert summary["status"] == "finished" and summary["steps_logged"] == 2
    assert [m["weight_version"] for m in summary["history"]] == [1.0, 2.0]
    assert summary["config"]["rollout"]["max_tokens"] == 6
    # metrics.jsonl: every documented metric on every step, the staleness histogram beside them
    history = read_history(str(out))
    assert [r["step"] for r in history] == [1, 2]
    for record in history:
        for name in METRICS:
            if name != "kl":  # KL is off by default for GRPO
                assert name in record, name
        assert record["staleness"]["counts"] == {"0": 8}
    # the offline wandb run directory and the reward curve
    runs = glob.glob(str(out / "wandb" / "offline-run-*"))
    assert len(runs) == 1 and glob.glob(os.path.join(runs[0], "*.wandb")), runs
    png = out / "reward_curve.png"
    assert summary["reward_curve"] == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    LLM(str(out / "final"), device="cpu", dtype="float32", max_model_len=64)  # `rollout launch` loads the same way


def test_colocated_run_syncs_through_ipc_and_sleeps_the_worker_while_training(process_group, tiny_checkpoint,
                                                                              tmp_path, prompts, vowel_reward):
    from weight_transfer.ipc import IPCTrainerWeightTransferEngine

    config = make_config(tiny_checkpoint("llama"), tmp_path)
    config.rollout = RolloutConfig(num_prompts_per_step=2, num_samples_per_prompt=4, max_tokens=8, max_model_len=128,
                                   colocate=True)
    with GRPOTrainer(config, single_reward(vowel_reward)) as trainer:
        worker = trainer.worker
        assert isinstance(trainer.sync, IPCTrainerWeightTransferEngine)
        asleep_in_train, asleep_in_sync = [], []
        train, send = trainer._train, trainer.sync.send_weights

        def watched_train(batch, advantages):
            asleep_in_train.append(worker.is_sleeping())
            return train(batch, advantages)

        def watched_send(*args, **kwargs):
            asleep_in_sync.append(worker.is_sleeping())
            return send(*args, **kwargs)

        trainer._train, trainer.sync.send_weights = watched_train, watched_send
        history = trainer.train(prompts, num_steps=2)

        assert asleep_in_train == [True, True]  # the engine gave the device up while the trainer trained
        assert asleep_in_sync == [False, False]  # and took it back for the sync and the next generation
        assert not worker.is_sleeping()
        assert worker.get_weight_version() == "step-2"
        assert [m["weight_version"] for m in history] == [1.0, 2.0]
        after = {n: p.full_tensor() for n, p in trainer.policy.model.named_parameters()}
        report = worker.weight_checker(hf_state_checksums(after))
        assert report["match"], report
        # the samples of step 2 came from the weights synced through ipc, scored alike on both sides
        assert history[1]["mismatch/abs"] < 1e-4 and history[1]["staleness/max"] == 0.0


def test_colocate_with_async_mode_is_rejected_naming_the_field():
    with pytest.raises(ValueError, match=r"rollout\.colocate"):
        RolloutConfig(colocate=True, async_mode=True)


def test_loss_choice_and_overrides(tiny_checkpoint):
    assert isinstance(make_loss(AlgorithmConfig()), GRPOLoss)
    assert isinstance(make_loss(AlgorithmConfig(loss="dr_grpo")), DrGRPOLoss)
    dapo = make_loss(AlgorithmConfig(loss="dapo"))
    assert isinstance(dapo, DAPOLoss) and dapo.config.clip_high == 0.28  # the loss's own default stays
    custom = make_loss(AlgorithmConfig(loss="dapo", clip_high=0.3, aggregation="seq-mean-token-mean", kl_coef=0.1))
    assert (custom.config.clip_high, custom.config.aggregation, custom.config.kl_coef) == (0.3, "seq-mean-token-mean", 0.1)


# ---- two ranks -----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned_reward(completion: str, item) -> float:
    # spawned ranks cannot import the conftest's helpers, so they carry their own reward
    return sum(ch in "aeiou" for ch in completion) / max(len(completion), 1)


def _rank_main(rank: int, path: str, port: int, out_dir: str, prompts: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    config = TrainerConfig(
        model=ModelConfig(path=path),
        rollout=RolloutConfig(num_prompts_per_step=2, num_samples_per_prompt=4, max_tokens=8, max_model_len=128),
        optim=OptimConfig(lr=1e-3, weight_decay=0.0),
        logging=LoggingConfig(output_dir=os.path.join(out_dir, "run"), save_final=False),
    )
    with GRPOTrainer(config, single_reward(_spawned_reward), log=lambda m, s: None) as trainer:
        assert trainer.world_size == 2
        shards = {n: tuple(p.to_local().shape) for n, p in trainer.policy.model.named_parameters()}
        before = {n: p.full_tensor().clone() for n, p in trainer.policy.model.named_parameters()}
        metrics = trainer.step(prompts[:2])
        after = {n: p.full_tensor().clone() for n, p in trainer.policy.model.named_parameters()}
        report = {"rank": rank, "metrics": metrics, "shards": shards}
        if rank == 0:
            report["engine_version"] = trainer.worker.get_weight_version()
            report["engine_match"] = trainer.worker.weight_checker(hf_state_checksums(after))["match"]
        torch.save({"before": before, "after": after}, os.path.join(out_dir, f"rank{rank}.pt"))
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_rank_fsdp2_grpo_step_changes_every_parameter_and_keeps_ranks_identical(tiny_checkpoint, tmp_path, prompts):
    path = tiny_checkpoint("llama")
    mp.start_processes(_rank_main, args=(path, _free_port(), str(tmp_path), prompts), nprocs=2, start_method="spawn", join=True)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    states = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    # Really sharded: each rank holds half of the layer weights.
    full = states[0]["after"]
    name = "model.layers.0.mlp.gate_proj.weight"
    assert reports[0]["shards"][name][0] + reports[1]["shards"][name][0] == full[name].shape[0]
    # Every trainable parameter moved, and both ranks hold the same weights after the step.
    assert set(full) == set(states[1]["after"])
    for n in full:
        assert not torch.equal(states[0]["before"][n], full[n]), n
        assert torch.equal(full[n], states[1]["after"][n]), n
    # Both ranks trained on their own half and agree on the reduced metrics; the engine got the new weights.
    assert _same_loss_metrics(reports)
    assert reports[0]["metrics"]["grad_norm"] > 0
    assert reports[0]["engine_version"] == "step-1"
    assert reports[0]["engine_match"]


def _same_loss_metrics(reports) -> bool:
    # Timings differ per rank; everything computed from the batch and the reductions must agree.
    skip = {"time/train", "time/sync"}
    a, b = (reports[r]["metrics"] for r in range(2))
    return all(a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-9) for k in a if k not in skip)
