"""Engine outputs in OpenAI's shapes: logprobs (legacy and chat), prompt logprobs, usage, SSE lines."""

from __future__ import annotations

import pydantic

from engine.outputs import CompletionOutput
from rollout.server import protocol as P


def finish_reason(reason: str | None) -> str | None:
    # OpenAI knows "stop" and "length"; the engine's repetition stop is a stop.
    return "stop" if reason == "repetition" else reason


def _token_text(engine, logprob_entry, token_id: int) -> str:
    if logprob_entry is not None and logprob_entry.decoded_token is not None:
        return logprob_entry.decoded_token
    return engine.tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(engine, c: CompletionOutput, text_offset: int) -> P.CompletionLogprobs | None:
    """OpenAI legacy logprobs for c's tokens; offsets start at `text_offset` (characters sent before)."""
    if c.logprobs is None:
        return None
    out = P.CompletionLogprobs()
    for token_id, position in zip(c.token_ids, c.logprobs):
        sampled = position.get(token_id)
        text = _token_text(engine, sampled, token_id)
        out.tokens.append(text)
        out.token_logprobs.append(sampled.logprob if sampled is not None else None)
        # The sampled token plus the top-k, as OpenAI's legacy format has it. Keys are texts, and
        # distinct tokens may share one (e.g. partial UTF-8 shows as U+FFFD): keep the likeliest.
        top: dict[str, float] = {}
        for tid, lp in position.items():
            key = _token_text(engine, lp, tid)
            top[key] = max(lp.logprob, top.get(key, float("-inf")))
        out.top_logprobs.append(top)
        out.text_offset.append(text_offset)
        text_offset += len(text)
    return out


def chat_logprobs(engine, c: CompletionOutput, num_top: int) -> P.ChatLogprobs | None:
    if c.logprobs is None:
        return None
    content = []
    for token_id, position in zip(c.token_ids, c.logprobs):
        sampled = position.get(token_id)
        text = _token_text(engine, sampled, token_id)
        # The dict holds the sampled token and the top-k: the k highest are the true top-k.
        ranked = sorted(position.items(), key=lambda kv: kv[1].logprob, reverse=True)[:num_top]
        tops = [
            P.ChatTopLogprob(token=(t := _token_text(engine, lp, tid)), logprob=lp.logprob, bytes=list(t.encode()))
            for tid, lp in ranked
        ]
        content.append(
            P.ChatTokenLogprob(
                token=text,
                logprob=sampled.logprob if sampled is not None else float("-inf"),
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
            str(tid): P.PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
            for tid, lp in position.items()
        }
        for position in prompt_logprobs
    ]


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
