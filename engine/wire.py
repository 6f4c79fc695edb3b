"""Wire types between a frontend and the EngineCore (msgspec structs, cheap to encode)."""

from __future__ import annotations

import enum
import time
from typing import Any

import msgspec
import numpy as np

from engine.core.stats import SchedulerStats
from engine.lora.request import LoRARequest
from engine.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    """Why a request finished; small ints on the wire, lower-case names for users."""

    STOP = 0  # EOS, a stop token or a stop string
    LENGTH = 1  # max_tokens or max_model_len
    ABORT = 2  # aborted by the caller or a pause
    ERROR = 3  # the engine could not serve it
    REPETITION = 4  # repetition_detection fired

    def __str__(self) -> str:
        return self.name.lower()


_FINISH_TEXT = {reason: str(reason) for reason in FinishReason}


def finish_reason_text(reason: object) -> str:
    """str(reason), from a table for a FinishReason (its __str__ is a Python call per finished request)."""
    return _FINISH_TEXT[reason] if type(reason) is FinishReason else str(reason)


class EngineStatus(enum.IntEnum):
    """The engine's health as pushed to its clients (EngineCoreOutputs.engine_status)."""

    HEALTHY = 0  # serving
    UNHEALTHY = 1  # a step failed; in-flight requests ended with ERROR; waiting for `retry`
    DEAD = 2  # exiting, or gone

    def __str__(self) -> str:
        return self.name.lower()


# Instructions a frontend may send (EngineCoreRequestType.FAULT_TOLERANCE); "status" is a query.
FAULT_TOLERANCE_INSTRUCTIONS = ("retry",)


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A tokenized request on its way into the engine core (untracked by the garbage collector: nothing it
    holds can refer back to it)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float = msgspec.field(default_factory=time.time)
    priority: int = 0
    client_index: int = 0
    lora_request: LoRARequest | None = None  # the adapter to run with (LLMEngine's enable_lora); None: the base model


class LogprobsLists(msgspec.Struct, array_like=True, eq=False, gc=False):
    """Logprobs of several positions: per position the chosen token first, then the top-k (one per row per
    step; untracked by the garbage collector: its arrays cannot refer back to it).

    token_ids[i, 0] is the sampled (or prompt) token, token_ids[i, 1:] the top-k ids in
    descending order; logprobs matches token_ids; ranks[i] is the chosen token's rank
    (1 = most likely) among the whole vocabulary. Numpy arrays, so that they cross ZMQ as
    zero-copy frames (engine/serial_utils.py); consumers call .tolist() once per chunk.
    """

    token_ids: np.ndarray  # [N, K+1] int64
    logprobs: np.ndarray  # [N, K+1] float32
    ranks: np.ndarray  # [N] int64

    def __len__(self) -> int:
        return len(self.ranks)

    @staticmethod
    def concat(parts: list["LogprobsLists"]) -> "LogprobsLists":
        """Stacks the positions of parts that share one top-k width (one request's chunks do)."""
        if not parts:
            return LogprobsLists(np.zeros((0, 1), np.int64), np.zeros((0, 1), np.float32), np.zeros(0, np.int64))
        return LogprobsLists(
            np.concatenate([p.token_ids for p in parts]),
            np.concatenate([p.logprobs for p in parts]),
            np.concatenate([p.ranks for p in parts]),
        )


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one step produced for one request.

    Untracked by the garbage collector (gc=False): a step makes one per running request, and nothing it
    holds (ids, arrays, strings) can refer back to it, so it can never be part of a reference cycle.
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # return_routed_experts: [n, num_moe_layers, top_k] int32 expert ids of the next n positions of
    # prompt + output that went through the model since the last output (see Request.routed_experts).
    new_routed_experts: np.ndarray | None = None
    num_preemptions: int = 0  # times the scheduler has preempted the request so far (last: omitted while 0)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """The answer to a UTILITY request: a result, or why the call failed."""

    call_id: int
    result: Any = None
    failure_message: str | None = None


class EngineCoreRequestType(bytes, enum.Enum):
    """One-byte message types from a frontend to the EngineCore process."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"
    FAULT_TOLERANCE = b"\x03"  # (call_id, "status" | an instruction), answered by the input thread


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """All outputs of one engine step for one client."""

    outputs: list[EngineCoreOutput] = []
    timestamp: float = 0.0
    finished_requests: set[str] | None = None
    scheduler_stats: SchedulerStats | None = None
    utility_output: UtilityOutput | None = None
    engine_index: int = 0
    # The weight version (EngineCore.update_weight_version) that computed this step's tokens.
    weight_version: str = "default"
    engine_status: EngineStatus | None = None  # set when the engine's health changed; None: unchanged
    # lora_int_id -> the weight_version of each adapter a weight sync labelled (finish_weight_update with
    # update_info "lora_name"): the version of its requests' tokens instead of weight_version. None: no such adapter.
    lora_weight_versions: dict[int, str] | None = None
