"""The n-gram lookup: longest suffix first, latest occurrence with k tokens after it, never the suffix itself."""

from __future__ import annotations

import numpy as np

from engine.worker.spec_decode.ngram.proposer import ngram_lookup


def lookup(tokens, k=3, n_min=1, n_max=3):
    return ngram_lookup(np.array(tokens, dtype=np.int64), k, n_min, n_max)


def test_the_longest_matching_suffix_wins():
    # Last 2 tokens (5, 6) occur at 0 followed by 7 8 9; the last token alone (6) also follows 1 at 10.
    assert lookup([5, 6, 7, 8, 9, 1, 6, 2, 2, 2, 5, 6], n_max=2) == [7, 8, 9]
    assert lookup([5, 6, 7, 8, 9, 1, 6, 2, 2, 2, 5, 6], n_max=1) == [2, 2, 2]


def test_the_latest_occurrence_with_k_tokens_after_it():
    tokens = [1, 2, 10, 11, 12, 1, 2, 20, 21, 22, 1, 2]
    assert lookup(tokens, k=3, n_max=2) == [20, 21, 22]
    # A period shorter than k: the latest occurrence has too few tokens after it, an earlier one has k.
    assert lookup([7, 8, 7, 8, 7, 8], k=4, n_max=2) == [7, 8, 7, 8]


def test_no_match_gives_no_drafts_and_the_suffix_is_not_its_own_match():
    assert lookup([1, 2, 3, 4]) == []
    assert lookup([9]) == []
    assert lookup([3, 3], k=2) == [3]  # the only earlier 3 is followed by one token


def test_the_batched_lookup_gives_each_rows_answer():
    """ngram_lookup_rows (one call for a step's rows) equals ngram_lookup row by row, whatever lies past a row's end."""
    from engine.worker.spec_decode.ngram.proposer import ngram_lookup_rows

    rng = np.random.default_rng(0)
    for trial in range(200):
        num_rows, width = int(rng.integers(1, 9)), int(rng.integers(1, 40))
        tokens = rng.integers(0, int(rng.integers(1, 6)), size=(num_rows, width))  # few symbols: many matches
        lengths = rng.integers(1, width + 1, size=num_rows)
        ks = rng.integers(-1, 6, size=num_rows)
        n_min = int(rng.integers(1, 4))
        n_max = n_min + int(rng.integers(0, 3))
        got = ngram_lookup_rows(tokens, lengths, ks, n_min, n_max)
        for r in range(num_rows):
            row = tokens[r, : lengths[r]]
            want = ngram_lookup(row, int(ks[r]), n_min, n_max) if ks[r] > 0 else []
            assert got[r] == want, (trial, r, row.tolist(), int(ks[r]), n_min, n_max)
