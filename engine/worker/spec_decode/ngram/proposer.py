"""N-gram speculator: the tokens that followed the latest earlier occurrence of the request's last n tokens."""

from __future__ import annotations

import numpy as np

from engine.config import SpecDecodeSettings
from engine.worker.request_state import RequestState
from engine.worker.spec_decode.proposer import VerifiedStep


def ngram_lookup(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed an earlier occurrence of tokens' last n tokens, longest n first.

    Among the occurrences of one suffix the latest that is followed by k tokens wins (else the
    latest at all): a repeating span continues the way it went last time. Candidates are the
    earlier occurrences of the last token, narrowed one token back at a time (one pass over
    the tokens, then work on the candidates only: a step calls this for every sampling row).
    """
    length = len(tokens)
    last_ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])  # where an occurrence ends
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        ends = last_ends[last_ends >= n - 1]
        for back in range(1, n):
            if not len(ends):
                break
            ends = ends[tokens[ends - back] == tokens[length - 1 - back]]
        if not len(ends):
            continue
        follow = ends + 1  # where each occurrence's continuation begins
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
