"""OpenAI-compatible request and response bodies (plus vLLM's extra sampling fields) as pydantic models."""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.sampling_params import (
    RepetitionDetectionParams,
    RequestOutputKind,
    SamplingParams,
)

# Most top logprobs one position may ask for (vLLM's default max_logprobs): each costs a
# sort over the vocabulary and bytes on the wire.
MAX_LOGPROBS = 20
# Most stop strings one request may carry: each is searched for in every step's new text.
MAX_STOP_STRINGS = 64

# The ranges SamplingParams enforces, written into the schema too, so that /openapi.json says what
# the server accepts (client generators and fuzzers read it).
TokenId = Annotated[int, Field(ge=0)]
NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
NonEmptyText = Annotated[str, Field(min_length=1)]


class RequestModel(BaseModel):
    """Base of request bodies: unknown fields are a 400 naming the field, and no silent coercion
    ("5" is not an int, 1 is not a bool)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------------------- errors


class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(ResponseModel):
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorInfo


# ---------------------------------------------------------------------------- requests


class StreamOptions(RequestModel):
    include_usage: bool = False
    """Send one last chunk with token usage (and empty choices) before [DONE]."""


class RepetitionDetection(RequestModel):
    max_pattern_size: int
    min_count: int
    min_pattern_size: int = 1


class SamplingRequest(RequestModel):
    """Fields shared by /v1/completions and /v1/chat/completions: OpenAI's, then vLLM's extras."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
    """Samples per prompt; at most the engine's max_num_seqs (--max-num-seqs)."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: NonEmptyText | Annotated[list[NonEmptyText], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: int | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling fields (same names and meanings).
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    bad_words: list[str] | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    prompt_logprobs: NumLogprobs | None = None
    repetition_detection: RepetitionDetection | None = None
    priority: int = 0
    return_token_ids: bool = False
    """Add prompt_token_ids and each choice's token_ids to the response (token in, token out)."""
    return_tokens_as_token_ids: bool = False
    """With logprobs: each token written "token_id:N" instead of its text (a token's bytes may not be UTF-8 alone)."""
    return_weight_versions: bool = False
    """Add each choice's weight_versions: [{"version", "start", "end"}] half-open spans over its output tokens,
    one per run of tokens sampled by one weight version (a stream sends them once, in each choice's last chunk)."""
    return_routed_experts: bool = False
    """MoE models: add each choice's routed_experts (a server started with --enable-return-routed-experts adds
    them to every request), as vLLM returns them: base64 of a .npy array [position, layer, k] over prompt +
    output[:-1], uint8 (uint16 past 256 experts), in the finished choice only."""
    routed_experts_prompt_start: int = Field(default=0, ge=0)
    """With routed experts: leave out the rows of the first N prompt tokens (a multi-turn client has them already)."""

    def _sampling_params(
        self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """SamplingParams from the shared fields; SamplingParams raises ValueError naming a bad field."""
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return SamplingParams(
            n=self.n,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            bad_words=self.bad_words,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            logit_bias=_logit_bias(self.logit_bias),
            allowed_token_ids=self.allowed_token_ids,
            repetition_detection=(
                RepetitionDetectionParams(**self.repetition_detection.model_dump())
                if self.repetition_detection is not None
                else None
            ),
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            return_routed_experts=self.return_routed_experts,
            routed_experts_prompt_start=self.routed_experts_prompt_start,
        )

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    # JSON object keys are strings; OpenAI's are token ids written as strings.
    if bias is None:
        return None
    try:
        return {int(k): float(v) for k, v in bias.items()}
    except ValueError:
        raise ValueError("logit_bias: keys must be token ids") from None


# A completion prompt: text, token ids, or a batch of either.
# Each non-empty (the engine refuses an empty prompt).
CompletionPrompt = (
    NonEmptyText
    | Annotated[list[TokenId], Field(min_length=1)]
    | Annotated[list[NonEmptyText], Field(min_length=1)]
    | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
)


class CompletionRequest(SamplingRequest):
    """Body of POST /v1/completions."""

    prompt: CompletionPrompt
    max_tokens: int | None = Field(default=16, ge=0)
    """Tokens to generate (OpenAI's default 16, also for null, as vLLM); 0 only with echo (the prompt alone)."""
    logprobs: NumLogprobs | None = None
    echo: bool = False
    """Return the prompt before the completion, and with logprobs the prompt tokens' logprobs first (the
    first prompt token's null): what log-likelihood scoring (lm-evaluation-harness) reads."""
    suffix: str | None = None

    def prompts(self) -> list[str | dict[str, Any]]:
        """The batch of prompts, each as AsyncLLM.generate takes it."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):  # p is not empty (CompletionPrompt)
            return [{"prompt_token_ids": list(p)}]
        if isinstance(p[0], str):
            return list(p)
        return [{"prompt_token_ids": list(ids)} for ids in p]

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the answer is the prompt alone (one token is still generated and dropped, as in vLLM)."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self, max_model_len: int, prompt_len: int | None = None) -> SamplingParams:
        if self.suffix is not None:
            raise ValueError("suffix: not supported")
        requested = 16 if self.max_tokens is None else self.max_tokens
        if requested == 0 and not self.echo:
            raise ValueError("max_tokens: must be at least 1 (0 only with echo, for the prompt alone)")
        _check_max_tokens("max_tokens", requested, max_model_len)
        # echo reports the prompt's logprobs too: as many top logprobs per position as asked for the output.
        prompt_logprobs = self.logprobs if self.echo and self.prompt_logprobs is None else None
        return self._sampling_params(max(requested, 1), self.logprobs, prompt_logprobs)


class TextContentPart(RequestModel):
    type: Literal["text"]
    text: str


class ParamValidationError(Exception):
    """A check vLLM 0.33 runs on a raw request body before its types (its VLLMValidationError): HTTP 400
    BadRequestError with `param`, worded as vLLM words it. Not a ValueError, so pydantic passes it on
    as it is instead of folding it into a type error, as it passes vLLM's on."""

    def __init__(self, message: str, *, parameter: str | None = None) -> None:
        super().__init__(message)
        self.parameter = parameter

    def __str__(self) -> str:
        base = super().__str__()
        return f"{base} (parameter={self.parameter})" if self.parameter is not None else base


class FunctionCallParam(RequestModel):
    name: str
    arguments: str | dict[str, Any] | None = None
    """JSON text of the arguments (OpenAI's form), or the object itself."""


class ToolCallParam(RequestModel):
    """A tool call in an assistant message sent back (OpenAI's ChatCompletionMessageToolCallParam)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(RequestModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    """Assistant messages: the calls the model made (what an answer's message.tool_calls held)."""
    tool_call_id: str | None = None
    """Tool messages: the id of the call this is the result of."""
    reasoning: str | None = None
    """Assistant messages: the model's reasoning, for templates that show it again (vLLM's field)."""
    reasoning_content: str | None = None
    """The older name of `reasoning` (vLLM reads either)."""

    @model_validator(mode="after")
    def _fields_of_the_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls: only an assistant message carries tool calls, not a {self.role} message")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"tool_call_id: only a tool message answers a tool call, not a {self.role} message")
        return self

    def text(self) -> str:
        """The content as text: text parts joined by newlines, as vLLM joins them for a string template."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)

    def template_message(self) -> dict[str, Any]:
        """The message as chat templates take it (transformers' form, as vLLM renders it): text content;
        tool calls with their arguments as objects (text that is not a JSON object becomes {}, as vLLM
        makes it, so that a bad call in the history does not break every later turn); the reasoning
        under both of its names; the tool message's call id."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": call.id, "type": call.type,
                 "function": {"name": call.function.name, "arguments": _arguments_object(call.function.arguments)}}
                for call in self.tool_calls
            ]
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if reasoning is not None:
            message["reasoning"] = message["reasoning_content"] = reasoning
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _arguments_object(arguments: str | dict[str, Any] | None) -> dict[str, Any]:
    if isinstance(arguments, dict):
        return arguments
    if not arguments:
        return {}
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them."""
    return [m.template_message() for m in messages]


class FunctionDefinition(RequestModel):
    name: NonEmptyText
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """JSON Schema of the arguments (an object schema)."""
    strict: bool | None = Field(default=None, exclude_if=lambda v: v is None)
    """Accepted and shown to the chat template; the arguments are not constrained to the schema (the
    engine has no guided decoding): see README "Tool calling"."""


class ChatCompletionToolsParam(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    """tool_choice naming the function the answer must call."""

    function: NamedFunction
    type: Literal["function"] = "function"


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice | None


class ChatCompletionRequest(SamplingRequest):
    """Body of POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    tools: list[ChatCompletionToolsParam] | None = None
    """Functions the model may call; the chat template is given them as `tools` (as transformers'
    apply_chat_template is)."""
    tool_choice: ToolChoice = "none"
    """"none", "auto" (the default when tools are given; needs --enable-auto-tool-choice), "required", or
    {"type": "function", "function": {"name": ...}}."""
    parallel_tool_calls: bool | None = True
    """false: an answer keeps only its first tool call."""
    # vLLM's chat extras.
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True
    """With --reasoning-parser: false leaves the reasoning out of the answer."""

    @model_validator(mode="before")
    @classmethod
    def _check_tool_usage(cls, data: Any) -> Any:
        """vLLM 0.33's check_tool_usage, on the raw body and with its words: tools given without
        tool_choice means "auto"; a tool_choice needs tools; a named choice names one of them."""
        if not isinstance(data, dict):
            return data
        tools = data.get("tools")
        if tools == []:
            raise ParamValidationError(
                "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.",
                parameter="tools",
            )
        if "tool_choice" not in data and tools:
            data = {**data, "tool_choice": "auto"}
        choice = data.get("tool_choice")
        if choice is None or choice == "none":
            return data
        if tools is None:
            raise ParamValidationError("When using `tool_choice`, `tools` must be set.", parameter="tool_choice")
        if choice not in ("auto", "required") and not isinstance(choice, dict):
            raise ParamValidationError(
                f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or "required" '
                "are supported.",
                parameter="tool_choice",
            )
        if isinstance(choice, dict):
            usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
            function = choice.get("function")
            if not isinstance(function, dict):
                raise ParamValidationError(f"Invalid value for `function`: `{function}` in `tool_choice`! {usage}",
                                           parameter="tool_choice.function")
            if "name" not in function:
                raise ParamValidationError(f"Expected field `name` in `function` in `tool_choice`! {usage}",
                                           parameter="tool_choice.function.name")
            name = function["name"]
            if not isinstance(name, str) or not name:
                raise ParamValidationError(f"Invalid `name` in `function`: `{name}` in `tool_choice`! {usage}",
                                           parameter="tool_choice.function.name")
            functions = [t.get("function") for t in tools if isinstance(t, dict)] if isinstance(tools, list) else []
            if name not in [f.get("name") for f in functions if isinstance(f, dict)]:
                raise ParamValidationError(
                    "The tool specified in `tool_choice` does not match any of the specified `tools`",
                    parameter="tool_choice",
                )
        return data

    def conversation(self) -> list[dict[str, Any]]:
        """Messages as the chat template takes them."""
        return conversation(self.messages)

    @property
    def forced_tool_call(self) -> bool:
        """tool_choice "required" or named: the answer must call a tool."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    def to_sampling_params(self, max_model_len: int, prompt_len: int | None = None) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        if self.max_completion_tokens is not None:
            _check_max_tokens("max_completion_tokens", self.max_completion_tokens, max_model_len)
            max_tokens = self.max_completion_tokens
        else:
            if self.max_tokens is not None:
                _check_max_tokens("max_tokens", self.max_tokens, max_model_len)
            max_tokens = self.max_tokens
        return self._sampling_params(_max_tokens(max_tokens, max_model_len, prompt_len), logprobs)


def _check_max_tokens(field: str, max_tokens: int, max_model_len: int) -> None:
    """vLLM's one refusal of an output length: more than the context holds (vLLM's message). A prompt that
    leaves fewer than max_tokens positions is not refused: its output stops at max_model_len
    (finish_reason "length"), as vLLM 0.33 clamps max_tokens to max_model_len - prompt length."""
    if max_tokens > max_model_len:
        raise ValueError(
            f"{field}={max_tokens} cannot be greater than max_model_len={max_model_len}. "
            f"Please request fewer output tokens. (parameter={field}, value={max_tokens})"
        )


def _max_tokens(requested: int | None, max_model_len: int, prompt_len: int | None) -> int | None:
    """An unset max_tokens means "up to the context length"; None lets the engine cap it."""
    if requested is not None or prompt_len is None:
        return requested
    return max(1, max_model_len - prompt_len)


class TokenizeRequest(RequestModel):
    """Body of POST /tokenize: text (`prompt`) or a conversation (`messages`)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    """Add token_strs: each token as the vocabulary spells it (convert_ids_to_tokens, as vLLM)."""


class DetokenizeRequest(RequestModel):
    """Body of POST /detokenize."""

    model: str | None = None
    tokens: list[int]


# ---------------------------------------------------------------------------- responses


class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # vLLM's (always null here: no cached-token or reasoning-token breakdown is reported).
    prompt_tokens_details: dict[str, Any] | None = None
    completion_tokens_details: dict[str, Any] | None = None


class _VllmResponseExtras(ResponseModel):
    """Top-level fields vLLM's completion and chat answers carry, null here (no service tiers, fingerprints,
    disaggregated serving or per-request metrics), so a client reading them finds them."""

    service_tier: str | None = None
    system_fingerprint: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None


class WeightVersionSpan(ResponseModel):
    """Output tokens [start, end) were sampled by the weights labelled `version` (vLLM's shape)."""

    version: str
    start: int
    end: int


class CompletionLogprobs(ResponseModel):
    """OpenAI's legacy completions logprobs: parallel lists, one entry per generated token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(ResponseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: per prompt position None (the first) or {token id (as text): logprob}.
PromptLogprobsJSON = list[dict[str, PromptLogprob] | None]


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # return_token_ids (vLLM's shape: per choice, since a batch has several prompts).
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    # return_weight_versions: which weights sampled which output tokens (a stream: in the last chunk only).
    weight_versions: list[WeightVersionSpan] | None = None
    prompt_logprobs: PromptLogprobsJSON | None = None
    # Routed experts (return_routed_experts or --enable-return-routed-experts): base64 .npy [position, layer, k]
    # over prompt[routed_experts_prompt_start:] + token_ids[:-1], in the finished choice (vLLM's form).
    routed_experts: str | None = None


class CompletionResponse(_VllmResponseExtras):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatTopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(ResponseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(ResponseModel):
    name: str
    arguments: str
    """JSON text of the arguments."""


class ToolCall(ResponseModel):
    id: str
    """"chatcmpl-tool-" and 16 hex digits, as vLLM makes them; a tool message answers it by this id."""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning: str | None = None
    """With --reasoning-parser: the model's reasoning, apart from the content (vLLM 0.33's field)."""
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=lambda v: not v)
    """With tool calling: the calls the model made (left out when it made none, as vLLM leaves it)."""


class ChatChoice(ResponseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    # return_weight_versions: which weights sampled which output tokens (a stream: in the last chunk only).
    weight_versions: list[WeightVersionSpan] | None = None
    # Routed experts (return_routed_experts or --enable-return-routed-experts): base64 .npy [position, layer, k]
    # over prompt[routed_experts_prompt_start:] + token_ids[:-1], in the finished choice (vLLM's form).
    routed_experts: str | None = None


class ChatCompletionResponse(_VllmResponseExtras):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobsJSON | None = None


class DeltaFunctionCall(ResponseModel):
    name: str | None = Field(default=None, exclude_if=lambda v: v is None)
    arguments: str | None = Field(default=None, exclude_if=lambda v: v is None)


class DeltaToolCall(ResponseModel):
    """A piece of a streamed tool call: first its index, id, type and name, then pieces of its arguments'
    JSON text that add up to the non-streamed answer's arguments (vLLM's shape, unset fields left out)."""

    index: int
    id: str | None = Field(default=None, exclude_if=lambda v: v is None)
    type: Literal["function"] | None = Field(default=None, exclude_if=lambda v: v is None)
    function: DeltaFunctionCall | None = Field(default=None, exclude_if=lambda v: v is None)


class DeltaMessage(ResponseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = Field(default=None, exclude_if=lambda v: v is None)
    tool_calls: list[DeltaToolCall] | None = Field(default=None, exclude_if=lambda v: not v)


class ChatStreamChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    # return_weight_versions: which weights sampled which output tokens (a stream: in the last chunk only).
    weight_versions: list[WeightVersionSpan] | None = None
    # Routed experts (return_routed_experts or --enable-return-routed-experts): base64 .npy [position, layer, k]
    # over prompt[routed_experts_prompt_start:] + token_ids[:-1], in the finished choice (vLLM's form).
    routed_experts: str | None = None


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None


class ModelPermission(ResponseModel):
    """vLLM's (and OpenAI's old) model permission object: what a client may do with the model."""

    id: str = Field(default_factory=lambda: f"modelperm-{uuid.uuid4().hex}")
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "rollout-toolkit"
    root: str | None = None
    parent: str | None = None
    """The base model of an adapter (a LoRA card: vLLM's); None for the base model itself."""
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(ResponseModel):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None


class TokenizerInfoResponse(BaseModel):
    """GET /tokenizer_info: the tokenizer's configuration (tokenizer_config.json's fields, less file paths)."""

    model_config = ConfigDict(extra="allow")
    tokenizer_class: str


class DetokenizeResponse(ResponseModel):
    prompt: str
