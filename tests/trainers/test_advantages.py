"""Advantage estimators: GRPO / Dr.GRPO by hand, DAPO's group filter, GAE against a plain-loop reference."""

from __future__ import annotations

import math
import random

import pytest
import torch

from trainers.advantages import dapo_keep_groups, dr_grpo_advantages, gae, grpo_advantages, whiten

D = torch.float64


def test_grpo_group_scaling_hand_computed():
    # Group 0 [1, 0, 0, 0]: mean 0.25, unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5
    #   -> [0.75, -0.25, -0.25, -0.25] / 0.5 = [1.5, -0.5, -0.5, -0.5]
    # Group 1 [1, 1, 1, 1]: all equal -> 0 (std 0, centred 0, eps keeps it finite)
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0], dtype=D)
    adv = grpo_advantages(rewards, group_size=4, scale="group")
    torch.testing.assert_close(adv, torch.tensor([1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0], dtype=D), atol=1e-5, rtol=0)
    assert adv.dtype == D


def test_grpo_batch_and_no_scaling_hand_computed():
    rewards = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    centred = torch.tensor([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0])
    torch.testing.assert_close(grpo_advantages(rewards, 4, scale="none"), centred)
    # Batch std over all 8 rewards: mean 5/8; squared deviations 5 * 0.375^2 + 3 * 0.625^2 = 1.875;
    # unbiased: sqrt(1.875 / 7).
    batch_std = math.sqrt(1.875 / 7)
    torch.testing.assert_close(grpo_advantages(rewards, 4, scale="batch", eps=0.0), centred / batch_std)
    # Dr.GRPO is the centred reward, no division.
    torch.testing.assert_close(dr_grpo_advantages(rewards, 4), centred)


def test_grpo_advantages_sum_to_zero_per_group():
    torch.manual_seed(0)
    rewards = torch.rand(6 * 5)
    for scale in ("group", "batch", "none"):
        adv = grpo_advantages(rewards, 5, scale=scale).view(6, 5)
        torch.testing.assert_close(adv.sum(-1), torch.zeros(6), atol=1e-5, rtol=0)
    # Group scaling gives each (non-constant) group unit unbiased std.
    adv = grpo_advantages(rewards, 5, scale="group", eps=0.0).view(6, 5)
    torch.testing.assert_close(adv.std(-1), torch.ones(6), atol=1e-5, rtol=0)


def test_dapo_keep_groups_drops_all_equal_groups():
    rewards = [0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.2, 0.0]
    keep = dapo_keep_groups(rewards, group_size=2)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [False, False, True, False, True]
    assert dapo_keep_groups(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0]), 3).tolist() == [True, False]


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda: grpo_advantages([1.0, 0.0, 1.0], 2), "rewards"),
        (lambda: grpo_advantages([1.0, 0.0], 1), "group_size"),
        (lambda: grpo_advantages([1.0, 0.0], 2.0), "group_size"),
        (lambda: grpo_advantages(torch.zeros(2, 2), 2), "rewards"),
        (lambda: grpo_advantages([], 2), "rewards"),
        (lambda: grpo_advantages([1.0, 0.0], 2, scale="prompt"), "scale"),
        (lambda: grpo_advantages([1.0, 0.0], 2, eps=-1.0), "eps"),
        (lambda: dr_grpo_advantages([1.0, 0.0, 1.0], 2), "rewards"),
        (lambda: dapo_keep_groups([1.0, 0.0], 0), "group_size"),
        (lambda: gae(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), gamma=1.5, lam=1.0), "gamma"),
        (lambda: gae(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), gamma=1.0, lam=-0.1), "lam"),
        (lambda: gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), gamma=1.0, lam=1.0), "values"),
        (lambda: gae(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(3), gamma=1.0, lam=1.0), "mask"),
        (lambda: gae(torch.zeros(6), torch.zeros(6), torch.ones(6), gamma=1.0, lam=1.0), "rewards"),
    ],
)
def test_bad_input_names_the_field(call, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        call()


def test_gae_hand_computed():
    rewards = torch.tensor([[0.0, 0.0, 1.0]], dtype=D)
    values = torch.tensor([[0.5, 0.6, 0.7]], dtype=D)
    mask = torch.ones(1, 3, dtype=D)
    # gamma = lam = 1: advantage = return-to-go (1 everywhere) minus V.
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.4, 0.3]], dtype=D))
    torch.testing.assert_close(ret, torch.ones(1, 3, dtype=D))
    # gamma 0.9, lam 0.5 (gamma * lam = 0.45):
    #   t2: delta = 1 + 0 - 0.7 = 0.3                 A = 0.3
    #   t1: delta = 0 + 0.9 * 0.7 - 0.6 = 0.03        A = 0.03 + 0.45 * 0.3 = 0.165
    #   t0: delta = 0 + 0.9 * 0.6 - 0.5 = 0.04        A = 0.04 + 0.45 * 0.165 = 0.11425
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.11425, 0.165, 0.3]], dtype=D))
    torch.testing.assert_close(ret, torch.tensor([[0.61425, 0.765, 1.0]], dtype=D))


def test_gae_skips_masked_positions():
    # The middle position is not a step (e.g. a tool output): its reward 5 and value 9 are ignored,
    # and t0 bootstraps from t2. gamma = lam = 1: A = [1 - 0.5, 0, 1 - 0.7].
    rewards = torch.tensor([[0.0, 5.0, 1.0, 0.0]], dtype=D)
    values = torch.tensor([[0.5, 9.0, 0.7, 4.0]], dtype=D)
    mask = torch.tensor([[1, 0, 1, 0]], dtype=D)
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.0, 0.3, 0.0]], dtype=D))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 0.0, 1.0, 0.0]], dtype=D))


def reference_gae(rewards, values, mask, gamma, lam):
    """Plain Python: per row, list the masked-in steps, run the textbook GAE recursion over them."""
    num_rows, num_cols = len(rewards), len(rewards[0])
    adv = [[0.0] * num_cols for _ in range(num_rows)]
    ret = [[0.0] * num_cols for _ in range(num_rows)]
    for b in range(num_rows):
        steps = [i for i in range(num_cols) if mask[b][i] == 1]
        last_adv = 0.0
        for k in range(len(steps) - 1, -1, -1):
            i = steps[k]
            next_value = values[b][steps[k + 1]] if k + 1 < len(steps) else 0.0
            delta = rewards[b][i] + gamma * next_value - values[b][i]
            last_adv = delta + gamma * lam * last_adv
            adv[b][i] = last_adv
            ret[b][i] = last_adv + values[b][i]
    return adv, ret


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.0, 0.7), (0.8, 1.0)])
def test_gae_matches_reference_loop_on_random_data(gamma, lam):
    rng = random.Random(1234)
    num_rows, num_cols = 7, 13
    rewards = [[rng.gauss(0, 1) for _ in range(num_cols)] for _ in range(num_rows)]
    values = [[rng.gauss(0, 1) for _ in range(num_cols)] for _ in range(num_rows)]
    mask = []
    for b in range(num_rows):
        if b == 0:
            mask.append([0] * num_cols)  # a row without steps
        elif b == 1:
            mask.append([1] * num_cols)
        elif b == 2:
            start, end = 3, 9  # a contiguous response with left and right padding
            mask.append([1 if start <= i < end else 0 for i in range(num_cols)])
        else:
            mask.append([1 if rng.random() < 0.6 else 0 for _ in range(num_cols)])  # holes anywhere
    adv, ret = gae(
        torch.tensor(rewards, dtype=D), torch.tensor(values, dtype=D), torch.tensor(mask, dtype=D), gamma, lam
    )
    ref_adv, ref_ret = reference_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, torch.tensor(ref_adv, dtype=D))
    torch.testing.assert_close(ret, torch.tensor(ref_ret, dtype=D))


def test_gae_has_no_gradient_and_accepts_bool_mask():
    values = torch.randn(2, 4, requires_grad=True)
    rewards = torch.randn(2, 4)
    mask = torch.tensor([[True, True, False, False], [True, True, True, True]])
    adv, ret = gae(rewards, values, mask, gamma=0.99, lam=0.95)
    assert not adv.requires_grad and not ret.requires_grad
    assert adv.dtype == torch.float32
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


def test_whiten_over_masked_positions():
    torch.manual_seed(0)
    values = torch.randn(4, 6, dtype=D) * 3 + 2
    mask = (torch.rand(4, 6) > 0.4).to(D)
    out = whiten(values, mask)
    kept = out[mask > 0]
    assert kept.mean().abs().item() < 1e-9
    assert kept.var(unbiased=False).item() == pytest.approx(1.0, abs=1e-6)
    assert (out[mask == 0] == 0).all()
    # shift_mean=False keeps the original mean and only rescales.
    out_keep = whiten(values, mask, shift_mean=False)
    assert out_keep[mask > 0].mean().item() == pytest.approx(values[mask > 0].mean().item())
