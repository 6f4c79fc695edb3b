"""Sampler tests: seeded rows are reproducible whatever batch they sit in; unseeded rows vary.

Seeded draws use counter-based Gumbel noise keyed by mix_seed(seed, position) (no test pins
specific token ids here except test_sample_gumbel.py::test_golden_token).
"""

from __future__ import annotations

import pytest
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
    assert make_generator(11, 2).initial_seed() == mix_seed(11, 2)  # the row's noise key


def _mixed_batch(num_rows: int, vocab: int, seed: int):
    """Random logits and a mix of greedy / top-k / top-p / min-p / plain rows."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab, generator=gen) * 2
    temps = (torch.rand(num_rows, generator=gen) + 0.3).tolist()
    kind = torch.randint(0, 5, (num_rows,), generator=gen)
    top_k = torch.where(kind == 1, torch.randint(1, 40, (num_rows,), generator=gen), 0)
    top_p = torch.where(kind == 2, torch.rand(num_rows, generator=gen) * 0.9 + 0.05, 1.0)
    min_p = torch.where(kind == 3, torch.rand(num_rows, generator=gen) * 0.5, 0.0)
    for i in range(num_rows):
        if kind[i] == 4 and i % 3 == 0:
            temps[i] = 0.0  # greedy
    return logits, temps, top_k, top_p, min_p


def test_seeded_batch_of_256_matches_each_row_alone(make_md):
    """Every seeded row of a mixed 256-row batch gives the token it gives alone; greedy rows give argmax;
    masked tokens are never chosen."""
    num_rows, vocab = 256, 3000
    logits, temps, top_k, top_p, min_p = _mixed_batch(num_rows, vocab, 0)
    seeds = {i: (i * 7919 - 10**6, 3 + i % 5) for i in range(num_rows) if i % 4 != 1}  # row 1 mod 4: unseeded

    def md_for(rows):
        gens = {j: make_generator(*seeds[r], "cpu") for j, r in enumerate(rows) if r in seeds and temps[r] > 0}
        t = [temps[r] for r in rows]
        return make_md(
            len(rows), temperature=t, generators=gens, top_k=top_k[rows], top_p=top_p[rows], min_p=min_p[rows]
        )

    everyone = list(range(num_rows))
    batch = Sampler(torch.Generator().manual_seed(1))(logits, md_for(everyone)).sampled_token_ids
    shuffled = torch.randperm(num_rows, generator=torch.Generator().manual_seed(2)).tolist()
    batch_shuffled = Sampler()(logits[shuffled], md_for(shuffled)).sampled_token_ids
    for r in range(num_rows):
        if r in seeds or temps[r] == 0:
            alone = Sampler()(logits[r : r + 1], md_for([r])).sampled_token_ids
            assert int(alone) == int(batch[r]) == int(batch_shuffled[shuffled.index(r)]), r
        if temps[r] == 0:
            assert int(batch[r]) == int(logits[r].argmax())
    # No row picks a token its own top-k / top-p / min-p masked.
    from engine.sample.topk_topp import apply_min_p, apply_temperature, apply_top_k_top_p

    shaped = apply_temperature(logits.clone(), torch.tensor(temps).clamp_min(1e-5))
    shaped = apply_top_k_top_p(shaped, top_k, top_p)
    shaped = apply_min_p(shaped, min_p)
    assert bool(torch.isfinite(shaped.gather(1, batch[:, None])).all())


def test_seeded_draws_over_positions_follow_top_k_top_p_distribution(make_md):
    """One request seeded at many positions: its draws follow the renormalized nucleus (total variation)."""
    vocab, num_draws = 12, 12000
    row = torch.linspace(-1.5, 1.5, vocab)
    logits = row.expand(num_draws, vocab).clone()
    gens = {i: make_generator(77, i) for i in range(num_draws)}
    top_k = torch.full((num_draws,), 8)
    top_p = torch.full((num_draws,), 0.8)
    out = Sampler()(logits, make_md(num_draws, generators=gens, top_k=top_k, top_p=top_p)).sampled_token_ids
    from engine.sample.topk_topp import apply_top_k_top_p_sort

    target = apply_top_k_top_p_sort(row[None].clone(), top_k[:1], top_p[:1]).softmax(-1)[0]
    freq = torch.bincount(out, minlength=vocab).double() / num_draws
    assert bool((freq[target == 0] == 0).all())
    assert 0.5 * float((freq - target.double()).abs().sum()) < 0.02


def test_seeded_keys_are_mix_seed_and_sample_like_generators(make_md):
    """The model runner's vectorised keys (mix_seeds, SeededKeys) equal mix_seed per row, including negative and
    extreme seeds, and the sampler draws the same tokens from them as from a dict of make_generator's."""
    import numpy as np

    from engine.sample.random_sampling import SeededKeys, mix_seeds, seed_to_uint64

    gen = torch.Generator().manual_seed(4)
    seeds = [0, -1, 2**63 - 1, -(2**63), 12345] + torch.randint(-(2**62), 2**62, (59,), generator=gen).tolist()
    positions = [0, 10**9, 2**40, 1, 7] + torch.randint(0, 10**6, (59,), generator=gen).tolist()
    keys = mix_seeds(np.array([seed_to_uint64(s) for s in seeds], dtype=np.uint64), np.array(positions))
    assert keys.tolist() == [mix_seed(s, p) for s, p in zip(seeds, positions)]

    num_rows, vocab = 96, 700
    logits = torch.randn(num_rows, vocab, generator=gen) * 2
    rows = np.arange(0, num_rows, 3)[: len(seeds)]  # every third row seeded, the rest draw from the sampler's own
    as_keys = SeededKeys(rows, keys[: len(rows)])
    as_gens = {int(r): make_generator(seeds[i], positions[i]) for i, r in enumerate(rows)}
    assert sorted(as_keys) == sorted(as_gens) and as_keys[int(rows[2])].initial_seed() == as_gens[int(rows[2])].initial_seed()
    a = Sampler(torch.Generator().manual_seed(1))(logits, make_md(num_rows, generators=as_keys)).sampled_token_ids
    b = Sampler(torch.Generator().manual_seed(2))(logits, make_md(num_rows, generators=as_gens)).sampled_token_ids
    assert torch.equal(a[rows], b[rows])
    with pytest.raises(ValueError, match="two equal 1-d arrays"):
        SeededKeys(rows, keys[:2])
