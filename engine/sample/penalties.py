"""Presence, frequency and repetition penalties applied to a batch of logits (vLLM/HF semantics)."""

from __future__ import annotations

import torch


def token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Counts each token id per row; ids outside [0, vocab_size) (padding) are dropped.

    token_ids: [B, L] int64, padded with vocab_size. Returns [B, V] int64.
    """
    num_rows = token_ids.shape[0]
    # Padding (and any stray out-of-range id) lands in the extra column V, cut off below.
    ids = torch.where((token_ids >= 0) & (token_ids < vocab_size), token_ids, vocab_size)
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.int64, device=token_ids.device)  # [B, V+1]
    counts.scatter_add_(1, ids, torch.ones_like(ids))
    return counts[:, :vocab_size]


def pad_output_token_ids(output_token_ids: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Packs ragged per-row output ids into [B, max_len] int64, padded with vocab_size."""
    max_len = max((len(ids) for ids in output_token_ids), default=0)
    rows = [ids + [vocab_size] * (max_len - len(ids)) for ids in output_token_ids]
    if max_len == 0:
        return torch.full((len(output_token_ids), 1), vocab_size, dtype=torch.int64, device=device)
    return torch.tensor(rows, dtype=torch.int64, device=device)


def apply_penalties(
    logits: torch.Tensor,  # [B, V] float32, modified in place
    prompt_token_ids: torch.Tensor | None,  # [B, max_prompt_len] int64, padded with vocab_size
    output_token_ids: list[list[int]],
    presence_penalties: torch.Tensor | None,  # [B] float32
    frequency_penalties: torch.Tensor | None,  # [B] float32
    repetition_penalties: torch.Tensor | None,  # [B] float32
) -> torch.Tensor:
    """Applies the three penalties; a row with neutral values (0, 0, 1) is left bit-identical.

    repetition: over prompt AND output tokens, positive logits / p, non-positive logits * p.
    frequency: logit -= f * (count of the token in the output).
    presence: logit -= r * (1 if the token occurs in the output).
    """
    num_rows, vocab_size = logits.shape
    output_ids = pad_output_token_ids(output_token_ids, vocab_size, logits.device)  # [B, max_out]
    output_counts = token_counts(output_ids, vocab_size)  # [B, V]
    output_mask = output_counts > 0  # [B, V]

    if repetition_penalties is not None:
        seen = output_mask
        if prompt_token_ids is not None:
            seen = seen | (token_counts(prompt_token_ids.to(logits.device), vocab_size) > 0)
        penalty = repetition_penalties.to(logits).unsqueeze(1).expand_as(logits)  # [B, V]
        # Only seen tokens change; p == 1 leaves them unchanged too (x / 1 == x * 1 == x).
        penalty = torch.where(seen, penalty, torch.ones_like(penalty))
        logits.copy_(torch.where(logits > 0, logits / penalty, logits * penalty))
    if frequency_penalties is not None:
        logits -= frequency_penalties.to(logits).unsqueeze(1) * output_counts.to(logits.dtype)
    if presence_penalties is not None:
        logits -= presence_penalties.to(logits).unsqueeze(1) * output_mask.to(logits.dtype)
    return logits
