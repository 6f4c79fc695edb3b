"""Sampler tests: greedy, temperature, top-k, top-p, min-p and the sampled distribution."""

from __future__ import annotations

import pytest
import torch

from engine.sample import Sampler
from engine.sample.topk_topp import apply_min_p, apply_top_k_top_p

NEG_INF = float("-inf")


def _counts(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab_size).to(torch.float64)


def test_greedy_is_argmax(make_md):
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    original = logits.clone()
    out = Sampler()(logits, make_md(6, temperature=0.0))
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs is None
    # Also through the full path (logprobs wanted), and the caller's logits stay untouched.
    out = Sampler()(logits, make_md(6, temperature=0.0, max_num_logprobs=2, logit_bias={0: {0: 0.0}}))
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert torch.equal(logits, original)


def test_mixed_greedy_and_random_rows(make_md):
    torch.manual_seed(0)
    logits = torch.zeros(200, 10)  # uniform: a random row almost surely leaves token 0
    logits[:, 3] = 0.5
    temps = [0.0 if i % 2 == 0 else 1.0 for i in range(200)]
    out = Sampler()(logits, make_md(200, temperature=temps)).sampled_token_ids
    assert (out[0::2] == 3).all()
    assert (out[1::2] != 3).any()


@pytest.mark.parametrize("temperature", [0.3, 1.0, 3.0])
def test_temperature_shapes_distribution(make_md, temperature):
    torch.manual_seed(1)
    num_draws, vocab = 20000, 4
    base = torch.tensor([2.0, 1.0, 0.0, -1.0])
    logits = base.expand(num_draws, vocab).clone()
    out = Sampler()(logits, make_md(num_draws, temperature=temperature)).sampled_token_ids
    freq = _counts(out, vocab) / num_draws
    expected = (base / temperature).softmax(-1).to(torch.float64)
    assert torch.allclose(freq, expected, atol=0.015), (freq, expected)


def test_low_temperature_concentrates(make_md):
    torch.manual_seed(2)
    logits = torch.tensor([1.0, 0.9, 0.8, 0.0]).expand(5000, 4).clone()
    hot = Sampler()(logits, make_md(5000, temperature=5.0)).sampled_token_ids
    cold = Sampler()(logits, make_md(5000, temperature=0.01)).sampled_token_ids
    assert (cold == 0).float().mean() > 0.99
    assert (hot == 0).float().mean() < 0.4


def test_top_k_per_row(make_md):
    torch.manual_seed(3)
    vocab = 20
    row_logits = torch.linspace(0.0, 1.0, vocab)  # nearly flat: every kept token gets drawn
    ks = [1, 3, 7, 0]  # 0 = off
    num_rows = 400
    logits = row_logits.expand(num_rows, vocab).clone()
    top_k = torch.tensor([ks[i % 4] for i in range(num_rows)], dtype=torch.int64)
    out = Sampler()(logits, make_md(num_rows, top_k=top_k)).sampled_token_ids
    for j, k in enumerate(ks):
        drawn = set(out[j::4].tolist())
        allowed = set(range(vocab - k, vocab)) if k else set(range(vocab))
        assert drawn <= allowed, (k, drawn)
        assert len(drawn) == len(allowed) if k else len(drawn) > 10


def test_top_p_keeps_smallest_set_with_mass_p():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log().expand(4, 4).clone()
    top_p = torch.tensor([0.4, 0.7, 0.85, 1.0])
    out = apply_top_k_top_p(logits.clone(), None, top_p)
    kept = [set(torch.nonzero(row > NEG_INF).flatten().tolist()) for row in out]
    assert kept == [{1}, {1, 3}, {1, 2, 3}, {0, 1, 2, 3}]
    # Kept entries keep their value; a row with top-p off is bit-identical.
    assert torch.equal(out[3], logits[3])
    assert out[1, 1] == logits[1, 1] and out[1, 3] == logits[1, 3]


def test_top_k_then_top_p_renormalizes():
    # top-k = 2 leaves {0.5, 0.3} -> renormalized {0.625, 0.375}; top-p 0.6 then keeps only the first.
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    out = apply_top_k_top_p(logits.clone(), torch.tensor([2]), torch.tensor([0.6]))
    assert torch.isfinite(out).tolist() == [[True, False, False, False]]


def test_top_p_sampling_only_draws_nucleus(make_md):
    torch.manual_seed(4)
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log().expand(3000, 4).clone()
    out = Sampler()(logits, make_md(3000, top_p=torch.full((3000,), 0.7))).sampled_token_ids
    assert set(out.tolist()) == {1, 3}
    freq = (out == 1).float().mean().item()
    assert abs(freq - 0.5 / 0.8) < 0.03


def test_min_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(3, 4).clone()
    out = apply_min_p(logits.clone(), torch.tensor([0.2, 0.5, 0.0]))
    kept = [torch.isfinite(row).nonzero().flatten().tolist() for row in out]
    assert kept == [[0, 1, 2], [0, 1], [0, 1, 2, 3]]
    assert torch.equal(out[2], logits[2])


def test_min_p_sampling(make_md):
    torch.manual_seed(5)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(3000, 4).clone()
    out = Sampler()(logits, make_md(3000, min_p=torch.full((3000,), 0.5))).sampled_token_ids
    assert set(out.tolist()) == {0, 1}


def test_sampled_distribution_matches_probs(make_md):
    """Chi-square goodness of fit over a small vocab; df = 4, 0.1% critical value 18.47."""
    torch.manual_seed(6)
    probs = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    num_draws = 40000
    logits = probs.log().expand(num_draws, 5).clone()
    out = Sampler()(logits, make_md(num_draws)).sampled_token_ids
    observed = _counts(out, 5)
    expected = probs.to(torch.float64) * num_draws
    chi2 = (((observed - expected) ** 2) / expected).sum().item()
    assert chi2 < 18.47, (chi2, observed)


def test_feature_off_rows_untouched_even_with_underflowing_probs():
    # exp(-200) underflows to probability 0 in float32; rows with the feature off must still
    # keep that token (an "off" row is bit-identical to its input).
    logits = torch.tensor([[0.0, -200.0, 1.0], [0.0, -200.0, 1.0]])
    out = apply_top_k_top_p(logits.clone(), torch.tensor([0, 1]), torch.tensor([1.0, 0.5]))
    assert torch.equal(out[0], logits[0])
    assert torch.isfinite(out[1]).tolist() == [False, False, True]


def test_min_p_one_keeps_ties_at_max():
    logits = torch.tensor([[1.0, 1.0, 0.0]])
    out = apply_min_p(logits.clone(), torch.tensor([1.0]))
    assert torch.isfinite(out).tolist() == [[True, True, False]]
