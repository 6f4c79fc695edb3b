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

import importlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

import torch
import torch.distributed as dist
from torch import nn

from trainers.advantages import gae, whiten
from trainers.cli import parse_config, to_dict
from trainers.config import (
    Aggregation,
    KLEstimator,
    LoggingConfig,
    MismatchMode,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    TaskConfig,
    _check_choice,
    _check_range,
)
from trainers.losses import PolicyBatch, PPOClipConfig, PPOClipLoss, ValueConfig, ValueLoss, kl_penalty
from trainers.policy import Policy, _is_dtensor, gather_response_rows, init_distributed
from trainers.rollouts import RolloutBatch, generate_rollouts
from weight_transfer import trainer_init
from weight_transfer.clients import LocalWeightSyncClient
from weight_transfer.local import LocalTrainerInitInfo

# batched reward: (completions, per-sample items) -> one float per completion
RewardFn = Callable[[list[str], list[Any]], Sequence[float]]
LogFn = Callable[[dict[str, float], int], None]


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
        _check_range("algorithm.clip_low", self.clip_low, 0.0, low_open=True)
        if self.clip_low >= 1.0:
            raise ValueError(f"algorithm.clip_low: must be < 1 (the ratio floor is 1 - clip_low), got {self.clip_low}")
        _check_range("algorithm.clip_high", self.clip_high, 0.0, low_open=True)
        if self.dual_clip is not None:
            _check_range("algorithm.dual_clip", self.dual_clip, 1.0, low_open=True)
        _check_choice("algorithm.aggregation", self.aggregation, Aggregation)
        _check_range("algorithm.kl_coef", self.kl_coef, 0.0)
        _check_choice("algorithm.kl_estimator", self.kl_estimator, KLEstimator)
        _check_range("algorithm.entropy_coef", self.entropy_coef, 0.0)
        _check_choice("algorithm.mismatch", self.mismatch, MismatchMode)
        _check_range("algorithm.mismatch_cap", self.mismatch_cap, 1.0, low_open=True)
        _check_range("algorithm.gamma", self.gamma, 0.0, 1.0)
        _check_range("algorithm.lam", self.lam, 0.0, 1.0)
        _check_range("algorithm.num_minibatches", self.num_minibatches, 1)
        _check_range("algorithm.num_epochs", self.num_epochs, 1)
        for name in ("clip_low", "clip_high", "kl_coef", "entropy_coef", "mismatch_cap", "gamma", "lam"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"algorithm.{name}: must be finite, got {getattr(self, name)}")


@dataclass
class CriticConfig:
    """The value model: the checkpoint's backbone with a scalar head, trained with the clipped value loss."""

    lr: float = 1e-5
    """Critic learning rate (AdamW; betas, eps and weight decay come from optim)."""
    max_grad_norm: float = 1.0
    """Clip the critic's gradient norm to this; 0 turns clipping off (the norm is still logged)."""
    value_clip: float | None = 0.2
    """How far a value may move from its rollout-time estimate before the clipped loss takes over; none: no clipping."""
    path: str | None = None
    """HF checkpoint of the critic's backbone; none: model.path (the policy's starting checkpoint)."""

    def __post_init__(self) -> None:
        _check_range("critic.lr", self.lr, 0.0, low_open=True)
        _check_range("critic.max_grad_norm", self.max_grad_norm, 0.0)
        if self.value_clip is not None and not (self.value_clip > 0.0 and math.isfinite(self.value_clip)):
            raise ValueError(f"critic.value_clip: must be a finite number > 0 or none, got {self.value_clip}")
        if self.path is not None and not os.path.isfile(os.path.join(self.path, "config.json")):
            raise ValueError(f"critic.path: {self.path!r} is not a directory with a config.json")


@dataclass
class PPOTrainerConfig:
    """A PPO training run (policy + critic)."""

    model: ModelConfig
    """The policy checkpoint."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling."""
    algorithm: PPOAlgorithmConfig = field(default_factory=PPOAlgorithmConfig)
    """The objective."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The policy optimizer (its betas, eps and weight decay also apply to the critic)."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Outputs."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """Prompts and reward."""
    num_steps: int = 20
    """Training steps (one generate -> reward -> update -> weight sync each)."""
    seed: int = 0
    """Seed of the trainer's torch generator (and the critic head's initialisation) and of problem sampling."""

    def __post_init__(self) -> None:
        _check_range("num_steps", self.num_steps, 0)
        if getattr(self.rollout, "async_mode", False):
            raise ValueError("rollout.async_mode: this PPO trainer is synchronous; async generation is GRPO-only for now")


# ---- the critic ------------------------------------------------------------------------------


class ValueModel(nn.Module):
    """A decoder backbone (HF AutoModel, no LM head) and a linear head giving one value [B, L, 1] per position."""

    def __init__(self, backbone: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.backbone(input_ids=input_ids, use_cache=False).last_hidden_state  # [B, L, H]
        # Written out rather than self.value_head(hidden): nn.Linear on 3-D input returns a view, and
        # FSDP2 cannot keep its backward hook on a view the caller might modify in place.
        return hidden @ self.value_head.weight.t() + self.value_head.bias  # [B, L, 1]


def load_sharded_value_model(path: str, model_config: ModelConfig) -> ValueModel:
    """The checkpoint's backbone plus a fresh value head in float32, each decoder layer and then the root fully_shard'ed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModel

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; call trainers.policy.init_distributed() first")
    device = torch.device("cuda", torch.cuda.current_device()) if model_config.device == "cuda" else torch.device("cpu")
    backbone = AutoModel.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    # Every rank seeds the head alike (the caller's torch.manual_seed), so the unsharded head agrees across ranks.
    model = ValueModel(backbone, backbone.config.hidden_size).to(device)
    model.eval()  # no dropout: values of the same tokens must not depend on the pass
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if model_config.param_dtype == "bfloat16" else None,
        reduce_dtype=torch.float32,
    )
    for layer in getattr(backbone, "layers", []):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def clip_and_step(params: list[torch.Tensor], optimizer: torch.optim.Optimizer, max_grad_norm: float) -> dict[str, float]:
    """Clips the gradient norm (0: off), steps the optimizer unless the norm is non-finite, clears gradients."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else math.inf)
    if _is_dtensor(norm):
        norm = norm.full_tensor()
    grad_norm = float(norm)
    skipped = not math.isfinite(grad_norm)  # the reduced norm is the same on every rank: all take the same branch
    if not skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"grad_norm": grad_norm, "step_skipped": float(skipped)}


class Critic:
    """The FSDP2-sharded value model with its own AdamW."""

    def __init__(self, model_config: ModelConfig, critic_config: CriticConfig, optim_config: OptimConfig) -> None:
        self.config = critic_config
        self.device_type = model_config.device
        self.model = load_sharded_value_model(critic_config.path or model_config.path, model_config)
        self.optimizer = torch.optim.AdamW(
            list(self.model.parameters()),
            lr=critic_config.lr,
            betas=(optim_config.beta1, optim_config.beta2),
            eps=optim_config.eps,
            weight_decay=optim_config.weight_decay,
        )

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.device_type == "cuda" else torch.device("cpu")

    def response_values(self, input_ids: torch.Tensor, prompt_lens: torch.Tensor, num_response_positions: int) -> torch.Tensor:
        """V(s_t) [B, R]: the value of the state just before response token t (the position whose logits predict it)."""
        values = self.model(input_ids.to(self.device)).float()  # [B, L, 1]
        rows = gather_response_rows(values, prompt_lens.to(self.device), num_response_positions)  # [B, R, 1]
        return rows.squeeze(-1)  # [B, R]

    def optimizer_step(self) -> dict[str, float]:
        return clip_and_step(list(self.model.parameters()), self.optimizer, self.config.max_grad_norm)


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


def start_worker(model: ModelConfig, rollout: RolloutConfig):
    """A RolloutWorker on the policy checkpoint whose logprobs are those of the distribution it samples from."""
    from rollout import RolloutWorker

    return RolloutWorker(
        model=model.path,
        multiprocess=rollout.multiprocess,
        device=model.device,
        dtype="bfloat16" if model.param_dtype == "bfloat16" else "float32",
        max_model_len=rollout.max_model_len,
        seed=rollout.seed,
        logprobs_mode="processed_logprobs",  # after temperature, as the trainer recomputes them
    )


def console_log(metrics: dict[str, float], step: int) -> None:
    """The default `log`: one line per step on stdout."""
    keys = ("reward_mean", "reward_std", "loss", "value_loss", "explained_variance", "kl", "entropy",
            "clip_fraction", "mismatch_abs", "grad_norm", "critic_grad_norm")
    shown = " ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics)
    print(f"step {step}: {shown}", flush=True)


class PPOTrainer:
    """One synchronous PPO run: the sharded policy and critic, the losses, the rollout worker (rank 0) and the weight sync.

    `worker` is a RolloutWorker (rank 0 only; other ranks pass None); when None on rank 0, one is
    started on the checkpoint and shut down by close(). `reward_fn(completions, items)` scores each
    sample against the item (a prompt, or an object with .prompt) it was generated from.
    """

    def __init__(self, config: PPOTrainerConfig, reward_fn: RewardFn, *, worker=None, log: LogFn | None = None) -> None:
        self.config = config
        self.reward_fn = reward_fn
        self.log = log or console_log
        self.rank, self.world_size = init_distributed(config.model.device)
        torch.manual_seed(config.seed)
        algo = config.algorithm
        self.policy = Policy(config.model, config.optim, reference=algo.kl_coef > 0)
        self.critic = Critic(config.model, config.critic, config.optim)
        # KL to the reference is a reward term here (it shapes the critic's targets), not a loss term.
        self.policy_loss = PPOClipLoss(PPOClipConfig(
            clip_low=algo.clip_low, clip_high=algo.clip_high, dual_clip=algo.dual_clip, aggregation=algo.aggregation,
            kl_coef=0.0, kl_estimator=algo.kl_estimator, entropy_coef=algo.entropy_coef,
            mismatch=algo.mismatch, mismatch_cap=algo.mismatch_cap,
        ))
        self.value_loss = ValueLoss(ValueConfig(clip=config.critic.value_clip, aggregation=algo.aggregation))
        self._owns_worker = False
        if self.rank == 0 and worker is None:
            worker = start_worker(config.model, config.rollout)
            self._owns_worker = True
        self.worker = worker if self.rank == 0 else None
        if self.worker is not None:
            mode = getattr(getattr(getattr(self.worker, "config", None), "model", None), "logprobs_mode", None)
            if mode == "raw_logprobs" and config.rollout.temperature != 1.0:
                raise ValueError(
                    f"worker: logprobs_mode 'raw_logprobs' ignores rollout.temperature={config.rollout.temperature}; "
                    "start the worker with logprobs_mode='processed_logprobs'"
                )
        client = LocalWeightSyncClient(self.worker) if self.rank == 0 else None
        self.sync = trainer_init(LocalTrainerInitInfo(encoding="tensors"), client=client, source=self.policy.weight_source())
        self.weight_version = self.worker.get_weight_version() if self.worker is not None else None
        self.step_count = 0

    # ---- one step ------------------------------------------------------------------------------

    def _generate(self, items: Sequence[Any]) -> tuple[RolloutBatch, torch.Tensor, dict[str, float]]:
        """Rank 0: samples, rewards [B] and rollout metrics for `items`; every rank gets the same (broadcast)."""
        cfg = self.config.rollout
        payload: list[Any] = [None]
        if self.rank == 0:
            start = time.perf_counter()
            batch = generate_rollouts(
                self.worker,
                [getattr(item, "prompt", item) for item in items],
                n=cfg.num_samples_per_prompt,
                temperature=cfg.temperature,
                max_tokens=cfg.max_tokens,
                seed=cfg.seed + self.step_count * 1_000_003,  # fresh samples every step, repeatable runs
            )
            generated = time.perf_counter()
            rewards = torch.as_tensor(list(self.reward_fn(batch.completions, [items[i] for i in batch.prompt_ids])),
                                      dtype=torch.float32)
            if rewards.shape != (batch.num_samples,):
                raise ValueError(f"reward_fn: returned {rewards.numel()} rewards for {batch.num_samples} completions")
            versions = batch.sample_versions()
            metrics = {
                "time_generate": generated - start,
                "time_reward": time.perf_counter() - generated,
                "tokens_per_s": float(batch.response_mask.sum()) / max(generated - start, 1e-9),
                "stale_fraction": sum(v != {self.weight_version} for v in versions) / len(versions),
            }
            payload = [(batch, rewards, metrics)]
        if self.world_size > 1:
            dist.broadcast_object_list(payload, src=0)
        return payload[0]

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
                if self.policy.reference is not None:
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
        if self.policy.reference is None:
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
        return self._mean_over_ranks(means)

    def _mean_over_ranks(self, metrics: dict[str, float]) -> dict[str, float]:
        if self.world_size == 1:
            return metrics
        names = sorted(metrics)  # same keys on every rank: same config, same code path
        values = torch.tensor([metrics[n] for n in names], dtype=torch.float64, device=self.policy.device)
        dist.all_reduce(values)
        return dict(zip(names, (values / self.world_size).tolist()))

    def step(self, items: Sequence[Any]) -> dict[str, float]:
        """One PPO step on `items` (prompts, or objects with .prompt that reward_fn understands); every rank calls it."""
        if not items:
            raise ValueError("items: empty; a step needs at least one prompt")
        self.step_count += 1
        step = self.step_count
        batch, rewards, metrics = self._generate(items)
        metrics = dict(metrics)
        metrics["reward_mean"] = float(rewards.mean())
        metrics["reward_std"] = float(rewards.std()) if rewards.numel() > 1 else 0.0
        metrics["response_len_mean"] = float(batch.response_mask.sum(-1).mean())

        start = time.perf_counter()
        if batch.num_samples >= self.world_size:
            metrics.update(self._train(batch, rewards))
        metrics["time_train"] = time.perf_counter() - start

        start = time.perf_counter()
        version = f"step-{step}"
        self.sync.send_weights(weight_version=version)
        self.weight_version = version
        metrics["time_sync"] = time.perf_counter() - start
        metrics["weight_version"] = float(step)
        if self.rank == 0 and step % self.config.logging.log_every == 0:
            self.log(metrics, step)
        return metrics

    def items_for_step(self, problems: Sequence[Any], step: int) -> list[Any]:
        """The num_prompts_per_step problems of 1-based `step`, cycling through `problems` in order."""
        num = self.config.rollout.num_prompts_per_step
        return [problems[((step - 1) * num + i) % len(problems)] for i in range(num)]

    def train(self, problems: Sequence[Any], num_steps: int | None = None) -> list[dict[str, float]]:
        """Runs num_steps (default config.num_steps) steps over `problems`, saving the policy on logging.save_every."""
        if not problems:
            raise ValueError("problems: empty; training needs at least one prompt")
        history = []
        for _ in range(self.config.num_steps if num_steps is None else num_steps):
            history.append(self.step(self.items_for_step(problems, self.step_count + 1)))
            every = self.config.logging.save_every
            if every and self.step_count % every == 0:
                self.policy.save(os.path.join(self.config.logging.output_dir, f"step-{self.step_count}"))
        return history

    def close(self) -> None:
        """Shuts the weight sync down (and the worker, if this trainer started it)."""
        self.sync.shutdown()
        if self._owns_worker and self.worker is not None:
            self.worker.shutdown()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- command line ----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """`python -m trainers.ppo`: train on config.task, evaluate held-out accuracy before and after, save the policy."""
    config = parse_config(PPOTrainerConfig, argv, prog="python -m trainers.ppo")
    task = importlib.import_module(config.task.module)
    problems = task.make_problems(config.task.num_train_problems, config.seed, "train")
    eval_problems = (
        task.make_problems(config.task.num_eval_problems, config.seed, "eval")
        if config.task.num_eval_problems and hasattr(task, "evaluate")
        else []
    )
    summary: dict[str, Any] = {"config": to_dict(config)}
    with PPOTrainer(config, reward_fn=task.batched_reward) as trainer:
        if trainer.rank == 0 and eval_problems:
            summary["accuracy_before"] = task.evaluate(trainer.worker, eval_problems)
            print(f"held-out accuracy before: {summary['accuracy_before']:.3f}", flush=True)
        history = trainer.train(problems)
        if trainer.rank == 0 and eval_problems:
            summary["accuracy_after"] = task.evaluate(trainer.worker, eval_problems)
            print(f"held-out accuracy after: {summary['accuracy_after']:.3f}", flush=True)
        if config.logging.save_final:
            trainer.policy.save(os.path.join(config.logging.output_dir, "final"))
        if trainer.rank == 0:
            summary["history"] = history
            os.makedirs(config.logging.output_dir, exist_ok=True)
            with open(os.path.join(config.logging.output_dir, "summary.json"), "w") as f:
                json.dump(summary, f, indent=2)
    if dist.is_initialized():
        dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:  # bad configuration: a one-line message naming the field, not a traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
