"""Sampler tests: logprobs ranks and top-K, the four logprobs modes, and per-row trimming."""

from __future__ import annotations

import numpy as np
import torch

from engine.sample import LogprobsTensors, Sampler, gather_logprobs, make_generator


def test_gather_logprobs_ranks_and_top_k():
    lp = torch.tensor([[-1.0, -3.0, -0.5, -2.0], [-1.0, -1.0, -2.0, -0.25]])
    out = gather_logprobs(lp, torch.tensor([1, 1]), num_logprobs=2)
    assert out.token_ids[0].tolist() == [1, 2, 0]
    assert out.token_ids[1, :2].tolist() == [1, 3] and out.token_ids[1, 2].item() in (0, 1)  # tie
    assert out.logprobs[0].tolist() == [-3.0, -0.5, -1.0]
    assert out.logprobs[1].tolist() == [-1.0, -0.25, -1.0]
    # Rank = 1 + entries strictly larger: row 0 token 1 is last; row 1 ties with token 0.
    assert out.ranks.tolist() == [4, 2]
    assert out.token_ids.dtype == torch.int64 and out.logprobs.dtype == torch.float32
    assert out.ranks.dtype == torch.int64
    zero = gather_logprobs(lp, torch.tensor([2, 3]), num_logprobs=0)
    assert zero.token_ids.tolist() == [[2], [3]] and zero.ranks.tolist() == [1, 1]


def test_to_lists_gives_host_arrays_trimmed_to_k():
    t = LogprobsTensors(
        token_ids=torch.tensor([[5, 1, 2, 3], [6, 4, 5, 6]]),
        logprobs=torch.tensor([[-1.0, -0.125, -0.25, -0.5], [-2.0, -0.5, -0.75, -2.0]]),
        ranks=torch.tensor([4, 3]),
    )
    lists = t.to_lists(1)
    assert lists.token_ids.tolist() == [[5, 1], [6, 4]]
    assert lists.logprobs.tolist() == [[-1.0, -0.125], [-2.0, -0.5]]
    assert lists.ranks.tolist() == [4, 3] and len(lists) == 2
    full = t.to_lists()
    assert isinstance(full.token_ids, np.ndarray) and full.token_ids.dtype == np.int64
    assert full.logprobs.dtype == np.float32 and full.token_ids.tolist() == t.token_ids.tolist()
    assert t.to_lists(0).token_ids.tolist() == [[5], [6]]


def _run_mode(make_md, logits, mode, k):
    # Row 0 random (temperature 2, top-k 3, bias), row 1 greedy (bias only); seeded so every
    # mode samples the same token.
    md = make_md(
        2,
        temperature=[2.0, 0.0],
        top_k=torch.tensor([3, 0]),
        logit_bias={0: {0: 1.0}, 1: {1: 3.0}},
        generators={0: make_generator(3, 0)},
        max_num_logprobs=k,
        logprobs_mode=mode,
    )
    return Sampler()(logits.clone(), md)


def _expected(snapshot, tokens, k):
    top_values, top_ids = snapshot.topk(k, dim=-1)
    chosen = snapshot.gather(1, tokens.unsqueeze(1))
    ranks = (snapshot > chosen).sum(-1) + 1
    return torch.cat([tokens.unsqueeze(1), top_ids], 1), torch.cat([chosen, top_values], 1), ranks


def test_logprobs_modes(make_md):
    torch.manual_seed(0)
    logits = torch.randn(2, 8)
    k = 3
    processed = logits.clone()
    processed[0, 0] += 1.0
    processed[1, 1] += 3.0
    processed[0] /= 2.0  # greedy row 1: no temperature
    outside_top3 = processed[0] < processed[0].topk(3).values[-1]
    processed[0, outside_top3] = float("-inf")
    snapshots = {
        "raw_logprobs": logits.log_softmax(-1),
        "raw_logits": logits,
        "processed_logprobs": processed.log_softmax(-1),
        "processed_logits": processed,
    }
    tokens = None
    for mode, snapshot in snapshots.items():
        out = _run_mode(make_md, logits, mode, k)
        if tokens is None:
            tokens = out.sampled_token_ids
        assert torch.equal(out.sampled_token_ids, tokens)
        ids, values, ranks = _expected(snapshot, tokens, k)
        assert torch.equal(out.logprobs.token_ids, ids), mode
        assert torch.allclose(out.logprobs.logprobs, values, atol=1e-6), mode
        assert torch.equal(out.logprobs.ranks, ranks), mode
    assert tokens[1].item() == processed[1].argmax().item()
    assert torch.isfinite(processed[0, tokens[0]])
    # The modes really differ on this input.
    raw = _run_mode(make_md, logits, "raw_logprobs", k).logprobs.logprobs
    proc = _run_mode(make_md, logits, "processed_logprobs", k).logprobs.logprobs
    assert not torch.allclose(raw, proc)


def test_logprobs_of_sampled_token_in_random_rows(make_md):
    torch.manual_seed(1)
    logits = torch.randn(64, 30)
    out = Sampler()(logits, make_md(64, max_num_logprobs=5))
    lp = logits.log_softmax(-1)
    tokens = out.sampled_token_ids
    assert torch.equal(out.logprobs.token_ids[:, 0], tokens)
    assert torch.allclose(out.logprobs.logprobs[:, 0], lp.gather(1, tokens.unsqueeze(1)).squeeze(1))
    expected_ranks = (lp > lp.gather(1, tokens.unsqueeze(1))).sum(-1) + 1
    assert torch.equal(out.logprobs.ranks, expected_ranks)
    assert (out.logprobs.logprobs[:, 1:].diff(dim=1) <= 0).all()  # top-K descending
    assert (out.logprobs.ranks > 1).any()  # some draws were not the argmax
