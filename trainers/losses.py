"""Policy and value losses for PPO, GRPO, Dr.GRPO and DAPO: small classes, each returning (loss, metrics)."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from typing import Literal, get_args

import torch

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLEstimator = Literal["k1", "k2", "k3"]
MismatchCorrection = Literal["tis", "mask", "none"]

# exp() of a log-ratio beyond this is inf in float32 or meaningless; clamping keeps one bad token
# from turning the whole loss into NaN (the clipped surrogate ignores such tokens anyway).
_MAX_LOG_RATIO = 20.0


def _check_choice(name: str, value: object, literal: object) -> None:
    choices = get_args(literal)
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


# --------------------------------------------------------------------------- batch


@dataclass
class PolicyBatch:
    """Per-token tensors of one policy-loss step, all [B, T] (B sequences, T padded response positions)."""

    logprobs: torch.Tensor
    """Trainer logprobs of the sampled tokens under the current parameters (carries the gradient)."""
    old_logprobs: torch.Tensor
    """Trainer logprobs at the start of the step: the behaviour policy of the PPO ratio (no gradient)."""
    advantages: torch.Tensor
    """Advantages, e.g. a sequence-level advantage broadcast over its tokens."""
    mask: torch.Tensor
    """1 (or True) on response tokens that count, 0 on prompt, padding and anything else."""
    ref_logprobs: torch.Tensor | None = None
    """Logprobs under the frozen reference policy, for the KL penalty."""
    rollout_logprobs: torch.Tensor | None = None
    """The inference engine's logprobs of the same tokens, for mismatch metrics and correction."""
    entropy: torch.Tensor | None = None
    """Per-token entropy of the trainer's distribution (carries the gradient for the entropy bonus)."""

    def __post_init__(self) -> None:
        if not isinstance(self.logprobs, torch.Tensor) or self.logprobs.dim() != 2:
            raise ValueError(f"logprobs must be a [B, T] tensor, got {_describe(self.logprobs)}")
        shape = tuple(self.logprobs.shape)
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in ("ref_logprobs", "rollout_logprobs", "entropy"):
                continue
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
                raise ValueError(
                    f"{f.name} must be a tensor of shape {list(shape)} like logprobs, got {_describe(value)}"
                )
            if f.name != "mask" and not value.is_floating_point():
                raise ValueError(f"{f.name} must be a floating-point tensor, got {value.dtype}")


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor of shape {list(value.shape)}"
    return type(value).__name__


# --------------------------------------------------------------------------- aggregation


def aggregate(
    loss_mat: torch.Tensor, mask: torch.Tensor, mode: Aggregation, norm_length: int | None = None
) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to a scalar over the tokens where mask is 1.

    token-mean               sum over all tokens / number of tokens (each token weighs the same; DAPO)
    seq-mean-token-mean      mean over tokens within a sequence, then mean over sequences (GRPO)
    seq-mean-token-sum-norm  sum over tokens within a sequence / norm_length (a constant, default T),
                             then mean over sequences: no length bias (Dr.GRPO)

    Sequences without any masked-in token do not count; an all-masked batch gives 0 (still attached
    to the graph, so backward() works on every rank).
    """
    _check_choice("aggregation", mode, Aggregation)
    mask = mask.to(loss_mat.dtype)
    # where(), not a product: a non-finite value at a padded position must not poison the sum.
    masked = torch.where(mask > 0, loss_mat, torch.zeros_like(loss_mat))  # [B, T]
    if mode == "token-mean":
        return masked.sum() / mask.sum().clamp(min=1.0)
    tokens_per_seq = mask.sum(dim=-1)  # [B]
    has_tokens = (tokens_per_seq > 0).to(loss_mat.dtype)  # [B]
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(dim=-1) / tokens_per_seq.clamp(min=1.0)
    else:
        length = norm_length if norm_length is not None else loss_mat.shape[-1]
        per_seq = masked.sum(dim=-1) / length
    return (per_seq * has_tokens).sum() / has_tokens.sum().clamp(min=1.0)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of values over the positions where mask is 1 (0 when there are none)."""
    mask = mask.to(values.dtype)
    return torch.where(mask > 0, values, torch.zeros_like(values)).sum() / mask.sum().clamp(min=1.0)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from tokens sampled by the policy.

    With d = logprobs - ref_logprobs (the log of pi/ref at the sampled token):
    k1 = d (unbiased, can be negative), k2 = d^2 / 2 (low variance, biased),
    k3 = exp(-d) - 1 + d (unbiased and never negative).
    """
    _check_choice("kl_estimator", estimator, KLEstimator)
    d = (logprobs - ref_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d.square()
    return torch.exp(-d) - 1.0 + d


# --------------------------------------------------------------------------- policy losses


@dataclass
class PPOClipConfig:
    """The clipped-surrogate policy loss and its regularisers (PPO defaults)."""

    clip_low: float = 0.2
    """The ratio is clipped below at 1 - clip_low."""
    clip_high: float = 0.2
    """The ratio is clipped above at 1 + clip_high (larger than clip_low is DAPO's clip-higher)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1: for negative advantages the loss is at most -c * A; None disables it."""
    aggregation: Aggregation = "token-mean"
    """How per-token losses reduce to a scalar (see `aggregate`)."""
    norm_length: int | None = None
    """The constant divisor of seq-mean-token-sum-norm (e.g. the max response length); None uses T."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the frozen reference policy; 0 disables it."""
    kl_estimator: KLEstimator = "k3"
    """Per-token KL estimator: k1, k2 or k3."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss); 0 disables it."""
    mismatch: MismatchCorrection = "tis"
    """Train/inference mismatch correction: tis (truncated importance weights), mask (drop tokens), none."""
    mismatch_cap: float = 2.0
    """tis: weights are capped at this value; mask: tokens with a ratio outside [1/cap, cap] are dropped."""

    def __post_init__(self) -> None:
        if not 0.0 < self.clip_low < 1.0:
            raise ValueError(f"clip_low must be in (0, 1), got {self.clip_low}")
        if not self.clip_high > 0.0:
            raise ValueError(f"clip_high must be > 0, got {self.clip_high}")
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ValueError(f"dual_clip must be > 1 or None, got {self.dual_clip}")
        _check_choice("aggregation", self.aggregation, Aggregation)
        if self.norm_length is not None and self.norm_length < 1:
            raise ValueError(f"norm_length must be >= 1 or None, got {self.norm_length}")
        if not (self.kl_coef >= 0.0 and math.isfinite(self.kl_coef)):
            raise ValueError(f"kl_coef must be a finite number >= 0, got {self.kl_coef}")
        _check_choice("kl_estimator", self.kl_estimator, KLEstimator)
        if not (self.entropy_coef >= 0.0 and math.isfinite(self.entropy_coef)):
            raise ValueError(f"entropy_coef must be a finite number >= 0, got {self.entropy_coef}")
        _check_choice("mismatch", self.mismatch, MismatchCorrection)
        if not (self.mismatch_cap > 1.0 and math.isfinite(self.mismatch_cap)):
            raise ValueError(f"mismatch_cap must be a finite number > 1, got {self.mismatch_cap}")


@dataclass
class GRPOConfig(PPOClipConfig):
    """GRPO: the PPO surrogate averaged per sequence, then over sequences; no KL unless asked for."""

    aggregation: Aggregation = "seq-mean-token-mean"
    """How per-token losses reduce to a scalar (see `aggregate`)."""


@dataclass
class DrGRPOConfig(PPOClipConfig):
    """Dr.GRPO: token sums divided by a constant length, so long answers are not under-weighted."""

    aggregation: Aggregation = "seq-mean-token-sum-norm"
    """How per-token losses reduce to a scalar (see `aggregate`)."""


@dataclass
class DAPOConfig(PPOClipConfig):
    """DAPO: clip-higher (0.2 / 0.28) and token-level aggregation; pair with `dapo_keep_groups`."""

    clip_high: float = 0.28
    """The ratio is clipped above at 1 + clip_high (larger than clip_low is DAPO's clip-higher)."""
    aggregation: Aggregation = "token-mean"
    """How per-token losses reduce to a scalar (see `aggregate`)."""


class PolicyLoss(ABC):
    """A policy loss: a scalar to minimise and float metrics for logging."""

    @abstractmethod
    def __call__(self, batch: PolicyBatch) -> tuple[torch.Tensor, dict[str, float]]: ...


class PPOClipLoss(PolicyLoss):
    """Clipped surrogate with separate low/high clip, optional dual clip, KL and entropy terms, and
    train/inference mismatch correction.

    Per token (r = exp(logprobs - old_logprobs), A the advantage, w the mismatch weight):
        pg   = max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))
        pg   = min(pg, -c * A) where A < 0                (dual clip, when c is set)
        loss = w * pg + kl_coef * KL(pi || ref) - entropy_coef * entropy
    then `aggregate`d over the mask. w corrects for the engine having sampled with slightly
    different probabilities than the trainer computes for the same weights: it is computed from
    old_logprobs - rollout_logprobs and never carries a gradient.
    """

    config_cls: type[PPOClipConfig] = PPOClipConfig

    def __init__(self, config: PPOClipConfig | None = None) -> None:
        if config is None:
            config = self.config_cls()
        if not isinstance(config, PPOClipConfig):
            raise ValueError(f"config must be a PPOClipConfig, got {type(config).__name__}")
        self.config = config

    def __call__(self, batch: PolicyBatch) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.config
        if cfg.kl_coef > 0.0 and batch.ref_logprobs is None:
            raise ValueError("ref_logprobs must be given when kl_coef > 0")
        if cfg.entropy_coef > 0.0 and batch.entropy is None:
            raise ValueError("entropy must be given when entropy_coef > 0")

        mask = batch.mask.to(batch.logprobs.dtype)  # [B, T]
        # Only the current policy's outputs carry gradient; everything else is a fixed target.
        old_logprobs = batch.old_logprobs.detach()
        advantages = batch.advantages.detach().to(batch.logprobs.dtype)

        log_ratio = (batch.logprobs - old_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        ratio = torch.exp(log_ratio)  # [B, T]
        pg_unclipped = -advantages * ratio
        pg_clipped = -advantages * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
        pg = torch.maximum(pg_unclipped, pg_clipped)
        clipped = pg_clipped > pg_unclipped
        metrics: dict[str, torch.Tensor] = {}
        if cfg.dual_clip is not None:
            # With A < 0 and a huge ratio the clipped surrogate is unbounded; cap it at -c * A.
            pg_dual = -advantages * cfg.dual_clip
            dual = (advantages < 0) & (pg > pg_dual)
            pg = torch.where(dual, pg_dual, pg)
            metrics["dual_clip_fraction"] = masked_mean(dual.to(mask.dtype), mask)

        weight, mismatch_metrics = self._mismatch_weight(batch, old_logprobs, mask)
        metrics.update(mismatch_metrics)
        loss_mat = pg * weight if weight is not None else pg
        metrics["pg_loss"] = aggregate(loss_mat.detach(), mask, cfg.aggregation, cfg.norm_length)

        if batch.ref_logprobs is not None:
            kl = kl_penalty(batch.logprobs, batch.ref_logprobs.detach(), cfg.kl_estimator)
            metrics["kl"] = masked_mean(kl.detach(), mask)
            if cfg.kl_coef > 0.0:
                loss_mat = loss_mat + cfg.kl_coef * kl
        if batch.entropy is not None:
            metrics["entropy"] = masked_mean(batch.entropy.detach(), mask)
            if cfg.entropy_coef > 0.0:
                loss_mat = loss_mat - cfg.entropy_coef * batch.entropy

        loss = aggregate(loss_mat, mask, cfg.aggregation, cfg.norm_length)
        metrics["loss"] = loss.detach()
        metrics["clip_fraction"] = masked_mean(clipped.to(mask.dtype), mask)
        metrics["ratio_mean"] = masked_mean(ratio.detach(), mask)
        # k3 estimate of KL(old || current): how far this step has moved the policy.
        metrics["approx_kl"] = masked_mean((torch.exp(-log_ratio) - 1.0 + log_ratio).detach(), mask)
        return loss, _to_floats(metrics)

    def _mismatch_weight(
        self, batch: PolicyBatch, old_logprobs: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """Per-token correction weights [B, T] (None: all ones) and the mismatch metrics."""
        one = mask.new_ones(())
        if batch.rollout_logprobs is None:
            return None, {"is_weight_mean": one}
        cfg = self.config
        # delta = log(pi_trainer / pi_engine) of the sampled token; the engine sampled it, so
        # exp(delta) is the importance weight from the engine's distribution to the trainer's.
        delta = (old_logprobs - batch.rollout_logprobs.detach()).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        is_ratio = torch.exp(delta)  # [B, T]
        metrics = {
            "mismatch_abs": masked_mean(delta.abs(), mask),
            # k3 estimate of KL(engine || trainer) from engine samples: r - 1 - log r with r = exp(delta).
            "mismatch_kl": masked_mean(is_ratio - 1.0 - delta, mask),
        }
        if cfg.mismatch == "none":
            metrics["is_weight_mean"] = one
            return None, metrics
        if cfg.mismatch == "tis":
            weight = is_ratio.clamp(max=cfg.mismatch_cap)
        else:
            keep = (is_ratio >= 1.0 / cfg.mismatch_cap) & (is_ratio <= cfg.mismatch_cap)
            weight = keep.to(mask.dtype)
            metrics["mismatch_masked_fraction"] = masked_mean(1.0 - weight, mask)
        metrics["is_weight_mean"] = masked_mean(weight, mask)
        return weight, metrics


class GRPOLoss(PPOClipLoss):
    """GRPO's policy loss (use with `grpo_advantages`)."""

    config_cls = GRPOConfig


class DrGRPOLoss(PPOClipLoss):
    """Dr.GRPO's policy loss (use with `dr_grpo_advantages`)."""

    config_cls = DrGRPOConfig


class DAPOLoss(PPOClipLoss):
    """DAPO's policy loss (use with `grpo_advantages` and `dapo_keep_groups`)."""

    config_cls = DAPOConfig


# --------------------------------------------------------------------------- value loss


@dataclass
class ValueConfig:
    """The PPO critic's clipped value loss."""

    clip: float | None = 0.2
    """How far values may move from old_values before the clipped loss takes over; None disables clipping."""
    aggregation: Aggregation = "token-mean"
    """How per-token losses reduce to a scalar (see `aggregate`)."""

    def __post_init__(self) -> None:
        if self.clip is not None and not (self.clip > 0.0 and math.isfinite(self.clip)):
            raise ValueError(f"clip must be a finite number > 0 or None, got {self.clip}")
        _check_choice("aggregation", self.aggregation, Aggregation)


class ValueLoss:
    """0.5 * max((V - R)^2, (V_clipped - R)^2) with V_clipped = V_old + clip(V - V_old, -clip, clip)."""

    def __init__(self, config: ValueConfig | None = None) -> None:
        if config is None:
            config = ValueConfig()
        if not isinstance(config, ValueConfig):
            raise ValueError(f"config must be a ValueConfig, got {type(config).__name__}")
        self.config = config

    def __call__(
        self, values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        if not isinstance(values, torch.Tensor) or values.dim() != 2:
            raise ValueError(f"values must be a [B, T] tensor, got {_describe(values)}")
        for name, t in (("old_values", old_values), ("returns", returns), ("mask", mask)):
            if not isinstance(t, torch.Tensor) or t.shape != values.shape:
                raise ValueError(
                    f"{name} must be a tensor of shape {list(values.shape)} like values, got {_describe(t)}"
                )
        mask = mask.to(values.dtype)
        old_values = old_values.detach()
        returns = returns.detach()
        loss_unclipped = (values - returns).square()  # [B, T]
        metrics: dict[str, torch.Tensor] = {}
        if self.config.clip is not None:
            values_clipped = old_values + (values - old_values).clamp(-self.config.clip, self.config.clip)
            loss_clipped = (values_clipped - returns).square()
            loss_mat = 0.5 * torch.maximum(loss_unclipped, loss_clipped)
            metrics["value_clip_fraction"] = masked_mean((loss_clipped > loss_unclipped).to(mask.dtype), mask)
        else:
            loss_mat = 0.5 * loss_unclipped
            metrics["value_clip_fraction"] = mask.new_zeros(())
        loss = aggregate(loss_mat, mask, self.config.aggregation)
        metrics["value_loss"] = loss.detach()
        metrics["value_mean"] = masked_mean(values.detach(), mask)
        # 1 - Var(R - V) / Var(R) over the masked tokens: 1 is a perfect critic, <= 0 a useless one.
        residual_var = _masked_var(returns - values.detach(), mask)
        metrics["explained_variance"] = 1.0 - residual_var / _masked_var(returns, mask).clamp(min=1e-8)
        return loss, _to_floats(metrics)


def _masked_var(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mean = masked_mean(values, mask)
    return masked_mean((values - mean).square(), mask)


def _to_floats(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    # One device-to-host transfer for all metrics instead of one .item() sync each.
    names = list(metrics)
    floats = torch.stack([metrics[n].detach().float().reshape(()) for n in names]).tolist()
    return dict(zip(names, floats))
