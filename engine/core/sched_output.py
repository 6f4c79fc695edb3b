"""SchedulerOutput: what one step computes; new requests travel in full, running ones as a diff."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.lora.request import LoRARequest
from engine.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the model runner has no state for: first scheduled, or resumed after preemption."""

    req_id: str
    token_ids: list[int]  # prompt + any output tokens generated before a preemption
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # prefix-cache hit (or 0)
    eos_token_id: int | None = None  # banned by min_tokens like the stop tokens
    lora_request: LoRARequest | None = None  # its adapter; None: the base model


@dataclass
class CachedRequestData:
    """Requests the runner already holds: only what changed since their last step."""

    req_ids: list[str] = field(default_factory=list)
    # Blocks appended this step; None where none were (most decode steps), as vLLM's CachedRequestData has it.
    new_block_ids: list[list[int] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # Tokens to compute this step per request; sum <= max_num_batched_tokens.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests whose runner state must be dropped before this step: finished, aborted or
    # preempted since the previous step (a preempted request comes back as new).
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # Speculative decoding: the draft tokens a request's step verifies; they are the last
    # len(drafts) of its num_scheduled_tokens, after its last known token.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
