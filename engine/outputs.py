"""User-facing generation results (vLLM's RequestOutput / CompletionOutput / Logprob shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple


@dataclass
class Logprob:
    """The log-probability of one token at one position, its rank in the vocabulary and its text."""

    logprob: float
    rank: int | None = None  # 1 = most likely
    decoded_token: str | None = None  # None when the request asked for no detokenization


# Per generated position: {token_id: Logprob}, the sampled token first, then the top-k.
SampleLogprobs = list[dict[int, Logprob]]
# Per prompt position: None for the first token (nothing precedes it), then as above.
PromptLogprobs = list[dict[int, Logprob] | None]


class WeightVersionSpan(NamedTuple):
    """Output tokens [start, end) were sampled by the weights labelled `version` (vLLM's WeightVersionSpan
    fields; a tuple too, so `version, start, end = span` works)."""

    version: str
    start: int
    end: int


@dataclass
class CompletionOutput:
    """One completion (one of a request's n samples)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop", "length", "abort", "error", "repetition"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # (weight_version, start, end) spans over this output's token_ids (end exclusive, indices into
    # token_ids, so a DELTA output covers only its own tokens): which weights produced which tokens.
    weight_versions: list[WeightVersionSpan] = field(default_factory=list)
    # return_routed_experts (MoE routing replay): [position][moe_layer][k] expert ids (best first) of
    # every position of prompt + token_ids that went through the model, in order. The last sampled
    # token never went through it, so a finished output holds len(prompt) + len(token_ids) - 1 rows
    # (cumulative), less the first routed_experts_prompt_start rows. A DELTA output holds only the rows
    # new since the last one. None when not asked for. (vLLM's is one ndarray on the finished output; the
    # HTTP server answers in vLLM's form, base64 .npy.)
    routed_experts: list[list[list[int]]] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What a caller receives for one request: the prompt and its completions so far (or new since last)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: Any | None = None
    lora_request: Any | None = None  # engine.lora.request.LoRARequest the request ran with; None: the base model
