"""Tool calling and reasoning in chat answers, as vLLM 0.33 serves them: which requests may use tools,
what the chat template is given, and how each choice's text becomes reasoning, content and tool calls.

The parsers are the server's (--enable-auto-tool-choice with --tool-call-parser, --reasoning-parser).
tool_choice "auto" lets the model decide and reads its calls from the text; "none" reads none (the
tools still go to the template unless --exclude-tools-when-tool-choice-none). "required" and named
choices must produce a call: vLLM constrains the output with guided decoding, which this engine does
not have, so the call's opening is written into the prompt instead, after the generation prompt, in
the parser's format (tool_parsers.py `forced_prefix`): for a named choice up to its arguments, for
"required" up to the name (with one tool, its name too). The model writes the rest; the arguments are
not constrained to the tool's schema. The forced text is part of the prompt (prompt_token_ids carry
it, token_ids and logprobs only what was sampled) and is read as the start of the answer; the answer
then has no reasoning (it starts inside the call).

A streamed choice sends, at each step, what the parsers' snapshot of the text so far adds to what it
sent before, so the deltas add up to the non-streamed message (arguments included, in json.dumps'
spelling). Two differences remain, both vLLM's: a llama3_json stream reads calls only where they start
the answer (an answer finds them anywhere), and a stream announces a call once its name is whole, so a
call whose JSON breaks later stays announced (the answer then has none). vLLM's stream also sends the
whitespace before a call as content, which its answer leaves out; here the stream leaves it out too.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.sampling_params import SamplingParams
from rollout.server import protocol as P
from rollout.server.config import ServerConfig
from rollout.server.formatting import finish_reason as engine_finish_reason
from rollout.server.reasoning_parsers import ReasoningParser, ReasoningParserManager
from rollout.server.tool_parsers import ToolParser, ToolParserManager


def make_tool_call_id() -> str:
    """vLLM's tool call id: "chatcmpl-tool-" and 16 hex digits of a random uuid."""
    return f"chatcmpl-tool-{uuid.uuid4().int & ((1 << 64) - 1):016x}"


class ChatParsing:
    """The server's chat parsers, checked against the tokenizer once, and the per-request rules."""

    def __init__(self, config: ServerConfig, tokenizer, model_name: str) -> None:
        self.tool_parser: ToolParser | None = None
        # As in vLLM, the tool parser exists only with --enable-auto-tool-choice.
        if config.enable_auto_tool_choice and config.tool_call_parser:
            self.tool_parser = ToolParserManager.get_tool_parser(config.tool_call_parser)()
        self.reasoning_parser_cls: type[ReasoningParser] | None = None
        if config.reasoning_parser:
            self.reasoning_parser_cls = ReasoningParserManager.get_reasoning_parser(config.reasoning_parser)
        self.exclude_tools_when_tool_choice_none = config.exclude_tools_when_tool_choice_none
        vocab = tokenizer.get_vocab()
        parsers = (("--tool-call-parser", self.tool_parser), ("--reasoning-parser", self.reasoning_parser_cls))
        for flag, parser in parsers:
            missing = [t for t in (parser.required_vocab if parser is not None else ()) if t not in vocab]
            if missing:
                raise ValueError(f"{flag} {parser.name} cannot be used with the tokenizer of {model_name!r}: "
                                 f"it has no {missing[0]!r} token")

    def check_request(self, body: P.ChatCompletionRequest) -> None:
        """vLLM's refusal of a tool_choice this server cannot serve (its words; 400 without a param)."""
        choice = body.tool_choice
        if self.tool_parser is not None or choice in (None, "none"):
            return
        if choice == "auto":
            raise P.ParamValidationError(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
        described = f'function "{choice.function.name}"' if isinstance(choice, P.NamedToolChoice) else f'"{choice}"'
        raise P.ParamValidationError(f"tool_choice={described} requires --tool-call-parser to be set")

    def template_kwargs(self, body: P.ChatCompletionRequest) -> dict[str, Any] | None:
        """chat_template_kwargs with the request's tools (what apply_chat_template's `tools` takes)."""
        kwargs = dict(body.chat_template_kwargs or {})
        if body.tools is not None and not (body.tool_choice == "none" and self.exclude_tools_when_tool_choice_none):
            kwargs["tools"] = [tool.model_dump() for tool in body.tools]
        return kwargs or None

    def forced_prefix(self, body: P.ChatCompletionRequest) -> str:
        """The opening of the call a "required" or named tool_choice forces ("" otherwise)."""
        if not body.forced_tool_call or self.tool_parser is None:
            return ""
        if isinstance(body.tool_choice, P.NamedToolChoice):
            name = body.tool_choice.function.name
        else:
            name = body.tools[0].function.name if len(body.tools) == 1 else None
        return self.tool_parser.forced_prefix(name)

    def sampling_params(self, body: P.ChatCompletionRequest, params: SamplingParams) -> SamplingParams:
        """A parser that needs the special tokens of its markup gets them (vLLM's hermes adjust_request)."""
        if (self.tool_parser is not None and self.tool_parser.keeps_special_tokens and body.tools
                and body.tool_choice != "none" and params.skip_special_tokens):
            return params.clone(skip_special_tokens=False)
        return params

    def keeps_tool_calls(self, body: P.ChatCompletionRequest) -> bool:
        """Whether an answer returns the calls its text makes (vLLM's keeps_tool_calls)."""
        if self.tool_parser is None:
            return False
        return body.forced_tool_call or (body.tool_choice == "auto" and bool(body.tools))

    def choice(self, body: P.ChatCompletionRequest, prompt: str | None, prefix: str) -> ChoiceParser:
        """The parser of one choice of `body`, whose rendered prompt is `prompt` and forced opening `prefix`."""
        reasoning = None
        if self.reasoning_parser_cls is not None and not prefix:
            reasoning = self.reasoning_parser_cls(body.chat_template_kwargs, prompt)
        tools = self.tool_parser if self.keeps_tool_calls(body) else None
        return ChoiceParser(body, reasoning, tools, prefix)


def finish_reason(engine_reason: str | None, body: P.ChatCompletionRequest, tool_calls_made: bool) -> str | None:
    """"tool_calls" for an answer that made calls and stopped by itself, except under a named tool_choice
    (OpenAI says "stop" there); a cut answer keeps "length" (vLLM's resolve_finish_reason)."""
    reason = engine_finish_reason(engine_reason)
    if tool_calls_made and reason == "stop" and not isinstance(body.tool_choice, P.NamedToolChoice):
        return "tool_calls"
    return reason


@dataclass
class _SentCall:
    id: str
    arguments: str = ""


@dataclass
class ChoiceParser:
    """One choice's text -> its message (`message`), or step by step -> its deltas (`delta`)."""

    body: P.ChatCompletionRequest
    reasoning_parser: ReasoningParser | None
    tool_parser: ToolParser | None
    prefix: str = ""
    text: str = ""
    sent_reasoning: str = ""
    sent_content: str = ""
    sent_calls: list[_SentCall] = field(default_factory=list)

    @property
    def tools_streamed(self) -> bool:
        return bool(self.sent_calls)

    def message(self, text: str) -> P.ChatResponseMessage:
        """The finished answer's message (vLLM's assemble_chat_message_fields)."""
        if self.reasoning_parser is None and self.tool_parser is None:
            return P.ChatResponseMessage(content=text)
        full = self.prefix + text
        reasoning, content = None, full
        if self.reasoning_parser is not None:
            reasoning, content = self.reasoning_parser.extract_reasoning(full)
        calls: list[P.ToolCall] = []
        if self.tool_parser is not None:
            extracted = self.tool_parser.extract_tool_calls(content or "")
            if extracted.tools_called:
                calls = [P.ToolCall(id=make_tool_call_id(), function=P.FunctionCall(name=c.name, arguments=c.arguments))
                         for c in extracted.tool_calls]
                content = extracted.content if extracted.content and extracted.content.strip() else None
            elif self.body.forced_tool_call and not (content or "").strip():
                content = None
            if self.body.forced_tool_call:
                content = content or ""
            if self.body.parallel_tool_calls is False:
                calls = calls[:1]
        if not self.body.include_reasoning:
            reasoning = None
        return P.ChatResponseMessage(content=content, reasoning=reasoning, tool_calls=calls or None)

    def delta(self, delta_text: str, finished: bool) -> P.DeltaMessage | None:
        """What `delta_text` (the next piece of the answer) adds; None when it adds nothing yet."""
        if self.reasoning_parser is None and self.tool_parser is None:
            return P.DeltaMessage(content=delta_text)  # no parsing: the text as it comes, as before
        self.text += delta_text
        full = self.prefix + self.text
        reasoning, content = "", full
        if self.reasoning_parser is not None:
            snap = self.reasoning_parser.snapshot(full, finished)
            reasoning, content = snap.reasoning, snap.content
        calls = []
        if content is not None and self.tool_parser is not None:
            tool_snap = self.tool_parser.snapshot(content, finished)
            content, calls = tool_snap.content, tool_snap.calls
            if not content.strip() and (calls or not finished):
                content = ""  # whitespace before a call is no content (as the answer has it): held until known
        added_reasoning = _added(reasoning, self.sent_reasoning)
        added_content = _added(content or "", self.sent_content)
        self.sent_reasoning += added_reasoning
        self.sent_content += added_content
        if not self.body.include_reasoning:
            added_reasoning = ""
        tool_calls = self._call_deltas(calls)
        if not (added_reasoning or added_content or tool_calls):
            return None
        return P.DeltaMessage(reasoning=added_reasoning or None, content=added_content or None,
                              tool_calls=tool_calls or None)

    def _call_deltas(self, calls) -> list[P.DeltaToolCall]:
        out = []
        for index, call in enumerate(calls):
            if index > 0 and self.body.parallel_tool_calls is False:
                break
            if index == len(self.sent_calls):
                if call.name is None:
                    break
                self.sent_calls.append(_SentCall(make_tool_call_id()))
                out.append(P.DeltaToolCall(index=index, id=self.sent_calls[index].id, type="function",
                                           function=P.DeltaFunctionCall(name=call.name)))
            sent = self.sent_calls[index]
            added = _added(call.arguments, sent.arguments)
            if added:
                sent.arguments = call.arguments
                out.append(P.DeltaToolCall(index=index, function=P.DeltaFunctionCall(arguments=added)))
        return out


def _added(now: str, sent: str) -> str:
    """What `now` adds to `sent` (snapshots only grow; anything else adds nothing)."""
    return now[len(sent):] if now.startswith(sent) else ""
