"""Temperature, top-k, top-p and min-p on a batch of logits (sort-based torch reference)."""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def apply_temperature(
    logits: torch.Tensor, temperature: torch.Tensor, greedy_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Divides each random row by its temperature; rows in greedy_mask ([B] bool) stay as they are."""
    temp = temperature.to(logits)  # [B]
    if greedy_mask is not None:
        temp = torch.where(greedy_mask, torch.ones_like(temp), temp)
    return logits.div_(temp.unsqueeze(1))


def apply_top_k_top_p(
    logits: torch.Tensor,  # [B, V]
    top_k: torch.Tensor | None,  # [B] int64; <= 0 or >= V = off
    top_p: torch.Tensor | None,  # [B] float32; >= 1.0 = off
) -> torch.Tensor:
    """Masks to -inf every token outside the row's top-k, then outside its top-p nucleus.

    top-p keeps the smallest set of most likely tokens whose probability mass (after top-k)
    is >= p. A row with both features off is returned unchanged.
    """
    if top_k is None and top_p is None:
        return logits
    num_rows, vocab_size = logits.shape
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
