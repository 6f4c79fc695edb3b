"""Incremental detokenizer: turns a request's output token ids into text as they arrive, step by step."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

# How many trailing prompt tokens serve as decoding context for the first output tokens.
# A handful is enough for the decoders we meet (leading-space stripping, byte merging);
# the whole prompt would cost a long decode per request for nothing.
NUM_PROMPT_CONTEXT_TOKENS = 6

_REPLACEMENT_CHAR = "\ufffd"

# (context ids, their text): what an IncrementalDetokenizer starts from (see prompt_context).
PromptContext = tuple[list[int], str]


def prompt_context(tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> PromptContext:
    """The decoding context of a prompt's outputs: its last NUM_PROMPT_CONTEXT_TOKENS tokens and their text,
    or none when that text ends in an incomplete character (see IncrementalDetokenizer)."""
    backend = tokenizer.backend_tokenizer
    context = list(prompt_token_ids[-NUM_PROMPT_CONTEXT_TOKENS:])
    text = backend.decode(context, skip_special_tokens=skip_special_tokens)
    if text.endswith(_REPLACEMENT_CHAR):
        context = []
        text = backend.decode(context, skip_special_tokens=skip_special_tokens)
    return context, text


class IncrementalDetokenizer:
    """Decodes output tokens incrementally with the tokenizers library's DecodeStream.

    Invariants:
      * `output_text` is the concatenation of everything `update` returned.
      * Text is only emitted once it is final: a token that ends in the middle of a
        multi-byte character (byte-level BPE splits "日" into 3 byte tokens) yields ""
        until a later token completes it, so no U+FFFD is emitted for a character that
        is merely incomplete. `update(..., finished=True)` flushes what is still pending
        (then an unfinishable byte sequence decodes to U+FFFD, as tokenizer.decode does).
      * For byte-level tokenizers, the concatenation equals
        tokenizer.decode(output ids, skip_special_tokens=...), however the ids are split.

    Prompt context: the stream starts from the last NUM_PROMPT_CONTEXT_TOKENS prompt
    tokens, whose text is never emitted. This matters for decoders that treat the start of
    a sequence specially, e.g. Metaspace/SentencePiece decoders strip the leading space of
    the first token: with the prompt as context, "Hello" + "▁world" streams " world" (what
    decode(prompt + output) adds), not "world". Byte-level decoders are unaffected. If the
    prompt ends in an incomplete character, the context is dropped, so output bytes that
    continue it decode as U+FFFD exactly as in tokenizer.decode(output ids).

    `spaces_between_special_tokens` is accepted for vLLM compatibility; fast (Rust)
    tokenizers have no such option, so it has no effect here.
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        context: PromptContext | None = None,
    ) -> None:
        """`context`: prompt_context(tokenizer, prompt_token_ids, skip_special_tokens), when the caller
        already has it (the n children of one request share their prompt, so one computes it for all)."""
        self._backend = tokenizer.backend_tokenizer  # the Rust tokenizers.Tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        if context is None:
            context = prompt_context(tokenizer, prompt_token_ids, skip_special_tokens)
        # The context's ids (never changed: shared between detokenizers) and their text.
        self._context_ids, self._context_text = context
        # Started by the first update(); an output decoded whole (decode_whole) never needs one.
        self._stream: DecodeStream | None = None
        self.token_ids: list[int] = []  # every output id passed to update
        # token_ids[:_num_final] are fully reflected in output_text; the rest are pending.
        self._num_final = 0
        self.output_text = ""

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, new_token_ids: list[int], finished: bool = False) -> str:
        """Adds tokens and returns the text they made final (all pending text if finished)."""
        pieces = []
        if self._stream is None:
            self._stream = DecodeStream(ids=self._context_ids, skip_special_tokens=self.skip_special_tokens)
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            try:
                piece = self._stream.step(self._backend, token_id)
            except Exception:
                # DecodeStream raises when its window stops being a prefix of the longer
                # decode; recover by decoding the pending tokens ourselves and restarting.
                piece = self._decode_pending()
                self._stream = DecodeStream(ids=self._recent_final_ids(), skip_special_tokens=self.skip_special_tokens)
                self._num_final = len(self.token_ids)
            if piece is not None:
                pieces.append(piece)
                self._num_final = len(self.token_ids)
        if finished and self._num_final < len(self.token_ids):
            pieces.append(self._decode_pending())
            self._num_final = len(self.token_ids)
        text = "".join(pieces)
        self.output_text += text
        return text

    def decode_whole(self, token_ids: list[int]) -> str:
        """The text of a whole output, decoded at once: what update(token_ids, finished=True) returns
        on a fresh detokenizer (decode(context + ids) minus decode(context), the rule the stream
        follows), without stepping the stream token by token. For outputs shown only when they
        finish (FINAL_ONLY); tokens whose ids the tokenizer does not know are ~20x cheaper this way."""
        assert not self.token_ids, "decode_whole is for a detokenizer that has seen no tokens"
        self.token_ids.extend(token_ids)
        text = self._decode_pending() if token_ids else ""
        self._num_final = len(self.token_ids)
        self.output_text += text
        return text

    def _recent_final_ids(self) -> list[int]:
        final_ids = self._context_ids + self.token_ids[: self._num_final]
        return final_ids[-NUM_PROMPT_CONTEXT_TOKENS:]

    def _decode_pending(self) -> str:
        """Text of the pending tokens: decode(recent final + pending) minus decode(recent final)."""
        prefix_ids = self._recent_final_ids()
        # Before any final token the prefix is the context, whose text is known already.
        prefix = self._context_text if self._num_final == 0 else self._decode(prefix_ids)
        full = self._decode(prefix_ids + self.token_ids[self._num_final :])
        # The final tokens decoded without a trailing partial character, so their text is a
        # prefix of the longer decode (UTF-8 is self-synchronising).
        return full[len(prefix) :]
