"""Unseeded samples with and without speculation fit the exact sequence probabilities (chi-square)."""

from __future__ import annotations

import collections
import itertools
import math

import pytest
import torch

from engine import LLM, SamplingParams

TOP_K = 4  # each position has exactly TOP_K possible tokens
MAX_TOKENS = 4  # with num_speculative_tokens=2 the verify step after prefill checks two drafts: both positions run
NUM_SAMPLES = 3000
MIN_EXPECTED = 5.0  # cells expected fewer times are pooled (the chi-square approximation needs ~5 per cell)
P_ACCEPT = 1e-3  # a correct sampler fails one run in a thousand; the engine seeds torch, so a run repeats exactly
P_POWER = 1e-6  # a wrong distribution must be rejected far below P_ACCEPT


def make_llm(path, speculative_config=None):
    return LLM(path, dtype="float32", device="cpu", max_model_len=64, max_num_seqs=256,
               speculative_config=speculative_config)


def next_token_probs(llm, prompt, prefixes):
    """prefix -> {token: probability} of the next token at temperature 1 with top-k TOP_K: the raw
    logprobs of the TOP_K most likely tokens, renormalised."""
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=TOP_K)
    outs = llm.generate([{"prompt_token_ids": prompt + list(p)} for p in prefixes], params, use_tqdm=False)
    table = {}
    for prefix, out in zip(prefixes, outs):
        top = sorted(out.outputs[0].logprobs[0].items(), key=lambda kv: -kv[1].logprob)[:TOP_K]
        logprobs = torch.tensor([lp.logprob for _, lp in top], dtype=torch.float64)
        table[tuple(prefix)] = dict(zip([t for t, _ in top], logprobs.softmax(0).tolist()))
    return table


def sequence_probs(table, transform=lambda probs: probs):
    """Every MAX_TOKENS-token sequence of the support -> its probability, the product over positions of
    transform(next-token distribution) (renormalised), so transform builds deliberately wrong distributions."""
    probs = {(): 1.0}
    for _ in range(MAX_TOKENS):
        grown = {}
        for prefix, p in probs.items():
            step = transform(table[prefix])
            total = sum(step.values())
            grown.update({prefix + (t,): p * q / total for t, q in step.items()})
        probs = grown
    return probs


def flattened(probs):  # temperature 1.5 instead of 1 within the support
    return {t: p ** (2 / 3) for t, p in probs.items()}


def favouring_the_argmax(probs):
    """What a classic verification bug gives: a draft of the argmax a accepted with probability p(a), and on
    rejection a fresh sample from p (instead of p given "not a"), so a is emitted with p(a) * (2 - p(a))."""
    a = max(probs, key=probs.get)
    pa = probs[a]
    return {t: pa * (2 - pa) if t == a else p * (1 - pa * (2 - pa)) / (1 - pa) for t, p in probs.items()}


def chi_square(counts, probs, num_samples):
    """(statistic, degrees of freedom, p-value) of the counts against the probabilities; cells expected
    fewer than MIN_EXPECTED times are pooled (and the pool with the smallest other cell if still too small)."""
    cells = sorted((num_samples * p, counts.get(seq, 0)) for seq, p in probs.items())
    pool_expected = pool_observed = 0.0
    while cells and cells[0][0] < MIN_EXPECTED:
        e, o = cells.pop(0)
        pool_expected, pool_observed = pool_expected + e, pool_observed + o
    if pool_expected > 0:
        if pool_expected < MIN_EXPECTED and cells:
            e, o = cells.pop(0)
            pool_expected, pool_observed = pool_expected + e, pool_observed + o
        cells.append((pool_expected, pool_observed))
    stat = sum((o - e) ** 2 / e for e, o in cells)
    df = len(cells) - 1
    # The chi-square survival function: the regularized upper incomplete gamma Q(df / 2, stat / 2).
    p_value = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)).item()
    return stat, df, p_value


def ngram():
    return {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def draft_self(path):
    # The model as its own draft proposes its argmax, inside the top-k support: accepted about
    # p(argmax) of the time, so both the acceptance and the rejection path run.
    return {"method": "draft_model", "model": path, "num_speculative_tokens": 2}


@pytest.fixture(scope="module")
def exact(tiny_checkpoint):
    """(checkpoint, prompt, next-token table). The prompt ends with the model's own greedy continuation,
    so the n-gram speculator finds the sampled tokens in it and proposes likely continuations."""
    path = tiny_checkpoint("llama")
    plain = make_llm(path)
    base = [5, 17, 42, 99]
    greedy = plain.generate([{"prompt_token_ids": base}], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids
    prompt = base + list(greedy)
    prefixes = [()]
    table = {}
    for _ in range(MAX_TOKENS):
        table.update(next_token_probs(plain, prompt, prefixes))
        prefixes = [p + (t,) for p in prefixes for t in table[p]]
    plain.engine_core.shutdown()
    return path, prompt, table


@pytest.mark.parametrize("method", ["plain", "ngram", "draft_model"])
def test_unseeded_samples_follow_the_model_distribution(exact, method):
    """NUM_SAMPLES unseeded requests at temperature 1, top-k 4, MAX_TOKENS tokens: the counts of the 4^4
    sequences fit their exact probabilities, and do not fit a flattened or an argmax-favouring one."""
    path, prompt, table = exact
    config = {"plain": None, "ngram": ngram(), "draft_model": draft_self(path)}[method]
    llm = make_llm(path, config)
    params = SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompt}] * NUM_SAMPLES, params, use_tqdm=False)
    counts = collections.Counter(tuple(o.outputs[0].token_ids) for o in outs)

    probs = sequence_probs(table)
    assert math.isclose(sum(probs.values()), 1.0, abs_tol=1e-9)
    outside = {seq: n for seq, n in counts.items() if seq not in probs}
    assert not outside, f"sampled outside the top-{TOP_K} support: {outside}"
    stat, df, p_value = chi_square(counts, probs, NUM_SAMPLES)
    print(f"{method}: chi2={stat:.1f} df={df} p={p_value:.4f}")
    assert p_value > P_ACCEPT, (method, stat, df, p_value)
    # Power: the same samples and statistic reject distributions that are a little off.
    for wrong in (flattened, favouring_the_argmax):
        stat, df, p_wrong = chi_square(counts, sequence_probs(table, wrong), NUM_SAMPLES)
        print(f"{method}: against {wrong.__name__}: chi2={stat:.1f} df={df} p={p_wrong:.2g}")
        assert p_wrong < P_POWER, (method, wrong.__name__, stat, df, p_wrong)

    totals = llm.engine_core.scheduler.spec_totals
    if config is None:
        assert totals is None
    else:  # both verification paths ran, at both draft positions for the draft model
        print(f"{method}: {totals}")
        assert 0 < totals.num_accepted_tokens < totals.num_draft_tokens
        if method == "draft_model":
            assert all(n > 0 for n in totals.num_accepted_tokens_per_pos)
            assert totals.num_accepted_tokens_per_pos[1] < totals.num_accepted_tokens_per_pos[0]
    assert not llm.engine_core.has_unfinished_requests()
    llm.engine_core.shutdown()


def test_chi_square_p_values_match_known_values():
    """The p-value helper against textbook chi-square quantiles (df 1: 3.841 -> 0.05; df 10: 23.209 -> 0.01)."""
    for df, x, p in ((1, 3.841459, 0.05), (10, 23.209251, 0.01), (3, 0.0, 1.0)):
        got = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                      torch.tensor(x / 2, dtype=torch.float64)).item()
        assert math.isclose(got, p, rel_tol=1e-5), (df, x, got)
    # Counts exactly at their expectation give statistic 0 and p-value 1; pooled cells count once.
    probs = {seq: 1 / 16 for seq in itertools.product(range(4), range(4))}
    counts = {seq: 100 for seq in probs}
    assert chi_square(counts, probs, 1600) == (0.0, 15, 1.0)
    probs = {"a": 0.02, "b": 0.03, "c": 0.45, "d": 0.5}  # a and b pool into one cell expected 5 times
    assert chi_square({"a": 4, "b": 1, "c": 45, "d": 50}, probs, 100) == (0.0, 2, 1.0)
    stat, df, _ = chi_square({"a": 2, "b": 1, "c": 47, "d": 50}, {**probs, "a": 0.01, "b": 0.01, "c": 0.48}, 100)
    assert df == 1 and math.isclose(stat, 0.0)  # a pool expected 2 times joins the smallest other cell
