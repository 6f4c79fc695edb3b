"""Synchronous PPO on FSDP2 with a learned critic: generate -> token rewards -> GAE -> clipped policy and value updates -> weight sync.

    python -m trainers.ppo --model.path examples/grpo_tiny/model --num-steps 30
    torchrun --nproc-per-node 2 -m trainers.ppo --config ppo.toml --critic.lr 1e-4

The critic is a separate value model built from the same HF checkpoint: its decoder backbone
plus a scalar head, sharded and optimised on its own (only the policy is synced to the rollout
worker). Rewards are per token: the sequence reward on the last response token and, when
algorithm.kl_coef > 0, a KL-to-reference penalty on every response token. Rank 0 owns the
worker, generates and scores; every rank trains on its share, as in trainers.grpo.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from trainers.advantages import gae, whiten
from trainers.common import (
    HistogramFn,
    LogFn,
    RewardFn,
    RolloutTrainer,
    broadcast_from_rank0,
    cli_entry,
    generate_and_score,
    rename_loss_metrics,
    reward_metrics,
    run_main,
    step_seed,
    worker_asleep,
)
from trainers.config import (
    Aggregation,
    KLEstimator,
    MismatchMode,
    RunConfig,
    check_choice,
    check_range,
)
from trainers.critic import Critic, CriticConfig, ValueModel, load_sharded_value_model  # noqa: F401 - re-exported
from trainers.losses import PolicyBatch, PPOClipConfig, PPOClipLoss, ValueConfig, ValueLoss, kl_penalty
from trainers.policy import Policy, mean_over_ranks
from trainers.rollouts import RolloutBatch

# ---- configuration ---------------------------------------------------------------------------


@dataclass
class PPOAlgorithmConfig:
    """The PPO objective: clipping, KL-in-reward, GAE, entropy, mismatch correction and update schedule."""

    clip_low: float = 0.2
    """Lower clip range epsilon of the policy ratio (1 - clip_low)."""
    clip_high: float = 0.2
    """Upper clip range epsilon of the policy ratio (1 + clip_high)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens; none: off."""
    aggregation: Aggregation = "token-mean"
    """How token losses (policy and value) become one number."""
    kl_coef: float = 0.0
    """Weight of the per-token KL-to-reference penalty subtracted from the rewards (a frozen reference copy is kept only when > 0)."""
    kl_estimator: KLEstimator = "k1"
    """KL estimator of the reward penalty: k1 (log ratio), k2 (squared log ratio / 2) or k3 (non-negative)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus in the policy loss."""
    mismatch: MismatchMode = "tis"
    """Train/inference mismatch correction: truncated importance sampling, masking tokens past the cap, or none."""
    mismatch_cap: float = 2.0
    """Cap C of the trainer/engine probability ratio for tis and mask."""
    gamma: float = 1.0
    """GAE discount per response token."""
    lam: float = 0.95
    """GAE lambda: 1 gives Monte-Carlo returns minus the value, 0 one-step TD errors."""
    whiten_advantages: bool = True
    """Normalise GAE advantages to zero mean and unit variance over each step's response tokens (all ranks)."""
    num_minibatches: int = 2
    """Optimizer steps per epoch over each step's samples (policy and critic alike)."""
    num_epochs: int = 2
    """Passes over each step's samples."""

    def __post_init__(self) -> None:
        check_range("algorithm.clip_low", self.clip_low, 0.0, low_open=True)
        if self.clip_low >= 1.0:
            raise ValueError(f"algorithm.clip_low: must be < 1 (the ratio floor is 1 - clip_low), got {self.clip_low}")
        check_range("algorithm.clip_high", self.clip_high, 0.0, low_open=True)
        if self.dual_clip is not None:
            check_range("algorithm.dual_clip", self.dual_clip, 1.0, low_open=True)
        check_choice("algorithm.aggregation", self.aggregation, Aggregation)
        check_range("algorithm.kl_coef", self.kl_coef, 0.0)
        check_choice("algorithm.kl_estimator", self.kl_estimator, KLEstimator)
        check_range("algorithm.entropy_coef", self.entropy_coef, 0.0)
        check_choice("algorithm.mismatch", self.mismatch, MismatchMode)
        check_range("algorithm.mismatch_cap", self.mismatch_cap, 1.0, low_open=True)
        check_range("algorithm.gamma", self.gamma, 0.0, 1.0)
        check_range("algorithm.lam", self.lam, 0.0, 1.0)
        check_range("algorithm.num_minibatches", self.num_minibatches, 1)
        check_range("algorithm.num_epochs", self.num_epochs, 1)
        for name in ("clip_low", "clip_high", "kl_coef", "entropy_coef", "mismatch_cap", "gamma", "lam"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"algorithm.{name}: must be finite, got {getattr(self, name)}")


@dataclass
class PPOTrainerConfig(RunConfig):
    """A PPO training run (policy + critic)."""

    algorithm: PPOAlgorithmConfig = field(default_factory=PPOAlgorithmConfig)
    """The objective."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if getattr(self.rollout, "async_mode", False):
            raise ValueError("rollout.async_mode: this PPO trainer is synchronous; async generation is GRPO-only for now")


# ---- rewards and advantages ------------------------------------------------------------------


def token_rewards(
    rewards: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None, kl_coef: float = 0.0
) -> torch.Tensor:
    """Per-token rewards [B, R]: each sequence's reward [B] on its last response token, minus kl_coef * kl [B, R] on every token.

        mask     1    1    1    0
        reward  -bk0 -bk1 -bk2+R  0        (b = kl_coef, k = per-token KL estimate)
    A sequence without response tokens gets no reward (it has no step to carry it).
    """
    mask = mask.to(torch.float32)
    out = torch.zeros_like(mask)  # [B, R]
    if kl is not None and kl_coef > 0:
        out = out - kl_coef * kl.to(torch.float32) * mask
    lengths = mask.sum(-1).to(torch.int64)  # [B]; responses are left-aligned, so the last token is at lengths - 1
    has_tokens = lengths > 0
    rows = torch.arange(mask.shape[0], device=mask.device)[has_tokens]
    out[rows, lengths[has_tokens] - 1] += rewards.to(out.device, torch.float32)[has_tokens]
    return out


def _whiten_across_ranks(chunks: list[torch.Tensor], masks: list[torch.Tensor], world_size: int) -> list[torch.Tensor]:
    """whiten() with the mean and variance of all ranks' masked-in tokens (ragged minibatches: one flat pool)."""
    if world_size == 1:
        flat = torch.cat([c.reshape(-1) for c in chunks])
        flat_mask = torch.cat([m.reshape(-1) for m in masks])
        white = whiten(flat, flat_mask)
        out, start = [], 0
        for c in chunks:
            out.append(white[start : start + c.numel()].view_as(c))
            start += c.numel()
        return out
    stats = torch.zeros(3, dtype=torch.float64, device=chunks[0].device)  # sum, sum of squares, count
    for c, m in zip(chunks, masks):
        m = m.to(torch.float64)
        stats += torch.stack([(c * m).sum(), (c.square() * m).sum(), m.sum()])
    dist.all_reduce(stats)
    count = stats[2].clamp(min=1.0)
    mean = stats[0] / count
    var = (stats[1] / count - mean.square()).clamp(min=0.0)
    scale = torch.rsqrt(var + 1e-8)
    return [((c - mean) * scale * m).to(c.dtype) for c, m in zip(chunks, masks)]


# ---- the trainer -----------------------------------------------------------------------------


class PPOTrainer(RolloutTrainer):
    """One synchronous PPO run: the sharded policy and critic, the losses, the rollout worker (rank 0) and the weight sync.

    `worker` is a RolloutWorker (rank 0 only; other ranks pass None); when None on rank 0, one is
    started on the checkpoint and shut down by close(). `reward_fn(completions, items)` scores each
    sample against the item (a prompt, or an object with .prompt) it was generated from.
    """

    def __init__(self, config: PPOTrainerConfig, reward_fn: RewardFn, *, worker=None, log: LogFn | None = None,
                 log_histogram: HistogramFn | None = None) -> None:
        super().__init__(config, reward_fn, log=log, log_histogram=log_histogram)
        algo = config.algorithm
        policy = Policy(config.model, config.optim, reference=algo.kl_coef > 0, lora=config.lora)
        self.critic = Critic(config.model, config.critic, config.optim)
        # KL to the reference is a reward term here (it shapes the critic's targets), not a loss term.
        self.policy_loss = PPOClipLoss(PPOClipConfig(
            clip_low=algo.clip_low, clip_high=algo.clip_high, dual_clip=algo.dual_clip, aggregation=algo.aggregation,
            kl_coef=0.0, kl_estimator=algo.kl_estimator, entropy_coef=algo.entropy_coef,
            mismatch=algo.mismatch, mismatch_cap=algo.mismatch_cap,
        ))
        self.value_loss = ValueLoss(ValueConfig(clip=config.critic.value_clip, aggregation=algo.aggregation))
        self._connect_worker(policy, worker)

    # ---- one step ------------------------------------------------------------------------------

    def _generate(self, items: Sequence[Any]) -> tuple[RolloutBatch, torch.Tensor, dict[str, float]]:
        """Rank 0: samples, rewards [B] and rollout metrics for `items`; every rank gets the same (broadcast)."""
        payload = None
        if self.rank == 0:
            batch, rewards, metrics = generate_and_score(self.worker, items, self.reward_fn, self.config.rollout,
                                                         step_seed(self.config.rollout, self.step_count))
            versions = batch.sample_versions()
            # Sync PPO: every sample comes from the weights of the last sync (staleness 0).
            staleness = [0 if v == {self.weight_version} else 1 for v in versions]
            metrics["staleness/values"] = staleness
            metrics["stale_fraction"] = sum(staleness) / len(staleness)
            payload = (batch, rewards, metrics)
        return broadcast_from_rank0(payload, self.world_size)

    def _prepare(self, minibatches: list[RolloutBatch], rewards: list[torch.Tensor]) -> tuple[list[dict[str, Any]], dict[str, float]]:
        """Rollout-time quantities of each minibatch (behaviour logprobs, reference logprobs, values, GAE), no gradient."""
        algo, temperature = self.config.algorithm, self.config.rollout.temperature
        prepared, adv_chunks, masks = [], [], []
        totals = {"token_reward_kl": 0.0, "advantage_mean": 0.0, "return_mean": 0.0}
        with torch.no_grad():
            for mb, reward in zip(minibatches, rewards):
                old_logprobs, _ = self.policy.response_logprobs(mb.input_ids, mb.prompt_lens, mb.response_ids,
                                                                temperature=temperature)
                device = old_logprobs.device
                mask = mb.response_mask.to(device)  # [b, R]
                ref_logprobs = kl = None
                if self.policy.has_reference:
                    ref_logprobs, _ = self.policy.response_logprobs(mb.input_ids, mb.prompt_lens, mb.response_ids,
                                                                    temperature=temperature, use_reference=True)
                    kl = kl_penalty(old_logprobs, ref_logprobs, algo.kl_estimator)  # [b, R]
                    totals["token_reward_kl"] += float((kl * mask).sum() / mask.sum().clamp(min=1.0))
                old_values = self.critic.response_values(mb.input_ids, mb.prompt_lens, mb.response_ids.shape[1])
                per_token = token_rewards(reward.to(device), mask, kl, algo.kl_coef)
                advantages, returns = gae(per_token, old_values, mask, algo.gamma, algo.lam)
                totals["advantage_mean"] += float((advantages * mask).sum() / mask.sum().clamp(min=1.0))
                totals["return_mean"] += float((returns * mask).sum() / mask.sum().clamp(min=1.0))
                prepared.append({"old_logprobs": old_logprobs, "ref_logprobs": ref_logprobs, "old_values": old_values,
                                 "returns": returns, "mask": mask})
                adv_chunks.append(advantages)
                masks.append(mask)
        if algo.whiten_advantages:
            adv_chunks = _whiten_across_ranks(adv_chunks, masks, self.world_size)
        for p, adv in zip(prepared, adv_chunks):
            p["advantages"] = adv
        metrics = {k: v / len(minibatches) for k, v in totals.items()}
        if not self.policy.has_reference:
            del metrics["token_reward_kl"]
        return prepared, metrics

    def _train(self, batch: RolloutBatch, rewards: torch.Tensor) -> dict[str, float]:
        """Epochs of minibatch updates of policy and critic on this rank's share; metrics averaged over updates and ranks."""
        algo, temperature = self.config.algorithm, self.config.rollout.temperature
        mine = list(range(self.rank, batch.num_samples, self.world_size))
        # Every rank runs the same number of forwards and optimizer steps (FSDP collectives), so the
        # minibatch count comes from the smallest share, which all ranks compute alike.
        num_minibatches = min(algo.num_minibatches, batch.num_samples // self.world_size)
        chunks = [mine[i::num_minibatches] for i in range(num_minibatches)]
        minibatches = [batch.select(c) for c in chunks]
        prepared, prep_metrics = self._prepare(minibatches, [rewards[c] for c in chunks])

        totals: dict[str, float] = {}
        num_updates = 0
        for _epoch in range(algo.num_epochs):
            for mb, p in zip(minibatches, prepared):
                logprobs, entropy = self.policy.response_logprobs(
                    mb.input_ids, mb.prompt_lens, mb.response_ids, temperature=temperature,
                    with_entropy=True, entropy_grad=algo.entropy_coef > 0,
                )
                loss, metrics = self.policy_loss(PolicyBatch(
                    logprobs=logprobs,
                    old_logprobs=p["old_logprobs"],
                    advantages=p["advantages"],
                    mask=p["mask"],
                    ref_logprobs=p["ref_logprobs"],
                    rollout_logprobs=mb.rollout_logprobs.to(logprobs.device),
                    entropy=entropy,
                ))
                loss.backward()
                metrics.update(self.policy.optimizer_step())

                values = self.critic.response_values(mb.input_ids, mb.prompt_lens, mb.response_ids.shape[1])
                value_loss, value_metrics = self.value_loss(values, p["old_values"], p["returns"], p["mask"])
                value_loss.backward()
                metrics.update(value_metrics)
                metrics.update({f"critic_{k}": v for k, v in self.critic.optimizer_step().items()})
                for k, v in metrics.items():
                    totals[k] = totals.get(k, 0.0) + v
                num_updates += 1
        means = {k: v / num_updates for k, v in totals.items()}
        means.update(prep_metrics)
        return rename_loss_metrics(mean_over_ranks(means, self.world_size, self.policy.device))

    def step(self, items: Sequence[Any]) -> dict[str, float]:
        """One PPO step on `items` (prompts, or objects with .prompt that reward_fn understands); every rank calls it."""
        if not items:
            raise ValueError("items: empty; a step needs at least one prompt")
        self.step_count += 1
        step = self.step_count
        batch, rewards, metrics = self._generate(items)
        metrics = dict(metrics)
        metrics.update(reward_metrics(rewards, batch))
        staleness = metrics.pop("staleness/values")
        metrics["staleness/mean"] = sum(staleness) / len(staleness)
        metrics["staleness/max"] = float(max(staleness))

        start = time.perf_counter()
        with worker_asleep(self.worker, self.config.rollout.colocate):
            if batch.num_samples >= self.world_size:
                metrics.update(self._train(batch, rewards))
        metrics["time/train"] = time.perf_counter() - start

        start = time.perf_counter()
        version = f"step-{step}"
        self.sync.send_weights(weight_version=version)
        self.weight_version = version
        metrics["time/sync"] = time.perf_counter() - start
        metrics["weight_version"] = float(step)
        if self.rank == 0 and step % self.config.logging.log_every == 0:
            self.log(metrics, step)
            if self.log_histogram is not None:
                self.log_histogram("staleness", staleness, step)
        return metrics

# ---- command line ----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """`python -m trainers.ppo`: train on config.task, evaluate held-out accuracy before and after, save the policy and the run record."""
    return run_main(PPOTrainerConfig, PPOTrainer, argv, prog="python -m trainers.ppo")


if __name__ == "__main__":
    cli_entry(main)
