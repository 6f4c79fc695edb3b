"""Tool-call parsers chosen by --tool-call-parser (vLLM's names): a model's text -> OpenAI tool calls.

Each parser reads one model family's tool-call format from the generated text, in two ways:
`extract_tool_calls` reads a finished answer as vLLM 0.33's parser of that name does, and `snapshot`
reads text that may still be growing, saying only what later text cannot change (content before any
call, each call's name once it is whole, its arguments as far as they are settled). A stream sends
the difference between successive snapshots (rollout/server/chat_tools.py), so that the streamed
answer adds up to the non-streamed one. `forced_prefix` is the text that starts a call in the
family's format, for tool_choice "required" and named choices (chat_tools.py says how it is used).
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

from rollout.server.partial_json import scan_object


@dataclass
class FunctionCall:
    name: str
    arguments: str
    """JSON text of the arguments, as json.dumps(arguments, ensure_ascii=False) writes them."""


@dataclass
class ExtractedToolCalls:
    """A finished answer read by a parser: the calls it made and the content around them (vLLM's
    ExtractedToolCallInformation)."""

    tools_called: bool
    tool_calls: list[FunctionCall] = field(default_factory=list)
    content: str | None = None


@dataclass
class PartialCall:
    name: str | None
    """None until the name is whole: a call is announced by its name."""
    arguments: str = ""
    """The settled prefix of its arguments' JSON text (partial_json.py)."""


@dataclass
class ToolSnapshot:
    """What growing text says for sure: `content` (never shrinks as text is added), the calls so far."""

    content: str
    calls: list[PartialCall] = field(default_factory=list)


def partial_tag_overlap(text: str, tag: str) -> int:
    """Length of the longest proper prefix of `tag` that `text` ends with ("...<tool_" -> 6)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _call_of(obj, argument_keys: tuple[str, ...]) -> FunctionCall | None:
    """A {"name": ..., "arguments": ...} object as a call; None when it is not one (vLLM's KeyError)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = next((k for k in argument_keys if k in obj), None)
    if key is None:
        return None
    return FunctionCall(name=obj["name"], arguments=json.dumps(obj[key], ensure_ascii=False))


def _partial_call(
    body: str, pos: int, final: bool, argument_keys: tuple[str, ...]
) -> tuple[PartialCall | None, int | None]:
    """(the call an object at body[pos] makes so far, or None until its name is whole; the object's end
    when it is complete)."""
    scanned = scan_object(body, pos, final)
    name = scanned.members.get("name")
    if name is None or name.state != "complete" or not isinstance(name.value, str):
        return None, scanned.end
    arguments = next((scanned.members[k] for k in argument_keys if k in scanned.members), None)
    return PartialCall(name.value, arguments.text if arguments is not None else ""), scanned.end


class ToolParser(ABC):
    """One model family's tool-call format. Stateless: every method reads the whole text so far."""

    name: ClassVar[str]
    required_vocab: ClassVar[tuple[str, ...]] = ()
    """Tokens the tokenizer must have for this format (checked when the server starts, as vLLM does)."""
    keeps_special_tokens: ClassVar[bool] = False
    """Detokenize with skip_special_tokens off when tools are offered: some tokenizers mark the call
    markup special, and skipping it would hide the calls (vLLM's hermes adjust_request)."""

    @abstractmethod
    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """The calls in a finished answer, and its content; no calls when any call is malformed."""

    @abstractmethod
    def snapshot(self, text: str, final: bool) -> ToolSnapshot:
        """What `text` says so far; `final`: the answer ends here (nothing is held back)."""

    @abstractmethod
    def forced_prefix(self, name: str | None) -> str:
        """The text that opens a call in this format, up to its arguments when `name` is given, up to
        where the name goes when not."""


class ParserRegistry:
    """Parsers by name, registered by a class decorator (vLLM's ToolParserManager and ReasoningParserManager)."""

    kind: ClassVar[str]
    parsers: ClassVar[dict[str, type]]

    @classmethod
    def register_module(cls, name: str):
        def register(parser_cls: type) -> type:
            parser_cls.name = name
            cls.parsers[name] = parser_cls
            return parser_cls

        return register

    @classmethod
    def list_registered(cls) -> list[str]:
        return sorted(cls.parsers)

    @classmethod
    def get(cls, name: str) -> type:
        if name not in cls.parsers:
            # vLLM's message (entrypoints/common/cli_args.py validate_api_server_args).
            raise ValueError(f"invalid {cls.kind}: {name} (chose from {{ {','.join(cls.list_registered())} }})")
        return cls.parsers[name]


class ToolParserManager(ParserRegistry):
    kind, parsers = "tool call parser", {}

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        return cls.get(name)


@ToolParserManager.register_module("hermes")
class Hermes2ProToolParser(ToolParser):
    """Hermes 2 Pro / Qwen2.5 / Qwen3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one per call;
    content is the text before the first call."""

    keeps_special_tokens = True
    start, end = "<tool_call>", "</tool_call>"
    _regions = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        if self.start not in text:
            return ExtractedToolCalls(False, content=text)
        calls = []
        for closed, open_ in self._regions.findall(text):
            try:
                call = _call_of(json.loads(closed or open_), ("arguments",))
            except ValueError:
                call = None
            if call is None:  # vLLM: any malformed call -> the whole answer is content
                return ExtractedToolCalls(False, content=text)
            calls.append(call)
        content = text[: text.find(self.start)]
        return ExtractedToolCalls(True, calls, content or None)

    def snapshot(self, text: str, final: bool) -> ToolSnapshot:
        first = text.find(self.start)
        if first < 0:
            held = 0 if final else partial_tag_overlap(text, self.start)
            return ToolSnapshot(text[: len(text) - held])
        if final and not self.extract_tool_calls(text).tools_called:
            return ToolSnapshot(text)  # no well-formed call: all of it is content, as the answer has it
        snap = ToolSnapshot(text[:first])
        pos = first
        while pos >= 0:
            body_start = pos + len(self.start)
            close = text.find(self.end, body_start)
            body = text[body_start:] if close < 0 else text[body_start:close]
            if close < 0 and not final:
                body = body[: len(body) - partial_tag_overlap(body, self.end)]
            call, _ = _partial_call(body, 0, final or close >= 0, ("arguments",))
            if call is None:
                break  # a later call is not announced before this one
            snap.calls.append(call)
            pos = -1 if close < 0 else text.find(self.start, close)
        return snap

    def forced_prefix(self, name: str | None) -> str:
        if name is None:
            return f'{self.start}\n{{"name":'
        return f'{self.start}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments":'


@ToolParserManager.register_module("llama3_json")
class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON tool calls: `{"name": ..., "parameters": {...}}` (or "arguments"), optionally after
    <|python_tag|>, several separated by "; ". A finished answer's JSON objects are calls wherever they
    are (and then the answer has no content), as vLLM reads them; a streamed answer is read as calls
    only when it starts with one, as vLLM streams them."""

    required_vocab = ("<|python_tag|>",)
    bot_token = "<|python_tag|>"
    _keys = ("arguments", "parameters")
    _decoder = json.JSONDecoder()

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        if self.bot_token not in text and "{" not in text:
            return ExtractedToolCalls(False, content=text)
        calls, end = [], -1
        for match in re.finditer(r"\{", text):
            if match.start() <= end:
                continue  # inside an object already read
            try:
                obj, length = self._decoder.raw_decode(text[match.start():])
            except ValueError:
                return ExtractedToolCalls(False, content=text)
            end = match.start() + length
            call = _call_of(obj, self._keys)
            if call is None:
                return ExtractedToolCalls(False, content=text)
            calls.append(call)
        if not calls:
            return ExtractedToolCalls(False, content=text)
        return ExtractedToolCalls(True, calls, None)

    def snapshot(self, text: str, final: bool) -> ToolSnapshot:
        if not final and self.bot_token.startswith(text):
            return ToolSnapshot("")  # nothing yet, or the start of <|python_tag|>
        if not (text.startswith(self.bot_token) or text.startswith("{")):
            return ToolSnapshot(text)
        if final and not self.extract_tool_calls(text).tools_called:
            return ToolSnapshot(text)  # it started like a call but is none: all of it is content
        snap = ToolSnapshot("")
        pos = len(self.bot_token) if text.startswith(self.bot_token) else 0
        while True:
            pos = text.find("{", pos)
            if pos < 0:
                return snap
            call, end = _partial_call(text, pos, final, self._keys)
            if call is None:
                return snap
            snap.calls.append(call)
            if end is None:
                return snap
            pos = end

    def forced_prefix(self, name: str | None) -> str:
        if name is None:
            return '{"name":'
        return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "parameters":'
