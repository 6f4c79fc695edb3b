"""SamplingParams: what a request asks the sampler and stop logic to do, validated on creation."""

from __future__ import annotations

import math
from enum import IntEnum

import msgspec

_GREEDY_EPS = 1e-5
# Every integer a request carries must fit in int64: it crosses msgspec and lands in torch tensors.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _check_int64(name: str, value: int | None) -> None:
    if value is not None and not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"{name} must fit in 64 bits, got {value}")


# The sampler computes in float32: a float beyond its range is infinite there.
_FLOAT32_MAX = 3.4028234663852886e38
_FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32: below it, a penalty is 0 there


def _check_finite(name: str, value: float) -> None:
    # NaN slips through every range check (all comparisons are false); infinity through one-sided ones.
    if not math.isfinite(value) or abs(value) > _FLOAT32_MAX:
        raise ValueError(f"{name} must be a finite number (within float32's range), got {value}")


class RequestOutputKind(IntEnum):
    """How a request's outputs are reported while it runs."""

    CUMULATIVE = 0  # every output holds everything generated so far
    DELTA = 1  # every output holds only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


class RepetitionDetectionParams(msgspec.Struct, frozen=True):
    """End a request when its output ends in a pattern of up to `max_pattern_size` tokens
    repeated at least `min_count` times in a row."""

    max_pattern_size: int
    min_count: int
    min_pattern_size: int = 1

    def __post_init__(self) -> None:
        for name in ("max_pattern_size", "min_count", "min_pattern_size"):
            _check_int64(f"repetition_detection.{name}", getattr(self, name))
        if self.min_pattern_size < 1:
            raise ValueError(f"repetition_detection.min_pattern_size must be >= 1, got {self.min_pattern_size}")
        if self.max_pattern_size < self.min_pattern_size:
            raise ValueError(
                "repetition_detection.max_pattern_size must be >= min_pattern_size, "
                f"got {self.max_pattern_size} < {self.min_pattern_size}"
            )
        if self.min_count < 2:
            raise ValueError(f"repetition_detection.min_count must be >= 2, got {self.min_count}")


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True, gc=False):
    """Sampling and stopping parameters of one request (vLLM's names and meanings).

    Untracked by the garbage collector (gc=False): every request holds one (each sample of an n > 1 request
    its own) for its whole life, and nothing it holds (numbers, strings, id lists, a bias dict) can refer
    back to it, so it can never be part of a reference cycle.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None  # top-k logprobs per generated token, besides the sampled one
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    repetition_detection: RepetitionDetectionParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    detokenize: bool = True
    # Mixture-of-experts models only: report the experts each token was routed to (routing replay),
    # see CompletionOutput.routed_experts. Requests asking for it skip the prefix cache.
    return_routed_experts: bool = False
    # With return_routed_experts: leave out the rows of the first N prompt positions (vLLM's name; a
    # multi-turn client already has them). At most the prompt's length (checked by the Processor).
    routed_experts_prompt_start: int = 0
    # Filled in by the frontend from the tokenizer (bad_words -> token id sequences).
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._check_bounded()
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty < _FLOAT32_TINY:  # > 0, also once in float32
            raise ValueError(f"repetition_penalty must be > 0 (at least {_FLOAT32_TINY:.3g}), got {self.repetition_penalty}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable), 0 (disable) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens, got {self.min_tokens} > {self.max_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}")
        if self.stop and any(not s for s in self.stop):
            raise ValueError("stop must not contain empty strings")
        if self.stop_token_ids and any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative, got {self.stop_token_ids}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty")
        if type(self.routed_experts_prompt_start) is not int or self.routed_experts_prompt_start < 0:
            raise ValueError(
                f"routed_experts_prompt_start must be a non-negative int, got {self.routed_experts_prompt_start!r}"
            )
        if not isinstance(self.return_routed_experts, bool):
            raise ValueError(f"return_routed_experts must be a bool, got {self.return_routed_experts!r}")
        if self.temperature < _GREEDY_EPS:
            # Greedy: sampling-only knobs are meaningless, as in vLLM.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _check_bounded(self) -> None:
        """Every float finite and every integer within int64, before any range check reads them."""
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p"):
            _check_finite(name, getattr(self, name))
        for name in ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
                     "routed_experts_prompt_start"):
            _check_int64(name, getattr(self, name))
        for name in ("stop_token_ids", "allowed_token_ids"):
            for token_id in getattr(self, name) or ():
                _check_int64(name, token_id)
        for token_id, bias in (self.logit_bias or {}).items():
            _check_int64("logit_bias", token_id)
            _check_finite(f"logit_bias[{token_id}]", bias)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_output_history(self) -> bool:
        """Whether sampling reads the tokens generated so far (penalties, bad words), so a step
        cannot be prepared before the previous step's token is known on the host."""
        penalties = self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
        return penalties or bool(self.bad_words_token_ids)

    @property
    def all_stop_token_ids(self) -> set[int]:
        return set(self.stop_token_ids or ())

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Checks the token ids a request names against the model's vocabulary."""
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("allowed_token_ids", self.allowed_token_ids),
            ("logit_bias", list(self.logit_bias) if self.logit_bias else None),
        ):
            if ids and any(not 0 <= t < vocab_size for t in ids):
                raise ValueError(f"{name} has token ids outside [0, {vocab_size})")

    def clone(self, **changes) -> "SamplingParams":
        return msgspec.structs.replace(self, **changes)
