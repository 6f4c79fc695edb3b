"""Sampler tests: seeded rows are reproducible whatever batch they sit in; unseeded rows vary."""

from __future__ import annotations

import torch

from engine.sample import Sampler, make_generator
from engine.sample.random_sampling import mix_seed


def _seeded_token(make_md, row_logits, seed, position, batch_size, row, torch_seed, top_k=None):
    """Samples row `row` of a batch whose other rows are random, unseeded and random-logit."""
    torch.manual_seed(torch_seed)
    vocab = row_logits.shape[0]
    logits = torch.randn(batch_size, vocab) * 3
    logits[row] = row_logits
    temps = (torch.rand(batch_size) + 0.5).tolist()
    temps[row] = 1.0
    md = make_md(batch_size, temperature=temps, generators={row: make_generator(seed, position)})
    if top_k is not None:
        ks = torch.randint(0, vocab, (batch_size,))
        ks[row] = top_k
        md.top_k = ks
    return Sampler()(logits, md).sampled_token_ids[row].item()


def test_seeded_row_independent_of_batch(make_md):
    torch.manual_seed(123)
    row_logits = torch.randn(100) * 0.5  # flat enough that tokens vary with position
    for seed in (0, 42, -7, 2**62 + 5):
        tokens = []
        for position in range(8):
            alone = _seeded_token(make_md, row_logits, seed, position, 1, 0, torch_seed=1)
            in_batch = _seeded_token(make_md, row_logits, seed, position, 31, 17, torch_seed=2)
            other_row = _seeded_token(make_md, row_logits, seed, position, 31, 3, torch_seed=3)
            assert alone == in_batch == other_row, (seed, position)
            tokens.append(alone)
        assert len(set(tokens)) > 1  # the position really changes the draw


def test_seeded_row_with_top_k_independent_of_batch(make_md):
    row_logits = torch.linspace(0, 1, 50)
    a = [_seeded_token(make_md, row_logits, 9, p, 1, 0, torch_seed=4, top_k=5) for p in range(10)]
    b = [_seeded_token(make_md, row_logits, 9, p, 31, 30, torch_seed=5, top_k=5) for p in range(10)]
    assert a == b
    assert set(a) <= set(range(45, 50))


def test_different_seeds_differ(make_md):
    row_logits = torch.zeros(1000)
    a = [_seeded_token(make_md, row_logits, 1, p, 1, 0, torch_seed=0) for p in range(5)]
    b = [_seeded_token(make_md, row_logits, 2, p, 1, 0, torch_seed=0) for p in range(5)]
    assert a != b


def test_unseeded_rows_vary(make_md):
    torch.manual_seed(0)
    logits = torch.zeros(20, 1000)
    first = Sampler()(logits, make_md(20)).sampled_token_ids
    second = Sampler()(logits, make_md(20)).sampled_token_ids
    assert not torch.equal(first, second)
    assert len(set(first.tolist())) > 10  # rows within one batch differ too


def test_seeded_sampling_follows_probs(make_md):
    """Each (seed, position) is one draw; over many seeds the draws follow probs (chi-square, df 3)."""
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    num_draws = 4000
    logits = probs.log().expand(num_draws, 4).clone()
    gens = {i: make_generator(i, 0) for i in range(num_draws)}
    out = Sampler()(logits, make_md(num_draws, generators=gens)).sampled_token_ids
    observed = torch.bincount(out, minlength=4).double()
    expected = probs.double() * num_draws
    assert (((observed - expected) ** 2) / expected).sum().item() < 16.27


def test_make_generator_is_deterministic():
    assert mix_seed(5, 3) == mix_seed(5, 3)
    assert mix_seed(5, 3) != mix_seed(5, 4) != mix_seed(6, 3)
    for seed in (0, -1, 2**63 - 1, -(2**63)):
        assert 0 <= mix_seed(seed, 10**9) < 2**63
    a = torch.rand(5, generator=make_generator(11, 2))
    b = torch.rand(5, generator=make_generator(11, 2))
    assert torch.equal(a, b)
