"""InputBatch: one step's flattened inputs, gathered from RequestState without Python loops over tokens."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.core.sched_output import SchedulerOutput
from engine.worker.request_state import RequestState


@dataclass
class InputBatch:
    """Rows are requests in the scheduler's order; tokens of all rows are concatenated.

    Row i owns tokens [query_start_loc[i], query_start_loc[i+1]) of input_ids, which sit at
    positions [seq_lens[i] - query_len_i, seq_lens[i]) of its sequence:

        tokens:     | row 0 (prefill chunk) | row 1 | row 2 | ...
        positions:    c0 .. c0+n0-1           c1      c2        (c = num_computed_tokens)
    """

    req_ids: list[str]
    slots: np.ndarray  # [B] int64, RequestState slot per row
    num_scheduled_tokens: np.ndarray  # [B] int64
    query_start_loc: np.ndarray  # [B + 1] int32
    seq_lens: np.ndarray  # [B] int32, context length after this step
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64, KV cache slot of each token
    block_table: np.ndarray  # [B, max_num_blocks] int32
    # Rows whose tokens are all computed after this step: they sample one token.
    sample_rows: np.ndarray  # [S] int64 indices into rows
    logits_indices: np.ndarray  # [S] int64 indices into tokens (each row's last token)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])


def make_input_batch(state: RequestState, sched: SchedulerOutput, block_size: int) -> InputBatch:
    req_ids = list(sched.num_scheduled_tokens)
    num_reqs = len(req_ids)
    slots = np.fromiter(map(state.req_id_to_slot.__getitem__, req_ids), dtype=np.int64, count=num_reqs)
    num_sched = np.fromiter(sched.num_scheduled_tokens.values(), dtype=np.int64, count=num_reqs)
    starts = state.num_computed_tokens[slots]  # [B]

    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
    np.cumsum(num_sched, out=query_start_loc[1:])
    total = int(query_start_loc[-1])

    if total == num_reqs:  # one token per row (decode steps): token i is row i's, at the row's start
        positions, token_slots = starts, slots
    else:
        row_of_token = np.repeat(np.arange(num_reqs), num_sched)  # [T]
        positions = np.arange(total) - query_start_loc[row_of_token] + starts[row_of_token]
        token_slots = slots[row_of_token]
    input_ids = state.token_ids[token_slots, positions]
    block_ids = state.block_table[token_slots, positions // block_size].astype(np.int64)
    slot_mapping = block_ids * block_size + positions % block_size

    seq_lens = (starts + num_sched).astype(np.int32)
    max_blocks = int(state.num_blocks[slots].max()) if len(req_ids) else 0
    block_table = state.block_table[slots, :max_blocks]

    sample_rows = np.nonzero(seq_lens >= state.num_tokens[slots])[0]
    logits_indices = query_start_loc[1:][sample_rows].astype(np.int64) - 1
    return InputBatch(
        req_ids=req_ids,
        slots=slots,
        num_scheduled_tokens=num_sched,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        block_table=block_table,
        sample_rows=sample_rows,
        logits_indices=logits_indices,
    )
