"""Reasoning parsers chosen by --reasoning-parser (vLLM's names): a model's text -> (reasoning, content).

The reasoning goes into the answer's `message.reasoning` (streamed as `delta.reasoning`), the field
vLLM 0.33 sends (it reads an assistant message's `reasoning_content` as the older name of
`reasoning`). What follows the reasoning is content, which a tool-call parser then reads. As with the
tool parsers, `extract_reasoning` reads a finished answer and `snapshot` growing text, saying only
what later text cannot change.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from rollout.server.tool_parsers import ParserRegistry, partial_tag_overlap


@dataclass
class ReasoningSnapshot:
    reasoning: str
    content: str | None
    """None while the answer is still reasoning."""


class ReasoningParser(ABC):
    """One model family's reasoning markup, for one answer: the request's chat_template_kwargs and the
    rendered prompt say whether the answer starts inside its reasoning."""

    name: ClassVar[str]
    required_vocab: ClassVar[tuple[str, ...]] = ()

    def __init__(self, chat_template_kwargs: dict[str, Any] | None = None, prompt: str | None = None) -> None:
        self.chat_template_kwargs = chat_template_kwargs or {}
        self.prompt = prompt or ""

    @abstractmethod
    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished answer, each None when empty."""

    @abstractmethod
    def snapshot(self, text: str, final: bool) -> ReasoningSnapshot:
        """What `text` says so far; `final`: the answer ends here (nothing is held back)."""


class ReasoningParserManager(ParserRegistry):
    kind, parsers = "reasoning parser", {}

    @classmethod
    def get_reasoning_parser(cls, name: str) -> type[ReasoningParser]:
        return cls.get(name)


@ReasoningParserManager.register_module("qwen3")
class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: an answer starts inside its reasoning (unless chat_template_kwargs has enable_thinking false,
    or the prompt already closed a <think> block), which ends at </think> or at a <tool_call> (which stays,
    for the tool parser). A <think> inside the reasoning and a repeated </think> after it are dropped, as
    vLLM 0.33's qwen3 parser drops them."""

    think_start, think_end = "<think>", "</think>"
    implicit_end = "<tool_call>"
    turn_boundaries = ("<|im_start|>", "<|im_end|>")

    def __init__(self, chat_template_kwargs: dict[str, Any] | None = None, prompt: str | None = None) -> None:
        super().__init__(chat_template_kwargs, prompt)
        thinking = self.chat_template_kwargs.get("enable_thinking", True) is not False
        self.starts_in_reasoning = thinking and not self._prompt_closed_reasoning()

    def _prompt_closed_reasoning(self) -> bool:
        """Whether the prompt's last marker (of think start/end and turn boundaries) is </think>."""
        markers = (self.think_end, self.think_start, *self.turn_boundaries)
        last = max(markers, key=lambda m: self.prompt.rfind(m))
        return self.prompt.rfind(last) >= 0 and last == self.think_end

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        if not self.starts_in_reasoning:
            return None, text
        snap = self.snapshot(text, final=True)
        return snap.reasoning or None, snap.content or None

    def snapshot(self, text: str, final: bool) -> ReasoningSnapshot:
        if not self.starts_in_reasoning:
            return ReasoningSnapshot("", text)
        ends = [(i, m) for m in (self.think_end, self.implicit_end) if (i := text.find(m)) >= 0]
        if not ends:
            held = 0 if final else max(partial_tag_overlap(text, m)
                                       for m in (self.think_end, self.implicit_end, self.think_start))
            return ReasoningSnapshot(text[: len(text) - held].replace(self.think_start, ""), None)
        index, marker = min(ends)
        rest = text[index + len(marker):] if marker == self.think_end else text[index:]
        if not final:
            rest = rest[: len(rest) - partial_tag_overlap(rest, self.think_end)]
        return ReasoningSnapshot(text[:index].replace(self.think_start, ""), rest.replace(self.think_end, ""))
