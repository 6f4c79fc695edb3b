"""Sampler tests: penalties, logit_bias, bad words, min_tokens and allowed_token_ids change logits exactly."""

from __future__ import annotations

import torch

from engine.sample import Sampler

NEG_INF = float("-inf")


def processed_logits(logits: torch.Tensor, md) -> torch.Tensor:
    """The sampler's processed logits, read back through processed_logits mode with K = V."""
    md.logprobs_mode = "processed_logits"
    md.max_num_logprobs = logits.shape[1]
    lp = Sampler()(logits, md).logprobs
    out = torch.empty_like(logits)
    out.scatter_(1, lp.token_ids[:, 1:], lp.logprobs[:, 1:])
    return out


def test_penalties_match_hand_computation(make_md):
    logits = torch.tensor(
        [
            [2.0, -1.0, 0.5, 3.0, -2.0, 1.0],
            [1.0, 1.0, -1.0, -1.0, 0.0, 2.0],
            [0.3, 0.2, 0.1, 0.0, -0.1, -0.2],
        ]
    )
    V = 6
    prompt = torch.tensor([[0, 1, V], [4, V, V], [0, 1, 2]])  # padded with V
    outputs = [[3, 3, 4], [2, 5, 5, 5], []]
    md = make_md(
        3,
        temperature=0.0,
        presence_penalties=torch.tensor([0.5, 0.0, 1.0]),
        frequency_penalties=torch.tensor([0.25, 0.1, 1.0]),
        repetition_penalties=torch.tensor([2.0, 1.5, 1.0]),
        prompt_token_ids=prompt,
        output_token_ids=outputs,
    )
    expected = logits.clone()
    # Row 0: repetition 2 over {0, 1} (prompt) and {3, 4} (output); then output counts 3:2, 4:1.
    expected[0] = torch.tensor([2.0 / 2, -1.0 * 2, 0.5, 3.0 / 2, -2.0 * 2, 1.0])
    expected[0, 3] -= 0.25 * 2 + 0.5
    expected[0, 4] -= 0.25 * 1 + 0.5
    # Row 1: repetition 1.5 over {4} and {2, 5}; 0.0 logit stays 0; counts 2:1, 5:3; presence 0.
    expected[1] = torch.tensor([1.0, 1.0, -1.0 * 1.5, -1.0, 0.0, 2.0 / 1.5])
    expected[1, 2] -= 0.1 * 1
    expected[1, 5] -= 0.1 * 3
    # Row 2: no output tokens, repetition 1: unchanged.
    got = processed_logits(logits, md)
    assert torch.allclose(got, expected, atol=1e-6), (got, expected)
    assert torch.equal(got[2], logits[2])


def test_repetition_penalty_without_prompt(make_md):
    logits = torch.tensor([[1.0, -1.0, 2.0]])
    md = make_md(1, temperature=0.0, repetition_penalties=torch.tensor([4.0]), output_token_ids=[[0, 1]])
    assert torch.allclose(processed_logits(logits, md), torch.tensor([[0.25, -4.0, 2.0]]))


def test_penalty_changes_greedy_choice(make_md):
    logits = torch.tensor([[1.0, 0.9]])
    md = make_md(1, temperature=0.0, frequency_penalties=torch.tensor([0.2]), output_token_ids=[[0]])
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [1]


def test_logit_bias(make_md):
    logits = torch.zeros(2, 5)
    md = make_md(2, temperature=0.0, logit_bias={0: {3: 2.5, 1: -1.0}, 1: {4: 0.5}})
    expected = torch.tensor([[0.0, -1.0, 0.0, 2.5, 0.0], [0.0, 0.0, 0.0, 0.0, 0.5]])
    assert torch.equal(processed_logits(logits, md), expected)
    md = make_md(2, temperature=0.0, logit_bias={0: {3: 2.5, 1: -1.0}, 1: {4: 0.5}})
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [3, 4]


def test_bad_words_multi_and_single_token(make_md):
    logits = torch.zeros(3, 10)
    md = make_md(
        3,
        temperature=0.0,
        output_token_ids=[[5, 7], [5, 7], []],
        bad_words_token_ids={
            0: [[7, 3], [5, 7, 4], [2]],  # 3 (prefix [7] ends output), 4 ([5, 7]), 2 (single token)
            1: [[5, 3], [6, 7, 8], [1, 5, 7, 9]],  # no prefix ends the output, nothing banned
            2: [[7, 3], [8]],  # empty output: only the single-token word bans
        },
    )
    got = processed_logits(logits, md)
    banned = [set(torch.nonzero(row == NEG_INF).flatten().tolist()) for row in got]
    assert banned == [{2, 3, 4}, set(), {8}]


def test_bad_words_steer_sampling(make_md):
    logits = torch.tensor([[0.0, 5.0, 4.0]])
    md = make_md(1, temperature=0.0, output_token_ids=[[2]], bad_words_token_ids={0: [[2, 1]]})
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [2]


def test_min_tokens_bans_stop_ids_only_below_min(make_md):
    logits = torch.zeros(3, 6)
    eos, stop = 5, 2
    md = make_md(
        3,
        temperature=0.0,
        output_token_ids=[[0, 1], [0, 1, 3], [0]],
        min_tokens={0: (3, {eos, stop}), 1: (3, {eos, stop}), 2: (1, {eos})},
    )
    got = processed_logits(logits, md)
    banned = [set(torch.nonzero(row == NEG_INF).flatten().tolist()) for row in got]
    assert banned == [{eos, stop}, set(), set()]


def test_min_tokens_prevents_eos_in_sampling(make_md):
    torch.manual_seed(0)
    logits = torch.tensor([[0.0, 0.0, 10.0]]).expand(200, 3).clone()
    md = make_md(200, output_token_ids=[[]] * 200, min_tokens={i: (1, {2}) for i in range(200)})
    assert 2 not in Sampler()(logits, md).sampled_token_ids.tolist()


def test_allowed_token_ids(make_md):
    torch.manual_seed(0)
    vocab = 8
    logits = torch.randn(400, vocab)
    banned = torch.ones(400, vocab, dtype=torch.bool)
    banned[:, [1, 6]] = False
    banned[1::2] = False  # odd rows are unrestricted
    out = Sampler()(logits, make_md(400, allowed_token_ids_mask=banned)).sampled_token_ids
    assert set(out[0::2].tolist()) == {1, 6}
    assert len(set(out[1::2].tolist())) > 2
    # Greedy rows pick the best allowed token.
    greedy = Sampler()(logits[:2], make_md(2, temperature=0.0, allowed_token_ids_mask=banned[:2])).sampled_token_ids
    assert greedy[0].item() == [1, 6][logits[0, [1, 6]].argmax().item()]
    assert greedy[1].item() == logits[1].argmax().item()


def test_extreme_penalties_and_biases_never_sample_past_the_vocabulary(make_md):
    """A repetition penalty that is 0 in float32 (5e-324, once accepted) made masked logits NaN (-inf * 0)
    and positive ones +inf: the sampler returned id == vocab_size and the engine died in the logprob gather.
    Now NaN never wins and +inf is the largest float: every row samples an allowed token, with finite logprobs."""
    torch.manual_seed(0)
    vocab, rows = 600, 8  # sparse and dense sampling paths (a row keeps 1 or all of 600 tokens)
    logits = torch.randn(rows, vocab) * 5
    banned = torch.ones(rows, vocab, dtype=torch.bool)
    banned[:4, 7] = False  # rows 0-3 may only say 7
    banned[4:] = False
    seen = [[7, 8, 9]] * rows
    for penalty in (0.0, 1.2e-38):
        md = make_md(rows, temperature=[1.0] * 4 + [0.0] * 4, repetition_penalties=torch.full((rows,), penalty),
                     output_token_ids=seen, allowed_token_ids_mask=banned, logit_bias={5: {3: 3e38}},
                     max_num_logprobs=2)
        out = Sampler()(logits.clone(), md)
        ids = out.sampled_token_ids.tolist()
        assert all(0 <= t < vocab for t in ids) and ids[:4] == [7] * 4, ids
        assert torch.isfinite(out.logprobs.logprobs[:4, 0]).all()
