"""N-gram speculator: the tokens that followed the latest earlier occurrence of the request's last n tokens."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.config import SpecDecodeSettings
from engine.worker.request_state import RequestState
from engine.worker.spec_decode.proposer import VerifiedStep


def ngram_lookup(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed an earlier occurrence of tokens' last n tokens, longest n first.

    Among the occurrences of one suffix the latest that is followed by k tokens wins (else the
    latest at all): a repeating span continues the way it went last time.
    """
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n:]
        # Windows starting at 0 .. length - n - 1: every occurrence except the suffix itself.
        windows = sliding_window_view(tokens[: length - 1], n)
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if not len(starts):
            continue
        follow = starts + n  # where each occurrence's continuation begins
        full = follow[follow + k <= length]
        begin = int(full[-1] if len(full) else follow[-1])
        return tokens[begin : begin + k].tolist()
    return []


class NgramProposer:
    """Host-only: reads each row's tokens from the runner's RequestState."""

    def __init__(self, settings: SpecDecodeSettings, state: RequestState) -> None:
        self.k = settings.num_speculative_tokens
        self.n_min, self.n_max = settings.prompt_lookup_min, settings.prompt_lookup_max
        self.state = state

    def propose(self, step: VerifiedStep) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in range(step.batch.num_reqs)]
        st = self.state
        for row, pos in zip(step.rows.tolist(), step.last_positions.tolist()):
            slot = int(step.batch.slots[row])
            k = min(self.k, st.max_model_len - 1 - pos)  # no draft past max_model_len
            if k > 0:
                drafts[row] = ngram_lookup(st.token_ids[slot, : pos + 1], k, self.n_min, self.n_max)
        return drafts
