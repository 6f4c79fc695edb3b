"""POST /inference/v1/generate: token ids in, token ids out, with vLLM 0.33's request and response bodies.

vLLM's token-in/token-out route (its scale_out generate server) takes the prompt as `token_ids` and a
`sampling_params` object with SamplingParams' own field names, and answers per choice the generated
`token_ids` with logprobs keyed by token id (output_mode "tokens") or also the text and chat-style
logprobs (output_mode "text"). Multimodal inputs, disaggregated-serving parameters and the "derender"
output mode are vLLM features this engine does not have: a request that uses them is a 400 naming the field.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, AsyncIterator, Literal

import msgspec
from fastapi import APIRouter, Request
from pydantic import Field

from engine.sampling_params import RequestOutputKind, SamplingParams
from rollout.server import formatting as F
from rollout.server import protocol as P
from rollout.server.middleware import StrictJSONRoute
from rollout.server.openapi import error_responses

# SamplingParams fields a client may not set: the route sets how outputs are reported, and the
# frontend fills in the bad-word token ids itself.
_SERVER_SET_FIELDS = {"output_kind", "bad_words_token_ids"}
_SAMPLING_FIELDS = frozenset(f.name for f in msgspec.structs.fields(SamplingParams)) - _SERVER_SET_FIELDS
# vLLM 0.33 SamplingParams fields for features this engine lacks. vLLM's own client sends some of them
# at their defaults (a dumped GenerateRequest carries skip_reading_prefix_cache), so an unset one (null,
# false, 0 or empty) is ignored; a set one is refused naming it. tests/compat checks this list against vLLM's.
VLLM_ONLY_SAMPLING_FIELDS = frozenset({
    "watermarking", "prompt_logprob_token_ids", "prompt_logprob_start", "logprob_token_ids", "flat_logprobs",
    "stream_interval", "skip_clone", "output_text_buffer_length", "structured_outputs", "extra_args",
    "skip_reading_prefix_cache", "thinking_token_budget", "trace_decode_token_ids",
})


class GenerateRequest(P.RequestModel):
    """Body of POST /inference/v1/generate (vLLM's GenerateRequest fields)."""

    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    """The engine's id for this request (echoed in the answer); a fresh one when unset."""
    token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    """SamplingParams by its field names (vLLM's); an unset max_tokens: up to max_model_len."""
    model: str | None = None
    return_token_ids: bool | None = None
    """Add prompt_token_ids to the answer (a stream: in its first chunk)."""
    output_mode: Literal["tokens", "text", "derender"] = "tokens"
    stream: bool | None = False
    stream_options: P.StreamOptions | None = None
    priority: int = 0
    # vLLM fields for features this engine lacks: accepted only unset (None).
    token_offsets: list[tuple[int, int]] | None = None
    features: dict[str, Any] | None = None
    content_parts: list[dict[str, Any]] | None = None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: dict[str, Any] | None = None
    parse_context: dict[str, Any] | None = None
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None

    def check_supported(self) -> None:
        if self.output_mode == "derender":
            raise ValueError("output_mode: 'derender' is not supported (no chat parser here); use 'tokens' or 'text'")
        for name in ("features", "content_parts", "reasoning_parser_kwargs", "parse_context", "cache_salt",
                     "kv_transfer_params", "ec_transfer_params"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name}: not supported by this engine")
        if self.reasoning_ended:
            raise ValueError("reasoning_ended: not supported by this engine")

    def to_sampling_params(self, max_model_len: int) -> SamplingParams:
        fields = dict(self.sampling_params)
        for name in VLLM_ONLY_SAMPLING_FIELDS & set(fields):
            if fields[name]:
                raise ValueError(f"sampling_params: {name} is not supported by this engine")
            del fields[name]
        unknown = sorted(set(fields) - _SAMPLING_FIELDS)
        if unknown:
            raise ValueError(f"sampling_params: unknown fields {unknown}")
        for name in ("logprobs", "prompt_logprobs"):
            value = fields.get(name)
            if value is not None and (type(value) is not int or not 0 <= value <= P.MAX_LOGPROBS):
                raise ValueError(f"sampling_params: {name} must be an int in [0, {P.MAX_LOGPROBS}], got {value!r}")
        if isinstance(fields.get("logit_bias"), dict):  # JSON keys are text; the token ids are ints
            try:
                fields["logit_bias"] = {int(k): v for k, v in fields["logit_bias"].items()}
            except ValueError:
                raise ValueError("sampling_params: logit_bias keys must be token ids") from None
        if self.output_mode != "tokens" and fields.get("detokenize") is False:
            raise ValueError(f"output_mode: {self.output_mode!r} needs sampling_params.detokenize true")
        fields.setdefault("max_tokens", None)  # unset: up to max_model_len, as vLLM's route does
        fields["output_kind"] = RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        try:
            return msgspec.convert(fields, SamplingParams)
        except msgspec.ValidationError as e:  # a wrong type, or __post_init__'s ValueError naming the field
            raise ValueError(f"sampling_params: {e}") from None


class GenerateLogProb(P.ResponseModel):
    token_id: int
    logprob: float
    rank: int | None = None


class GenerateLogProbsContent(GenerateLogProb):
    top_logprobs: list[GenerateLogProb] = Field(default_factory=list)


class GenerateLogProbs(P.ResponseModel):
    content: list[GenerateLogProbsContent] | None = None


class GenerateChoice(P.ResponseModel):
    index: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    routed_experts: str | None = None
    sampling_mask: list[list[int]] | None = None  # vLLM's; this engine has no sampling masks
    weight_versions: list[P.WeightVersionSpan] | None = None
    text: str | None = None  # output_mode "text" only
    logprobs: GenerateLogProbs | P.ChatLogprobs | None = None


class GenerateResponse(P.ResponseModel):
    request_id: str
    model: str | None = None
    created: int | None = None
    usage: P.UsageInfo | None = None
    prompt_logprobs: P.PromptLogprobsJSON | None = None
    prompt_token_id_logprobs: str | None = None
    prompt_token_ids: list[int] | None = None
    mm_placeholders: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    output_mode: Literal["tokens", "text"] = "tokens"
    choices: list[GenerateChoice]


class GenerateStreamResponse(P.ResponseModel):
    request_id: str
    usage: P.UsageInfo | None = None
    prompt_token_ids: list[int] | None = None
    mm_placeholders: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None
    output_mode: Literal["tokens", "text"] = "tokens"
    choices: list[GenerateChoice]


def _token_logprobs(token_ids, positions) -> GenerateLogProbs:
    """vLLM's token-id logprobs: per token its logprob and rank, and every candidate the engine returned
    (the token first, then the top-k), clamped to vLLM's -9999."""
    content = []
    for token_id, position in zip(token_ids, positions):
        chosen = position.get(token_id) if position is not None else None
        if chosen is None:
            content.append(GenerateLogProbsContent(token_id=token_id, logprob=F.MIN_LOGPROB))
            continue
        content.append(GenerateLogProbsContent(
            token_id=token_id, logprob=max(chosen.logprob, F.MIN_LOGPROB), rank=chosen.rank or None,
            top_logprobs=[GenerateLogProb(token_id=tid, logprob=max(lp.logprob, F.MIN_LOGPROB), rank=lp.rank or None)
                          for tid, lp in position.items()],
        ))
    return GenerateLogProbs(content=content)


def generate_router(state) -> APIRouter:
    """The route over the server's state (rollout/server/app.py's ServerState)."""
    from rollout.server.app import _open_streams, _request_id, _generate_all, _routed_experts, _sse_error, _streaming_response
    from rollout.server.app import _STREAM, _ChoiceStream

    router = APIRouter(route_class=StrictJSONRoute)
    engine = state.engine

    def choice_logprobs(body: GenerateRequest, params: SamplingParams, c):
        if params.logprobs is None or c.logprobs is None:
            return None
        if body.output_mode == "text":
            return F.chat_logprobs(engine, c, P.MAX_LOGPROBS + 1)
        return _token_logprobs(c.token_ids, c.logprobs)

    async def stream(body: GenerateRequest, params: SamplingParams, req_id: str, gens, firsts) -> AsyncIterator[str]:
        streams: dict[int, _ChoiceStream] = {}
        prompt_ids = None
        num_prompt, num_completion = 0, 0
        try:
            from rollout.server.streams import merge_streams

            async for _, out in merge_streams(gens, firsts):
                num_prompt = len(out.prompt_token_ids)
                if prompt_ids is None:
                    prompt_ids = list(out.prompt_token_ids) if body.return_token_ids else []
                for c in out.outputs:
                    cs = streams.setdefault(c.index, _ChoiceStream())
                    cs.add(c)
                    num_completion += len(c.token_ids)
                    last = c.finish_reason is not None
                    if not (c.token_ids or last or (body.output_mode == "text" and c.text)):
                        continue
                    choice = GenerateChoice(
                        index=c.index, finish_reason=c.finish_reason and F.finish_reason(c.finish_reason),
                        stop_reason=c.stop_reason, token_ids=list(c.token_ids),
                        routed_experts=F.routed_experts_b64(cs.routed, state.num_experts) if last and cs.routed else None,
                        weight_versions=F.weight_version_spans(cs.spans) if last else None,
                        text=c.text if body.output_mode == "text" else None,
                        logprobs=choice_logprobs(body, params, c),
                    )
                    chunk = GenerateStreamResponse(request_id=req_id, output_mode=body.output_mode, choices=[choice],
                                                   prompt_token_ids=prompt_ids or None)
                    prompt_ids = []
                    # As vLLM: fields absent from a token-bearing chunk are left out, and a tokens choice has no text.
                    exclude: dict = {k: True for k in ("prompt_token_ids", "mm_placeholders", "metrics")
                                     if getattr(chunk, k) is None}
                    if body.output_mode == "tokens":
                        exclude["choices"] = {"__all__": {"text"}}
                    yield f"data: {chunk.model_dump_json(exclude=exclude)}\n\n"
            if body.stream_options is not None and body.stream_options.include_usage:
                final = GenerateStreamResponse(request_id=req_id, output_mode=body.output_mode, choices=[],
                                               usage=F.usage([num_prompt], num_completion))
                yield F.sse(final)
        except Exception as e:
            yield _sse_error(e)
        yield F.SSE_DONE

    @router.post("/inference/v1/generate", response_model=GenerateResponse,
                 responses={**error_responses(404, 503), 200: {"content": _STREAM}})
    async def generate(body: GenerateRequest, request: Request):
        lora = state.check_model(body.model)
        body.check_supported()
        params = state.with_server_defaults(body.to_sampling_params(state.max_model_len))
        req_id = body.request_id or _request_id("gen")
        prompt = {"prompt_token_ids": list(body.token_ids)}
        if body.stream:
            gens, firsts = await _open_streams(request, state, [prompt], params, req_id, body.priority, lora)
            return _streaming_response(stream(body, params, req_id, gens, firsts))
        (out,) = await _generate_all(request, state, [prompt], params, req_id, body.priority, lora)
        choices = [
            GenerateChoice(
                index=c.index, finish_reason=F.finish_reason(c.finish_reason) or "stop", stop_reason=c.stop_reason,
                token_ids=list(c.token_ids), routed_experts=_routed_experts(state, c),
                weight_versions=F.weight_version_spans(c.weight_versions),
                text=c.text if body.output_mode == "text" else None, logprobs=choice_logprobs(body, params, c),
            )
            for c in sorted(out.outputs, key=lambda c: c.index)
        ]
        response = GenerateResponse(
            request_id=req_id, model=state.served_name(lora), created=int(time.time()), output_mode=body.output_mode,
            usage=F.usage([len(out.prompt_token_ids)], sum(len(c.token_ids) for c in out.outputs)),
            prompt_logprobs=F.prompt_logprobs_json(out.prompt_logprobs),
            prompt_token_ids=list(out.prompt_token_ids) if body.return_token_ids else None, choices=choices,
        )
        if body.output_mode == "tokens":  # a tokens choice has no text field, as vLLM's GenerateTokensChoice
            from fastapi.responses import JSONResponse

            return JSONResponse(response.model_dump(mode="json", exclude={"choices": {"__all__": {"text"}}}))
        return response

    return router
