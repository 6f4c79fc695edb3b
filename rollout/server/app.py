"""The FastAPI app: OpenAI-compatible routes plus tokenize, health, metrics and version, over one AsyncLLM."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from importlib import metadata
from typing import Any, AsyncIterator, Protocol

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from engine.async_llm import Admission
from engine.config import EngineConfig
from engine.engine_args import num_routed_experts
from engine.control import EngineControls
from engine.exceptions import EngineDeadError
from engine.lora.names import LoRAAdapters
from engine.lora.request import LoRARequest
from engine.outputs import RequestOutput
from engine.processor import Processor, PromptType
from engine.sampling_params import SamplingParams
from rollout.server import chat_tools
from rollout.server import formatting as F
from rollout.server import protocol as P
from rollout.server.config import ServerConfig
from rollout.server.elastic_routes import elastic_router, vllm_elastic_router
from rollout.server.errors import ERROR_TYPES, ModelNotFoundError, add_exception_handlers, error_response
from rollout.server.generate_routes import generate_router
from rollout.server.lora import LoRAPathPolicy
from rollout.server.middleware import (
    AdmissionMiddleware,
    AuthMiddleware,
    BodyLimitMiddleware,
    CatchAllMiddleware,
    StrictJSONRoute,
)
from rollout.server.openapi import error_responses, install_openapi
from rollout.server.rl_routes import control_routers, server_info_router
from rollout.server.streams import first_outputs, merge_streams, run_until_disconnect

logger = logging.getLogger(__name__)

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServedEngine(EngineControls, Protocol):
    """What the server needs of its engine, an AsyncLLM or a RolloutGroup: the declared controls
    (engine/control.py) plus generation, admission, health and metrics."""

    config: EngineConfig
    model_name: str
    tokenizer: Any
    processor: Processor
    lora_adapters: LoRAAdapters  # the adapters served by name (load_lora_adapter)

    @property
    def is_dead(self) -> bool: ...

    def generate(self, prompt: PromptType, sampling_params: SamplingParams, request_id: str | None = None,
                 priority: int = 0, admission: Admission | None = None,
                 lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]: ...

    def admit(self, num_requests: int) -> Admission: ...

    def check_admission(self, num_requests: int, num_prompt_tokens: int = 0) -> None: ...

    async def check_health(self) -> None: ...

    def prometheus_text(self) -> bytes: ...

    def shutdown(self) -> None: ...


@dataclass
class ServerState:
    engine: ServedEngine
    config: ServerConfig
    model_name: str
    max_model_len: int
    chat: chat_tools.ChatParsing
    num_experts: int = 0  # routed experts per MoE layer (0: a dense model); sets the dtype of routed_experts

    def check_batch(self, num_prompts: int, n: int) -> None:
        """A batched completion fans out into num_prompts x n sequences: bounded before any is made."""
        limit = self.config.max_batch_sequences
        if num_prompts * n > limit:
            raise ValueError(
                f"prompt: {num_prompts} prompts x n={n} is {num_prompts * n} sequences, over this server's "
                f"limit of {limit} (--max-batch-sequences)"
            )

    def with_server_defaults(self, params: SamplingParams) -> SamplingParams:
        """--enable-return-routed-experts turns routed experts on for every request."""
        if self.config.enable_return_routed_experts and not params.return_routed_experts:
            return params.clone(return_routed_experts=True)
        return params

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter that `model` names, None for the base model (an absent model means the base model, as
        vLLM); ModelNotFoundError (404, vLLM's words: only the base model is named) for any other name."""
        if model is None or model == self.model_name:
            return None
        lora = self.engine.lora_adapters.get(model)
        if lora is None:
            raise ModelNotFoundError(f"The model `{model}` does not exist. Valid aliases: {self.model_name}.")
        return lora

    def served_name(self, lora: LoRARequest | None) -> str:
        """The `model` of an answer: the adapter's name, or the base model's (as vLLM answers)."""
        return lora.lora_name if lora is not None else self.model_name


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


def _start_generation(state: ServerState, prompts: list, params, req_id: str, priority: int,
                      lora: LoRARequest | None = None):
    """(one generate() iterator per prompt, their admission): what the request asks for is bounded
    (n, priority, prompts x n: 400) and its places in the engine's queue are taken now, on arrival
    (AdmissionError: 503 at once), before any iterator starts. `lora`: the adapter every prompt runs with."""
    state.engine.processor.check_params(params, priority)
    state.check_batch(len(prompts), params.n)
    admission = state.engine.admit(len(prompts) * params.n)
    gens = [
        state.engine.generate(prompt, params, f"{req_id}-{i}" if len(prompts) > 1 else req_id, priority, admission,
                              lora)
        for i, prompt in enumerate(prompts)
    ]
    return gens, admission


async def _generate_all(
    request: Request, state: ServerState, prompts: list, params, req_id: str, priority: int,
    lora: LoRARequest | None = None,
) -> list[RequestOutput]:
    """Runs every prompt to its final output; a disconnect or any failure cancels (aborts) the rest."""
    gens, admission = _start_generation(state, prompts, params, req_id, priority, lora)
    try:
        return await run_until_disconnect(request, [_final_output(g) for g in gens])
    finally:
        admission.release()  # what a request cancelled before its tokenization still held


def _prompt_text(state: ServerState, body: P.CompletionRequest, out: RequestOutput) -> str:
    """The prompt's text as an echo shows it: as given, or decoded from its token ids ("" with
    return_token_ids, whose prompt_token_ids say it already, as vLLM does)."""
    if body.return_token_ids:
        return ""
    if out.prompt is not None:
        return out.prompt
    return state.engine.tokenizer.decode(out.prompt_token_ids)


def _routed_experts(state: ServerState, c) -> str | None:
    return F.routed_experts_b64(c.routed_experts, state.num_experts) if c.routed_experts is not None else None


def _completion_choices(state: ServerState, body: P.CompletionRequest, outputs: list[RequestOutput]):
    choices = []
    for prompt_index, out in enumerate(outputs):
        for c in out.outputs:
            text, token_ids, positions = c.text, c.token_ids, c.logprobs
            if body.echo:
                text, token_ids, positions = F.echoed(_prompt_text(state, body, out), out.prompt_token_ids,
                                                      out.prompt_logprobs, c, body.echo_only)
            logprobs = None
            if body.logprobs is not None and positions is not None:
                logprobs = F.legacy_logprobs(state.engine, token_ids, positions, 0, body.return_tokens_as_token_ids)
            choices.append(
                P.CompletionChoice(
                    index=prompt_index * body.n + c.index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=F.finish_reason(c.finish_reason),
                    stop_reason=c.stop_reason,
                    prompt_token_ids=list(out.prompt_token_ids) if body.return_token_ids else None,
                    token_ids=list(c.token_ids) if body.return_token_ids else None,
                    weight_versions=F.weight_version_spans(c.weight_versions) if body.return_weight_versions else None,
                    prompt_logprobs=F.prompt_logprobs_json(out.prompt_logprobs),
                    routed_experts=_routed_experts(state, c),
                )
            )
    return sorted(choices, key=lambda ch: ch.index)


class _ChoiceStream:
    """What a streamed choice has sent so far: its text offset, whether its prompt was echoed, its
    weight-version spans and routed-experts rows (both sent whole in its last chunk, as vLLM does)."""

    def __init__(self) -> None:
        self.offset = 0
        self.echoed = False
        self.sent_prompt_ids = False
        self.num_tokens = 0
        self.spans: list[list] = []  # [version, start, end] over the whole output
        self.routed: list | None = None

    def add(self, c) -> None:
        for version, start, end in c.weight_versions:
            if self.spans and self.spans[-1][0] == version and self.spans[-1][2] == self.num_tokens + start:
                self.spans[-1][2] = self.num_tokens + end
            else:
                self.spans.append([version, self.num_tokens + start, self.num_tokens + end])
        self.num_tokens += len(c.token_ids)
        if c.routed_experts is not None:
            self.routed = (self.routed or []) + c.routed_experts


async def _stream_completions(
    state: ServerState, body: P.CompletionRequest, req_id: str, gens: list, firsts: list, model: str
) -> AsyncIterator[str]:
    created, n = int(time.time()), body.n
    streams: dict[int, _ChoiceStream] = {}  # by choice index
    prompt_lens: dict[int, int] = {}
    prompt_logprobs: dict[int, Any] = {}  # DELTA outputs carry a prompt's logprobs once: kept for every choice's echo
    num_completion_tokens = 0
    try:
        async for prompt_index, out in merge_streams(gens, firsts):
            prompt_lens[prompt_index] = len(out.prompt_token_ids)
            if out.prompt_logprobs is not None:
                prompt_logprobs.setdefault(prompt_index, out.prompt_logprobs)
            choices = []
            for c in out.outputs:
                index = prompt_index * n + c.index
                cs = streams.setdefault(index, _ChoiceStream())
                cs.add(c)
                num_completion_tokens += len(c.token_ids)
                text, token_ids, positions = c.text, c.token_ids, c.logprobs
                if body.echo and not cs.echoed:
                    text, token_ids, positions = F.echoed(_prompt_text(state, body, out), out.prompt_token_ids,
                                                          prompt_logprobs.get(prompt_index), c, body.echo_only)
                    cs.echoed = True
                elif body.echo_only:
                    continue  # the prompt alone was asked for, and it is sent
                logprobs = None
                if body.logprobs is not None and positions is not None:
                    logprobs = F.legacy_logprobs(state.engine, token_ids, positions, cs.offset,
                                                 body.return_tokens_as_token_ids)
                cs.offset = F.next_text_offset(logprobs, cs.offset, text)
                last = c.finish_reason is not None
                send_prompt_ids, cs.sent_prompt_ids = body.return_token_ids and not cs.sent_prompt_ids, True
                choices.append(
                    P.CompletionChoice(
                        index=index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=F.finish_reason(c.finish_reason),
                        stop_reason=c.stop_reason,
                        # Once per choice, in its first chunk (as vLLM).
                        prompt_token_ids=list(out.prompt_token_ids) if send_prompt_ids else None,
                        token_ids=list(c.token_ids) if body.return_token_ids else None,
                        weight_versions=(
                            F.weight_version_spans(cs.spans) if body.return_weight_versions and last else None
                        ),
                        # DELTA outputs carry the prompt logprobs once, in the first output.
                        prompt_logprobs=F.prompt_logprobs_json(out.prompt_logprobs),
                        routed_experts=(
                            F.routed_experts_b64(cs.routed, state.num_experts) if last and cs.routed else None
                        ),
                    )
                )
            if choices:
                yield F.sse(P.CompletionResponse(id=req_id, created=created, model=model, choices=choices))
        if body.include_usage_in_stream:
            final = P.CompletionResponse(
                id=req_id, created=created, model=model, choices=[],
                usage=F.usage(list(prompt_lens.values()), num_completion_tokens),
            )
            yield F.sse(final)
    except Exception as e:  # headers are sent: report in-band, as OpenAI does
        yield _sse_error(e)
    yield F.SSE_DONE


async def _stream_chat(
    state: ServerState, body: P.ChatCompletionRequest, req_id: str, gens: list, firsts: list, prefix: str, model: str
) -> AsyncIterator[str]:
    created, num_top = int(time.time()), body.top_logprobs or 0
    num_completion_tokens, prompt_len = 0, 0
    streams: dict[int, _ChoiceStream] = {}
    parsers: dict[int, chat_tools.ChoiceParser] = {}

    def chunk(choices, **extra) -> str:
        return F.sse(P.ChatCompletionChunk(id=req_id, created=created, model=model, choices=choices, **extra))

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
                cs = streams.setdefault(c.index, _ChoiceStream())
                cs.add(c)
                last = c.finish_reason is not None
                if c.index not in parsers:
                    parsers[c.index] = state.chat.choice(body, out.prompt, prefix)
                parser = parsers[c.index]
                logprobs = F.chat_logprobs(state.engine, c, num_top, body.return_tokens_as_token_ids)
                delta = parser.delta(c.text, last)
                if delta is None:  # the parsers hold the text back (a tag may be starting)
                    if not last and logprobs is None and not body.return_token_ids:
                        continue
                    delta = P.DeltaMessage()
                choices.append(
                    P.ChatStreamChoice(
                        index=c.index,
                        delta=delta,
                        logprobs=logprobs,
                        finish_reason=chat_tools.finish_reason(c.finish_reason, body, parser.tools_streamed),
                        stop_reason=c.stop_reason,
                        token_ids=list(c.token_ids) if body.return_token_ids else None,
                        weight_versions=(
                            F.weight_version_spans(cs.spans) if body.return_weight_versions and last else None
                        ),
                        routed_experts=(
                            F.routed_experts_b64(cs.routed, state.num_experts) if last and cs.routed else None
                        ),
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


async def _open_streams(request: Request, state: ServerState, prompts: list, params, req_id: str, priority: int,
                        lora: LoRARequest | None = None):
    """Starts one DELTA generate() per prompt and waits for each one's first output, so that bad
    input and admission errors become a proper HTTP status before any streamed byte."""
    gens, admission = _start_generation(state, prompts, params, req_id, priority, lora)
    try:
        firsts = await run_until_disconnect(request, [first_outputs(gens)])
    finally:
        admission.release()
    return gens, firsts[0]


def _streaming_response(body_iter: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(body_iter, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _chat_prompt(state: ServerState, body: P.ChatCompletionRequest, prefix: str) -> dict:
    """The conversation as the engine's prompt: its processor renders the chat template (given the
    request's tools) after admission, in the tokenizer threads (engine/processor.py). A forced tool
    call's opening (chat_tools.py) goes after the rendered prompt, so that one is rendered here."""
    prompt = {"messages": body.conversation(), "add_generation_prompt": body.add_generation_prompt,
              "chat_template_kwargs": state.chat.template_kwargs(body)}
    if not prefix:
        return prompt
    processor = state.engine.processor

    def render() -> dict:
        text = processor.render_chat(prompt["messages"], body.add_generation_prompt, prompt["chat_template_kwargs"])
        text += prefix
        return {"prompt": text, "prompt_token_ids": processor.encode(text, add_special_tokens=False)}

    return await asyncio.to_thread(render)


# ---------------------------------------------------------------------------- app


def build_app(engine: ServedEngine, server_config: ServerConfig, model_name: str | None = None) -> FastAPI:
    """The server's FastAPI app over `engine` (an AsyncLLM, or a RolloutGroup of them); `model_name` overrides the served name."""
    name = server_config.served_model_name or model_name or engine.model_name
    hf_config = engine.config.model.hf_config_dict()
    chat = chat_tools.ChatParsing(server_config, engine.tokenizer, engine.config.model.model)
    state = ServerState(engine, server_config, name, engine.config.model.max_model_len, chat,
                        num_routed_experts(hf_config))
    if server_config.enable_return_routed_experts and not state.num_experts:
        raise ValueError("enable_return_routed_experts: the model has no mixture-of-experts layers, "
                         "so there is no expert routing to return")
    app = FastAPI(title="rollout-toolkit", version=_version())
    app.state.server = state
    add_exception_handlers(app)
    open_router = _open_routes(state)
    app.include_router(open_router)
    app.include_router(_api_routes(state))
    app.include_router(generate_router(state))  # /inference/v1/generate
    # Control routes exist only when asked for (docs/architecture.md: RL and weight routes are off by default).
    routers = control_routers(engine, checks={"init_weight_transfer_engine": _backend_check(server_config),
                                              "load_lora_adapter": LoRAPathPolicy(server_config.allowed_lora_paths).check})
    if server_config.enable_rl_routes:
        app.include_router(routers["rl"])
        app.include_router(elastic_router(engine))
        app.include_router(vllm_elastic_router(engine))
        app.include_router(server_info_router(engine))
    if server_config.allow_runtime_lora_updating:  # vLLM mounts them only with VLLM_ALLOW_RUNTIME_LORA_UPDATING
        app.include_router(routers["lora"])
    if engine.config.fault_tolerance.enable_fault_tolerance:
        app.include_router(routers["fault_tolerance"])
        if engine.config.fault_tolerance.enable_fault_injection:  # tests only
            app.include_router(routers["fault_injection"])

    # Middleware, outermost last: every failure is a JSON answer; the key is checked before any
    # body is read; a body over its limit is refused before a route parses it.
    app.add_middleware(
        BodyLimitMiddleware, max_bytes=server_config.max_request_body_bytes,
        path_limits={path: (server_config.max_weight_update_body_bytes, "--max-weight-update-body-bytes")
                     for path in ("/update_weights", "/apply_weight_update")},  # both carry an update_info
    )
    open_paths = {route.path for route in open_router.routes} | {
        p for p in (app.openapi_url, app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url) if p
    }
    if engine.config.admission.max_num_queued_reqs is not None or engine.config.admission.max_num_queued_tokens is not None:
        app.add_middleware(AdmissionMiddleware, engine=engine, paths={"/v1/completions", "/v1/chat/completions"})
    if server_config.api_key is not None:
        app.add_middleware(AuthMiddleware, api_key=server_config.api_key, open_paths=open_paths)
    app.add_middleware(CatchAllMiddleware)
    install_openapi(app, is_protected=lambda path: server_config.api_key is not None and path not in open_paths)
    return app


def _backend_check(server_config: ServerConfig):
    """init_weight_transfer_engine's check: the server picks the backend of an init_info that names none
    (vLLM's trainers never do: --weight-transfer-backend / --weight-transfer-config, else nccl as in vLLM),
    and refuses one that names another backend than the operator allowed."""
    allowed = server_config.weight_transfer_backend

    def check(arguments: dict) -> None:
        init_info = arguments["init_info"]
        if not isinstance(init_info, dict):
            return  # the engine's own check names the field
        backend = init_info.get("backend")
        if backend is None:
            arguments["init_info"] = {**init_info, "backend": allowed or "nccl"}
        elif allowed is not None and backend != allowed:
            raise ValueError(f"init_info.backend: this server takes weight_transfer_backend {allowed!r} "
                             f"(--weight-transfer-backend / --weight-transfer-config), got {backend!r}")

    return check


def _version() -> str:
    try:
        return metadata.version("rollout-toolkit")
    except metadata.PackageNotFoundError:
        return "unknown"


# What served an answer, in vLLM's system_fingerprint field (vLLM writes "vllm-<version>-<hash>").
SYSTEM_FINGERPRINT = f"rollout-toolkit-{_version()}"


def _open_routes(state: ServerState) -> APIRouter:
    """Routes that monitoring reaches without the API key."""
    router = APIRouter(route_class=StrictJSONRoute)

    @router.get(
        "/health", response_class=Response,
        responses={200: {"description": "The engine is healthy (an empty body)", "content": {}},
                   **error_responses(503)},
    )
    async def health() -> Response:
        try:
            await asyncio.wait_for(state.engine.check_health(), timeout=10.0)
        except (EngineDeadError, asyncio.TimeoutError) as e:
            return error_response(503, f"engine is not healthy: {e or 'no answer within 10 s'}")
        return Response(status_code=200)

    @router.get(
        "/metrics", response_class=Response,
        responses={200: {"description": "Prometheus text exposition format",
                         "content": {PROMETHEUS_CONTENT_TYPE: {"schema": {"type": "string"}}}}},
    )
    async def metrics() -> Response:
        return Response(state.engine.prometheus_text(), media_type=PROMETHEUS_CONTENT_TYPE)

    return router


class VersionResponse(P.ResponseModel):
    version: str


# With "stream": true: server-sent events, each `data:` a JSON chunk (or an in-band error body), then [DONE].
_STREAM = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a JSON chunk or error body, or [DONE]"}},
}}}


def _api_routes(state: ServerState) -> APIRouter:
    router = APIRouter(route_class=StrictJSONRoute)
    engine = state.engine

    @router.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=_version())

    @router.get("/v1/models")
    async def models() -> P.ModelList:
        card = P.ModelCard(id=state.model_name, root=engine.config.model.model, max_model_len=state.max_model_len,
                           parent=None)
        # vLLM's adapter cards: the adapter's directory as root, the base model as parent, no max_model_len.
        adapters = [P.ModelCard(id=lora.lora_name, root=lora.lora_path, parent=state.model_name)
                    for lora in engine.lora_adapters.all()]
        return P.ModelList(data=[card, *adapters])

    generation_errors = {**error_responses(404, 503), 200: {"content": _STREAM}}

    @router.post("/v1/completions", response_model=P.CompletionResponse, responses=generation_errors)
    async def completions(body: P.CompletionRequest, request: Request):
        lora = state.check_model(body.model)
        prompts = body.prompts()
        params = state.with_server_defaults(body.to_sampling_params(state.max_model_len))
        req_id = _request_id("cmpl")
        if body.stream:
            gens, firsts = await _open_streams(request, state, prompts, params, req_id, body.priority, lora)
            return _streaming_response(_stream_completions(state, body, req_id, gens, firsts, state.served_name(lora)))
        outputs = await _generate_all(request, state, prompts, params, req_id, body.priority, lora)
        choices = _completion_choices(state, body, outputs)
        num_completion = sum(len(c.token_ids) for out in outputs for c in out.outputs)
        return P.CompletionResponse(
            id=req_id, model=state.served_name(lora), choices=choices, system_fingerprint=SYSTEM_FINGERPRINT,
            usage=F.usage([len(o.prompt_token_ids) for o in outputs], num_completion),
        )

    @router.post("/v1/chat/completions", response_model=P.ChatCompletionResponse, responses=generation_errors)
    async def chat_completions(body: P.ChatCompletionRequest, request: Request):
        lora = state.check_model(body.model)
        state.chat.check_request(body)
        prefix = state.chat.forced_prefix(body)
        prompt = await _chat_prompt(state, body, prefix)
        # An unset max_tokens: up to max_model_len.
        params = state.with_server_defaults(body.to_sampling_params(state.max_model_len))
        params = state.chat.sampling_params(body, params)
        req_id = _request_id("chatcmpl")
        if body.stream:
            gens, firsts = await _open_streams(request, state, [prompt], params, req_id, body.priority, lora)
            return _streaming_response(_stream_chat(state, body, req_id, gens, firsts, prefix, state.served_name(lora)))
        (out,) = await _generate_all(request, state, [prompt], params, req_id, body.priority, lora)
        choices = []
        for c in sorted(out.outputs, key=lambda c: c.index):
            message = state.chat.choice(body, out.prompt, prefix).message(c.text)
            choices.append(P.ChatChoice(
                index=c.index,
                message=message,
                logprobs=F.chat_logprobs(engine, c, body.top_logprobs or 0, body.return_tokens_as_token_ids),
                finish_reason=chat_tools.finish_reason(c.finish_reason, body, bool(message.tool_calls)),
                stop_reason=c.stop_reason,
                token_ids=list(c.token_ids) if body.return_token_ids else None,
                weight_versions=F.weight_version_spans(c.weight_versions) if body.return_weight_versions else None,
                routed_experts=_routed_experts(state, c),
            ))
        return P.ChatCompletionResponse(
            id=req_id, model=state.served_name(lora), choices=choices, system_fingerprint=SYSTEM_FINGERPRINT,
            usage=F.usage([len(out.prompt_token_ids)], sum(len(c.token_ids) for c in out.outputs)),
            prompt_token_ids=list(out.prompt_token_ids) if body.return_token_ids else None,
            prompt_logprobs=F.prompt_logprobs_json(out.prompt_logprobs),
        )

    @router.post("/tokenize", responses=error_responses(404))
    async def tokenize(body: P.TokenizeRequest) -> P.TokenizeResponse:
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ValueError("prompt: give exactly one of prompt or messages")
        processor = engine.processor  # the engine's text bounds apply: a text too long for max_model_len is a 400
        if body.messages is not None:
            conversation = {"messages": P.conversation(body.messages),
                            "add_generation_prompt": body.add_generation_prompt}
            _, ids = await asyncio.to_thread(processor.tokenize, conversation)
        else:
            ids = await asyncio.to_thread(processor.encode, body.prompt, body.add_special_tokens)
        token_strs = engine.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return P.TokenizeResponse(tokens=ids, count=len(ids), max_model_len=state.max_model_len, token_strs=token_strs)

    if state.config.enable_tokenizer_info_endpoint:

        @router.get("/tokenizer_info")
        async def tokenizer_info() -> P.TokenizerInfoResponse:
            return P.TokenizerInfoResponse(**F.tokenizer_info(engine.tokenizer))

    @router.post("/detokenize", responses=error_responses(404))
    async def detokenize(body: P.DetokenizeRequest) -> P.DetokenizeResponse:
        state.check_model(body.model)
        vocab = len(engine.tokenizer)
        if any(not 0 <= t < vocab for t in body.tokens):
            raise ValueError(f"tokens: token ids must be in [0, {vocab})")
        return P.DetokenizeResponse(prompt=await asyncio.to_thread(engine.tokenizer.decode, body.tokens))

    return router

