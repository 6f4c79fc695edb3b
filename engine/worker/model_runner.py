"""ModelRunner: applies a SchedulerOutput diff to persistent request state, runs the model and samples."""

from __future__ import annotations

import numpy as np
import torch

from engine.attention.metadata import AttentionMetadata
from engine.config import EngineConfig
from engine.core.sched_output import SchedulerOutput
from engine.forward_context import set_forward_context
from engine.sample import LogprobsTensors, Sampler, SamplingMetadata, gather_logprobs, make_generator
from engine.wire import LogprobsLists
from engine.worker.cuda_graphs import CudaGraphRunner
from engine.worker.input_batch import InputBatch, make_input_batch
from engine.worker.model_state import model_state_for
from engine.worker.request_state import RequestState
from engine.worker.runner_output import ModelRunnerOutput


def dummy_forward(model: torch.nn.Module, device: torch.device) -> None:
    """One forward pass of token id 0 at position 0, reading block 0, with slot -1: its KV is never written.

    The block pool reserves no block, so block 0 may be another request's; reading it is harmless
    (the KV cache holds finite values and the output is dropped).
    """
    metadata = AttentionMetadata(
        num_actual_tokens=1,
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([1], dtype=torch.int32, device=device),
        block_table=torch.zeros(1, 1, dtype=torch.int32, device=device),
        slot_mapping=torch.full((1,), -1, dtype=torch.int64, device=device),  # no KV write
        max_query_len=1,
        max_seq_len=1,
        query_lens_cpu=[1],
        seq_lens_cpu=[1],
    )
    token = torch.zeros(1, dtype=torch.int64, device=device)  # [1]: id 0, and position 0
    with torch.inference_mode(), set_forward_context(metadata):
        model(input_ids=token, positions=token)


class ModelRunner:
    """Owns per-request state between steps; the worker owns the model and KV tensors."""

    def __init__(self, config: EngineConfig, model: torch.nn.Module, device: torch.device,
                 architecture: str, vocab_size: int, max_model_len: int) -> None:
        self.config = config
        self.model = model
        self.device = device
        self.block_size = config.cache.block_size
        self.vocab_size = vocab_size
        self.logprobs_mode = config.model.logprobs_mode
        max_num_blocks_per_req = -(-max_model_len // self.block_size)
        self.state = RequestState(config.scheduler.max_num_seqs, max_model_len, max_num_blocks_per_req)
        self.model_state = model_state_for(architecture, device)
        # Rows without their own seed draw from one engine-wide generator (ModelConfig.seed).
        generator = torch.Generator(device=device)
        generator.manual_seed(config.model.seed)
        self.sampler = Sampler(generator)
        self.eos_token_ids: dict[str, int | None] = {}
        self.max_num_blocks_per_req = max_num_blocks_per_req
        # Decode CUDA graphs (GPU only); captured by capture_cuda_graphs() once the KV cache exists.
        self.cuda_graphs: CudaGraphRunner | None = None
        # Routing capture (return_routed_experts) is on only during steps with a request that asked
        # for it: the capture copies [T, layers, k] ids to the host, which other steps need not pay.
        self.supports_routed_experts = hasattr(model, "set_routing_capture")
        self._capturing_routing = False

    def capture_cuda_graphs(self) -> None:
        """Captures the decode graphs, unless on CPU, enforce_eager, or the attention backend or the model can't replay."""
        from engine.attention.layer import get_attention_backend

        if self.device.type != "cuda" or self.config.model.enforce_eager:
            return
        if not getattr(get_attention_backend(), "SUPPORTS_CUDA_GRAPHS", False):
            return
        if not getattr(self.model, "supports_cuda_graphs", True):  # e.g. a model whose layers sync with the host
            return
        graphs = CudaGraphRunner(self.model, self.device, self.config.scheduler.max_num_seqs,
                                 self.max_num_blocks_per_req)
        graphs.capture()
        self.cuda_graphs = graphs

    def _forward(self, batch: InputBatch) -> torch.Tensor:  # [T, hidden]
        """One forward pass: a graph replay for decode steps that fit a bucket, else eager."""
        graphs = self.cuda_graphs
        if graphs is not None and not self._capturing_routing:  # a graph replay captures nothing
            size = graphs.bucket_for(batch)
            if size is not None:
                return graphs.replay(size, batch)
        attn_metadata = self.model_state.attn_metadata(batch)
        with set_forward_context(attn_metadata):
            return self.model(**self.model_state.model_inputs(batch))

    # ---- state updates -------------------------------------------------------------------

    def _update_states(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids | sched.preempted_req_ids:
            self.state.remove_request(req_id)
            self.eos_token_ids.pop(req_id, None)
        for new in sched.scheduled_new_reqs:
            self.state.add_request(new)
            self.eos_token_ids[new.req_id] = new.eos_token_id
        cached = sched.scheduled_cached_reqs
        for req_id, new_block_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            slot = self.state.req_id_to_slot[req_id]
            self.state.num_computed_tokens[slot] = num_computed
            if new_block_ids:
                self.state.append_block_ids(slot, new_block_ids)

    def reset_requests(self) -> None:
        """Forgets every request (after a failed step the scheduler starts over as well)."""
        for req_id in list(self.state.req_id_to_slot):
            self.state.remove_request(req_id)
        self.eos_token_ids.clear()

    # ---- the step --------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(sched)
        if sched.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput.empty()
        batch = make_input_batch(self.state, sched, self.block_size)
        routing_rows = self._set_routing_capture(batch)
        hidden = self._forward(batch)  # [T, hidden]
        routed_experts = self._routed_experts(batch, routing_rows)

        prompt_logprobs = self._prompt_logprobs(batch, hidden)
        sampled: list[list[int]] = [[] for _ in batch.req_ids]
        row_logprobs: list[LogprobsLists | None] | None = None
        if len(batch.sample_rows):
            logits_indices = torch.from_numpy(batch.logits_indices).to(self.device)
            logits = self.model.compute_logits(hidden[logits_indices])  # [S, V] float32
            metadata = self._sampling_metadata(batch)
            out = self.sampler(logits, metadata)
            token_ids = out.sampled_token_ids.tolist()  # the step's one host sync
            for i, row in enumerate(batch.sample_rows.tolist()):
                sampled[row] = [token_ids[i]]
                self.state.append_token(int(batch.slots[row]), token_ids[i])
            if out.logprobs is not None:
                row_logprobs = self._split_logprobs(batch, out.logprobs)
        return ModelRunnerOutput(
            req_ids=batch.req_ids,
            sampled_token_ids=sampled,
            logprobs=row_logprobs,
            prompt_logprobs=prompt_logprobs,
            routed_experts=routed_experts,
        )

    @torch.inference_mode()
    def execute_dummy_batch(self) -> None:
        """One eager forward pass of a dummy token that belongs to no request; nothing is sampled or returned.

        Lockstep engines (expert parallelism) call it when they have no work while others do, so every
        rank runs the same MoE collectives. Request state and routing capture are left as they are
        (the next real step sets capture again before its forward).
        """
        dummy_forward(self.model, self.device)

    # ---- routed experts (MoE routing replay) ----------------------------------------------

    def _set_routing_capture(self, batch: InputBatch) -> list[int]:
        """Rows that asked for return_routed_experts; capture is switched on iff there are any."""
        if not self.supports_routed_experts:
            return []
        rows = np.nonzero(self.state.return_routed_experts[batch.slots])[0].tolist()
        if bool(rows) != self._capturing_routing:
            self.model.set_routing_capture(bool(rows))
            self._capturing_routing = bool(rows)
        return rows

    def _routed_experts(self, batch: InputBatch, rows: list[int]) -> dict[str, tuple[int, np.ndarray]]:
        """Each requesting row's slice of the step's routing: its tokens are contiguous in the batch.

            tokens:   | row 0 | row 1 ........ | row 2 |     ids [T, layers, k]
                              ^ query_start_loc[1], at position seq_lens[1] - num_scheduled_tokens[1]
        """
        if not rows:
            return {}
        ids = self.model.routed_expert_ids()  # [T, num_moe_layers, top_k] int32
        if ids is None:
            return {}
        ids = ids.cpu().numpy()
        out: dict[str, tuple[int, np.ndarray]] = {}
        for row in rows:
            first, end = int(batch.query_start_loc[row]), int(batch.query_start_loc[row + 1])
            start_pos = int(batch.seq_lens[row] - batch.num_scheduled_tokens[row])
            out[batch.req_ids[row]] = (start_pos, ids[first:end])
        return out

    # ---- sampling inputs ------------------------------------------------------------------

    def _sampling_metadata(self, batch: InputBatch) -> SamplingMetadata:
        st = self.state
        slots = batch.slots[batch.sample_rows]  # [S]
        slots_t = torch.from_numpy(slots)
        params = [st.sampling_params[s] for s in slots.tolist()]
        temperature = st.temperature[slots_t]
        greedy = temperature == 0.0
        num_outputs = (st.num_tokens[slots] - st.num_prompt_tokens[slots]).tolist()

        def column(values: torch.Tensor, off_value: float) -> torch.Tensor | None:
            col = values[slots_t]
            return col.to(self.device) if bool((col != off_value).any()) else None

        generators = {
            i: make_generator(sp.seed, num_outputs[i], self.device)
            for i, sp in enumerate(params)
            if sp.seed is not None and not sp.greedy
        }
        presence = st.presence_penalty[slots_t]
        frequency = st.frequency_penalty[slots_t]
        repetition = st.repetition_penalty[slots_t]
        use_penalties = bool((presence != 0).any() or (frequency != 0).any() or (repetition != 1).any())
        need_outputs = use_penalties or any(sp.bad_words_token_ids for sp in params)
        output_token_ids = [st.output_ids(s) for s in slots.tolist()] if need_outputs else []
        prompt_token_ids = None
        if use_penalties:
            max_prompt = int(st.num_prompt_tokens[slots].max())
            padded = np.full((len(slots), max_prompt), self.vocab_size, dtype=np.int64)
            for i, s in enumerate(slots.tolist()):
                prompt = st.prompt_ids(s)
                padded[i, : len(prompt)] = prompt
            prompt_token_ids = torch.from_numpy(padded).to(self.device)

        min_tokens = {}
        for i, sp in enumerate(params):
            if num_outputs[i] < sp.min_tokens:
                stop_ids = sp.all_stop_token_ids
                eos = self.eos_token_ids.get(batch.req_ids[batch.sample_rows[i]])
                if eos is not None and not sp.ignore_eos:
                    stop_ids = stop_ids | {eos}
                min_tokens[i] = (sp.min_tokens, stop_ids)

        allowed_mask = None
        if any(sp.allowed_token_ids for sp in params):
            allowed_mask = torch.zeros(len(params), self.vocab_size, dtype=torch.bool)
            for i, sp in enumerate(params):
                if sp.allowed_token_ids:
                    allowed_mask[i] = True
                    allowed_mask[i, sp.allowed_token_ids] = False
            allowed_mask = allowed_mask.to(self.device)

        wanted = [sp.logprobs for sp in params if sp.logprobs is not None]
        return SamplingMetadata(
            temperature=temperature.to(self.device),
            all_greedy=bool(greedy.all()),
            all_random=not bool(greedy.any()),
            top_k=column(st.top_k, 0),
            top_p=column(st.top_p, 1.0),
            min_p=column(st.min_p, 0.0),
            generators=generators,
            presence_penalties=presence.to(self.device) if use_penalties else None,
            frequency_penalties=frequency.to(self.device) if use_penalties else None,
            repetition_penalties=repetition.to(self.device) if use_penalties else None,
            prompt_token_ids=prompt_token_ids,
            output_token_ids=output_token_ids,
            min_tokens=min_tokens,
            logit_bias={i: sp.logit_bias for i, sp in enumerate(params) if sp.logit_bias},
            bad_words_token_ids={
                i: sp.bad_words_token_ids for i, sp in enumerate(params) if sp.bad_words_token_ids
            },
            allowed_token_ids_mask=allowed_mask,
            max_num_logprobs=max(wanted) if wanted else None,
            logprobs_mode=self.logprobs_mode,
        )

    def _split_logprobs(self, batch: InputBatch, lp: LogprobsTensors) -> list[LogprobsLists | None]:
        rows: list[LogprobsLists | None] = [None] * batch.num_reqs
        # Per-row views of the step's host arrays: the sampler builds fresh tensors every step,
        # so no later step writes into memory these views share.
        token_ids, logprobs, ranks = lp.token_ids.cpu().numpy(), lp.logprobs.cpu().numpy(), lp.ranks.cpu().numpy()
        for i, row in enumerate(batch.sample_rows.tolist()):
            sp = self.state.sampling_params[int(batch.slots[row])]
            if sp.logprobs is not None:
                k = sp.logprobs + 1
                rows[row] = LogprobsLists(token_ids[i : i + 1, :k], logprobs[i : i + 1, :k], ranks[i : i + 1])
        return rows

    # ---- prompt logprobs ------------------------------------------------------------------

    def _prompt_logprobs(self, batch: InputBatch, hidden: torch.Tensor) -> dict[str, LogprobsLists]:
        """Logprobs of prompt tokens 1..P-1 covered by this step (hidden at p predicts p+1)."""
        out: dict[str, LogprobsLists] = {}
        st = self.state
        for row, slot in enumerate(batch.slots.tolist()):
            sp = st.sampling_params[slot]
            if sp.prompt_logprobs is None:
                continue
            start = int(batch.seq_lens[row] - batch.num_scheduled_tokens[row])
            end = min(int(batch.seq_lens[row]), int(st.num_prompt_tokens[slot]) - 1)
            if start >= end:
                continue
            first = int(batch.query_start_loc[row])
            logits = self.model.compute_logits(hidden[first : first + end - start])  # [n, V]
            targets = torch.from_numpy(st.token_ids[slot, start + 1 : end + 1]).to(self.device)
            lp = gather_logprobs(torch.log_softmax(logits, dim=-1), targets, sp.prompt_logprobs)
            out[batch.req_ids[row]] = lp.to_lists()
        return out
