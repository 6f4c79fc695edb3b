"""Temperature, top-k, top-p and min-p on a batch of logits: partial-selection paths and the sort-based reference."""

from __future__ import annotations

import torch

from engine.kernels import use_triton
from engine.kernels.top_p import top_p_threshold_triton

_NEG_INF = float("-inf")
# Top-p without top-k first looks at this many candidates per row; rows whose nucleus is
# wider are sorted (see _top_p_threshold).
_TOP_P_FIRST_CANDIDATES = 1024
# A first try at least this fraction of the vocabulary is skipped in favour of a sort.
# Measured on CPU (benchmarks/sampling_micro.py): for a wide nucleus, a larger second topk
# plus the sort it often still needs costs more than sorting right away.
_SORT_FRACTION = 1 / 8


def apply_temperature(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    greedy_mask: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Divides each random row by its temperature; rows in greedy_mask ([B] bool) stay as they are.

    In place by default; with out_dtype, returns a new tensor of that dtype instead (one pass
    that upcasts and divides: the same values as `logits.to(out_dtype)` then dividing in place).
    """
    temp = temperature.to(device=logits.device, dtype=out_dtype or logits.dtype)  # [B]
    if greedy_mask is not None:
        temp = torch.where(greedy_mask, torch.ones_like(temp), temp)
    if out_dtype is not None:
        return torch.div(logits, temp.unsqueeze(1)).to(out_dtype)  # computed in out_dtype: no extra pass
    return logits.div_(temp.unsqueeze(1))


def apply_top_k_top_p(
    logits: torch.Tensor,  # [B, V]
    top_k: torch.Tensor | None,  # [B] int64; <= 0 or >= V = off
    top_p: torch.Tensor | None,  # [B] float32; >= 1.0 = off
    max_top_k: int | None = None,  # an upper bound of top_k known on the host (None: read from top_k)
) -> torch.Tensor:
    """Masks to -inf every token outside the row's top-k, then outside its top-p nucleus (in place).

    Same semantics as apply_top_k_top_p_sort without sorting the vocabulary; each row ends
    with one threshold and keeps every token >= it:
      - top-k: torch.topk of the batch's largest k (+1) gives each row's k-th largest value.
        Tie rule: every token equal to the k-th largest value is kept (the sort reference
        keeps exactly k, choosing among ties arbitrarily).
      - top-p: keeps the smallest set of most likely tokens whose mass (after top-k) is >= p,
        i.e. every token >= the value at which the descending cumulative mass first reaches
        p (tokens tied with that boundary token are all kept). With top-k on, the mass is
        summed over the same top-k candidates; otherwise over the row's top 1024 values,
        and a sort of only the rows whose nucleus is wider.
    Rows with both features off are returned bit-identical. On CPU, top-k alone syncs with the
    device only without max_top_k and top-p costs a few host syncs per call (which rows its
    candidates settle); on the GPU the same thresholds come from top_k_top_p_threshold, which
    never syncs when max_top_k is given.
    """
    if top_k is None and top_p is None:
        return logits
    if top_p is not None and use_triton(logits) and logits.stride(-1) == 1:
        return logits.masked_fill_(logits < top_k_top_p_threshold(logits, top_k, top_p, max_top_k), _NEG_INF)
    num_rows, vocab_size = logits.shape
    k = p = None
    if top_k is not None:
        k = top_k.to(device=logits.device, dtype=torch.int64)  # [B]
        k = torch.where((k <= 0) | (k >= vocab_size), 0, k)  # 0 = off
        if max_top_k is None:
            max_top_k = int(k.max())
        k = k if 0 < max_top_k else None  # rows at 0 keep every token; an upper bound only costs candidates
    if top_p is not None:
        p = top_p.to(device=logits.device, dtype=torch.float32)  # [B]
        p = p if bool((p < 1.0).any()) else None
    if k is None and p is None:
        return logits

    threshold = torch.full((num_rows, 1), _NEG_INF, dtype=logits.dtype, device=logits.device)  # [B, 1]
    p_slow = None if p is None else p < 1.0  # [B]: top-p rows not settled on the top-k candidates
    if k is not None:
        # One extra candidate tells whether ties of the k-th value reach beyond the candidates.
        num_candidates = min(vocab_size, max_top_k + 1)
        cand = logits.topk(num_candidates, dim=-1, sorted=True).values  # [B, K], descending
        kth = cand.gather(1, (k - 1).clamp_min(0).unsqueeze(1))  # [B, 1]
        threshold = kth.masked_fill_((k == 0).unsqueeze(1), _NEG_INF)  # rows with top-k off keep all
        if p is not None:
            #   cand: c_0 >= ... >= c_{k-1} = kth  > c_k ...   (complete: nothing >= kth lies beyond)
            complete = (cand[:, -1:] < kth).squeeze(1) | (num_candidates == vocab_size)  # [B]
            fast = p_slow & (k > 0) & complete  # [B]
            if bool(fast.any()):
                kept = cand.masked_fill(cand < kth, _NEG_INF)  # [B, K]: exactly the row's top-k set
                p_threshold = _nucleus_threshold(kept, kept.logsumexp(dim=-1, keepdim=True), p)  # [B, 1]
                threshold = torch.where(fast.unsqueeze(1), torch.maximum(threshold, p_threshold), threshold)
                p_slow &= ~fast
    if p_slow is not None and bool(p_slow.any()):
        rows = None if bool(p_slow.all()) else p_slow.nonzero().flatten()
        sub = logits if rows is None else logits[rows]  # [R, V]; a copy when some rows
        sub_threshold = threshold if rows is None else threshold[rows]  # [R, 1]
        if k is not None:
            sub.masked_fill_(sub < sub_threshold, _NEG_INF)  # top-k first (final mask below repeats it)
        sub_k = None if k is None else (k if rows is None else k[rows])
        p_threshold = _top_p_threshold(sub, p if rows is None else p[rows], sub_k, max_top_k)  # [R, 1]
        if rows is None:
            threshold = torch.maximum(threshold, p_threshold)
        else:
            threshold[rows] = torch.maximum(sub_threshold, p_threshold)
    return logits.masked_fill_(logits < threshold, _NEG_INF)


def top_k_lower(logits: torch.Tensor, top_k: torch.Tensor | None, max_top_k: int | None = None) -> torch.Tensor | None:
    """GPU: each row's k-th largest value ([B] float32, -inf where top-k is off), from one partial topk; None when
    no row has top-k. No host sync when max_top_k is given."""
    if top_k is None:
        return None
    vocab_size = logits.shape[1]
    k = top_k.to(device=logits.device, dtype=torch.int64)
    k = torch.where((k <= 0) | (k >= vocab_size), 0, k)  # 0 = off
    if max_top_k is None:
        max_top_k = int(k.max())
    if max_top_k <= 0:
        return None
    cand = logits.topk(min(vocab_size, max_top_k), dim=-1, sorted=True).values  # [B, K], descending
    kth = cand.gather(1, (k - 1).clamp(0, cand.shape[1] - 1).unsqueeze(1))  # [B, 1]
    return kth.to(torch.float32).masked_fill_((k == 0).unsqueeze(1), _NEG_INF).squeeze(1)


def top_k_top_p_threshold(
    logits: torch.Tensor,  # [B, V] on the GPU, any float dtype
    top_k: torch.Tensor | None,  # [B] int64; <= 0 or >= V = off
    top_p: torch.Tensor,  # [B] float32; >= 1.0 = off
    max_top_k: int | None = None,
    temperature: torch.Tensor | None = None,  # [B] float32 > 0: the logits are unscaled (greedy rows pass 1)
) -> torch.Tensor:  # [B, 1] float32
    """GPU: the value each row keeps tokens at or above under top-k then top-p (apply_top_k_top_p's rule),
    from top_k_lower and the sort-free pivot search of engine/kernels/top_p.py; no host sync when max_top_k
    is given. With temperature, the nucleus is that of softmax(logits / T)."""
    return top_p_threshold_triton(logits, top_p, top_k_lower(logits, top_k, max_top_k), temperature)


def _nucleus_threshold(cand: torch.Tensor, lse: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The top-p boundary value per row from descending candidates; -inf where they never reach p.

      candidates: c_0 >= c_1 >= ... >= c_{K-1}    cum_j = sum_{i<=j} exp(c_i - lse)
      boundary j* = first j with cum_j >= p;  keep every token with value >= c_{j*}
    Any token above c_{j*} is among the candidates, so c_{j*} is exact.
    cand: [R, K]; lse: [R, 1] log of the row's whole mass; p: [R]. Returns [R, 1].
    """
    # Summed in float64: near p = 1 a float32 running sum drifts by more than 1 - p.
    cum = (cand - lse).exp_().cumsum(dim=-1, dtype=torch.float64)  # [R, K]
    reached = cum >= p.unsqueeze(1)  # [R, K]: False ... False True ... True (cum never decreases)
    boundary = (~reached).sum(dim=-1, keepdim=True)  # [R, 1]: index of the first True, K if none
    found = boundary < cand.shape[1]
    return torch.where(found, cand.gather(1, boundary.clamp_max(cand.shape[1] - 1)), _NEG_INF)


def _top_p_threshold(
    logits: torch.Tensor, p: torch.Tensor, k: torch.Tensor | None, max_k: int | None = None
) -> torch.Tensor:
    """Top-p boundary value ([R, 1]) of rows that all have p < 1; k ([R] int64, 0 = off; max_k bounds
    it) sizes the candidates.

    Candidates are each row's top K values and the normalizer is the logsumexp of the whole
    row, so a row is settled once its candidates reach mass p. Rows still unsettled are
    sorted; after a sort every row settles (rounding can leave the total a hair under p:
    then the whole row stays).
    """
    vocab_size = logits.shape[1]
    lse = logits.logsumexp(dim=-1, keepdim=True)  # [R, 1]
    num_candidates = _TOP_P_FIRST_CANDIDATES
    if k is not None:
        num_candidates = max(num_candidates, (int(k.max()) if max_k is None else max_k) + 1)
    if num_candidates >= _SORT_FRACTION * vocab_size:
        return _nucleus_threshold(logits.sort(dim=-1, descending=True).values, lse, p)
    threshold = _nucleus_threshold(logits.topk(num_candidates, dim=-1, sorted=True).values, lse, p)  # [R, 1]
    pending = (threshold == _NEG_INF).squeeze(1).nonzero().flatten()  # rows wider than the candidates
    if pending.numel():
        wide = logits[pending].sort(dim=-1, descending=True).values  # [r, V]
        threshold[pending] = _nucleus_threshold(wide, lse[pending], p[pending])
    return threshold


def apply_top_k_top_p_sort(
    logits: torch.Tensor,  # [B, V]
    top_k: torch.Tensor | None,  # [B] int64; <= 0 or >= V = off
    top_p: torch.Tensor | None,  # [B] float32; >= 1.0 = off
) -> torch.Tensor:
    """Reference: a full sort of every row (in place). Keeps exactly k tokens (ties broken arbitrarily).

    top-p keeps the smallest set of most likely tokens whose probability mass (after top-k)
    is >= p. A row with both features off is returned unchanged.
    """
    if top_k is None and top_p is None:
        return logits
    vocab_size = logits.shape[1]
    # Ascending sort: the kept tokens are always a suffix of each sorted row.
    logits_sort, sort_idx = logits.sort(dim=-1, descending=False)  # [B, V], [B, V]

    if top_k is not None:
        k = top_k.to(device=logits.device, dtype=torch.int64)
        k = torch.where((k <= 0) | (k > vocab_size), vocab_size, k)  # [B]
        #   sorted position: 0 ............ V-k-1 | V-k ........ V-1
        #                    masked                | kept (top k)
        positions = torch.arange(vocab_size, device=logits.device).unsqueeze(0)  # [1, V]
        logits_sort.masked_fill_(positions < (vocab_size - k).unsqueeze(1), _NEG_INF)

    if top_p is not None:
        p = top_p.to(device=logits.device, dtype=torch.float32)  # [B]
        probs_sort = logits_sort.softmax(dim=-1)  # [B, V]
        cum = probs_sort.cumsum(dim=-1)  # [B, V]
        # Drop token i iff the tokens at or below it hold <= 1 - p: what stays holds >= p, and
        # dropping one more would leave < p.
        drop = cum <= (1.0 - p).unsqueeze(1)
        drop[:, -1] = False  # the most likely token always survives
        drop &= (p < 1.0).unsqueeze(1)  # rows with top-p off are exactly untouched
        logits_sort.masked_fill_(drop, _NEG_INF)

    return logits.scatter_(1, sort_idx, logits_sort)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Masks tokens whose probability is below min_p times the row's largest probability."""
    probs = logits.softmax(dim=-1)  # [B, V]
    max_probs = probs.amax(dim=-1, keepdim=True)  # [B, 1]
    threshold = min_p.to(probs).unsqueeze(1) * max_probs  # [B, 1]; 0 for rows with min-p off
    return logits.masked_fill_(probs < threshold, _NEG_INF)
