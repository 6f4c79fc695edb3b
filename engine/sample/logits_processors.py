"""Per-request logits edits: allowed_token_ids, bad words, min_tokens and logit_bias."""

from __future__ import annotations

import torch


def apply_allowed_token_ids(logits: torch.Tensor, banned_mask: torch.Tensor) -> torch.Tensor:
    """Sets every token outside a row's allowed set to -inf; banned_mask is [B, V] bool, True = banned."""
    return logits.masked_fill_(banned_mask.to(logits.device), float("-inf"))


def _ban(logits: torch.Tensor, rows: list[int], cols: list[int]) -> None:
    """Sets logits[rows[i], cols[i]] = -inf with one indexed write."""
    if rows:
        idx_rows = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        idx_cols = torch.tensor(cols, dtype=torch.int64, device=logits.device)
        logits[idx_rows, idx_cols] = float("-inf")


def bad_words_banned_tokens(bad_words: list[list[int]], output: list[int]) -> list[int]:
    """Tokens that would complete one of `bad_words` given the output so far.

    A sequence [w0, ..., wn] bans wn when [w0, ..., wn-1] is a suffix of the output, so a
    one-token bad word (empty prefix) is always banned.
    """
    banned = []
    for word in bad_words:
        if not word:
            continue
        prefix = word[:-1]
        if len(prefix) > len(output):
            continue
        if not prefix or output[len(output) - len(prefix) :] == prefix:
            banned.append(word[-1])
    return banned


def apply_bad_words(
    logits: torch.Tensor, bad_words_token_ids: dict[int, list[list[int]]], output_token_ids: list[list[int]]
) -> torch.Tensor:
    """Bans, per row, the last token of every bad word whose prefix ends the current output."""
    rows, cols = [], []
    for row, words in bad_words_token_ids.items():
        output = output_token_ids[row] if row < len(output_token_ids) else []
        for tok in bad_words_banned_tokens(words, output):
            rows.append(row)
            cols.append(tok)
    _ban(logits, rows, cols)
    return logits


def apply_min_tokens(
    logits: torch.Tensor, min_tokens: dict[int, tuple[int, set[int]]], output_token_ids: list[list[int]]
) -> torch.Tensor:
    """Bans a row's stop tokens (incl. EOS) while its output is shorter than its min_tokens."""
    rows, cols = [], []
    for row, (num_min_tokens, stop_ids) in min_tokens.items():
        num_output = len(output_token_ids[row]) if row < len(output_token_ids) else 0
        if num_output >= num_min_tokens:
            continue
        for tok in stop_ids:
            rows.append(row)
            cols.append(tok)
    _ban(logits, rows, cols)
    return logits


def apply_logit_bias(logits: torch.Tensor, logit_bias: dict[int, dict[int, float]]) -> torch.Tensor:
    """Adds each row's {token id: bias} to its logits."""
    rows, cols, values = [], [], []
    for row, bias in logit_bias.items():
        for tok, value in bias.items():
            rows.append(row)
            cols.append(tok)
            values.append(value)
    if rows:
        device = logits.device
        index = (
            torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(cols, dtype=torch.int64, device=device),
        )
        logits.index_put_(index, torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True)
    return logits
