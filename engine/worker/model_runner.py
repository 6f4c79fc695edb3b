"""ModelRunner: applies a SchedulerOutput diff to persistent request state, runs the model and samples."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.attention.metadata import AttentionMetadata
from engine.config import EngineConfig
from engine.core.sched_output import SchedulerOutput
from engine.forward_context import set_forward_context
from engine.host_copy import to_device, to_host
from engine.kernels import triton_enabled
from engine.lora.manager import LoRAManager
from engine.lora.ops import LoRAMapping, make_lora_mapping
from engine.sample import LogprobsTensors, Sampler, SamplingMetadata, gather_logprobs
from engine.wire import LogprobsLists
from engine.worker.cuda_graphs import CudaGraphRunner
from engine.worker.input_batch import InputBatch, make_input_batch
from engine.worker.model_state import model_state_for
from engine.worker.prefill_share import SharedPrefill, copy_kv_slots, fold_shared_rows
from engine.worker.request_state import RequestState
from engine.worker.runner_output import ModelRunnerOutput
from engine.worker.sampling_inputs import SamplingInputs
from engine.worker.spec_decode.proposer import Proposer, VerifiedStep
from engine.worker.spec_decode.verify import accepted_tokens

# A token id the host does not know yet: sampled by the step in flight. The next step's input
# at its position is filled in on the device from that step's sampled ids (launch_step).
PLACEHOLDER = -1


@dataclass
class StepInFlight:
    """A launched step: its sampled ids on the device, their copies on their way to the host,
    and where each sampled token goes in RequestState when finish_step() collects it."""

    batch: InputBatch | None = None
    sampled: torch.Tensor | None = None  # [S] int64, device: the next step's placeholders read it
    host_sampled: torch.Tensor | None = None  # [S] int64 host copy (pinned on CUDA), filled asynchronously
    host_logprobs: LogprobsTensors | None = None
    logprob_counts: np.ndarray | None = None  # [S] logprobs each sampled row asked for, -1: none
    done: torch.cuda.Event | None = None  # recorded after the copies; None on CPU
    sample_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # [S]
    sample_positions: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # [S]
    sample_generations: np.ndarray | None = None  # [S] RequestState.generation of each sample's slot at launch
    # Prompt logprobs and routed experts of this step, on their way to the host like the samples.
    prompt_logprobs: dict[str, LogprobsTensors] = field(default_factory=dict)
    routed_ids: torch.Tensor | None = None  # [T, num_moe_layers, top_k] int32 host copy
    routed_rows: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # req -> (position, first, end)
    # A speculative step's results, settled at launch (such steps are synchronous): per row the tokens
    # it emits, their logprobs, and the drafts proposed for its next step.
    spec_sampled: list[list[int]] | None = None
    spec_logprobs: list[LogprobsLists | None] | None = None
    spec_drafts: list[list[int]] | None = None


def forward_without_kv_writes(model: torch.nn.Module, device: torch.device, query_lens: list[int],
                              seq_lens: list[int], num_blocks: int = 1, block_size: int = 1) -> torch.Tensor:
    """One eager forward pass of token id 0 at each row's last query_len positions of seq_len, with
    slot -1 (no KV is ever written), reading any of the first num_blocks blocks; returns [T, hidden].

    The block pool reserves no block, so those blocks may be requests'; reading them is harmless
    (the KV cache holds finite values and the outputs are dropped). Warm-up passes and lockstep
    dummy batches use it.
    """
    num_reqs = len(query_lens)
    width = max(-(-s // block_size) for s in seq_lens)
    block_table = (torch.arange(num_reqs * width, device=device) % num_blocks).view(num_reqs, width)
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)]).to(device)  # [T]
    num_tokens = positions.shape[0]
    query_start_loc = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    metadata = AttentionMetadata(
        num_actual_tokens=num_tokens,
        query_start_loc=query_start_loc.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=block_table.to(torch.int32),
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),  # no KV write
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
    )
    input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    with torch.inference_mode(), set_forward_context(metadata):
        return model(input_ids=input_ids, positions=positions)


def dummy_forward(model: torch.nn.Module, device: torch.device) -> None:
    """One forward pass of token id 0 at position 0, reading block 0; its KV is never written."""
    forward_without_kv_writes(model, device, [1], [1])


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
        self.sampling_inputs = SamplingInputs(self.state, device, vocab_size, self.logprobs_mode, self.eos_token_ids)
        self.max_num_blocks_per_req = max_num_blocks_per_req
        # Decode CUDA graphs (GPU only); captured by capture_cuda_graphs() once the KV cache exists.
        self.cuda_graphs: CudaGraphRunner | None = None
        # Routing capture (return_routed_experts) is on only during steps with a request that asked
        # for it: the capture copies [T, layers, k] ids to the host, which other steps need not pay.
        self.supports_routed_experts = hasattr(model, "set_routing_capture")
        self._capturing_routing = False
        # The last launched step until finish_step() collects it (async scheduling: the next
        # step may launch first, reading its sampled ids on the device).
        self._in_flight: StepInFlight | None = None
        # Speculative decoding (set_speculator): proposes drafts after each step; steps verify them.
        self.speculator: Proposer | None = None
        self.num_spec_tokens = 0
        # LoRA serving (LoRAConfig.enable_lora): pages each step's adapters into slots; set by the worker.
        self.lora_manager: LoRAManager | None = None
        self._attn_layers: list | None = None  # the model's Attention modules, found on first use (_kv_caches)

    def set_speculator(self, speculator: Proposer, num_spec_tokens: int) -> None:
        self.speculator = speculator
        self.num_spec_tokens = num_spec_tokens

    def capture_cuda_graphs(self) -> None:
        """Captures the decode graphs, unless on CPU, enforce_eager, or the attention backend or the model can't replay
        (with LoRA: unless the Triton kernels are off)."""
        from engine.attention.layer import get_attention_backend

        if self.device.type != "cuda" or self.config.model.enforce_eager:
            return
        if not getattr(get_attention_backend(), "SUPPORTS_CUDA_GRAPHS", False):
            return
        if not getattr(self.model, "supports_cuda_graphs", True):  # e.g. a model whose layers sync with the host
            return
        lora = self.lora_manager is not None
        if lora and not triton_enabled():
            # Only the Triton pair reads the fixed-shape token slots; the torch references group tokens by
            # adapter with index tensors of per-step shapes, which a graph cannot replay.
            return
        graphs = CudaGraphRunner(self.model, self.device, self.config.scheduler.max_num_seqs,
                                 self.max_num_blocks_per_req, max_verify_len=self.num_spec_tokens + 1, lora=lora)
        graphs.capture()
        self.cuda_graphs = graphs

    def _forward(self, batch: InputBatch,
                 fill: tuple[torch.Tensor | slice, torch.Tensor] | None) -> torch.Tensor:  # [T, hidden]
        """One forward pass: a graph replay for decode steps that fit a bucket, else eager.

        fill: (token indices or a slice of them, ids) written into the input ids on the device (placeholders).
        """
        graphs = self.cuda_graphs
        if graphs is not None and not self._capturing_routing:  # a graph replay captures nothing
            size = graphs.bucket_for(batch)
            if size is not None:
                return graphs.replay(size, batch, fill, self._lora_slots(batch))
        attn_metadata = self.model_state.attn_metadata(batch)
        inputs = self.model_state.model_inputs(batch)
        if fill is not None:
            inputs["input_ids"][fill[0]] = fill[1]
        with set_forward_context(attn_metadata, self._lora_mapping(batch)):
            return self.model(**inputs)

    def _shared_prefill(self, batch: InputBatch, routing_rows: list[int]) -> SharedPrefill | None:
        """The batch with equal-context prefill rows folded (engine/worker/prefill_share.py), or None.

        CPU only for now (the GPU path is not measured with it yet); never with a speculator (its
        draft model mirrors each prefill row's KV itself) or routing capture (per-row routing), and
        rows asking for prompt logprobs keep their own hidden states."""
        if self.device.type != "cpu" or self.speculator is not None or routing_rows or batch.num_reqs < 2:
            return None
        prefill_rows = np.nonzero(batch.num_scheduled_tokens > 1)[0]
        if len(prefill_rows) < 2:  # decode steps: nothing to fold, and no per-request work
            return None
        exclude = np.zeros(batch.num_reqs, dtype=bool)
        exclude[prefill_rows] = self.state.wants_prompt_logprobs[batch.slots[prefill_rows]]
        return fold_shared_rows(batch, self.state, PLACEHOLDER, exclude)

    def _kv_caches(self) -> list[torch.Tensor]:
        """Every attention layer's paged KV tensor (found once; the tensors are read each call, as sleep
        frees and reallocates them)."""
        if self._attn_layers is None:
            from engine.attention.layer import Attention

            self._attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        return [layer.kv_cache for layer in self._attn_layers if layer.kv_cache is not None]

    def _lora_mapping(self, batch: InputBatch) -> LoRAMapping | None:
        """Pages this step's adapters into their slots; each token's slot (None: no LoRA in this step)."""
        token_slots = self._lora_slots(batch)
        return None if token_slots is None else make_lora_mapping(token_slots, self.device)

    def _lora_slots(self, batch: InputBatch) -> np.ndarray | None:
        """Pages this step's adapters into their slots; [T] int32 each token's slot, -1: none (None: no LoRA
        in this step)."""
        if self.lora_manager is None:
            return None
        row_ids = self.state.lora_ids[batch.slots]  # [B]
        if not row_ids.any():
            return None
        requests = {int(i): self.state.lora_requests[s] for i, s in zip(row_ids, batch.slots.tolist()) if i}
        return self.lora_manager.activate(np.repeat(row_ids, batch.num_scheduled_tokens), requests)  # [T] ids

    def _placeholder_fill(self, batch: InputBatch) -> tuple[torch.Tensor | slice, torch.Tensor] | None:
        """For input tokens still PLACEHOLDER: their indices (a slice when they are all the tokens, in the order
        the step in flight sampled them) and, gathered on the device, the ids the step in flight sampled for
        them (a decode row's token is the previous step's sample)."""
        tokens = np.nonzero(batch.input_ids == PLACEHOLDER)[0]
        if not len(tokens):
            return None
        prev = self._in_flight
        assert prev is not None and prev.sampled is not None, "placeholder input tokens without a step in flight"
        if len(tokens) == batch.num_tokens == len(prev.sample_slots) and np.array_equal(batch.slots, prev.sample_slots):
            # Steady decoding: every row's one input is what it sampled last step, in the same row order, so
            # the step in flight's sampled ids are the input ids as they are (no index to copy or gather by).
            assert (prev.sample_positions == batch.positions).all(), (
                "a placeholder input token that the step in flight does not sample"
            )
            return slice(0, batch.num_tokens), prev.sampled
        rows = np.searchsorted(batch.query_start_loc, tokens, side="right") - 1
        index_of_slot = np.full(self.state.max_num_reqs, -1, dtype=np.int64)
        index_of_slot[prev.sample_slots] = np.arange(len(prev.sample_slots))
        src = index_of_slot[batch.slots[rows]]
        assert (src >= 0).all() and (prev.sample_positions[src] == batch.positions[tokens]).all(), (
            "a placeholder input token that the step in flight does not sample"
        )
        return self._h2d(torch.from_numpy(tokens)), prev.sampled[self._h2d(torch.from_numpy(src))]

    def _h2d(self, t: torch.Tensor) -> torch.Tensor:
        return to_device(t, self.device)

    # ---- state updates -------------------------------------------------------------------

    def _update_states(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids | sched.preempted_req_ids:
            self.state.remove_request(req_id)
            self.eos_token_ids.pop(req_id, None)
        for new in sched.scheduled_new_reqs:
            self.state.add_request(new)
            self.eos_token_ids[new.req_id] = new.eos_token_id
        cached = sched.scheduled_cached_reqs
        if cached.req_ids:
            slots = np.fromiter(map(self.state.req_id_to_slot.__getitem__, cached.req_ids), dtype=np.int64,
                                count=len(cached.req_ids))
            self.state.num_computed_tokens[slots] = cached.num_computed_tokens
            for slot, new_block_ids in zip(slots.tolist(), cached.new_block_ids):
                if new_block_ids:  # None for most rows of a decode step
                    self.state.append_block_ids(slot, new_block_ids)
        # Drafts sit after the last known token, as this step's inputs; num_tokens stays until verified.
        for req_id, drafts in sched.scheduled_spec_decode_tokens.items():
            slot = self.state.req_id_to_slot[req_id]
            n = int(self.state.num_tokens[slot])
            self.state.token_ids[slot, n : n + len(drafts)] = drafts

    def reset_requests(self) -> None:
        """Forgets every request (after a failed step the scheduler starts over as well)."""
        for req_id in list(self.state.req_id_to_slot):
            self.state.remove_request(req_id)
        self.eos_token_ids.clear()
        self.sampling_inputs.clear()
        self._in_flight = None

    def release(self) -> None:
        """The worker shuts down: every request and the step in flight (its sampled ids on the device) are
        forgotten. The graphs are the worker's to release (Worker.drop_cuda_graphs, with the draft's)."""
        self.reset_requests()

    # ---- the step --------------------------------------------------------------------------

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """One step, start to end (synchronous scheduling)."""
        return self.finish_step(self.launch_step(sched))

    @torch.inference_mode()
    def launch_step(self, sched: SchedulerOutput) -> StepInFlight:
        """Applies the diff, runs the forward pass and sampling, and starts copying the samples to
        the host, without waiting for the device.

        The step may launch before the previous one is finished: tokens that step samples are
        PLACEHOLDER in RequestState until finish_step(), and where this step reads them as input
        they are taken from its device tensor. Prompt logprobs and routed experts start their
        copies here too, behind the same event.
        """
        self._update_states(sched)
        if sched.total_num_scheduled_tokens == 0:
            return StepInFlight()
        batch = make_input_batch(self.state, sched, self.block_size)
        routing_rows = self._set_routing_capture(batch)
        shared = self._shared_prefill(batch, routing_rows)
        fwd_batch = batch if shared is None else shared.batch  # the rows the forward runs
        fill = self._placeholder_fill(fwd_batch)
        hidden = self._forward(fwd_batch, fill)  # [T of fwd_batch, hidden]
        if shared is not None:
            copy_kv_slots(self._kv_caches(), self._h2d(torch.from_numpy(shared.src_slots)),
                          self._h2d(torch.from_numpy(shared.dst_slots)))
        step = StepInFlight(batch=batch, prompt_logprobs=self._prompt_logprobs(fwd_batch, hidden))
        step.routed_ids, step.routed_rows = self._routed_experts(batch, routing_rows)
        if self.speculator is not None:  # every step: a draft model mirrors prefill chunks into its KV too
            self._verify_and_propose(sched, batch, hidden, step)
        elif len(batch.sample_rows):
            if (shared is None and len(batch.sample_rows) == batch.num_tokens == hidden.shape[0]
                    and hidden.is_contiguous()):
                # A decode step: every token samples, in order, so the rows to sample are hidden as it is (the
                # same contiguous [T, hidden] the gather would copy): no index to copy to the device or gather by.
                sample_hidden = hidden
            else:
                sample_hidden = hidden[self._h2d(torch.from_numpy(
                    batch.logits_indices if shared is None else shared.logits_indices))]
            logits = self.model.compute_logits(sample_hidden)  # [S, V]: model dtype on GPU, float32 on CPU
            out = self.sampler(logits, self._sampling_metadata(batch, batch.sample_rows))
            slots = batch.slots[batch.sample_rows]
            positions = self.state.num_tokens[slots].copy()
            room = positions < self.state.max_model_len  # a token past max_model_len is never an input
            self.state.token_ids[slots[room], positions[room]] = PLACEHOLDER
            self.state.num_tokens[slots[room]] += 1
            step.sampled, step.sample_slots, step.sample_positions = out.sampled_token_ids, slots, positions
            step.sample_generations = self.state.generation[slots]
            step.host_sampled = to_host(out.sampled_token_ids)
            if out.logprobs is not None:
                step.host_logprobs = _logprobs_to_host(out.logprobs)
                step.logprob_counts = self.state.num_logprobs[slots]  # -1: the row asked for none
        if self.device.type == "cuda" and (step.host_sampled is not None or step.prompt_logprobs
                                           or step.routed_ids is not None):
            step.done = torch.cuda.Event()
            step.done.record()
        self._in_flight = step
        return step

    def finish_step(self, step: StepInFlight) -> ModelRunnerOutput:
        """Waits for a launched step's samples, writes them over their placeholders and reports them."""
        if self._in_flight is step:
            self._in_flight = None
        batch = step.batch
        if batch is None:
            return ModelRunnerOutput.empty()
        sampled: list[list[int]] | None = None
        row_logprobs: list[LogprobsLists | None] | None = None
        if step.done is not None:
            step.done.synchronize()  # the step's one wait for the device
        if step.spec_sampled is not None:
            sampled, row_logprobs = step.spec_sampled, step.spec_logprobs
        if step.host_sampled is not None:
            host = step.host_sampled.numpy()
            token_ids = host.tolist()
            rows = batch.sample_rows
            if len(rows) == batch.num_reqs:  # every row sampled (rows are 0..n-1 in order): decode steps
                sampled = [[t] for t in token_ids]
            else:
                sampled = [[] for _ in batch.req_ids]
                for row, t in zip(rows.tolist(), token_ids):
                    sampled[row] = [t]
            st = self.state
            slots, positions = step.sample_slots, step.sample_positions
            # Skip rows whose request left the runner since (finished, aborted or preempted: its slot's
            # generation moved on) and tokens past max_model_len (never an input).
            keep = (st.generation[slots] == step.sample_generations) & (positions < st.max_model_len)
            st.token_ids[slots[keep], positions[keep]] = host[keep]
            if step.host_logprobs is not None:
                row_logprobs = self._split_logprobs(batch, step.logprob_counts, step.host_logprobs)
        return ModelRunnerOutput(
            req_ids=batch.req_ids,
            sampled_token_ids=sampled if sampled is not None else [[] for _ in batch.req_ids],
            logprobs=row_logprobs,
            prompt_logprobs={req_id: lp.to_lists() for req_id, lp in step.prompt_logprobs.items()},
            routed_experts=self._routed_expert_lists(step),
            spec_token_ids=step.spec_drafts if self.speculator is not None else None,
        )

    def _verify_and_propose(self, sched: SchedulerOutput, batch: InputBatch, hidden: torch.Tensor,
                            step: StepInFlight) -> None:
        """A speculative step's sampling, synchronous: one sample per position of each sampling row's
        last known token and drafts, the prefix spec_decode.verify accepts written into RequestState,
        then the speculator's drafts for the next step.

            row tokens:  t_{n-1}  d_1  ...  d_k      (positions n-1 .. n+k-1)
            samples:     s_0      s_1 ...  s_k      (s_j: the token at position n + j)
        """
        st = self.state
        rows = batch.sample_rows
        sampled: list[list[int]] = [[] for _ in batch.req_ids]
        row_logprobs: list[LogprobsLists | None] = [None] * batch.num_reqs
        step.spec_sampled, step.spec_logprobs = sampled, row_logprobs
        if not len(rows):
            step.spec_drafts = self.speculator.propose(VerifiedStep(batch, rows, rows, rows))
            return
        spec = sched.scheduled_spec_decode_tokens
        drafts = [spec.get(batch.req_ids[r], []) for r in rows.tolist()]
        counts = np.array([len(d) + 1 for d in drafts], dtype=np.int64)  # samples per row
        firsts = np.cumsum(counts) - counts
        ends = batch.query_start_loc[1:][rows].astype(np.int64)  # one past each row's last token
        offsets = np.arange(int(counts.sum())) - np.repeat(firsts, counts)  # [S] 0..d per row
        logits_indices = np.repeat(ends - counts, counts) + offsets  # each row's last d + 1 tokens
        logits = self.model.compute_logits(hidden[self._h2d(torch.from_numpy(logits_indices))])
        entry_rows = np.repeat(rows, counts)
        out = self.sampler(logits, self._sampling_metadata(batch, entry_rows, offsets))
        samples = out.sampled_token_ids.tolist()  # the step's one wait for the device
        lp = None
        if out.logprobs is not None:
            lp = tuple(t.cpu().numpy() for t in (out.logprobs.token_ids, out.logprobs.logprobs, out.logprobs.ranks))
        last_tokens, last_positions = [], []
        for i, row in enumerate(rows.tolist()):
            first = int(firsts[i])
            tokens = accepted_tokens(samples[first : first + int(counts[i])], drafts[i])
            sampled[row] = tokens
            slot = int(batch.slots[row])
            n = int(st.num_tokens[slot])
            kept = tokens[: max(0, st.max_model_len - n)]  # a token past max_model_len is never an input
            st.token_ids[slot, n : n + len(kept)] = kept
            st.num_tokens[slot] = n + len(kept)
            last_positions.append(int(st.num_tokens[slot]) - 1)
            last_tokens.append(int(st.token_ids[slot, last_positions[-1]]))
            wanted = st.sampling_params[slot].logprobs
            if lp is not None and wanted is not None:
                end = first + len(tokens)
                row_logprobs[row] = LogprobsLists(lp[0][first:end, : wanted + 1], lp[1][first:end, : wanted + 1],
                                                  lp[2][first:end])
        step.spec_drafts = self.speculator.propose(
            VerifiedStep(batch, rows, np.array(last_tokens, dtype=np.int64), np.array(last_positions, dtype=np.int64))
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

    def _routed_experts(
        self, batch: InputBatch, rows: list[int]
    ) -> tuple[torch.Tensor | None, dict[str, tuple[int, int, int]]]:
        """Starts copying the step's routing to the host; and each requesting row's slice of it, as
        (position of its first token, first, end): a row's tokens are contiguous in the batch.

            tokens:   | row 0 | row 1 ........ | row 2 |     ids [T, layers, k]
                              ^ query_start_loc[1], at position seq_lens[1] - num_scheduled_tokens[1]
        """
        if not rows:
            return None, {}
        ids = self.model.routed_expert_ids()  # [T, num_moe_layers, top_k] int32
        if ids is None:
            return None, {}
        slices = {}
        for row in rows:
            first, end = int(batch.query_start_loc[row]), int(batch.query_start_loc[row + 1])
            slices[batch.req_ids[row]] = (int(batch.seq_lens[row] - batch.num_scheduled_tokens[row]), first, end)
        return to_host(ids), slices

    @staticmethod
    def _routed_expert_lists(step: StepInFlight) -> dict[str, tuple[int, np.ndarray]]:
        """The finished step's routing per requesting request: (position of its first token, ids [n, layers, k])."""
        if step.routed_ids is None:
            return {}
        ids = step.routed_ids.numpy()
        return {req_id: (pos, ids[first:end]) for req_id, (pos, first, end) in step.routed_rows.items()}

    # ---- sampling inputs ------------------------------------------------------------------

    def _sampling_metadata(self, batch: InputBatch, rows: np.ndarray, offsets: np.ndarray | None = None) -> SamplingMetadata:
        """Sampling inputs for one sample per entry of rows (batch rows; a row may repeat); see SamplingInputs.

        offsets (speculative steps): entry i samples the token offsets[i] places after the row's
        known tokens, i.e. after its first offsets[i] drafts, which count as its output so far.
        """
        return self.sampling_inputs.metadata(batch.slots[rows], batch.req_ids, rows, offsets)

    @staticmethod
    def _split_logprobs(batch: InputBatch, counts: np.ndarray, lp: LogprobsTensors) -> list[LogprobsLists | None]:
        """Each sampled row's logprobs (counts[i]: how many that row asked for, -1 for none)."""
        rows: list[LogprobsLists | None] = [None] * batch.num_reqs
        # Per-row views of the step's host arrays: the sampler builds fresh tensors every step,
        # so no later step writes into memory these views share.
        token_ids, logprobs, ranks = lp.token_ids.cpu().numpy(), lp.logprobs.cpu().numpy(), lp.ranks.cpu().numpy()
        if len(counts) == batch.num_reqs and len(counts) and counts[0] >= 0 and (counts == counts[0]).all():
            # Every row samples and asks for the same number (the usual step): numpy makes the [1, k] views of all
            # rows at once when iterating [S, 1, k] arrays, instead of three slices per row here.
            k = int(counts[0]) + 1
            return list(map(LogprobsLists, token_ids[:, None, :k], logprobs[:, None, :k], ranks[:, None]))
        for i, (row, count) in enumerate(zip(batch.sample_rows.tolist(), counts.tolist())):
            if count >= 0:
                k = count + 1
                rows[row] = LogprobsLists(token_ids[i : i + 1, :k], logprobs[i : i + 1, :k], ranks[i : i + 1])
        return rows

    # ---- prompt logprobs ------------------------------------------------------------------

    def _prompt_logprobs(self, batch: InputBatch, hidden: torch.Tensor) -> dict[str, LogprobsTensors]:
        """Logprobs of prompt tokens 1..P-1 covered by this step (hidden at p predicts p+1), on their way
        to the host."""
        out: dict[str, LogprobsTensors] = {}
        st = self.state
        if not st.wants_prompt_logprobs.any():  # no request in the runner asks for them (the usual step)
            return out
        for row in np.flatnonzero(st.wants_prompt_logprobs[batch.slots]).tolist():
            slot = int(batch.slots[row])
            sp = st.sampling_params[slot]
            start = int(batch.seq_lens[row] - batch.num_scheduled_tokens[row])
            end = min(int(batch.seq_lens[row]), int(st.num_prompt_tokens[slot]) - 1)
            if start >= end:
                continue
            first = int(batch.query_start_loc[row])
            logits = self.model.compute_logits(hidden[first : first + end - start]).float()  # [n, V] float32
            targets = self._h2d(torch.from_numpy(st.token_ids[slot, start + 1 : end + 1]))
            lp = gather_logprobs(torch.log_softmax(logits, dim=-1), targets, sp.prompt_logprobs)
            out[batch.req_ids[row]] = _logprobs_to_host(lp)
        return out


def _logprobs_to_host(lp: LogprobsTensors) -> LogprobsTensors:
    """Starts the copies of logprob tensors to the host (see host_copy.to_host)."""
    return LogprobsTensors(to_host(lp.token_ids), to_host(lp.logprobs), to_host(lp.ranks))
