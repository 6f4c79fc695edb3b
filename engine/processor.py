"""Processor: turns a user's prompt and SamplingParams into a validated EngineCoreRequest."""

from __future__ import annotations

import time
from typing import Any, Union

from engine.config import EngineConfig
from engine.engine_core import has_routed_experts, validate_request
from engine.sampling_params import SamplingParams
from engine.wire import EngineCoreRequest

# A prompt is text, or pre-tokenized {"prompt_token_ids": [...]} (optionally with "prompt").
PromptType = Union[str, dict[str, Any]]


class Processor:
    def __init__(self, config: EngineConfig, tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.max_model_len = config.model.max_model_len
        hf = config.model.hf_config_dict()
        self.vocab_size = hf["vocab_size"]
        self.has_routed_experts = has_routed_experts(hf)
        eos = tokenizer.eos_token_id
        self.eos_token_id = eos if eos is not None else hf.get("eos_token_id")

    def process(
        self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0
    ) -> tuple[str | None, EngineCoreRequest]:
        """Returns (prompt text or None, request); raises ValueError naming a bad field."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        text, token_ids = self._tokenize(prompt)
        if params.bad_words and params.bad_words_token_ids is None:
            params = params.clone(bad_words_token_ids=self._bad_words_token_ids(params.bad_words))
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=time.time(),
            priority=priority,
        )
        validate_request(request, self.max_model_len, self.vocab_size, self.has_routed_experts)
        return text, request

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown:
                raise ValueError(f"prompt: unknown fields {sorted(unknown)}")
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                    raise ValueError("prompt_token_ids: must be a list of ints")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt:
                return self._tokenize(prompt["prompt"])
        raise ValueError(f"prompt: expected a string or a dict with prompt_token_ids, got {type(prompt).__name__}")

    def _bad_words_token_ids(self, bad_words: list[str]) -> list[list[int]]:
        """Each bad word as token ids, both as written and with a leading space (as in vLLM)."""
        sequences: list[list[int]] = []
        for word in bad_words:
            for variant in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(variant, add_special_tokens=False)
                if ids and ids not in sequences:
                    sequences.append(ids)
        return sequences
