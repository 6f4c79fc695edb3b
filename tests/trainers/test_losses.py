"""Policy and value losses against hand-computed examples, gradient flow, and config validation."""

from __future__ import annotations

import math

import pytest
import torch

from trainers.losses import (
    DAPOConfig,
    DAPOLoss,
    DrGRPOLoss,
    GRPOConfig,
    GRPOLoss,
    PolicyBatch,
    PolicyLoss,
    PPOClipConfig,
    PPOClipLoss,
    ValueConfig,
    ValueLoss,
    aggregate,
    kl_penalty,
)

D = torch.float64


def t(data) -> torch.Tensor:
    return torch.tensor(data, dtype=D)


def batch_with_ratios(ratios, advantages, mask=None, **extra) -> PolicyBatch:
    """A batch whose logprobs - old_logprobs = log(ratios); logprobs is a leaf with grad."""
    ratios = t(ratios)
    old = torch.log(torch.linspace(0.2, 0.6, ratios.numel(), dtype=D)).view_as(ratios)
    logprobs = (old + torch.log(ratios)).detach().requires_grad_(True)
    mask = torch.ones_like(ratios) if mask is None else t(mask)
    return PolicyBatch(logprobs=logprobs, old_logprobs=old, advantages=t(advantages), mask=mask, **extra)


def test_ppo_clip_hand_computed_loss_clip_fraction_and_gradient():
    # clip 0.2 / 0.2, per token pg = max(-A r, -A clip(r, 0.8, 1.2)):
    #   r=1.5 A=+1: max(-1.5, -1.2) = -1.2  clipped
    #   r=0.5 A=+1: max(-0.5, -0.8) = -0.5
    #   r=1.1 A=-1: max( 1.1,  1.1) =  1.1  (inside the clip range)
    #   r=0.7 A=-1: max( 0.7,  0.8) =  0.8  clipped
    # token-mean = (-1.2 - 0.5 + 1.1 + 0.8) / 4 = 0.05, clip_fraction = 2/4
    batch = batch_with_ratios([[1.5, 0.5, 1.1, 0.7]], [[1.0, 1.0, -1.0, -1.0]])
    loss, metrics = PPOClipLoss()(batch)
    assert loss.item() == pytest.approx(0.05, abs=1e-12)
    assert metrics["clip_fraction"] == pytest.approx(0.5)
    assert metrics["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.1 + 0.7) / 4)
    assert metrics["is_weight_mean"] == 1.0  # no rollout logprobs: nothing to correct
    assert all(isinstance(v, float) for v in metrics.values())
    loss.backward()
    # d(-A r)/d logprob = -A r on unclipped tokens, divided by 4 tokens; clipped tokens get none.
    expected = t([[0.0, -0.5 / 4, 1.1 / 4, 0.0]])
    torch.testing.assert_close(batch.logprobs.grad, expected)


def test_clip_higher_lets_positive_advantages_move_further():
    # r = 1.25, A = +1: symmetric clip 0.2 caps the objective at 1.2; DAPO's clip_high 0.28 does not.
    batch = batch_with_ratios([[1.25]], [[1.0]])
    loss_sym, m_sym = PPOClipLoss()(batch)
    loss_dapo, m_dapo = DAPOLoss()(batch)
    assert loss_sym.item() == pytest.approx(-1.2)
    assert m_sym["clip_fraction"] == 1.0
    assert loss_dapo.item() == pytest.approx(-1.25)
    assert m_dapo["clip_fraction"] == 0.0
    # The low side is unchanged: r = 0.7 with A = -1 is clipped at 0.8 by both.
    low = batch_with_ratios([[0.7]], [[-1.0]])
    assert DAPOLoss()(low)[0].item() == pytest.approx(0.8)


def test_dual_clip_bounds_negative_advantage_loss():
    # r = 5:  A = -1: max(5, 1.2) = 5, dual clip c = 3 caps it at -c A = 3
    #         A = +1: max(-5, -1.2) = -1.2, dual clip does not apply to positive advantages
    batch = batch_with_ratios([[5.0, 5.0]], [[-1.0, 1.0]])
    loss_plain, _ = PPOClipLoss()(batch)
    assert loss_plain.item() == pytest.approx((5.0 - 1.2) / 2)
    loss, metrics = PPOClipLoss(PPOClipConfig(dual_clip=3.0))(batch)
    assert loss.item() == pytest.approx((3.0 - 1.2) / 2)
    assert metrics["dual_clip_fraction"] == pytest.approx(0.5)
    loss.backward()
    # Both tokens sit on a constant (clipped) branch: no gradient.
    torch.testing.assert_close(batch.logprobs.grad, torch.zeros(1, 2, dtype=D))


def aggregation_batch() -> PolicyBatch:
    # ratio 1 everywhere, so pg = -A. Masked-in losses: row 0 [-1, -3], row 1 [2, 2, 2, 2], row 2 none.
    return batch_with_ratios(
        [[1.0] * 4] * 3,
        [[1.0, 3.0, 99.0, 99.0], [-2.0] * 4, [7.0] * 4],
        mask=[[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]],
    )


def test_aggregation_modes_hand_computed():
    batch = aggregation_batch()
    # token-mean: (-1 - 3 + 2 * 4) / 6 tokens
    assert PPOClipLoss(PPOClipConfig(aggregation="token-mean"))(batch)[0].item() == pytest.approx(4 / 6)
    # seq-mean-token-mean: row means -2 and 2 -> 0 (row 2 has no tokens and does not count)
    assert PPOClipLoss(PPOClipConfig(aggregation="seq-mean-token-mean"))(batch)[0].item() == pytest.approx(0.0)
    # seq-mean-token-sum-norm with T = 4: row sums -4/4 = -1 and 8/4 = 2 -> 0.5
    cfg = PPOClipConfig(aggregation="seq-mean-token-sum-norm")
    assert PPOClipLoss(cfg)(batch)[0].item() == pytest.approx(0.5)
    # ... with a constant norm_length 8: -0.5 and 1 -> 0.25
    cfg = PPOClipConfig(aggregation="seq-mean-token-sum-norm", norm_length=8)
    assert PPOClipLoss(cfg)(batch)[0].item() == pytest.approx(0.25)


def test_variants_differ_by_config_defaults_only():
    batch = aggregation_batch()
    assert GRPOLoss()(batch)[0].item() == pytest.approx(0.0)  # seq-mean-token-mean
    assert DrGRPOLoss()(batch)[0].item() == pytest.approx(0.5)  # seq-mean-token-sum-norm
    assert DAPOLoss()(batch)[0].item() == pytest.approx(4 / 6)  # token-mean
    for loss_cls in (PPOClipLoss, GRPOLoss, DrGRPOLoss, DAPOLoss):
        loss = loss_cls()
        assert isinstance(loss, PolicyLoss)
        # KL is off by default and mismatch correction is on by default.
        assert loss.config.kl_coef == 0.0
        assert loss.config.mismatch == "tis"
    assert DAPOLoss().config.clip_low == 0.2 and DAPOLoss().config.clip_high == 0.28
    # An explicit config wins over the class default.
    assert GRPOLoss(GRPOConfig(aggregation="token-mean"))(batch)[0].item() == pytest.approx(4 / 6)


def test_kl_penalty_estimators_hand_computed():
    d = t([math.log(2.0), -math.log(2.0)])  # logprobs - ref_logprobs
    ref = t([-1.0, -2.0])
    lp = ref + d
    torch.testing.assert_close(kl_penalty(lp, ref, "k1"), d)
    torch.testing.assert_close(kl_penalty(lp, ref, "k2"), 0.5 * d.square())
    # k3 = exp(-d) - 1 + d: 0.5 - 1 + ln 2 and 2 - 1 - ln 2
    torch.testing.assert_close(kl_penalty(lp, ref, "k3"), t([math.log(2) - 0.5, 1 - math.log(2)]))
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_penalty(lp, ref, "k4")


def test_kl_term_in_loss_and_gradient():
    # A = 0 so the surrogate is 0; d = ±ln 2; k3 values ln2 - 0.5 and 1 - ln2 average to 0.25.
    batch = batch_with_ratios([[1.0, 1.0]], [[0.0, 0.0]])
    batch.ref_logprobs = batch.logprobs.detach() - t([[math.log(2.0), -math.log(2.0)]])
    loss, metrics = PPOClipLoss(PPOClipConfig(kl_coef=0.1, kl_estimator="k3"))(batch)
    assert metrics["kl"] == pytest.approx(0.25)
    assert loss.item() == pytest.approx(0.1 * 0.25)
    loss.backward()
    # d k3 / d logprob = 1 - exp(-d): 0.5 and -1; times kl_coef 0.1 over 2 tokens.
    torch.testing.assert_close(batch.logprobs.grad, t([[0.025, -0.05]]))
    # KL off (GRPO default): reported, not added.
    loss_off, metrics_off = GRPOLoss()(batch)
    assert loss_off.item() == pytest.approx(0.0)
    assert metrics_off["kl"] == pytest.approx(0.25)


def test_entropy_bonus_hand_computed():
    entropy = t([[1.0, 3.0]]).requires_grad_(True)
    batch = batch_with_ratios([[1.0, 1.0]], [[0.0, 0.0]], entropy=entropy)
    loss, metrics = PPOClipLoss(PPOClipConfig(entropy_coef=0.01))(batch)
    # loss = -0.01 * mean(1, 3) = -0.02
    assert loss.item() == pytest.approx(-0.02)
    assert metrics["entropy"] == pytest.approx(2.0)
    loss.backward()
    torch.testing.assert_close(entropy.grad, t([[-0.005, -0.005]]))


def mismatch_batch() -> PolicyBatch:
    # ratio 1 and A = 1: pg = -1 per token. The engine's probabilities are such that
    # exp(old - rollout) = [0.6, 1, 3].
    batch = batch_with_ratios([[1.0, 1.0, 1.0]], [[1.0, 1.0, 1.0]])
    batch.rollout_logprobs = batch.old_logprobs - t([[math.log(0.6), 0.0, math.log(3.0)]])
    return batch


def test_mismatch_metrics_and_truncated_importance_sampling():
    loss, metrics = PPOClipLoss(PPOClipConfig(mismatch="tis", mismatch_cap=2.0))(mismatch_batch())
    # mean |delta| = (|ln 0.6| + 0 + ln 3) / 3
    assert metrics["mismatch_abs"] == pytest.approx((abs(math.log(0.6)) + math.log(3.0)) / 3)
    # k3 estimate, r - 1 - ln r per token: (0.6 - 1 - ln 0.6) + 0 + (3 - 1 - ln 3)
    expected_kl = ((0.6 - 1 - math.log(0.6)) + (3 - 1 - math.log(3.0))) / 3
    assert metrics["mismatch_kl"] == pytest.approx(expected_kl)
    # weights min(r, 2) = [0.6, 1, 2]: loss = -(0.6 + 1 + 2) / 3
    assert metrics["is_weight_mean"] == pytest.approx(3.6 / 3)
    assert loss.item() == pytest.approx(-3.6 / 3)


def test_mismatch_masking_and_none():
    loss, metrics = PPOClipLoss(PPOClipConfig(mismatch="mask", mismatch_cap=2.0))(mismatch_batch())
    # r = 3 is outside [1/2, 2] and is dropped; the denominator stays 3 tokens, so keeping
    # fewer tokens does not up-weight the rest: -(1 + 1 + 0) / 3.
    assert loss.item() == pytest.approx(-2 / 3)
    assert metrics["mismatch_masked_fraction"] == pytest.approx(1 / 3)
    assert metrics["is_weight_mean"] == pytest.approx(2 / 3)
    loss, metrics = PPOClipLoss(PPOClipConfig(mismatch="none"))(mismatch_batch())
    assert loss.item() == pytest.approx(-1.0)
    assert metrics["is_weight_mean"] == 1.0
    assert metrics["mismatch_abs"] > 0.5  # still measured when not corrected


def test_gradients_flow_only_through_logprobs_and_entropy():
    torch.manual_seed(0)
    shape = (3, 5)

    def leaf(x):
        return x.to(D).requires_grad_(True)

    logprobs = leaf(-torch.rand(shape) - 0.1)
    batch = PolicyBatch(
        logprobs=logprobs,
        old_logprobs=leaf(logprobs.detach() + 0.1 * torch.randn(shape)),
        advantages=leaf(torch.randn(shape)),
        mask=(torch.rand(shape) > 0.3).to(D),
        ref_logprobs=leaf(logprobs.detach() + 0.1 * torch.randn(shape)),
        rollout_logprobs=leaf(logprobs.detach() + 0.1 * torch.randn(shape)),
        entropy=leaf(torch.rand(shape)),
    )
    cfg = PPOClipConfig(kl_coef=0.1, entropy_coef=0.01, dual_clip=3.0, mismatch="tis")
    loss, _ = PPOClipLoss(cfg)(batch)
    loss.backward()
    assert batch.logprobs.grad is not None and batch.logprobs.grad.abs().sum() > 0
    assert batch.entropy.grad is not None and batch.entropy.grad.abs().sum() > 0
    for name in ("old_logprobs", "advantages", "ref_logprobs", "rollout_logprobs"):
        assert getattr(batch, name).grad is None, name
    # Masked-out positions receive no gradient.
    assert (batch.logprobs.grad[batch.mask == 0] == 0).all()

    values = leaf(torch.randn(shape))
    old_values, returns = leaf(torch.randn(shape)), leaf(torch.randn(shape))
    v_loss, _ = ValueLoss()(values, old_values, returns, torch.ones(shape))
    v_loss.backward()
    assert values.grad is not None and values.grad.abs().sum() > 0
    assert old_values.grad is None and returns.grad is None


def test_all_masked_batch_gives_zero_loss_that_backpropagates():
    batch = batch_with_ratios([[1.5, 0.5]], [[1.0, -1.0]], mask=[[0, 0]])
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        loss, metrics = PPOClipLoss(PPOClipConfig(aggregation=mode))(batch)
        assert loss.item() == 0.0
        assert all(math.isfinite(v) for v in metrics.values())
        loss.backward()
        assert torch.isfinite(batch.logprobs.grad).all()


def test_padding_garbage_does_not_reach_the_loss():
    # A padded position holding inf (e.g. a -inf logprob) is masked out and must not make the loss NaN.
    loss_mat = t([[1.0, float("inf")], [2.0, float("nan")]])
    mask = t([[1, 0], [1, 0]])
    assert aggregate(loss_mat, mask, "token-mean").item() == pytest.approx(1.5)
    assert aggregate(loss_mat, mask, "seq-mean-token-sum-norm").item() == pytest.approx(0.75)


def test_value_loss_hand_computed():
    # clip 0.2, per token 0.5 * max((V - R)^2, (V_old + clip(V - V_old) - R)^2):
    #   V=1.0 V_old=1.5 R=0: unclipped 1,  V_clipped 1.3 -> 1.69  clipped branch wins
    #   V=1.6 V_old=1.5 R=1: unclipped 0.36, V_clipped 1.6 -> 0.36 (inside the range)
    #   V=0.0 V_old=1.5 R=3: unclipped 9,  V_clipped 1.3 -> 2.89  unclipped wins
    # loss = 0.5 * (1.69 + 0.36 + 9) / 3
    values = t([[1.0, 1.6, 0.0]]).requires_grad_(True)
    old_values, returns, mask = t([[1.5, 1.5, 1.5]]), t([[0.0, 1.0, 3.0]]), t([[1, 1, 1]])
    loss, metrics = ValueLoss(ValueConfig(clip=0.2))(values, old_values, returns, mask)
    assert loss.item() == pytest.approx(0.5 * (1.69 + 0.36 + 9.0) / 3)
    assert metrics["value_clip_fraction"] == pytest.approx(1 / 3)
    assert metrics["value_mean"] == pytest.approx(2.6 / 3)
    residual = returns - values.detach()
    expected_ev = 1 - residual.var(unbiased=False) / returns.var(unbiased=False)
    assert metrics["explained_variance"] == pytest.approx(expected_ev.item())
    loss.backward()
    # d/dV of 0.5 (V - R)^2 / 3 = (V - R) / 3 on unclipped tokens; the clipped token's V is saturated.
    torch.testing.assert_close(values.grad, t([[0.0, 0.6 / 3, -3.0 / 3]]))

    loss_noclip, metrics_noclip = ValueLoss(ValueConfig(clip=None))(values, old_values, returns, mask)
    assert loss_noclip.item() == pytest.approx(0.5 * (1.0 + 0.36 + 9.0) / 3)
    assert metrics_noclip["value_clip_fraction"] == 0.0


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"clip_low": 0.0}, "clip_low"),
        ({"clip_low": 1.0}, "clip_low"),
        ({"clip_high": 0.0}, "clip_high"),
        ({"dual_clip": 1.0}, "dual_clip"),
        ({"aggregation": "sum"}, "aggregation"),
        ({"norm_length": 0}, "norm_length"),
        ({"kl_coef": -0.1}, "kl_coef"),
        ({"kl_coef": float("nan")}, "kl_coef"),
        ({"kl_estimator": "k4"}, "kl_estimator"),
        ({"entropy_coef": -1.0}, "entropy_coef"),
        ({"mismatch": "is"}, "mismatch"),
        ({"mismatch_cap": 1.0}, "mismatch_cap"),
        ({"mismatch_cap": float("inf")}, "mismatch_cap"),
    ],
)
def test_invalid_policy_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        PPOClipConfig(**kwargs)
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        DAPOConfig(**kwargs)


@pytest.mark.parametrize("kwargs, field", [({"clip": 0.0}, "clip"), ({"aggregation": "max"}, "aggregation")])
def test_invalid_value_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        ValueConfig(**kwargs)


def test_invalid_batches_name_the_field():
    good = batch_with_ratios([[1.0, 1.0]], [[1.0, 1.0]])
    with pytest.raises(ValueError, match="^logprobs"):
        PolicyBatch(
            logprobs=good.logprobs.view(-1), old_logprobs=good.old_logprobs, advantages=good.advantages, mask=good.mask
        )
    with pytest.raises(ValueError, match="^old_logprobs"):
        PolicyBatch(
            logprobs=good.logprobs,
            old_logprobs=good.old_logprobs.view(2, 1),
            advantages=good.advantages,
            mask=good.mask,
        )
    with pytest.raises(ValueError, match="^mask"):
        PolicyBatch(logprobs=good.logprobs, old_logprobs=good.old_logprobs, advantages=good.advantages, mask=None)
    with pytest.raises(ValueError, match="^rollout_logprobs"):
        PolicyBatch(
            logprobs=good.logprobs,
            old_logprobs=good.old_logprobs,
            advantages=good.advantages,
            mask=good.mask,
            rollout_logprobs=torch.zeros(3, 3, dtype=D),
        )
    with pytest.raises(ValueError, match="^advantages"):
        PolicyBatch(
            logprobs=good.logprobs,
            old_logprobs=good.old_logprobs,
            advantages=torch.ones(1, 2, dtype=torch.long),
            mask=good.mask,
        )
    with pytest.raises(ValueError, match="^ref_logprobs"):
        PPOClipLoss(PPOClipConfig(kl_coef=0.1))(good)
    with pytest.raises(ValueError, match="^entropy"):
        PPOClipLoss(PPOClipConfig(entropy_coef=0.1))(good)
    with pytest.raises(ValueError, match="^config"):
        GRPOLoss(ValueConfig())
    with pytest.raises(ValueError, match="^returns"):
        ValueLoss()(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3, 2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="^aggregation"):
        aggregate(torch.zeros(2, 2), torch.ones(2, 2), "mean")
