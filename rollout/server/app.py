"""The FastAPI app: OpenAI-compatible routes plus tokenize, health, metrics and version, over one AsyncLLM."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from dataclasses import dataclass
from importlib import metadata
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from engine.exceptions import EngineDeadError
from engine.outputs import RequestOutput
from rollout.server import formatting as F
from rollout.server import protocol as P
from rollout.server.config import ServerConfig
from rollout.server.elastic_routes import elastic_router
from rollout.server.errors import (
    ERROR_TYPES,
    AuthError,
    ModelNotFoundError,
    add_exception_handlers,
    error_response,
)
from rollout.server.rl_routes import fault_tolerance_router, rl_router
from rollout.server.streams import first_outputs, merge_streams, run_until_disconnect

logger = logging.getLogger(__name__)

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class ServerState:
    engine: Any  # engine.async_llm.AsyncLLM
    config: ServerConfig
    model_name: str
    max_model_len: int

    def check_model(self, model: str | None) -> None:
        # An absent model means "the one you serve", as vLLM does.
        if model is not None and model != self.model_name:
            raise ModelNotFoundError(f"The model `{model}` does not exist.")


# ---------------------------------------------------------------------------- generation helpers


def _request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def _final_output(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The one FINAL_ONLY output of a generate() iterator."""
    final = None
    async for out in gen:
        final = out
    if final is None:
        raise RuntimeError("the engine returned no output")
    return final


async def _generate_all(
    request: Request, state: ServerState, prompts: list, params, req_id: str, priority: int
) -> list[RequestOutput]:
    """Runs every prompt to its final output; a disconnect or any failure cancels (aborts) the rest."""
    gens = [
        state.engine.generate(prompt, params, f"{req_id}-{i}" if len(prompts) > 1 else req_id, priority)
        for i, prompt in enumerate(prompts)
    ]
    return await run_until_disconnect(request, [_final_output(g) for g in gens])


def _completion_choices(state: ServerState, outputs: list[RequestOutput], n: int, return_token_ids: bool):
    choices = []
    for prompt_index, out in enumerate(outputs):
        for c in out.outputs:
            choices.append(
                P.CompletionChoice(
                    index=prompt_index * n + c.index,
                    text=c.text,
                    logprobs=F.completion_logprobs(state.engine, c, 0),
                    finish_reason=F.finish_reason(c.finish_reason),
                    stop_reason=c.stop_reason,
                    prompt_token_ids=list(out.prompt_token_ids) if return_token_ids else None,
                    token_ids=list(c.token_ids) if return_token_ids else None,
                    weight_versions=list(c.weight_versions) if return_token_ids else None,
                    prompt_logprobs=F.prompt_logprobs_json(out.prompt_logprobs),
                    routed_experts=c.routed_experts,
                )
            )
    return sorted(choices, key=lambda ch: ch.index)


async def _stream_completions(
    state: ServerState, body: P.CompletionRequest, req_id: str, gens: list, firsts: list
) -> AsyncIterator[str]:
    created, n = int(time.time()), body.n
    offsets: dict[int, int] = {}  # choice index -> characters sent (text_offset continues across chunks)
    prompt_lens: dict[int, int] = {}
    num_completion_tokens = 0
    try:
        async for prompt_index, out in merge_streams(gens, firsts):
            first_of_prompt = prompt_index not in prompt_lens
            prompt_lens[prompt_index] = len(out.prompt_token_ids)
            choices = []
            for c in out.outputs:
                index = prompt_index * n + c.index
                offset = offsets.get(index, 0)
                offsets[index] = offset + len(c.text)
                num_completion_tokens += len(c.token_ids)
                choices.append(
                    P.CompletionChoice(
                        index=index,
                        text=c.text,
                        logprobs=F.completion_logprobs(state.engine, c, offset),
                        finish_reason=F.finish_reason(c.finish_reason),
                        stop_reason=c.stop_reason,
                        prompt_token_ids=(
                            list(out.prompt_token_ids) if body.return_token_ids and first_of_prompt else None
                        ),
                        token_ids=list(c.token_ids) if body.return_token_ids else None,
                        weight_versions=list(c.weight_versions) if body.return_token_ids else None,
                        # DELTA outputs carry the prompt logprobs once, in the first output.
                        prompt_logprobs=F.prompt_logprobs_json(out.prompt_logprobs),
                        routed_experts=c.routed_experts,
                    )
                )
            if choices:
                yield F.sse(P.CompletionResponse(id=req_id, created=created, model=state.model_name, choices=choices))
        if body.include_usage_in_stream:
            final = P.CompletionResponse(
                id=req_id, created=created, model=state.model_name, choices=[],
                usage=F.usage(list(prompt_lens.values()), num_completion_tokens),
            )
            yield F.sse(final)
    except Exception as e:  # headers are sent: report in-band, as OpenAI does
        yield _sse_error(e)
    yield F.SSE_DONE


async def _stream_chat(
    state: ServerState, body: P.ChatCompletionRequest, req_id: str, gens: list, firsts: list
) -> AsyncIterator[str]:
    created, num_top = int(time.time()), body.top_logprobs or 0
    num_completion_tokens, prompt_len = 0, 0

    def chunk(choices, **extra) -> str:
        return F.sse(P.ChatCompletionChunk(id=req_id, created=created, model=state.model_name, choices=choices, **extra))

    try:
        # Every choice starts with the assistant role, as OpenAI's stream does.
        yield chunk(
            [P.ChatStreamChoice(index=i, delta=P.DeltaMessage(role="assistant", content="")) for i in range(body.n)],
            prompt_token_ids=list(firsts[0].prompt_token_ids) if body.return_token_ids else None,
        )
        async for _, out in merge_streams(gens, firsts):
            prompt_len = len(out.prompt_token_ids)
            choices = []
            for c in out.outputs:
                num_completion_tokens += len(c.token_ids)
                choices.append(
                    P.ChatStreamChoice(
                        index=c.index,
                        delta=P.DeltaMessage(content=c.text),
                        logprobs=F.chat_logprobs(state.engine, c, num_top),
                        finish_reason=F.finish_reason(c.finish_reason),
                        stop_reason=c.stop_reason,
                        token_ids=list(c.token_ids) if body.return_token_ids else None,
                        weight_versions=list(c.weight_versions) if body.return_token_ids else None,
                        routed_experts=c.routed_experts,
                    )
                )
            if choices:
                yield chunk(choices)
        if body.include_usage_in_stream:
            yield chunk([], usage=F.usage([prompt_len], num_completion_tokens))
    except Exception as e:
        yield _sse_error(e)
    yield F.SSE_DONE


def _sse_error(e: Exception) -> str:
    status = 400 if isinstance(e, ValueError) else getattr(e, "http_status", 500)
    logger.warning("stream failed: %s: %s", type(e).__name__, e)
    body = P.ErrorResponse(error=P.ErrorInfo(message=str(e), type=ERROR_TYPES.get(status, "error"), code=status))
    return f"data: {body.model_dump_json()}\n\n"


async def _open_streams(request: Request, state: ServerState, prompts: list, params, req_id: str, priority: int):
    """Starts one DELTA generate() per prompt and waits for each one's first output, so that bad
    input and admission errors become a proper HTTP status before any streamed byte."""
    gens = [
        state.engine.generate(prompt, params, f"{req_id}-{i}" if len(prompts) > 1 else req_id, priority)
        for i, prompt in enumerate(prompts)
    ]
    firsts = await run_until_disconnect(request, [first_outputs(gens)])
    return gens, firsts[0]


def _streaming_response(body_iter: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(body_iter, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _chat_prompt(state: ServerState, conversation: list[dict], add_generation_prompt: bool, kwargs) -> dict:
    """Renders a conversation with the chat template (in a thread: templates can be slow) and tokenizes it."""
    tokenizer = state.engine.tokenizer

    def render() -> dict:
        try:
            text = tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt, **(kwargs or {})
            )
        except Exception as e:  # a template error is the request's fault (e.g. a role it rejects)
            raise ValueError(f"messages: the chat template failed: {e}") from None
        return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}

    return await asyncio.to_thread(render)


# ---------------------------------------------------------------------------- app


def build_app(engine, server_config: ServerConfig, model_name: str | None = None) -> FastAPI:
    """The server's FastAPI app over `engine` (an AsyncLLM, or a RolloutGroup of them); `model_name` overrides the served name."""
    name = server_config.served_model_name or model_name or engine.model_name
    state = ServerState(engine, server_config, name, engine.config.model.max_model_len)
    app = FastAPI(title="rollout-toolkit", version=_version())
    app.state.server = state
    add_exception_handlers(app)
    app.include_router(_open_routes(state))
    auth = [Depends(_auth_dependency(server_config.api_key))]
    app.include_router(_api_routes(state), dependencies=auth)
    # Control routes exist only when asked for (DESIGN.md: RL and weight routes are off by default).
    if server_config.enable_rl_routes:
        app.include_router(rl_router(engine, server_config.weight_transfer_backend), dependencies=auth)
        app.include_router(elastic_router(engine), dependencies=auth)
    if engine.config.fault_tolerance.enable_fault_tolerance:
        app.include_router(fault_tolerance_router(engine), dependencies=auth)
    return app


def _auth_dependency(api_key: str | None):
    expected = f"Bearer {api_key}".encode() if api_key else None

    async def check(request: Request) -> None:
        if expected is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):  # constant time: no key prefix leaks by timing
            raise AuthError("missing or invalid API key (send `Authorization: Bearer <key>`)")

    return check


def _version() -> str:
    try:
        return metadata.version("rollout-toolkit")
    except metadata.PackageNotFoundError:
        return "unknown"


def _open_routes(state: ServerState) -> APIRouter:
    """Routes that monitoring reaches without the API key."""
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        try:
            await asyncio.wait_for(state.engine.check_health(), timeout=10.0)
        except (EngineDeadError, asyncio.TimeoutError) as e:
            return error_response(503, f"engine is not healthy: {e or 'no answer within 10 s'}")
        return Response(status_code=200)

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(state.engine.prometheus_text(), media_type=PROMETHEUS_CONTENT_TYPE)

    return router


def _api_routes(state: ServerState) -> APIRouter:
    router = APIRouter()
    engine = state.engine

    @router.get("/version")
    async def version() -> dict:
        return {"version": _version()}

    @router.get("/v1/models")
    async def models() -> P.ModelList:
        card = P.ModelCard(id=state.model_name, root=engine.config.model.model, max_model_len=state.max_model_len)
        return P.ModelList(data=[card])

    @router.post("/v1/completions")
    async def completions(body: P.CompletionRequest, request: Request):
        state.check_model(body.model)
        prompts = body.prompts()
        params = body.to_sampling_params(state.max_model_len)
        req_id = _request_id("cmpl")
        if body.stream:
            gens, firsts = await _open_streams(request, state, prompts, params, req_id, body.priority)
            return _streaming_response(_stream_completions(state, body, req_id, gens, firsts))
        outputs = await _generate_all(request, state, prompts, params, req_id, body.priority)
        choices = _completion_choices(state, outputs, body.n, body.return_token_ids)
        num_completion = sum(len(c.token_ids) for out in outputs for c in out.outputs)
        return P.CompletionResponse(
            id=req_id, model=state.model_name, choices=choices,
            usage=F.usage([len(o.prompt_token_ids) for o in outputs], num_completion),
        )

    @router.post("/v1/chat/completions")
    async def chat_completions(body: P.ChatCompletionRequest, request: Request):
        state.check_model(body.model)
        prompt = await _chat_prompt(state, body.conversation(), body.add_generation_prompt, body.chat_template_kwargs)
        params = body.to_sampling_params(state.max_model_len, len(prompt["prompt_token_ids"]))
        req_id = _request_id("chatcmpl")
        if body.stream:
            gens, firsts = await _open_streams(request, state, [prompt], params, req_id, body.priority)
            return _streaming_response(_stream_chat(state, body, req_id, gens, firsts))
        (out,) = await _generate_all(request, state, [prompt], params, req_id, body.priority)
        choices = [
            P.ChatChoice(
                index=c.index,
                message=P.ChatResponseMessage(content=c.text),
                logprobs=F.chat_logprobs(engine, c, body.top_logprobs or 0),
                finish_reason=F.finish_reason(c.finish_reason),
                stop_reason=c.stop_reason,
                token_ids=list(c.token_ids) if body.return_token_ids else None,
                weight_versions=list(c.weight_versions) if body.return_token_ids else None,
                routed_experts=c.routed_experts,
            )
            for c in sorted(out.outputs, key=lambda c: c.index)
        ]
        return P.ChatCompletionResponse(
            id=req_id, model=state.model_name, choices=choices,
            usage=F.usage([len(out.prompt_token_ids)], sum(len(c.token_ids) for c in out.outputs)),
            prompt_token_ids=list(out.prompt_token_ids) if body.return_token_ids else None,
            prompt_logprobs=F.prompt_logprobs_json(out.prompt_logprobs),
        )

    @router.post("/tokenize")
    async def tokenize(body: P.TokenizeRequest) -> P.TokenizeResponse:
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ValueError("prompt: give exactly one of prompt or messages")
        if body.messages is not None:
            conversation = [{"role": m.role, "content": m.text()} for m in body.messages]
            ids = (await _chat_prompt(state, conversation, body.add_generation_prompt, None))["prompt_token_ids"]
        else:
            ids = await asyncio.to_thread(engine.tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens)
        return P.TokenizeResponse(tokens=ids, count=len(ids), max_model_len=state.max_model_len)

    @router.post("/detokenize")
    async def detokenize(body: P.DetokenizeRequest) -> P.DetokenizeResponse:
        state.check_model(body.model)
        vocab = len(engine.tokenizer)
        if any(not 0 <= t < vocab for t in body.tokens):
            raise ValueError(f"tokens: token ids must be in [0, {vocab})")
        return P.DetokenizeResponse(prompt=await asyncio.to_thread(engine.tokenizer.decode, body.tokens))

    return router

