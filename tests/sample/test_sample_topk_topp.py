"""Partial-selection top-k / top-p against the sort-based reference and a float64 oracle."""

from __future__ import annotations

import pytest
import torch

from engine.sample.topk_topp import apply_top_k_top_p, apply_top_k_top_p_sort

NEG_INF = float("-inf")


def _oracle(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, eps: float = 3e-6):
    """Float64 kept masks under the threshold tie rule, and the kept counts rounding can justify.

    Returns (kept [B, V] bool, lo [B], hi [B]): a float32 implementation may keep the top n
    tokens for any n in [lo, hi], the counts whose cumulative mass is within eps of p.
    """
    x = logits.to(torch.float64)
    num_rows, vocab = x.shape
    kept = torch.ones_like(x, dtype=torch.bool)
    lo = torch.zeros(num_rows, dtype=torch.int64)
    hi = torch.zeros(num_rows, dtype=torch.int64)
    for r in range(num_rows):
        row = x[r].clone()
        if top_k is not None and 0 < int(top_k[r]) < vocab:
            kth = row.sort(descending=True).values[int(top_k[r]) - 1]
            row[row < kth] = NEG_INF
        n = int((row > NEG_INF).sum())
        lo[r] = hi[r] = n
        if top_p is not None and float(top_p[r]) < 1.0:
            p = float(top_p[r])
            values = row.sort(descending=True).values
            cum = (values - row.logsumexp(0)).exp().cumsum(0)
            j = int((cum >= p).nonzero()[0]) if bool((cum >= p).any()) else vocab - 1
            row[row < values[j]] = NEG_INF
            count = int((row > NEG_INF).sum())
            lo[r] = min(_first_count(cum, p - eps, n), count)
            hi[r] = max(_first_count(cum, p + eps, n), count)
        kept[r] = row > NEG_INF
    return kept, lo, hi


def _first_count(cum: torch.Tensor, q: float, default: int) -> int:
    """The smallest n whose top-n mass reaches q (default when none does)."""
    reached = (cum >= q).nonzero()
    return int(reached[0]) + 1 if len(reached) else default


def _assert_close_to_oracle(out: torch.Tensor, logits: torch.Tensor, kept, lo, hi) -> None:
    """Each row keeps exactly the oracle's set, or a top-n set with n in [lo, hi] when rounding allows."""
    mask = torch.isfinite(out)
    count = mask.sum(-1)
    exact = (mask == kept).all(-1)
    kept_min = torch.where(mask, logits, float("inf")).amin(-1)
    dropped_max = torch.where(mask, NEG_INF, logits).amax(-1)
    prefix = kept_min > dropped_max  # the kept tokens are the row's most likely ones
    near = prefix & (count >= lo) & (count <= hi)
    assert bool((exact | near).all()), (exact, count, lo, hi)
    assert int(exact.sum()) >= len(exact) // 2  # most rows are not borderline at all


def _random_case(seed: int, num_rows: int, vocab: int, scale: float, ties: bool):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab, generator=gen) * scale
    if ties:  # coarse values: many exact ties, also at the k-th value and the nucleus boundary
        logits = (logits * 2).round() / 2
    k_choices = torch.tensor([0, 1, 2, 5, 50, vocab - 1, vocab, vocab + 7, -3])
    p_choices = torch.tensor([1.0, 1.0, 0.999999, 0.99, 0.9, 0.5, 0.1, 1e-6, 0.0])
    top_k = k_choices[torch.randint(0, len(k_choices), (num_rows,), generator=gen)]
    top_p = p_choices[torch.randint(0, len(p_choices), (num_rows,), generator=gen)]
    top_p = torch.where(torch.rand(num_rows, generator=gen) < 0.3, torch.rand(num_rows, generator=gen), top_p)
    return logits, top_k, top_p


@pytest.mark.parametrize(
    "vocab,scale",
    # Small scales give nuclei wider than the first 1024 candidates: the sort path for those rows.
    [(30, 2.0), (1000, 1.0), (5000, 0.3), (5000, 4.0), (20000, 0.2), (151936, 0.7)],
)
@pytest.mark.parametrize("features", ["k", "p", "kp"])
def test_matches_sort_reference_and_oracle(vocab, scale, features):
    logits, top_k, top_p = _random_case(vocab + int(scale * 10), 24, vocab, scale, ties=False)
    top_k = top_k if "k" in features else None
    top_p = top_p if "p" in features else None
    new = apply_top_k_top_p(logits.clone(), top_k, top_p)
    ref = apply_top_k_top_p_sort(logits.clone(), top_k, top_p)
    kept, lo, hi = _oracle(logits, top_k, top_p)
    _assert_close_to_oracle(new, logits, kept, lo, hi)
    _assert_close_to_oracle(ref, logits, kept, lo, hi)
    # Kept entries keep their value; masked ones are -inf.
    assert torch.equal(new[torch.isfinite(new)], logits[torch.isfinite(new)])


@pytest.mark.parametrize("vocab", [40, 3000])
def test_ties_keep_every_token_equal_to_the_boundary(vocab):
    logits, top_k, top_p = _random_case(7, 32, vocab, 1.5, ties=True)
    for k, p in [(top_k, None), (None, top_p), (top_k, top_p)]:
        new = torch.isfinite(apply_top_k_top_p(logits.clone(), k, p))
        kept, _, _ = _oracle(logits, k, p, eps=0.0)
        assert torch.equal(new, kept)  # coarse values: no partial sum lies within rounding of p
        if p is None:  # top-k alone: the reference's kept set is a subset, differing only in ties
            ref = torch.isfinite(apply_top_k_top_p_sort(logits.clone(), k, None))
            assert bool((ref <= new).all())
            lowest_kept = torch.where(ref, logits, float("inf")).amin(dim=-1, keepdim=True)
            assert bool((logits[new & ~ref] == lowest_kept.expand_as(logits)[new & ~ref]).all())


def test_feature_off_rows_are_bit_identical():
    logits, _, _ = _random_case(3, 6, 3000, 1.0, ties=False)
    logits[:, ::7] = -200.0  # underflows to probability 0
    top_k = torch.tensor([0, 3000, 0, 10, -1, 0])
    top_p = torch.tensor([1.0, 1.0, 0.5, 1.0, 1.0, 2.0])
    out = apply_top_k_top_p(logits.clone(), top_k, top_p)
    for row in (0, 1, 4, 5):
        assert torch.equal(out[row], logits[row])
    assert int(torch.isfinite(out[3]).sum()) == 10


def test_k_one_and_p_tiny_keep_only_the_argmax():
    logits, _, _ = _random_case(4, 8, 2000, 2.0, ties=False)
    best = logits.argmax(dim=-1)
    for k, p in [(torch.ones(8, dtype=torch.int64), None), (None, torch.full((8,), 1e-7)), (None, torch.zeros(8))]:
        out = apply_top_k_top_p(logits.clone(), k, p)
        assert torch.equal(torch.isfinite(out).sum(-1), torch.ones(8, dtype=torch.int64))
        assert torch.equal(out.argmax(-1), best)


def test_top_p_near_one_keeps_almost_everything():
    logits = torch.randn(4, 5000, generator=torch.Generator().manual_seed(5))
    out = apply_top_k_top_p(logits.clone(), None, torch.full((4,), 0.9999999))
    kept, _, _ = _oracle(logits, None, torch.full((4,), 0.9999999))
    # float64 oracle vs float32 logsumexp may differ by a token or two at the very tail.
    assert (torch.isfinite(out) ^ kept).sum() <= 8
    assert int(torch.isfinite(out).sum()) > 4 * 4900


def test_sampler_top_k_top_p_rows_match_sort_reference_in_a_mixed_batch():
    """All-rows-on, some-rows-on and the only-k fast path agree with the reference (no ties)."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(16, 4000, generator=gen) * 2
    top_k = torch.tensor([0, 20, 0, 1, 3999, 4000, 100, 0] * 2)
    top_p = torch.tensor([0.9, 1.0, 1.0, 0.3, 0.8, 0.95, 0.99, 0.5] * 2)
    for k, p in [(top_k, top_p), (top_k, None), (None, top_p), (top_k[:1].expand(16), top_p)]:
        new = torch.isfinite(apply_top_k_top_p(logits.clone(), k, p))
        ref = torch.isfinite(apply_top_k_top_p_sort(logits.clone(), k, p))
        assert torch.equal(new, ref)


@pytest.mark.parametrize("vocab,scale,ties", [(1000, 1.0, False), (3000, 1.5, True), (151936, 0.7, False)])
def test_a_host_upper_bound_of_k_gives_the_same_mask(vocab, scale, ties):
    """The model runner passes the batch's largest k from the host (no device sync); any upper bound,
    even one at or past the vocabulary, masks exactly what reading k from the tensor does."""
    logits, top_k, top_p = _random_case(11, 24, vocab, scale, ties=ties)
    clamped = torch.where((top_k <= 0) | (top_k >= vocab), 0, top_k)
    for p in (None, top_p):
        expected = apply_top_k_top_p(logits.clone(), top_k, p)
        for bound in (int(clamped.max()), int(clamped.max()) + 3, vocab + 7):
            assert torch.equal(apply_top_k_top_p(logits.clone(), top_k, p, max_top_k=bound), expected)
    off = torch.zeros_like(top_k)  # every row's top-k off: an upper bound of 0 skips top-k
    assert torch.equal(apply_top_k_top_p(logits.clone(), off, None, max_top_k=0), logits)
