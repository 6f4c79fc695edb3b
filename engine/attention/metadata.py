"""The attention metadata of one step: where each request's queries, context and KV cache slots are."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Per-step attention inputs for a flattened batch of requests.

    Requests appear in the order of `query_start_loc`; request i owns query tokens
    query_start_loc[i]:query_start_loc[i+1]. Its context has seq_lens[i] tokens
    INCLUDING this step's, and its new tokens are the LAST query_len of them:

        context:  [ cached (seq_len - query_len) | new (query_len) ]
        positions: 0 ....................................... seq_len-1

    Token p of request i lives in cache slot
    block_table[i, p // block_size] * block_size + p % block_size.
    """

    num_actual_tokens: int  # tokens in this step (sum of query lens)
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, cumulative query lens starting at 0
    seq_lens: torch.Tensor  # [num_reqs] int32, context length including this step's tokens
    block_table: torch.Tensor  # [num_reqs, max_num_blocks_per_req] int32, physical block ids
    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot to write each new token's KV into
    max_query_len: int
    max_seq_len: int
    # Host copies, so the reference path can split rows without a device sync.
    query_lens_cpu: list[int]  # [num_reqs]
    seq_lens_cpu: list[int]  # [num_reqs]
    # Scratch for the attention backend: how it split this step's rows, computed on the
    # first layer and reused by the others (the metadata lives for one forward pass).
    backend_plan: Any = None
    # Scratch of the Triton backend's decode steps: request indices by context length, longest first.
    longest_first_order: torch.Tensor | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_table: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> "AttentionMetadata":
        """Builds metadata from host lists (block_table rows may be ragged); for tests and simple runners."""
        if len(query_lens) != len(seq_lens) or len(seq_lens) != len(block_table):
            raise ValueError("query_lens, seq_lens and block_table must have one entry per request")
        max_num_blocks = max((len(row) for row in block_table), default=0)
        table = torch.zeros(len(block_table), max(max_num_blocks, 1), dtype=torch.int32)
        slots = []
        for i, (query_len, seq_len, row) in enumerate(zip(query_lens, seq_lens, block_table)):
            if query_len > seq_len or seq_len > len(row) * block_size:
                raise ValueError(f"request {i}: query_len {query_len}, seq_len {seq_len} do not fit {len(row)} blocks")
            table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
            for pos in range(seq_len - query_len, seq_len):
                slots.append(row[pos // block_size] * block_size + pos % block_size)
        query_start_loc = [0]
        for query_len in query_lens:
            query_start_loc.append(query_start_loc[-1] + query_len)
        return cls(
            num_actual_tokens=query_start_loc[-1],
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_table=table.to(device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
        )
