"""Draft-model speculator: a smaller model of the same tokenizer proposes k tokens greedily, with its own KV cache.

Its KV cache has the model's block layout (the same block ids, its own tensors), so it needs
no block manager of its own: every step it first runs over the tokens the model just ran
(prefill chunks, known tokens and drafts alike), so its KV matches the model's at every
known position, then decodes k tokens from each sampling row's last token. Those k passes
write KV up to k positions past the step, into lookahead slots the scheduler allocated.
KV at rejected positions is overwritten when the real tokens get there.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from engine.attention.layer import get_attention_backend, override_attention_backend
from engine.config import SpecDecodeSettings
from engine.forward_context import set_forward_context
from engine.worker.cuda_graphs import CudaGraphRunner
from engine.worker.input_batch import InputBatch
from engine.worker.model_state import model_state_for
from engine.worker.request_state import RequestState
from engine.worker.spec_decode.proposer import VerifiedStep


class DraftModelProposer:
    """Owns the draft model's forward passes (graphs included); the worker owns its weights and KV."""

    def __init__(self, settings: SpecDecodeSettings, model: torch.nn.Module, architecture: str,
                 device: torch.device, state: RequestState, block_size: int) -> None:
        self.model = model
        self.block_size = block_size
        self.k = settings.num_speculative_tokens
        self.attention_backend = settings.attention_backend
        self.device = device
        self.state = state
        self.model_state = model_state_for(architecture, device)
        self.cuda_graphs: CudaGraphRunner | None = None

    def backend(self) -> contextlib.AbstractContextManager:
        """The draft's attention backend for the duration of its passes (None: the model's)."""
        if self.attention_backend is None:
            return contextlib.nullcontext()
        return override_attention_backend(self.attention_backend)

    def capture_cuda_graphs(self, max_num_seqs: int, max_num_blocks_per_req: int) -> None:
        """Decode and verify graphs of the draft, unless its attention backend cannot replay (it then runs eagerly)."""
        with self.backend():
            if not getattr(get_attention_backend(), "SUPPORTS_CUDA_GRAPHS", False):
                return
        graphs = CudaGraphRunner(self.model, self.device, max_num_seqs, max_num_blocks_per_req,
                                 max_verify_len=self.k + 1)
        with self.backend():
            graphs.capture()
        self.cuda_graphs = graphs

    def _forward(self, batch: InputBatch, fill: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        with self.backend():
            graphs = self.cuda_graphs
            if graphs is not None and (size := graphs.bucket_for(batch)) is not None:
                return graphs.replay(size, batch, fill)
            inputs = self.model_state.model_inputs(batch)
            if fill is not None:
                inputs["input_ids"][fill[0]] = fill[1]
            with set_forward_context(self.model_state.attn_metadata(batch)):
                return self.model(**inputs)

    @torch.inference_mode()
    def propose(self, step: VerifiedStep) -> list[list[int]]:
        self._forward(step.batch)  # the model's tokens of this step into the draft's KV
        drafts: list[list[int]] = [[] for _ in range(step.batch.num_reqs)]
        num_rows = len(step.rows)
        if num_rows == 0:
            return drafts
        st = self.state
        max_len = st.max_model_len
        slots = step.batch.slots[step.rows]
        req_ids = [step.batch.req_ids[r] for r in step.rows.tolist()]
        block_table = st.block_table[slots, : int(st.num_blocks[slots].max())]
        bs = self.block_size
        ids = torch.from_numpy(step.last_token_ids).to(self.device)  # [R]
        fill_index = torch.arange(num_rows, device=self.device)
        outputs = []
        for j in range(self.k):
            want = step.last_positions + j  # [R]: pass j reads the token at pos + j and predicts pos + j + 1
            positions = np.minimum(want, max_len - 1)
            blocks = block_table[np.arange(num_rows), positions // bs].astype(np.int64)
            slot_mapping = np.where(want < max_len, blocks * bs + positions % bs, -1)
            batch = InputBatch(
                req_ids=req_ids, slots=slots, num_scheduled_tokens=np.ones(num_rows, dtype=np.int64),
                query_start_loc=np.arange(num_rows + 1, dtype=np.int32), seq_lens=(positions + 1).astype(np.int32),
                input_ids=np.zeros(num_rows, dtype=np.int64), positions=positions, slot_mapping=slot_mapping,
                block_table=block_table, sample_rows=np.arange(num_rows), logits_indices=np.arange(num_rows),
            )
            hidden = self._forward(batch, (fill_index, ids))
            ids = self.model.compute_logits(hidden[:num_rows]).argmax(dim=-1)  # greedy: a one-hot proposal
            outputs.append(ids)
        proposed = torch.stack(outputs, dim=1).cpu().numpy()  # [R, k]; the step's one wait for the draft
        room = np.minimum(self.k, max_len - 1 - step.last_positions)  # no draft at or past max_model_len
        for i, row in enumerate(step.rows.tolist()):
            drafts[row] = proposed[i, : max(0, int(room[i]))].tolist()
        return drafts
