"""Errors the engine's frontends raise, each knowing the HTTP status a server should answer with."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The EngineCore process died or stopped answering; every waiting caller gets this."""

    http_status = 503

    def __init__(self, message: str = "the engine process is dead") -> None:
        super().__init__(message)


class EngineStartupError(RuntimeError):
    """The EngineCore process failed before it was ready (e.g. the model could not load)."""


class AdmissionError(RuntimeError):
    """A request was refused before reaching the engine; retry later (HTTP 503)."""

    http_status = 503
    reason = "overloaded"


class QueueOverflowError(AdmissionError):
    """More than max_num_queued_reqs requests are already waiting."""

    reason = "queue_full"


class MaxQueuedTokensError(AdmissionError):
    """More than max_num_queued_tokens prompt tokens are already waiting."""

    reason = "queued_tokens"


class EngineNotReadyError(RuntimeError):
    """The engine is paused or asleep and refuses new requests for now; retry after resume() /
    wake_up() (HTTP 503). `reason` says which: "paused" or "sleeping"."""

    http_status = 503
    retryable = True

    def __init__(self, message: str = "the engine is not ready", reason: str = "not_ready") -> None:
        super().__init__(message)
        self.reason = reason


class WeightUpdateStateError(ValueError, RuntimeError):
    """A weight-update call out of order (e.g. update before start): the caller's mistake, HTTP 400."""


class WeightTransferError(RuntimeError):
    """A weight transfer failed mid-way (peer gone, timeout): the update was aborted and the previous weights restored."""


class PeerTimeoutError(TimeoutError):
    """A peer the engine waits on (a weight-transfer rendezvous: the trainer's store or group) did not
    answer within its timeout; nothing changed in the engine (HTTP 504, the message names the peer)."""

    http_status = 504


class InvalidUserInputError(ValueError):
    """A request that conflicts with what is loaded (a LoRA name already in use, or the base model's):
    HTTP 400 with vLLM's error type for it, "InvalidUserInput"."""

    error_type = "InvalidUserInput"


class LoRAAdapterNotFoundError(LookupError):
    """No LoRA adapter by this name is loaded, or none is at the path given (HTTP 404, vLLM's NotFoundError)."""

    http_status = 404
