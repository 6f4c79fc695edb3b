"""Verification: a row keeps its drafts up to the first one the model's own sample disagrees with.

Why this is rejection sampling, exactly. A step that verifies drafts d_1..d_k of one row
computes the model's distributions p_0..p_k at the row's next k + 1 positions (p_j given the
known tokens and d_1..d_j) and draws one sample s_j from each with the ordinary sampler: same
temperature, top-k/top-p, penalties over the history including d_1..d_j, and for a seeded
request the same noise keyed by (seed, output index) as without speculation. It returns
s_0..s_a, where a is the number of leading drafts equal to the samples (d_j == s_{j-1}).

Our speculators propose one token each (the n-gram continuation, or the draft model's
argmax), i.e. a one-hot proposal q_j. Rejection sampling with a one-hot q accepts d_j with
probability min(1, p(d_j) / q(d_j)) = p(d_j) and on rejection samples from the residual
max(0, p - q), which is p conditioned on "not d_j". Drawing s ~ p and accepting iff s == d_j
is the same thing: P(accept) = p(d_j), and a rejected s is distributed as p given s != d_j.
So every returned token is a sample of the model's distribution at its position given the
tokens before it, whatever was proposed; greedy rows return exactly the greedy tokens, and
a seeded request returns exactly the tokens it returns without speculation.
"""

from __future__ import annotations


def accepted_tokens(samples: list[int], drafts: list[int]) -> list[int]:
    """The tokens a row emits: samples[0..a], a = the number of leading drafts equal to the samples.

    samples[j] is the model's sample at the position after drafts[:j] (len(samples) == len(drafts) + 1).
    """
    assert len(samples) == len(drafts) + 1, (len(samples), len(drafts))
    a = 0
    while a < len(drafts) and drafts[a] == samples[a]:
        a += 1
    return samples[: a + 1]
