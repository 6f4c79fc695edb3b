"""GPU tier: the sort-free top-p threshold (engine/kernels/top_p.py) against an exact float64 nucleus, its use in the Sampler, and no host sync."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.sampling import gumbel_sample_triton
from engine.kernels.top_p import top_p_sample_triton, top_p_threshold_triton
from engine.sample.random_sampling import mix_seed

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _exact_threshold(logits: torch.Tensor, p: torch.Tensor, lower: torch.Tensor | None, temperature) -> torch.Tensor:
    """The definition in float64 on the host: the largest row value whose tokens at or above it hold mass >= p."""
    x = logits.double().cpu()
    if temperature is not None:
        x = x / temperature.double().cpu()[:, None]
    lower_raw = torch.full((x.shape[0],), float("-inf"), dtype=torch.float64) if lower is None else lower.double().cpu()
    out = []
    for r in range(x.shape[0]):
        raw = logits[r].double().cpu()
        kept = (raw >= lower_raw[r]) & torch.isfinite(raw)
        if float(p[r]) >= 1.0 or not kept.any():
            out.append(float(lower_raw[r]))
            continue
        vals, order = x[r][kept].sort(descending=True)
        probs = (vals - vals.max()).exp()
        cum = probs.cumsum(0) / probs.sum()
        j = int((cum < float(p[r])).sum().clamp_max(len(vals) - 1))
        out.append(float(raw[kept][order[j]]))
    return torch.tensor(out, dtype=torch.float64)


def _kept(logits: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    return logits.double().cpu() >= threshold.double().cpu().reshape(-1, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [151936, 5000, 1000])
def test_threshold_matches_the_exact_nucleus(dtype, vocab):
    gen = torch.Generator().manual_seed(vocab)
    rows = 24
    logits = (torch.randn(rows, vocab, generator=gen) * torch.linspace(0.5, 6, rows)[:, None]).to(dtype)
    logits[3, 100:] = float("-inf")  # a row with 100 finite tokens
    logits[4, 1:] = float("-inf")  # one finite token
    logits[5, : vocab // 2] = logits[5, 0]  # a long tie at one value
    p = torch.tensor([0.9, 0.5, 0.99, 0.9, 0.7, 0.3, 1.0, 0.95] * 3)
    temperature = torch.rand(rows, generator=gen) + 0.3
    for temp in (None, temperature):
        thr = top_p_threshold_triton(logits.to(DEV), p.to(DEV), None, None if temp is None else temp.to(DEV))
        assert thr.shape == (rows, 1)
        exact = _exact_threshold(logits, p, None, temp)
        got, want = _kept(logits, thr), _kept(logits, exact)
        # float32 exp and float64 sums against float64 throughout: only a boundary token may move, in a rare row.
        assert (got != want).any(dim=-1).sum() <= 1
        assert (got != want).sum(dim=-1).max() <= 1
        assert bool(got[6].all()) and bool(got[4, 0]) and int(got[4].sum()) == 1  # p = 1 keeps all; one token stays
        assert int(got[3, 100:].sum()) == 0


def test_top_k_then_top_p_and_rows_off_keep_lower():
    from engine.sample.topk_topp import top_k_top_p_threshold

    gen = torch.Generator().manual_seed(3)
    rows, vocab = 16, 151936
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(torch.bfloat16)
    top_k = torch.tensor([0, 50, 1, 1000] * 4)
    p = torch.tensor([0.9, 0.9, 0.9, 0.5, 1.0, 1.0, 0.8, 0.8] * 2)
    thr = top_k_top_p_threshold(logits.to(DEV), top_k.to(DEV), p.to(DEV), max_top_k=1000)
    kth = torch.stack([logits[r].float().topk(int(k)).values[-1] if k > 0 else torch.tensor(float("-inf"))
                       for r, k in enumerate(top_k.tolist())])
    exact = _exact_threshold(logits, p, kth, None)
    got, want = _kept(logits, thr), _kept(logits, exact)
    assert (got != want).any(dim=-1).sum() <= 1
    assert int(got[2].sum()) == 1  # top-k 1 keeps one token whatever p is
    for r in (4, 5):  # top-p off: exactly the top-k set (or everything)
        assert torch.equal(got[r], logits[r].double() >= kth[r].double())


def test_a_row_alone_gets_its_in_batch_threshold():
    gen = torch.Generator().manual_seed(11)
    logits = (torch.randn(64, 151936, generator=gen) * 2).to(torch.bfloat16).to(DEV)
    p = torch.full((64,), 0.9, device=DEV)
    batch = top_p_threshold_triton(logits, p)
    for r in (0, 17, 63):
        assert torch.equal(top_p_threshold_triton(logits[r : r + 1], p[r : r + 1]), batch[r : r + 1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rounds", [0, 1, 2, 3])
def test_sampling_takes_the_token_of_the_search_then_one_draw(dtype, rounds):
    """Accepting a draw by one count, drawing again above it, and searching only for the rows left decide
    exactly as the full search does; rounds = 0 searches every row, small p makes many rows redraw."""
    gen = torch.Generator().manual_seed(5 + rounds)
    rows, vocab = 32, 151936
    logits = (torch.randn(rows, vocab, generator=gen) * torch.linspace(0.3, 5, rows)[:, None]).to(dtype)
    logits[7, 10:] = float("-inf")
    logits[9] = float("-inf")  # nothing finite: index 0, as the plain draw gives
    logits[11, : vocab // 3] = logits[11, 0]  # a long tie
    logits = logits.to(DEV)
    p = torch.tensor([0.9, 0.3, 0.1, 0.99, 1.0, 0.6, 0.05, 0.8] * 4, device=DEV)
    temperature = (torch.rand(rows, generator=gen) + 0.3).to(DEV)
    kth = logits.float().topk(50, dim=-1).values[:, -1]
    lower = torch.where(torch.arange(rows, device=DEV) % 3 == 0, kth, float("-inf"))
    thr = top_p_threshold_triton(logits, p, lower, temperature)
    redrawn = 0
    for seed in range(8):
        keys = torch.tensor([mix_seed(seed, r) for r in range(rows)], device=DEV)
        got = top_p_sample_triton(logits, keys, p, lower, temperature, temperature, rounds=rounds)
        assert torch.equal(got, gumbel_sample_triton(logits, keys, temperature, thr))
        redrawn += int((gumbel_sample_triton(logits, keys, temperature, lower) != got).sum())
    assert redrawn > 0  # some first draws fell outside their nucleus: the redraw and the search were exercised


def _metadata(num_rows, temperature, top_k, top_p, min_p, max_top_k):
    from engine.sample import SamplingMetadata, make_generator

    return SamplingMetadata(
        temperature=temperature, all_greedy=False, all_random=False, top_k=top_k, top_p=top_p, min_p=min_p,
        generators={i: make_generator(500 + i, 3, DEV) for i in range(num_rows)}, presence_penalties=None,
        frequency_penalties=None, repetition_penalties=None, prompt_token_ids=None, output_token_ids=[],
        max_top_k=max_top_k,
    )


def test_sampler_top_p_fast_path_equals_the_general_path_and_thresholds_never_sync():
    from engine.sample import Sampler
    from engine.sample.topk_topp import apply_top_k_top_p, top_k_top_p_threshold

    num_rows, vocab = 64, 151936
    gen = torch.Generator().manual_seed(8)
    logits = (torch.randn(num_rows, vocab, generator=gen) * 3).to(torch.bfloat16).to(DEV)
    temperature = (torch.rand(num_rows, generator=gen) + 0.3).to(DEV)
    temperature[::5] = 0.0  # greedy rows
    top_k = torch.where(torch.arange(num_rows) % 3 == 1, 40, 0).to(DEV)
    top_p = torch.where(torch.arange(num_rows) % 4 == 0, 1.0, 0.9).to(DEV)
    zeros = torch.zeros(num_rows, device=DEV)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync in here raises
    try:
        top_k_top_p_threshold(logits, top_k, top_p, 40, torch.where(temperature == 0, 1.0, temperature))
        apply_top_k_top_p(logits.float(), top_k, top_p, 40)
        top_p_sample_triton(logits, torch.arange(num_rows, device=DEV), top_p, None, temperature.clamp_min(0.1),
                            temperature.clamp_min(0.1))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    fast = Sampler()(logits, _metadata(num_rows, temperature, top_k, top_p, None, 40)).sampled_token_ids
    # min_p = 0 masks nothing but takes the general path (float32 copy, division, masks, sampling).
    general = Sampler()(logits, _metadata(num_rows, temperature, top_k, top_p, zeros, 40)).sampled_token_ids
    assert torch.equal(fast, general)
    greedy = temperature == 0
    assert torch.equal(fast[greedy], logits[greedy].argmax(dim=-1))
    # Every sampled token of a top-p row lies inside its nucleus (exact check on the host).
    kth = torch.stack([logits[r].float().topk(40).values[-1] if r % 3 == 1 else torch.tensor(float("-inf"), device=DEV)
                       for r in range(num_rows)])
    scaled_temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    exact = _exact_threshold(logits, torch.where(greedy, 1.0, top_p).cpu(), kth, scaled_temp)
    chosen = logits.double().cpu().gather(1, fast.cpu().unsqueeze(1)).squeeze(1)
    assert bool((chosen >= exact - 1e-2).all())
