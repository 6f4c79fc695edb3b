"""N-gram speculator: the tokens that followed the latest earlier occurrence of the request's last n tokens."""

from __future__ import annotations

import numpy as np

from engine.config import SpecDecodeSettings
from engine.worker.request_state import RequestState
from engine.worker.spec_decode.proposer import VerifiedStep

# Rows from which one batched lookup beats one lookup per row (measured on CPU: a batched call
# costs ~60 us at 1 row and ~120 us at 16, a row's own lookup ~10-15 us).
BATCHED_FROM_ROWS = 8


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


def ngram_lookup_rows(tokens: np.ndarray, lengths: np.ndarray, ks: np.ndarray, n_min: int, n_max: int) -> list[list[int]]:
    """ngram_lookup for many rows at once: row r's tokens are tokens[r, :lengths[r]] and it wants up to ks[r].

    The same answer as ngram_lookup row by row, in a fixed number of array operations whatever
    the number of rows (a step calls it once for all its sampling rows): one pass over [R, W]
    finds every earlier occurrence of each row's last token as (row, end) pairs, and each
    longer suffix narrows those pairs one token back. np.nonzero orders pairs by row, then by
    end, so a row's last surviving pair is its latest occurrence.
    """
    num_rows, width = tokens.shape
    lengths = lengths.astype(np.int64)
    last = lengths - 1
    row_ids = np.arange(num_rows)
    rr, ee = np.nonzero((np.arange(width) < last[:, None]) & (tokens == tokens[row_ids, np.maximum(last, 0)][:, None]))
    survivors = {1: (rr, ee)}
    for n in range(2, n_max + 1):
        back = n - 1
        keep = (ee >= back) & (last[rr] >= back)
        rr, ee = rr[keep], ee[keep]
        keep = tokens[rr, ee - back] == tokens[rr, last[rr] - back]
        rr, ee = rr[keep], ee[keep]
        survivors[n] = (rr, ee)
    begins = np.full(num_rows, -1, dtype=np.int64)
    for n in range(n_max, n_min - 1, -1):  # longest suffix first: rows it settles are done
        rr, ee = survivors[n]
        open_rows = begins[rr] < 0
        rr, ee = rr[open_rows], ee[open_rows]
        if not len(rr):
            continue
        full = ee + 1 + ks[rr] <= lengths[rr]  # followed by k tokens
        for r, e in ((rr, ee), (rr[full], ee[full])):  # the latest, then the latest followed by k (wins)
            final = np.flatnonzero(np.r_[r[1:] != r[:-1], True]) if len(r) else r
            begins[r[final]] = e[final] + 1
    out = []
    for r in range(num_rows):
        b = int(begins[r])
        out.append(tokens[r, b : min(b + int(ks[r]), int(lengths[r]))].tolist() if b >= 0 and ks[r] > 0 else [])
    return out


class NgramProposer:
    """Host-only: reads each row's tokens from the runner's RequestState."""

    def __init__(self, settings: SpecDecodeSettings, state: RequestState) -> None:
        self.k = settings.num_speculative_tokens
        self.n_min, self.n_max = settings.prompt_lookup_min, settings.prompt_lookup_max
        self.state = state

    def propose(self, step: VerifiedStep) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in range(step.batch.num_reqs)]
        if not len(step.rows):
            return drafts
        st = self.state
        lengths = step.last_positions + 1
        ks = np.minimum(self.k, st.max_model_len - lengths)  # no draft past max_model_len
        slots = step.batch.slots[step.rows]
        if len(slots) >= BATCHED_FROM_ROWS:
            found = ngram_lookup_rows(st.token_ids[slots, : int(lengths.max())], lengths, ks, self.n_min, self.n_max)
        else:
            found = [ngram_lookup(st.token_ids[slot, :n], int(k), self.n_min, self.n_max) if k > 0 else []
                     for slot, n, k in zip(slots.tolist(), lengths.tolist(), ks.tolist())]
        for row, d in zip(step.rows.tolist(), found):
            drafts[row] = d
        return drafts
