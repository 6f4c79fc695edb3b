"""ModelState: per-architecture step inputs (model kwargs and attention metadata) from an InputBatch."""

from __future__ import annotations

import torch

from engine.attention.metadata import AttentionMetadata
from engine.host_copy import to_device
from engine.worker.input_batch import InputBatch


class ModelState:
    """Default for decoder-only text models whose positions are plain token indices.

    An architecture with other inputs (e.g. multimodal rotary positions) subclasses this and
    is registered in MODEL_STATES; the runner never branches on the architecture.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def _to_device(self, array, dtype: torch.dtype) -> torch.Tensor:
        return to_device(torch.from_numpy(array).to(dtype), self.device)

    def model_inputs(self, batch: InputBatch) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self._to_device(batch.input_ids, torch.int64),  # [T]
            "positions": self._to_device(batch.positions, torch.int64),  # [T]
        }

    def attn_metadata(self, batch: InputBatch) -> AttentionMetadata:
        query_lens = batch.num_scheduled_tokens
        return AttentionMetadata(
            num_actual_tokens=batch.num_tokens,
            query_start_loc=self._to_device(batch.query_start_loc, torch.int32),
            seq_lens=self._to_device(batch.seq_lens, torch.int32),
            block_table=self._to_device(batch.block_table, torch.int32),
            slot_mapping=self._to_device(batch.slot_mapping, torch.int64),
            max_query_len=int(query_lens.max()) if len(query_lens) else 0,
            max_seq_len=int(batch.seq_lens.max()) if len(batch.seq_lens) else 0,
            query_lens_cpu=query_lens.tolist(),
            seq_lens_cpu=batch.seq_lens.tolist(),
        )


MODEL_STATES: dict[str, type[ModelState]] = {}


def model_state_for(architecture: str, device: torch.device) -> ModelState:
    return MODEL_STATES.get(architecture, ModelState)(device)
