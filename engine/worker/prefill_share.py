"""Shared prefill: rows of one step with the same context (an n>1 request's samples) run the forward once.

An RL step sends each prompt n times (SamplingParams.n); the children's prompts are equal, and a
prompt shorter than a KV block never gets a prefix-cache hit, so every child computed the same
prompt again: n times the prefill's FLOPs. Here rows whose whole context is equal (same tokens up
to seq_len, same number already computed, same adapter) are run once: the forward sees one
representative per group, its KV is copied into the other rows' cache slots afterwards, and
their logits are the representative's last hidden row. A row's result is the one its
representative computes for it, so sampling (each row's own seed) and every later step are as if
the row had run itself.

    full batch rows:    r0 (p)  r1 (p)  r2 (q)  r3 (p)      p, q: contexts
    forward rows:       r0      r2                           r1, r3 -> r0
    after the forward:  KV slots of r1, r3 <- slots of r0 (position by position)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.worker.input_batch import InputBatch
from engine.worker.request_state import RequestState


@dataclass
class SharedPrefill:
    """A step's batch with equal-context rows folded onto one representative each."""

    batch: InputBatch  # the rows the forward runs (original order, duplicates left out)
    # [S] int64: for each sampling row of the FULL batch (its sample_rows order), the token of `batch`
    # whose hidden state gives its logits (its representative's last token).
    logits_indices: np.ndarray
    src_slots: np.ndarray  # [N] int64 KV cache slots the representatives' tokens were written to
    dst_slots: np.ndarray  # [N] int64 the left-out rows' slots for the same positions


def fold_shared_rows(batch: InputBatch, state: RequestState, placeholder: int,
                     exclude: np.ndarray | None = None) -> SharedPrefill | None:
    """The batch with rows of equal context folded (None when no two rows share one).

    Candidates are rows scheduling more than one token (prefill chunks; decode rows of different
    requests never share a context) without placeholder inputs (token id `placeholder`, sampled by
    the step in flight); `exclude` ([B] bool) keeps rows out (ones that need their own hidden
    states, e.g. for prompt logprobs).
    """
    num_sched = batch.num_scheduled_tokens
    candidates = np.nonzero(num_sched > 1)[0]
    if len(candidates) < 2:
        return None
    qsl = batch.query_start_loc
    rep_of = np.arange(batch.num_reqs)  # [B] each row's representative (itself when it runs)
    # A row with a placeholder input (an id the step in flight samples) or excluded runs by itself.
    alone = np.add.reduceat(batch.input_ids == placeholder, qsl[:-1].astype(np.int64))[candidates] > 0
    if exclude is not None:
        alone |= exclude[candidates]
    rows = candidates[~alone]
    if len(rows) < 2:
        return None
    # Rows with equal (computed count, adapter, length, context) are one computation; the first in order runs.
    slots, seq_lens = batch.slots[rows], batch.seq_lens[rows]
    starts = (seq_lens - batch.num_scheduled_tokens[rows]).tolist()
    first_row: dict[tuple, int] = {}
    token_ids = state.token_ids
    for row, slot, seq_len, start, lora_id in zip(rows.tolist(), slots.tolist(), seq_lens.tolist(), starts,
                                                  state.lora_ids[slots].tolist()):
        key = (start, lora_id, seq_len, token_ids[slot, :seq_len].tobytes())
        rep_of[row] = first_row.setdefault(key, row)
    keep = rep_of == np.arange(batch.num_reqs)  # [B]
    if keep.all():
        return None
    kept = np.nonzero(keep)[0]
    kept_sched = num_sched[kept]
    new_qsl = np.zeros(len(kept) + 1, dtype=np.int32)
    np.cumsum(kept_sched, out=new_qsl[1:])
    token_keep = np.repeat(keep, num_sched)  # [T]
    is_sample = np.zeros(batch.num_reqs, dtype=bool)
    is_sample[batch.sample_rows] = True
    sample_rows = np.nonzero(is_sample[kept])[0]
    folded = InputBatch(
        req_ids=[batch.req_ids[i] for i in kept.tolist()],
        slots=batch.slots[kept],
        num_scheduled_tokens=kept_sched,
        query_start_loc=new_qsl,
        seq_lens=batch.seq_lens[kept],
        input_ids=batch.input_ids[token_keep],
        positions=batch.positions[token_keep],
        slot_mapping=batch.slot_mapping[token_keep],
        block_table=batch.block_table[kept],
        sample_rows=sample_rows,
        logits_indices=new_qsl[1:][sample_rows].astype(np.int64) - 1,
    )
    index_in_folded = np.full(batch.num_reqs, -1, dtype=np.int64)
    index_in_folded[kept] = np.arange(len(kept))
    # Every row's logits come from its representative's last token in the folded batch.
    logits_indices = new_qsl[1:][index_in_folded[rep_of[batch.sample_rows]]].astype(np.int64) - 1
    # Tokens of the left-out rows and, position by position, their representatives' tokens:
    #   row d: tokens qsl[d] .. qsl[d+1]-1  <-  row rep_of[d]: qsl[rep] + (t - qsl[d])
    dup_rows = np.nonzero(~keep)[0]
    row_of_token = np.repeat(dup_rows, num_sched[dup_rows])
    dst_tokens = np.flatnonzero(~token_keep)  # the left-out rows' tokens, row by row
    src_tokens = qsl[rep_of[row_of_token]] + (dst_tokens - qsl[row_of_token])
    return SharedPrefill(folded, logits_indices, batch.slot_mapping[src_tokens], batch.slot_mapping[dst_tokens])


def copy_kv_slots(kv_caches: list[torch.Tensor], src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Copies K and V of cache slots src_slots[i] into dst_slots[i], in every layer's cache.

    kv_caches: [2, num_blocks, block_size, num_kv_heads, head_size] each (slot = block * block_size + offset).
    """
    for kv in kv_caches:
        _, num_blocks, block_size = kv.shape[:3]
        flat = kv.view(2, num_blocks * block_size, *kv.shape[3:])
        if flat.dtype.itemsize == 1:  # float8 index ops are incomplete on CPU: copy the bytes
            flat = flat.view(torch.uint8)
        flat.index_copy_(1, dst_slots, flat.index_select(1, src_slots))
