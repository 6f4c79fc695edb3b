"""Request: the scheduler's view of one sequence, whose computed tokens catch up with its tokens."""

from __future__ import annotations

import enum

from engine.lora.request import LoRARequest
from engine.sampling_params import SamplingParams
from engine.wire import EngineCoreRequest, FinishReason


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything after PREEMPTED is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6
    FINISHED_REPETITION = 7

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: "RequestStatus") -> FinishReason | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
    RequestStatus.FINISHED_REPETITION: FinishReason.REPETITION,
}


class Request:
    """One sequence. Invariant: 0 <= num_computed_tokens <= num_tokens; the scheduler
    hands out the difference (prompt, chunk, or the one new token of a decode)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float = 0.0,
        priority: int = 0,
        client_index: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.priority = priority
        self.client_index = client_index
        self.lora_request = lora_request
        # What a block's KV depends on besides its tokens: the adapter that computes this request's
        # (the EngineCore's number for that load of the adapter, engine/lora/registry.py); None: the base model.
        self.lora_cache_key: int | None = None

        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.max_tokens = sampling_params.max_tokens  # may be capped by max_model_len later
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens being sampled by scheduled steps whose outputs have not come back (async
        # scheduling keeps one step in flight): the next step already computes their positions.
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1  # prefix-cache hit on first scheduling; -1 until then
        self.num_preemptions = 0
        # Hashes of this request's full blocks, extended by the KV cache manager.
        self.block_hashes: list[int] = []
        # return_routed_experts: routing of positions [0, num_routed_tokens) is known; the part not
        # yet reported (numpy [n, layers, k] arrays, e.g. mid-prompt chunks) waits here.
        self.num_routed_tokens = 0
        self.pending_routed_experts: list | tuple = ()
        # Speculative decoding: tokens the speculator proposed after this request's last step, to be
        # verified by its next one (the scheduler may schedule fewer).
        self.spec_token_ids: list[int] | tuple[()] = ()
        # (The two start as the shared empty tuple, not a list each: most requests never have any, and a list
        # would live as long as the request, for the garbage collector to walk.)

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest) -> "Request":
        return cls(
            req.request_id,
            req.prompt_token_ids,
            req.sampling_params,
            req.eos_token_id,
            req.arrival_time,
            req.priority,
            req.client_index,
            req.lora_request,
        )

    @property
    def lora_int_id(self) -> int:
        """The adapter's id; 0 for the base model (vLLM's convention)."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_id(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finish_reason(self) -> FinishReason | None:
        return RequestStatus.finish_reason(self.status)

    def __lt__(self, other: "Request") -> bool:
        # Priority order: lower priority value first, then earlier arrival, then id.
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority,
            other.arrival_time,
            other.request_id,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
