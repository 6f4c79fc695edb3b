"""Engine outputs in OpenAI's shapes: logprobs (legacy and chat), prompt logprobs, usage, SSE lines."""

from __future__ import annotations

import pydantic

from engine.outputs import CompletionOutput
from rollout.server import protocol as P


def finish_reason(reason: str | None) -> str | None:
    # OpenAI knows "stop" and "length"; the engine's repetition stop is a stop.
    return "stop" if reason == "repetition" else reason


def _token_text(engine, logprob_entry, token_id: int, as_ids: bool = False) -> str:
    """A token's text in logprobs; with return_tokens_as_token_ids vLLM's "token_id:N" (which names a
    token whose text is not valid UTF-8 on its own)."""
    if as_ids:
        return f"token_id:{token_id}"
    if logprob_entry is not None and logprob_entry.decoded_token is not None:
        return logprob_entry.decoded_token
    return engine.tokenizer.decode([token_id], skip_special_tokens=False)


# The most negative logprob written to JSON: -inf is not JSON, and vLLM writes this in its place.
MIN_LOGPROB = -9999.0


def legacy_logprobs(engine, token_ids, positions, text_offset: int = 0, as_ids: bool = False) -> P.CompletionLogprobs:
    """OpenAI legacy logprobs, one entry per token id: its text, logprob, the top logprobs by text and its
    character offset (from `text_offset`, each token's text after the one before). A position of None
    (the first prompt token of an echo: nothing precedes it) has a null logprob and null top logprobs."""
    out = P.CompletionLogprobs()
    for token_id, position in zip(token_ids, positions):
        if position is None:
            text = _token_text(engine, None, token_id, as_ids)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            sampled = position.get(token_id)
            text = _token_text(engine, sampled, token_id, as_ids)
            out.token_logprobs.append(max(sampled.logprob, MIN_LOGPROB) if sampled is not None else None)
            # The token plus the top-k, as OpenAI's legacy format has it. Keys are texts, and distinct
            # tokens may share one (e.g. partial UTF-8 shows as U+FFFD): keep the likeliest.
            top: dict[str, float] = {}
            for tid, lp in position.items():
                key = _token_text(engine, lp, tid, as_ids)
                top[key] = max(lp.logprob, top.get(key, MIN_LOGPROB))
            out.top_logprobs.append(top)
        out.tokens.append(text)
        out.text_offset.append(text_offset)
        text_offset += len(text)
    return out


def next_text_offset(logprobs: P.CompletionLogprobs | None, offset: int, text: str) -> int:
    """Where the next chunk's text_offset starts: after the tokens just reported (text held back for a
    stop string lags them), or after the text when no logprobs are reported."""
    if logprobs is not None and logprobs.tokens:
        return logprobs.text_offset[-1] + len(logprobs.tokens[-1])
    return offset + len(text)


def echoed(prompt_text: str, prompt_token_ids, prompt_logprobs, c: CompletionOutput, echo_only: bool):
    """(text, token ids, logprob positions or None) of a choice that echoes its prompt: the prompt alone
    (max_tokens 0), or the prompt then the completion."""
    if echo_only:
        return prompt_text, list(prompt_token_ids), prompt_logprobs
    positions = None
    if c.logprobs is not None:
        positions = [*(prompt_logprobs or [None] * len(prompt_token_ids)), *c.logprobs]
    return prompt_text + c.text, [*prompt_token_ids, *c.token_ids], positions


def weight_version_spans(spans) -> list[P.WeightVersionSpan]:
    return [P.WeightVersionSpan(version=v, start=start, end=end) for v, start, end in spans]


def routed_experts_b64(rows, num_experts: int) -> str | None:
    """Routed experts as vLLM answers them: base64 of the .npy bytes of a [position, layer, k] array,
    uint8 (uint16 for more than 256 experts). None when there are no rows."""
    if not rows:
        return None
    import base64
    import io

    import numpy as np

    array = np.asarray(rows, dtype=np.uint8 if num_experts <= 256 else np.uint16)
    with io.BytesIO() as buffer:
        np.save(buffer, array, allow_pickle=False)
        return base64.b64encode(buffer.getvalue()).decode("ascii")


def chat_logprobs(engine, c: CompletionOutput, num_top: int, as_ids: bool = False) -> P.ChatLogprobs | None:
    if c.logprobs is None:
        return None
    content = []
    for token_id, position in zip(c.token_ids, c.logprobs):
        sampled = position.get(token_id)
        text = _token_text(engine, sampled, token_id, as_ids)
        # The dict holds the sampled token and the top-k: the k highest are the true top-k.
        ranked = sorted(position.items(), key=lambda kv: kv[1].logprob, reverse=True)[:num_top]
        tops = [
            P.ChatTopLogprob(token=(t := _token_text(engine, lp, tid, as_ids)), logprob=max(lp.logprob, MIN_LOGPROB),
                             bytes=list(t.encode()))
            for tid, lp in ranked
        ]
        content.append(
            P.ChatTokenLogprob(
                token=text,
                logprob=max(sampled.logprob, MIN_LOGPROB) if sampled is not None else MIN_LOGPROB,
                bytes=list(text.encode()),
                top_logprobs=tops,
            )
        )
    return P.ChatLogprobs(content=content)


def prompt_logprobs_json(prompt_logprobs) -> P.PromptLogprobsJSON | None:
    if prompt_logprobs is None:
        return None
    return [
        None if position is None else {
            str(tid): P.PromptLogprob(logprob=max(lp.logprob, MIN_LOGPROB), rank=lp.rank, decoded_token=lp.decoded_token)
            for tid, lp in position.items()
        }
        for position in prompt_logprobs
    ]


def tokenizer_info(tokenizer) -> dict:
    """GET /tokenizer_info's body as vLLM builds it: the tokenizer's init kwargs (tokenizer_config.json) less
    the vocabulary and merges file paths, special tokens as their text, and tokenizer_class."""
    config = {k: v for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items()
              if k not in ("vocab_file", "merges_file")}
    config = _json_safe(config)
    config["tokenizer_class"] = type(tokenizer).__name__
    return config


def _json_safe(obj):
    if hasattr(obj, "content"):  # an AddedToken
        return obj.content
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def usage(prompt_token_counts: list[int], completion_tokens: int) -> P.UsageInfo:
    prompt_tokens = sum(prompt_token_counts)
    return P.UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def sse(payload: pydantic.BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


SSE_DONE = "data: [DONE]\n\n"
