"""Reads a JSON value that may still be arriving: its longest settled prefix, written as json.dumps writes it.

A tool call's arguments stream out of the model a few characters at a time. What has been sent of them
must never change, and all of it put together must equal what the non-streamed answer carries,
`json.dumps(arguments, ensure_ascii=False)` (vLLM's form). So a value is rewritten token by token in
json.dumps' spelling (", " and ": " separators, numbers as Python prints them, strings re-escaped),
and a token enters the prefix only once nothing that follows can change how it is written: a number
or literal when a delimiter follows it, a string character by character (one escape sequence at a
time, a surrogate pair whole).

    raw:      {"city":"Par          ->  {"city": "Par
    raw:      {"city":"Paris","n":1  ->  {"city": "Paris", "n":        (1 may still become 12)
    raw:      {"city":"Paris","n":1} ->  {"city": "Paris", "n": 1}     complete
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_WHITESPACE = " \t\n\r"
_LITERALS = ("true", "false", "null")

State = Literal["complete", "incomplete", "invalid"]


@dataclass
class Scanned:
    """One JSON value read from text[start:]: `text` is its settled prefix in json.dumps' spelling
    (all of it when complete), `end` the index just past it (complete only), `value` the decoded value
    (complete only)."""

    state: State
    text: str
    end: int | None = None
    value: Any = None


@dataclass
class ScannedObject:
    """A JSON object's top-level members as far as they have arrived, each value scanned alone; the
    object's state is "incomplete" while it is open, "invalid" when the text stops being JSON."""

    state: State
    members: dict[str, Scanned] = field(default_factory=dict)
    end: int | None = None


class _Incomplete(Exception):
    pass


class _Invalid(Exception):
    pass


class _Scanner:
    def __init__(self, text: str, pos: int, final: bool) -> None:
        self.text, self.pos, self.final = text, pos, final
        self.out: list[str] = []

    def peek(self) -> str:
        while self.pos < len(self.text) and self.text[self.pos] in _WHITESPACE:
            self.pos += 1
        if self.pos >= len(self.text):
            raise _Incomplete
        return self.text[self.pos]

    def expect(self, char: str, written: str) -> None:
        if self.peek() != char:
            raise _Invalid
        self.pos += 1
        self.out.append(written)

    def value(self) -> None:
        c = self.peek()
        if c == "{":
            self.container("{", "}", self.member)
        elif c == "[":
            self.container("[", "]", self.value)
        elif c == '"':
            self.string()
        elif c in "-0123456789":
            self.number()
        elif c in "tfn":
            self.literal()
        else:
            raise _Invalid

    def container(self, open_: str, close: str, item) -> None:
        self.expect(open_, open_)
        if self.peek() == close:
            self.expect(close, close)
            return
        while True:
            item()
            c = self.peek()
            if c == ",":
                self.expect(",", ", ")
            elif c == close:
                self.expect(close, close)
                return
            else:
                raise _Invalid

    def member(self) -> None:
        if self.peek() != '"':
            raise _Invalid
        self.string()
        self.expect(":", ": ")
        self.value()

    def string(self) -> None:
        start, text = self.pos, self.text  # text[start] is the opening quote
        i, settled = start + 1, start + 1  # settled: end of the escapes known whole
        while i < len(text):
            c = text[i]
            if c == '"':
                try:
                    decoded = json.loads(text[start:i + 1])
                except ValueError:
                    raise _Invalid from None
                self.out.append(json.dumps(decoded, ensure_ascii=False))
                self.pos = i + 1
                return
            if c == "\\":
                width = 6 if text[i + 1:i + 2] == "u" else 2
                if i + width > len(text):
                    break  # an escape sequence cut short
                i += width
            else:
                i += 1
            settled = i
        try:
            decoded = json.loads(text[start:settled] + '"')
        except ValueError:
            raise _Invalid from None
        if decoded and "\ud800" <= decoded[-1] <= "\udbff":
            decoded = decoded[:-1]  # half a surrogate pair: the other half decides the character
        self.out.append(json.dumps(decoded, ensure_ascii=False)[:-1])
        raise _Incomplete

    def number(self) -> None:
        end = self.pos
        while end < len(self.text) and self.text[end] in _NUMBER_CHARS:
            end += 1
        if end == len(self.text) and not self.final:
            raise _Incomplete  # more digits may follow
        token = self.text[self.pos:end]
        if not _NUMBER.fullmatch(token):
            raise _Invalid
        self.out.append(json.dumps(json.loads(token)))
        self.pos = end

    def literal(self) -> None:
        rest = self.text[self.pos:self.pos + 5]
        for word in _LITERALS:
            if rest.startswith(word):
                self.out.append(word)
                self.pos += len(word)
                return
            if word.startswith(rest):
                raise _Incomplete
        raise _Invalid


def scan_value(text: str, pos: int = 0, final: bool = False) -> Scanned:
    """The JSON value starting at text[pos] (after whitespace); `final`: no more text will come."""
    scanner = _Scanner(text, pos, final)
    try:
        scanner.value()
    except _Incomplete:
        return Scanned("incomplete", "".join(scanner.out))
    except _Invalid:
        return Scanned("invalid", "".join(scanner.out))
    end = scanner.pos
    return Scanned("complete", "".join(scanner.out), end, json.loads(text[pos:end]))


def scan_object(text: str, pos: int = 0, final: bool = False) -> ScannedObject:
    """The JSON object starting at text[pos]: its members so far, the last one possibly incomplete."""
    scanner = _Scanner(text, pos, final)
    result = ScannedObject("incomplete")
    try:
        scanner.expect("{", "{")
        if scanner.peek() == "}":
            scanner.pos += 1
            return ScannedObject("complete", {}, scanner.pos)
        while True:
            key = scan_value(text, scanner.pos, final)
            if key.state == "incomplete":
                return result
            if key.state == "invalid" or not isinstance(key.value, str):
                result.state = "invalid"
                return result
            scanner.pos = key.end
            scanner.expect(":", ": ")
            scanner.peek()  # the value has started
            value = scan_value(text, scanner.pos, final)
            result.members[key.value] = value
            if value.state != "complete":
                result.state = value.state
                return result
            scanner.pos = value.end
            c = scanner.peek()
            if c == "}":
                result.state, result.end = "complete", scanner.pos + 1
                return result
            scanner.expect(",", ", ")
    except _Incomplete:
        return result
    except _Invalid:
        result.state = "invalid"
        return result
