"""Processor: turns a user's prompt and SamplingParams into a validated EngineCoreRequest."""

from __future__ import annotations

import time
from typing import Any, Union

from engine.config import EngineConfig
from engine.engine_core import has_routed_experts, validate_request
from engine.lora.request import LoRARequest, lora_request_of
from engine.sampling_params import INT64_MAX, INT64_MIN, SamplingParams
from engine.wire import EngineCoreRequest

# A prompt is text, pre-tokenized {"prompt_token_ids": [...]} (optionally with "prompt"), or a
# conversation {"messages": [{"role", "content"}, ...]} (optionally with "add_generation_prompt"
# and "chat_template_kwargs") that the tokenizer's chat template renders.
PromptType = Union[str, dict[str, Any]]

_TOKEN_IDS_KEYS = {"prompt", "prompt_token_ids"}
_CHAT_KEYS = {"messages", "add_generation_prompt", "chat_template_kwargs"}


def max_token_chars(tokenizer) -> int:
    """An upper bound on the characters one token stands for: its longest vocabulary entry (byte-level
    BPE spells each byte as one character, so an entry is at least as long as the text it decodes to),
    times 4 when a normalizer (e.g. NFC) may compose several code points into one."""
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    composes = backend is None or backend.normalizer is not None
    return max(1, longest) * (4 if composes else 1)


def check_text(field: str, text: str) -> None:
    """ValueError unless `text` is valid Unicode text (JSON's "\\ud800" escapes give lone surrogates,
    which no tokenizer can encode)."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{field}: not valid text (a lone surrogate at character {e.start})") from None


class Processor:
    def __init__(self, config: EngineConfig, tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.max_model_len = config.model.max_model_len
        self.max_num_seqs = config.scheduler.max_num_seqs
        # A text longer than this cannot fit max_model_len tokens: refused before it is tokenized.
        self.max_prompt_chars = self.max_model_len * max_token_chars(tokenizer)
        hf = config.model.hf_config_dict()
        self.vocab_size = hf["vocab_size"]
        self.has_routed_experts = has_routed_experts(hf)
        eos = tokenizer.eos_token_id
        self.eos_token_id = eos if eos is not None else hf.get("eos_token_id")

    def check_params(self, params: SamplingParams, priority: int = 0) -> None:
        """The checks that need no prompt, cheap enough to run before anything is tokenized or admitted."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        # Each of the n samples is a running sequence: more than the engine runs at once is refused
        # up front instead of fanning out (and holding) that many requests.
        if params.n > self.max_num_seqs:
            raise ValueError(f"n must be at most max_num_seqs={self.max_num_seqs}, got {params.n}")
        if type(priority) is not int or not INT64_MIN <= priority <= INT64_MAX:
            raise ValueError(f"priority: expected an int that fits in 64 bits, got {priority!r}")

    def check_lora(self, lora_request: object) -> LoRARequest | None:
        """The request's adapter as a LoRARequest (None: the base model); ValueError when LoRA is off or it is malformed.
        Whether the adapter itself fits the model is the engine's to check (EngineCore.add_lora)."""
        if lora_request is None:
            return None
        if not self.config.lora.enable_lora:
            raise ValueError("lora_request: LoRA is off; start the engine with enable_lora=True (--enable-lora)")
        return lora_request_of(lora_request)

    def process(
        self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> tuple[str | None, EngineCoreRequest]:
        """Returns (prompt text or None, request); raises ValueError naming a bad field."""
        self.check_params(params, priority)
        lora_request = self.check_lora(lora_request)
        text, token_ids = self.tokenize(prompt)
        if params.bad_words and params.bad_words_token_ids is None:
            params = params.clone(bad_words_token_ids=self._bad_words_token_ids(params.bad_words))
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=time.time(),
            priority=priority,
            lora_request=lora_request,
        )
        validate_request(request, self.max_model_len, self.vocab_size, self.has_routed_experts)
        self._check_fits(len(token_ids), params)
        return text, request

    def _check_fits(self, prompt_len: int, params: SamplingParams) -> None:
        """vLLM's length rules after tokenization: a prompt must leave room for one output token (a longer
        max_tokens is not refused: the output stops at max_model_len, finish_reason "length"), and
        routed_experts_prompt_start lies within the prompt."""
        if prompt_len >= self.max_model_len:
            raise ValueError(
                f"prompt: the prompt ({prompt_len} tokens) plus at least 1 output token is longer than "
                f"max_model_len={self.max_model_len}"
            )
        if params.routed_experts_prompt_start > prompt_len:
            raise ValueError(
                f"routed_experts_prompt_start must be between 0 and the prompt length ({prompt_len}), inclusive, "
                f"got {params.routed_experts_prompt_start}"
            )

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) of any PromptType; ValueError naming what is wrong."""
        if isinstance(prompt, str):
            return prompt, self.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, dict):
            if "messages" in prompt:
                unknown = set(prompt) - _CHAT_KEYS
                if unknown:
                    raise ValueError(f"prompt: unknown fields {sorted(unknown)} beside messages")
                text = self.render_chat(
                    prompt["messages"], prompt.get("add_generation_prompt", True), prompt.get("chat_template_kwargs")
                )
                # The template wrote the special tokens already.
                return text, self.encode(text, add_special_tokens=False)
            unknown = set(prompt) - _TOKEN_IDS_KEYS
            if unknown:
                raise ValueError(f"prompt: unknown fields {sorted(unknown)}")
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, list):
                    raise ValueError("prompt_token_ids: must be a list of ints")
                if len(ids) > self.max_model_len:  # before any per-token work
                    raise ValueError(f"prompt: {len(ids)} tokens is longer than max_model_len={self.max_model_len}")
                if not all(isinstance(t, int) for t in ids):
                    raise ValueError("prompt_token_ids: must be a list of ints")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
        raise ValueError(f"prompt: expected a string or a dict with prompt_token_ids, got {type(prompt).__name__}")

    def encode(self, text: str, add_special_tokens: bool = True, field: str = "prompt") -> list[int]:
        """Token ids of `text`, refused from its length alone when it cannot fit max_model_len tokens."""
        if not isinstance(text, str):
            raise ValueError(f"{field}: expected a string, got {type(text).__name__}")
        if len(text) > self.max_prompt_chars:
            raise ValueError(
                f"{field}: {len(text)} characters cannot fit max_model_len={self.max_model_len} tokens "
                f"(this tokenizer spells at most {self.max_prompt_chars // self.max_model_len} characters a token)"
            )
        check_text(field, text)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def render_chat(self, messages: Any, add_generation_prompt: bool = True, kwargs: dict | None = None) -> str:
        """A conversation rendered with the chat template (text, not yet tokenized)."""
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages: expected a non-empty list of {role, content} objects")
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **(kwargs or {})
            )
        except Exception as e:  # a template error is the request's fault (e.g. a role it rejects)
            raise ValueError(f"messages: the chat template failed: {e}") from None

    def _bad_words_token_ids(self, bad_words: list[str]) -> list[list[int]]:
        """Each bad word as token ids, both as written and with a leading space (as in vLLM)."""
        sequences: list[list[int]] = []
        for word in bad_words:
            for variant in (word, " " + word.lstrip()):
                ids = self.encode(variant, add_special_tokens=False, field="bad_words")
                if ids and ids not in sequences:
                    sequences.append(ids)
        return sequences
