"""RequestState: persistent per-request state in preallocated arrays, one slot per live request."""

from __future__ import annotations

import numpy as np
import torch

from engine.core.sched_output import NewRequestData
from engine.lora.request import LoRARequest
from engine.sample.random_sampling import seed_to_uint64
from engine.sampling_params import SamplingParams


class RequestState:
    """The model runner's memory of every request it holds, across steps.

    A request gets a slot when it first arrives (or comes back after a preemption) and keeps
    it until it finishes or is preempted; per-step inputs are gathered from these arrays by
    slot, so a running request costs the scheduler only a small diff each step.
    Invariant: num_computed_tokens[s] <= num_tokens[s] <= max_model_len.
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, max_num_blocks_per_req: int) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        # Host arrays: the scheduler's diffs land here, per-step inputs are gathered from here.
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)  # prompt + sampled so far
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        # Sampling parameters as columns, so a step's batch is one fancy-index away. Each torch
        # column shares its memory with a numpy array (_columns), which add_request writes: a numpy
        # element store costs ~0.1 us, a torch one several.
        self._columns = {
            "temperature": np.zeros(max_num_reqs, dtype=np.float32),
            "top_k": np.zeros(max_num_reqs, dtype=np.int64),
            "top_p": np.ones(max_num_reqs, dtype=np.float32),
            "min_p": np.zeros(max_num_reqs, dtype=np.float32),
            "presence_penalty": np.zeros(max_num_reqs, dtype=np.float32),
            "frequency_penalty": np.zeros(max_num_reqs, dtype=np.float32),
            "repetition_penalty": np.ones(max_num_reqs, dtype=np.float32),
        }
        self.temperature = torch.from_numpy(self._columns["temperature"])
        self.top_k = torch.from_numpy(self._columns["top_k"])
        self.top_p = torch.from_numpy(self._columns["top_p"])
        self.min_p = torch.from_numpy(self._columns["min_p"])
        self.presence_penalty = torch.from_numpy(self._columns["presence_penalty"])
        self.frequency_penalty = torch.from_numpy(self._columns["frequency_penalty"])
        self.repetition_penalty = torch.from_numpy(self._columns["repetition_penalty"])
        # Seeded sampling (random_sampling.mix_seeds): True where the request has a seed and samples
        # (not greedy); seed holds it as uint64.
        self.seeded = np.zeros(max_num_reqs, dtype=bool)
        self.seed = np.zeros(max_num_reqs, dtype=np.uint64)
        self.sampling_params: list[SamplingParams | None] = [None] * max_num_reqs
        # Per-slot flags, so that a step looks at a request's SamplingParams only where they ask for
        # something: uses_row_params where it has min_tokens, allowed_token_ids, bad words or a logit
        # bias (the sampler's per-row edits); num_logprobs its `logprobs` (-1: None); wants_prompt_logprobs.
        self.uses_row_params = np.zeros(max_num_reqs, dtype=bool)
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)
        self.wants_prompt_logprobs = np.zeros(max_num_reqs, dtype=bool)
        self.return_routed_experts = np.zeros(max_num_reqs, dtype=bool)
        # LoRA: each request's adapter id (0: none) and request (whose path a slot is paged in from).
        self.lora_ids = np.zeros(max_num_reqs, dtype=np.int64)
        self.lora_requests: list[LoRARequest | None] = [None] * max_num_reqs

        # Bumped whenever a slot is given up, so that a launched step's sample can tell whether the request it
        # was for still holds the slot (RequestState is updated between a step's launch and its collection).
        self.generation = np.zeros(max_num_reqs, dtype=np.int64)
        self.req_id_to_slot: dict[str, int] = {}
        # Bumped whenever a request joins or leaves: what was derived from the slots' requests (their sampling
        # parameters) still holds while it is unchanged.
        self.version = 0
        # The token ids last written from a list, with the slot and that slot's generation: the n samples of one
        # prompt arrive one after another, and while that request holds its slot (same generation) the row's
        # first len(ids) entries are still those ids (a request only ever writes past its known tokens).
        self._last_written: tuple[list[int], int, int] | None = None
        self.slot_to_req_id: list[str | None] = [None] * max_num_reqs
        self._free_slots = list(range(max_num_reqs - 1, -1, -1))

    def column(self, name: str) -> np.ndarray:
        """A sampling-parameter column's numpy array (the memory its torch column shares), e.g. "top_p"."""
        return self._columns[name]

    def add_request(self, new: NewRequestData) -> int:
        if new.req_id in self.req_id_to_slot:
            raise ValueError(f"request {new.req_id!r} is already in the model runner")
        slot = self._free_slots.pop()
        self.version += 1
        self.req_id_to_slot[new.req_id] = slot
        self.slot_to_req_id[slot] = new.req_id
        n = len(new.token_ids)
        last = self._last_written
        if last is not None and last[2] == self.generation[last[1]] and last[0] == new.token_ids:
            self.token_ids[slot, :n] = self.token_ids[last[1], :n]  # a row copy instead of converting the list
        else:
            self.token_ids[slot, :n] = new.token_ids
            self._last_written = (list(new.token_ids), slot, int(self.generation[slot]))
        self.num_tokens[slot] = n
        self.num_prompt_tokens[slot] = new.num_prompt_tokens
        self.num_computed_tokens[slot] = new.num_computed_tokens
        self.num_blocks[slot] = 0
        self.append_block_ids(slot, new.block_ids)

        sp = new.sampling_params
        self.sampling_params[slot] = sp
        cols = self._columns
        greedy = sp.greedy
        cols["temperature"][slot] = 0.0 if greedy else sp.temperature
        cols["top_k"][slot] = max(sp.top_k, 0)
        cols["top_p"][slot] = sp.top_p
        cols["min_p"][slot] = sp.min_p
        cols["presence_penalty"][slot] = sp.presence_penalty
        cols["frequency_penalty"][slot] = sp.frequency_penalty
        cols["repetition_penalty"][slot] = sp.repetition_penalty
        self.seeded[slot] = sp.seed is not None and not greedy
        self.seed[slot] = seed_to_uint64(sp.seed) if sp.seed is not None else 0
        self.return_routed_experts[slot] = sp.return_routed_experts
        self.uses_row_params[slot] = bool(sp.min_tokens or sp.allowed_token_ids or sp.bad_words_token_ids
                                          or sp.logit_bias)
        self.num_logprobs[slot] = -1 if sp.logprobs is None else sp.logprobs
        self.wants_prompt_logprobs[slot] = sp.prompt_logprobs is not None
        self.lora_requests[slot] = new.lora_request
        self.lora_ids[slot] = new.lora_request.lora_int_id if new.lora_request is not None else 0
        return slot

    def remove_request(self, req_id: str) -> None:
        slot = self.req_id_to_slot.pop(req_id, None)
        if slot is None:
            return
        self.slot_to_req_id[slot] = None
        self.version += 1
        self.generation[slot] += 1
        self.sampling_params[slot] = None
        self.return_routed_experts[slot] = False
        self.uses_row_params[slot] = False
        self.num_logprobs[slot] = -1
        self.wants_prompt_logprobs[slot] = False
        self.lora_requests[slot] = None
        self.lora_ids[slot] = 0
        self._free_slots.append(slot)

    def append_block_ids(self, slot: int, block_ids: list[int]) -> None:
        start = int(self.num_blocks[slot])
        self.block_table[slot, start : start + len(block_ids)] = block_ids
        self.num_blocks[slot] = start + len(block_ids)

    def append_token(self, slot: int, token_id: int) -> None:
        n = int(self.num_tokens[slot])
        if n < self.max_model_len:
            self.token_ids[slot, n] = token_id
            self.num_tokens[slot] = n + 1

    def prompt_ids(self, slot: int) -> np.ndarray:
        return self.token_ids[slot, : self.num_prompt_tokens[slot]]

    def output_ids(self, slot: int) -> list[int]:
        return self.token_ids[slot, self.num_prompt_tokens[slot] : self.num_tokens[slot]].tolist()
