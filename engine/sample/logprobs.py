"""Top-K logprobs of chosen tokens as tensors, and their conversion to wire arrays."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.wire import LogprobsLists


@dataclass
class LogprobsTensors:
    """Logprobs of N positions: column 0 is the chosen token, columns 1..K the top-K, descending."""

    token_ids: torch.Tensor  # [N, K+1] int64
    logprobs: torch.Tensor  # [N, K+1] float32
    ranks: torch.Tensor  # [N] int64; 1 + number of vocab entries strictly above the chosen token

    def to_lists(self, num_logprobs: int | None = None) -> LogprobsLists:
        """Copies to host numpy arrays, keeping the chosen token plus the first num_logprobs top entries."""
        width = None if num_logprobs is None else num_logprobs + 1
        return LogprobsLists(
            token_ids=self.token_ids[:, :width].cpu().numpy(),
            logprobs=self.logprobs[:, :width].cpu().numpy(),
            ranks=self.ranks.cpu().numpy(),
        )


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """Picks each row's chosen-token logprob, its rank and the row's top-`num_logprobs` entries.

    logprobs: [N, V] (log-probabilities, or logits in the raw/processed_logits modes; rank is
    well defined for both). token_ids: [N] int64.
    """
    token_ids = token_ids.to(device=logprobs.device, dtype=torch.int64).unsqueeze(1)  # [N, 1]
    chosen = logprobs.gather(1, token_ids)  # [N, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1  # [N]
    num_logprobs = min(num_logprobs, logprobs.shape[1])
    if num_logprobs > 0:
        top_values, top_ids = logprobs.topk(num_logprobs, dim=-1)  # [N, K], [N, K], descending
        ids = torch.cat([token_ids, top_ids], dim=1)  # [N, K+1]
        values = torch.cat([chosen, top_values], dim=1)  # [N, K+1]
    else:
        ids, values = token_ids, chosen
    return LogprobsTensors(token_ids=ids, logprobs=values.to(torch.float32), ranks=ranks.to(torch.int64))
