"""A vLLM-v1-style inference engine: paged KV cache, continuous batching, exact on CPU."""

from engine.lora.request import LoRARequest
from engine.sampling_params import RepetitionDetectionParams, RequestOutputKind, SamplingParams
from engine.wire import FinishReason

__all__ = [
    "LLM",
    "SamplingParams",
    "LoRARequest",
    "RepetitionDetectionParams",
    "RequestOutputKind",
    "FinishReason",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
]


def __getattr__(name: str):
    # LLM and the output types pull in torch/transformers; import them on first use so that
    # `engine.core` stays importable without torch.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput", "Logprob"):
        from engine import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
