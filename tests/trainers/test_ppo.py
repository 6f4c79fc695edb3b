"""The PPO trainer with real parts: a RolloutWorker, FSDP2 policy and critic on gloo, GAE, the clipped losses and weight sync."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainers.common import single_reward
from trainers.config import LoggingConfig, ModelConfig, OptimConfig, RolloutConfig
from trainers.logging import METRICS
from trainers.ppo import CriticConfig, PPOAlgorithmConfig, PPOTrainer, PPOTrainerConfig, token_rewards
from weight_transfer import hf_state_checksums


def make_config(path: str, tmp_path, **algorithm) -> PPOTrainerConfig:
    return PPOTrainerConfig(
        model=ModelConfig(path=path),
        rollout=RolloutConfig(num_prompts_per_step=2, num_samples_per_prompt=4, max_tokens=8, max_model_len=128),
        algorithm=PPOAlgorithmConfig(**algorithm),
        critic=CriticConfig(lr=1e-3),
        optim=OptimConfig(lr=1e-3, weight_decay=0.0),  # no decay: only real gradients move a parameter
        logging=LoggingConfig(output_dir=str(tmp_path / "run"), save_final=False),
    )


def test_token_rewards_put_the_reward_on_the_last_token_and_kl_on_every_token():
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    kl = torch.full((3, 4), 0.5)
    out = token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask, kl, kl_coef=0.2)
    expected = torch.tensor([[-0.1, -0.1, -0.1 + 1.0, 0.0], [-0.1 + 2.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(out, expected)
    without_kl = torch.tensor([[0.0, 0.0, 1.0, 0.0], [2.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask), without_kl)


def test_whitening_pools_ragged_minibatches_and_the_all_rank_formula_agrees(monkeypatch):
    from trainers import ppo

    torch.manual_seed(0)
    chunks = [torch.randn(3, 5) * 4 + 2, torch.randn(2, 7) - 1]  # minibatches trimmed to different R
    masks = [(torch.rand(3, 5) > 0.3).float(), (torch.rand(2, 7) > 0.3).float()]
    pooled = ppo._whiten_across_ranks(chunks, masks, world_size=1)
    values = torch.cat([c[m > 0] for c, m in zip(pooled, masks)])
    assert abs(float(values.mean())) < 1e-5 and float(values.var(unbiased=False)) == pytest.approx(1.0, abs=1e-4)
    assert all(float(c[m == 0].abs().sum()) == 0.0 for c, m in zip(pooled, masks))
    # The multi-rank branch's sum / sum-of-squares statistics, with this process standing in for all ranks.
    monkeypatch.setattr(ppo.dist, "all_reduce", lambda t: t)
    for a, b in zip(ppo._whiten_across_ranks(chunks, masks, world_size=2), pooled):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_one_ppo_step_moves_policy_and_critic_and_syncs_the_worker(process_group, tiny_checkpoint, tmp_path, prompts, vowel_reward):
    config = make_config(tiny_checkpoint("llama"), tmp_path, kl_coef=0.05, num_epochs=2, num_minibatches=2)
    logged: list[tuple[dict, int]] = []
    with PPOTrainer(config, single_reward(vowel_reward), log=lambda m, s: logged.append((m, s))) as trainer:
        worker = trainer.worker
        assert worker.get_weight_version() == trainer.weight_version  # not "step-*" yet
        policy_before = {n: p.full_tensor().clone() for n, p in trainer.policy.model.named_parameters()}
        critic_before = {n: p.full_tensor().clone() for n, p in trainer.critic.model.named_parameters()}

        metrics = trainer.step(prompts[:2])

        assert worker.get_weight_version() == "step-1" == trainer.weight_version
        assert [s for _, s in logged] == [1]
        for key in (*METRICS, "loss", "value_loss", "explained_variance", "value_clip_fraction", "token_reward_kl",
                    "is_weight_mean", "grad_norm", "critic_grad_norm"):
            assert key in metrics, key
        assert not any(isinstance(v, list) for v in logged[0][0].values())
        assert metrics["grad_norm"] > 0 and metrics["critic_grad_norm"] > 0
        assert metrics["mismatch/abs"] < 1e-4  # step 1 sampled and trained on the same initial weights
        assert metrics["stale_fraction"] == 0.0

        policy_after = {n: p.full_tensor() for n, p in trainer.policy.model.named_parameters()}
        critic_after = {n: p.full_tensor() for n, p in trainer.critic.model.named_parameters()}
        assert all(not torch.equal(policy_before[n], policy_after[n]) for n in policy_before)
        # The whole critic trained: backbone layers (reached through the head) and the head itself.
        assert all(not torch.equal(critic_before[n], critic_after[n]) for n in critic_before)
        assert any(n.startswith("value_head.") for n in critic_before)
        # The critic is not part of the sync: the engine holds exactly the policy's weights.
        report = worker.weight_checker(hf_state_checksums(policy_after))
        assert report["match"], report
        # A second step samples from the synced weights: still no train/inference mismatch.
        second = trainer.step(prompts[2:])
        assert second["mismatch/abs"] < 1e-4 and second["stale_fraction"] == 0.0
        assert worker.get_weight_version() == "step-2"


def test_ppo_improves_the_reward_over_thirty_steps(process_group, tiny_checkpoint, tmp_path, prompts, vowel_reward):
    # Signs end to end: token rewards, GAE, whitening, the ratio, both losses and the weight sync
    # all have to point the right way for the reward to climb.
    config = make_config(tiny_checkpoint("llama"), tmp_path, num_epochs=1, num_minibatches=2)
    config.rollout = RolloutConfig(num_prompts_per_step=4, num_samples_per_prompt=4, max_tokens=8, max_model_len=128)
    config.optim = OptimConfig(lr=3e-3)
    with PPOTrainer(config, single_reward(vowel_reward), log=lambda m, s: None) as trainer:
        history = trainer.train(prompts, num_steps=30)
    rewards = [m["reward/mean"] for m in history]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"PPO vowel-fraction reward: first 5 steps {first:.3f}, last 5 steps {last:.3f}; per step {[round(r, 3) for r in rewards]}")
    print(f"explained variance: first {history[0]['explained_variance']:.3f}, last {history[-1]['explained_variance']:.3f}")
    assert last > first + 0.15, rewards
    assert all(m["mismatch/abs"] < 1e-4 for m in history)  # every sync kept engine and trainer in agreement


@pytest.mark.parametrize(
    "build, field",
    [
        (lambda: PPOAlgorithmConfig(gamma=1.5), "algorithm.gamma"),
        (lambda: PPOAlgorithmConfig(lam=-0.1), "algorithm.lam"),
        (lambda: PPOAlgorithmConfig(clip_low=1.0), "algorithm.clip_low"),
        (lambda: PPOAlgorithmConfig(clip_high=0.0), "algorithm.clip_high"),
        (lambda: PPOAlgorithmConfig(dual_clip=1.0), "algorithm.dual_clip"),
        (lambda: PPOAlgorithmConfig(kl_estimator="k4"), "algorithm.kl_estimator"),
        (lambda: PPOAlgorithmConfig(aggregation="sum"), "algorithm.aggregation"),
        (lambda: PPOAlgorithmConfig(mismatch_cap=1.0), "algorithm.mismatch_cap"),
        (lambda: PPOAlgorithmConfig(num_epochs=0), "algorithm.num_epochs"),
        (lambda: PPOAlgorithmConfig(kl_coef=float("inf")), "algorithm.kl_coef"),
        (lambda: CriticConfig(lr=0.0), "critic.lr"),
        (lambda: CriticConfig(value_clip=-0.2), "critic.value_clip"),
        (lambda: CriticConfig(path="/nonexistent"), "critic.path"),
    ],
)
def test_bad_ppo_config_names_the_field(build, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        build()


def test_ppo_command_line_help_and_bad_flag(tiny_checkpoint):
    result = subprocess.run([sys.executable, "-m", "trainers.ppo", "--help"], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    for flag in ("--config", "--model.path", "--algorithm.gamma", "--algorithm.lam", "--algorithm.whiten-advantages",
                 "--critic.lr", "--critic.value-clip", "--optim.max-grad-norm"):
        assert flag in result.stdout, flag
    result = subprocess.run([sys.executable, "-m", "trainers.ppo", "--model.path", tiny_checkpoint("llama"),
                             "--algorithm.lam", "2"], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2
    assert "error: algorithm.lam: must be <= 1.0" in result.stderr, result.stderr


def test_command_line_run_writes_the_run_record_and_a_servable_checkpoint(tiny_checkpoint, tmp_path):
    import glob

    from engine import LLM
    from trainers.logging import read_history

    out = tmp_path / "cli-run"
    cmd = [sys.executable, "-m", "trainers.ppo", "--model.path", tiny_checkpoint("llama"), "--num-steps", "2",
           "--rollout.num-prompts-per-step", "2", "--rollout.max-tokens", "6", "--task.num-train-problems", "8",
           "--task.num-eval-problems", "4", "--algorithm.kl-coef", "0.1", "--logging.output-dir", str(out),
           "--logging.console", "lines"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 2:" in result.stdout and "kl=" in result.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert 0.0 <= summary["accuracy_before"] <= 1.0 and 0.0 <= summary["accuracy_after"] <= 1.0  # top level
    assert [m["weight_version"] for m in summary["history"]] == [1.0, 2.0]
    assert summary["config"]["algorithm"]["kl_coef"] == 0.1 and "critic" in summary["config"]
    history = read_history(str(out))
    assert [r["step"] for r in history] == [1, 2]
    for record in history:
        assert set(METRICS) <= set(record), set(METRICS) - set(record)
        assert "value_loss" in record and record["staleness"]["counts"] == {"0": 8}
    runs = glob.glob(str(out / "wandb" / "offline-run-*"))
    assert len(runs) == 1 and glob.glob(os.path.join(runs[0], "*.wandb")), runs
    assert (out / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    LLM(str(out / "final"), device="cpu", dtype="float32", max_model_len=64)  # `rollout launch` loads the same way


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
    config = PPOTrainerConfig(
        model=ModelConfig(path=path),
        rollout=RolloutConfig(num_prompts_per_step=2, num_samples_per_prompt=4, max_tokens=8, max_model_len=128),
        critic=CriticConfig(lr=1e-3),
        optim=OptimConfig(lr=1e-3, weight_decay=0.0),
        logging=LoggingConfig(output_dir=os.path.join(out_dir, "run"), save_final=False),
    )
    with PPOTrainer(config, single_reward(_spawned_reward), log=lambda m, s: None) as trainer:
        assert trainer.world_size == 2
        models = {"policy": trainer.policy.model, "critic": trainer.critic.model}
        before = {k: {n: p.full_tensor().clone() for n, p in m.named_parameters()} for k, m in models.items()}
        metrics = trainer.step(prompts[:2])
        after = {k: {n: p.full_tensor().clone() for n, p in m.named_parameters()} for k, m in models.items()}
        report = {"rank": rank, "metrics": metrics}
        if rank == 0:
            report["engine_version"] = trainer.worker.get_weight_version()
            report["engine_match"] = trainer.worker.weight_checker(hf_state_checksums(after["policy"]))["match"]
        torch.save({"before": before, "after": after}, os.path.join(out_dir, f"rank{rank}.pt"))
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_rank_ppo_step_moves_every_parameter_and_keeps_ranks_identical(tiny_checkpoint, tmp_path, prompts):
    mp.start_processes(_rank_main, args=(tiny_checkpoint("llama"), _free_port(), str(tmp_path), prompts), nprocs=2,
                       start_method="spawn", join=True)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    states = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for model in ("policy", "critic"):
        full = states[0]["after"][model]
        for n in full:
            assert not torch.equal(states[0]["before"][model][n], full[n]), (model, n)
            assert torch.equal(full[n], states[1]["after"][model][n]), (model, n)
    # Both ranks agree on the reduced metrics (timings aside); the engine got the new policy weights.
    a, b = (reports[r]["metrics"] for r in range(2))
    assert all(a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-9) for k in a if k not in ("time/train", "time/sync"))
    assert reports[0]["engine_version"] == "step-1" and reports[0]["engine_match"]
