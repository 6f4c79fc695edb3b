"""Advantage estimators: group-relative (GRPO, Dr.GRPO), DAPO's group filter, GAE for the PPO critic."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, get_args

import torch

RewardScale = Literal["group", "batch", "none"]


def _as_rewards(rewards: torch.Tensor | Sequence[float], group_size: int) -> torch.Tensor:
    """rewards as a float32 [N] tensor, N a multiple of group_size >= 2 (samples of one prompt adjacent)."""
    if not isinstance(rewards, torch.Tensor):
        rewards = torch.tensor(list(rewards), dtype=torch.float32)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be a 1-D [N] tensor, got shape {list(rewards.shape)}")
    if type(group_size) is not int or group_size < 2:
        raise ValueError(f"group_size must be an int >= 2 (a group of one has no baseline), got {group_size!r}")
    if rewards.numel() == 0 or rewards.numel() % group_size != 0:
        raise ValueError(f"rewards has {rewards.numel()} entries, not a positive multiple of group_size={group_size}")
    rewards = rewards.detach()
    return rewards if rewards.is_floating_point() else rewards.float()


def grpo_advantages(
    rewards: torch.Tensor | Sequence[float], group_size: int, scale: RewardScale = "group", eps: float = 1e-6
) -> torch.Tensor:
    """GRPO advantages [N]: each reward minus its group's mean, divided by a standard deviation.

    rewards holds N // group_size groups of group_size samples of the same prompt, contiguous:
        [p0 s0, p0 s1, ..., p0 s(G-1), p1 s0, ...]
    scale: "group" divides by the group's std (GRPO), "batch" by the std of all N rewards (one
    scale for every prompt, so easy and hard prompts are not re-weighted), "none" does not divide
    (same as `dr_grpo_advantages`). Standard deviations are the unbiased (n - 1) estimate.
    """
    if scale not in get_args(RewardScale):
        raise ValueError(f"scale must be one of {get_args(RewardScale)}, got {scale!r}")
    if not (eps >= 0.0 and math.isfinite(eps)):
        raise ValueError(f"eps must be a finite number >= 0, got {eps}")
    rewards = _as_rewards(rewards, group_size)
    grouped = rewards.view(-1, group_size)  # [num_groups, group_size]
    centred = grouped - grouped.mean(dim=-1, keepdim=True)
    if scale == "group":
        centred = centred / (grouped.std(dim=-1, keepdim=True) + eps)
    elif scale == "batch":
        centred = centred / (rewards.std() + eps)
    return centred.reshape(-1)


def dr_grpo_advantages(rewards: torch.Tensor | Sequence[float], group_size: int) -> torch.Tensor:
    """Dr.GRPO advantages [N]: reward minus its group's mean, without the std division (which biases
    learning towards groups that are nearly all right or all wrong)."""
    rewards = _as_rewards(rewards, group_size)
    grouped = rewards.view(-1, group_size)
    return (grouped - grouped.mean(dim=-1, keepdim=True)).reshape(-1)


def dapo_keep_groups(rewards: torch.Tensor | Sequence[float], group_size: int) -> torch.Tensor:
    """DAPO dynamic sampling: bool [N // group_size], False for groups whose rewards are all equal.

    Such a group has zero advantage for every sample, so it adds no gradient and only dilutes the
    batch; the trainer drops it (and may sample more prompts to refill the batch).
    """
    grouped = _as_rewards(rewards, group_size).view(-1, group_size)
    return grouped.amax(dim=-1) > grouped.amin(dim=-1)


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over [B, T] per-token rewards and critic values.

    Only positions with mask = 1 are steps of the episode. Each step bootstraps from the value of
    the next masked-in position in its row, and from 0 after the last one (the episode ends there):

        mask     1   1   0   1   0   0       (a 0 in the middle, e.g. a tool output, is skipped)
        step     t0  t1      t2
        delta_t  = r_t + gamma * V(next step) - V_t
        A_t      = delta_t + gamma * lam * A(next step)
        returns  = A + V

    Returns (advantages, returns), both [B, T], 0 at masked-out positions, with no gradient.
    """
    if not (0.0 <= gamma <= 1.0):
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    if not (0.0 <= lam <= 1.0):
        raise ValueError(f"lam must be in [0, 1], got {lam}")
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 2:
        raise ValueError(f"rewards must be a [B, T] tensor, got shape {list(getattr(rewards, 'shape', []))}")
    for name, t in (("values", values), ("mask", mask)):
        if not isinstance(t, torch.Tensor) or t.shape != rewards.shape:
            raise ValueError(f"{name} must be a tensor of shape {list(rewards.shape)} like rewards")
    with torch.no_grad():
        dtype = torch.promote_types(rewards.dtype, values.dtype)
        if not dtype.is_floating_point:
            dtype = torch.float32
        rewards, values, mask = rewards.to(dtype), values.to(dtype), mask.to(dtype)
        num_steps = rewards.shape[1]
        advantages = torch.zeros_like(rewards)
        next_value = torch.zeros_like(rewards[:, 0])  # [B], V of the next masked-in step (0 past the end)
        next_advantage = torch.zeros_like(rewards[:, 0])  # [B]
        # A reverse scan over time; vectorised over the batch.
        for t in reversed(range(num_steps)):
            m = mask[:, t]
            delta = rewards[:, t] + gamma * next_value - values[:, t]
            adv_t = delta + gamma * lam * next_advantage
            advantages[:, t] = adv_t * m
            # A masked-out position passes its successor's value and advantage through unchanged.
            next_value = torch.where(m > 0, values[:, t], next_value)
            next_advantage = torch.where(m > 0, adv_t, next_advantage)
        returns = (advantages + values) * mask
    return advantages, returns


def whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Normalise values to unit variance (and zero mean if shift_mean) over the masked-in positions;
    masked-out positions are 0. PPO commonly whitens GAE advantages across the batch."""
    if not isinstance(values, torch.Tensor) or not isinstance(mask, torch.Tensor) or values.shape != mask.shape:
        raise ValueError("values and mask must be tensors of the same shape")
    with torch.no_grad():
        m = mask.to(values.dtype)
        count = m.sum().clamp(min=1.0)
        mean = (values * m).sum() / count
        var = ((values - mean).square() * m).sum() / count
        out = (values - mean) * torch.rsqrt(var + eps)
        if not shift_mean:
            out = out + mean
        return out * m
