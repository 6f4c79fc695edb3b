"""Tool-call and reasoning parsing on scripted text (no model): each answer whole, and streamed in every
split of its text, adds up to the same message; the request rules and launch checks of tool calling."""

from __future__ import annotations

import json
import random

import pytest

from rollout.server import protocol as P
from rollout.server.chat_tools import ChatParsing, finish_reason
from rollout.server.config import ServerConfig
from rollout.server.partial_json import scan_object, scan_value

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
HERMES = f"<tool_call>\n{CALL}\n</tool_call>"
PARIS = ("get_weather", '{"city": "Paris"}')


class _Tokenizer:
    def __init__(self, vocab=("<|python_tag|>",)):
        self.vocab = {t: i for i, t in enumerate(vocab)}

    def get_vocab(self):
        return self.vocab


def _chat(tool="hermes", reasoning=None, **config) -> ChatParsing:
    return ChatParsing(ServerConfig(enable_auto_tool_choice=tool is not None, tool_call_parser=tool,
                                    reasoning_parser=reasoning, **config), _Tokenizer(), "m")


def _body(**fields) -> P.ChatCompletionRequest:
    return P.ChatCompletionRequest(**{"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], **fields})


def _summary(message_or_deltas) -> dict:
    """reasoning, content (None when empty) and (name, arguments) of the calls, of a message or deltas."""
    if isinstance(message_or_deltas, P.ChatResponseMessage):
        m = message_or_deltas
        return {"reasoning": m.reasoning, "content": m.content or None,
                "calls": [(c.function.name, c.function.arguments) for c in m.tool_calls or []]}
    reasoning, content, calls = "", "", {}
    for delta in message_or_deltas:
        reasoning += delta.reasoning or ""
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            call = calls.setdefault(tc.index, ["", ""])
            call[0] += (tc.function.name if tc.function else None) or ""
            call[1] += (tc.function.arguments if tc.function else None) or ""
    return {"reasoning": reasoning or None, "content": content or None,
            "calls": [tuple(calls[i]) for i in sorted(calls)]}


def _streamed(chat, body, pieces, prompt="", prefix="") -> list[P.DeltaMessage]:
    parser = chat.choice(body, prompt, prefix)
    deltas = [parser.delta(piece, i == len(pieces) - 1) for i, piece in enumerate(pieces)]
    return [d for d in deltas if d is not None]


def _splits(text: str):
    """Every split of `text` in two, one character at a time, and a few random splits in many pieces."""
    yield [text]
    for k in range(1, len(text)):
        yield [text[:k], text[k:]]
    yield list(text)
    rng = random.Random(0)
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, len(text)), min(6, len(text) - 1)))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


# (tool parser, reasoning parser, request fields, text, expected summary)
CASES = [
    ("hermes", None, {}, "It is sunny.", {"reasoning": None, "content": "It is sunny.", "calls": []}),
    ("hermes", None, {}, HERMES, {"reasoning": None, "content": None, "calls": [PARIS]}),
    ("hermes", None, {}, "Checking. " + HERMES, {"reasoning": None, "content": "Checking. ", "calls": [PARIS]}),
    ("hermes", None, {}, "\n\n" + HERMES, {"reasoning": None, "content": None, "calls": [PARIS]}),
    ("hermes", None, {},
     HERMES + '\n<tool_call>{"name":"f","arguments":{"a":[1,2.50],"b":"caf\\u00e9\\n"}}</tool_call>',
     {"reasoning": None, "content": None, "calls": [PARIS, ("f", '{"a": [1, 2.5], "b": "café\\n"}')]}),
    ("hermes", None, {}, '<tool_call>{"name": "f", "arguments": {"e": "\\ud83d\\ude00", "n": -1.5e3}}</tool_call>',
     {"reasoning": None, "content": None, "calls": [("f", '{"e": "😀", "n": -1500.0}')]}),
    ("hermes", None, {}, "<tool_call>\nnot json\n</tool_call>",
     {"reasoning": None, "content": "<tool_call>\nnot json\n</tool_call>", "calls": []}),
    ("hermes", None, {}, "a <tool_", {"reasoning": None, "content": "a <tool_", "calls": []}),
    ("hermes", None, {"tool_choice": "none"}, HERMES, {"reasoning": None, "content": HERMES, "calls": []}),
    ("hermes", None, {"parallel_tool_calls": False}, HERMES + HERMES.replace("Paris", "Rome"),
     {"reasoning": None, "content": None, "calls": [PARIS]}),
    ("hermes", "qwen3", {}, "<think>\nPlan.\n</think>\n\n" + HERMES,
     {"reasoning": "\nPlan.\n", "content": None, "calls": [PARIS]}),
    ("hermes", "qwen3", {}, "Plan." + HERMES, {"reasoning": "Plan.", "content": None, "calls": [PARIS]}),
    ("hermes", "qwen3", {}, "Still thinking", {"reasoning": "Still thinking", "content": None, "calls": []}),
    ("hermes", "qwen3", {}, "a<think>b</think>c</think>d", {"reasoning": "ab", "content": "cd", "calls": []}),
    ("hermes", "qwen3", {"include_reasoning": False}, "abc</think>Hi",
     {"reasoning": None, "content": "Hi", "calls": []}),
    ("hermes", "qwen3", {"chat_template_kwargs": {"enable_thinking": False}}, "Hi</think>",
     {"reasoning": None, "content": "Hi</think>", "calls": []}),
    (None, "qwen3", {}, "abc</think>" + HERMES, {"reasoning": "abc", "content": HERMES, "calls": []}),
    ("llama3_json", None, {}, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
     {"reasoning": None, "content": None, "calls": [PARIS]}),
    ("llama3_json", None, {}, CALL + '; {"name": "f", "parameters": {}}',
     {"reasoning": None, "content": None, "calls": [PARIS, ("f", "{}")]}),
    ("llama3_json", None, {}, "Plain words.", {"reasoning": None, "content": "Plain words.", "calls": []}),
    ("llama3_json", None, {}, '{"city": "Paris"}', {"reasoning": None, "content": '{"city": "Paris"}', "calls": []}),
]


@pytest.mark.parametrize("tool, reasoning, fields, text, expected", CASES, ids=[str(i) for i in range(len(CASES))])
def test_whole_and_every_split_of_a_stream_give_the_same_answer(tool, reasoning, fields, text, expected):
    chat, body = _chat(tool, reasoning), _body(**fields)
    assert _summary(chat.choice(body, "", "").message(text)) == expected
    for pieces in _splits(text):
        assert _summary(_streamed(chat, body, pieces)) == expected, pieces


def test_a_streamed_call_opens_with_its_name_then_sends_argument_pieces():
    deltas = _streamed(_chat(), _body(), list("Checking. " + HERMES + HERMES.replace("Paris", "Rome")))
    pieces = [tc for d in deltas for tc in d.tool_calls or []]
    opened = [tc for tc in pieces if tc.id is not None]
    assert [(tc.index, tc.type, tc.function.name, tc.function.arguments) for tc in opened] == [
        (0, "function", "get_weather", None), (1, "function", "get_weather", None)]
    assert all(tc.id.startswith("chatcmpl-tool-") and len(tc.id) == len("chatcmpl-tool-") + 16 for tc in opened)
    rest = [tc for tc in pieces if tc.id is None]
    assert all(tc.type is None and tc.function.name is None and tc.function.arguments for tc in rest)
    # Each piece says only what is settled: the pieces of call 0 all come before call 1 opens.
    assert [tc.index for tc in pieces] == sorted(tc.index for tc in pieces)
    # As vLLM serializes a delta: unset fields left out.
    assert json.loads(opened[0].model_dump_json()) == {"index": 0, "id": opened[0].id, "type": "function",
                                                       "function": {"name": "get_weather"}}
    assert "tool_calls" not in json.loads(P.DeltaMessage(content="x").model_dump_json())


def test_finish_reasons():
    named = _body(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert finish_reason("stop", _body(), True) == "tool_calls"
    assert finish_reason("stop", named, True) == "stop"  # OpenAI's for a named choice
    assert finish_reason("length", _body(), True) == "length"  # a cut call stays visible as cut
    assert finish_reason("repetition", _body(), False) == "stop"
    assert finish_reason("stop", _body(), False) == "stop"


def test_forced_calls_start_with_the_opening_in_the_prompt():
    chat = _chat()
    named = _body(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    prefix = chat.forced_prefix(named)
    assert prefix == '<tool_call>\n{"name": "get_weather", "arguments":'
    rest = ' {"city": "Paris"}}\n</tool_call>'
    message = chat.choice(named, "", prefix).message(rest)
    assert message.content == "" and _summary(message)["calls"] == [PARIS]  # vLLM's content for a forced call
    for pieces in _splits(rest):
        assert _summary(_streamed(chat, named, pieces, prefix=prefix))["calls"] == [PARIS]
    assert chat.forced_prefix(_body(tool_choice="required")) == prefix  # one tool: its name too
    assert chat.forced_prefix(_body(tool_choice="required", tools=[WEATHER, TIME])) == '<tool_call>\n{"name":'
    assert chat.forced_prefix(_body()) == "" and chat.forced_prefix(_body(tool_choice="none")) == ""
    llama = _chat("llama3_json")
    assert llama.forced_prefix(named) == '{"name": "get_weather", "parameters":'
    # A forced answer has no reasoning: it starts inside the call.
    assert _chat("hermes", "qwen3").choice(named, "", prefix).reasoning_parser is None


def test_qwen3_reasoning_follows_the_prompt_and_enable_thinking():
    chat, body = _chat("hermes", "qwen3"), _body()
    open_prompt, closed_prompt = "<|im_start|>assistant\n", "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert chat.choice(body, open_prompt, "").message("abc</think>Hi").reasoning == "abc"
    assert chat.choice(body, closed_prompt, "").message("Hi").model_dump(exclude_none=True)["content"] == "Hi"
    assert chat.choice(body, closed_prompt + "<|im_end|>\n<|im_start|>assistant\n", "").message("x").reasoning == "x"


def test_partial_json_prefixes_only_grow_and_end_as_json_dumps():
    texts = ['{"city":"Paris","n":12,"f":[1.50,true,false,null],"o":{}}',
             '{ "s" : "tab\\there \\"quoted\\" caf\\u00e9 \\ud83d\\ude00" , "e" : -0.5E+2 }',
             '[1, [2, [3, {"k": "v"}]]]', '"just a string"', "123"]
    for raw in texts:
        final = json.dumps(json.loads(raw), ensure_ascii=False)
        previous = ""
        for k in range(len(raw) + 1):
            scanned = scan_value(raw[:k], final=k == len(raw))
            assert final.startswith(scanned.text) and scanned.text.startswith(previous), (raw[:k], scanned)
            previous = scanned.text
        assert (scanned.state, scanned.text, scanned.value) == ("complete", final, json.loads(raw))
    assert scan_value('{"a": 1,]').state == "invalid"
    obj = scan_object('{"name": "f", "arguments": {"x": 1')
    assert obj.state == "incomplete" and obj.members["name"].value == "f" and obj.members["arguments"].text == '{"x": '


# ---------------------------------------------------------------------------- requests and launch


def test_messages_go_to_the_template_as_transformers_takes_them():
    body = P.ChatCompletionRequest(messages=[
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "reasoning_content": "think",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
                        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ])
    user, assistant, tool = body.conversation()
    assert user == {"role": "user", "content": "a\nb"}  # text parts joined by newlines, as vLLM joins them
    assert assistant == {"role": "assistant", "content": "", "reasoning": "think", "reasoning_content": "think",
                         "tool_calls": [
                             {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
                             {"id": "c2", "type": "function", "function": {"name": "g", "arguments": {}}}]}
    assert tool == {"role": "tool", "content": "42", "tool_call_id": "c1"}
    for bad in ({"role": "user", "content": "x", "tool_calls": []},
                {"role": "user", "content": "x", "tool_call_id": "c"}):
        with pytest.raises(ValueError, match="tool_call"):
            P.ChatCompletionRequest(messages=[bad])


def test_template_kwargs_carry_the_tools():
    chat = _chat()
    assert chat.template_kwargs(_body(chat_template_kwargs={"enable_thinking": False})) == {
        "enable_thinking": False, "tools": [{"type": "function", "function": {
            "name": "get_weather", "description": None, "parameters": {"type": "object"}}}]}
    assert chat.template_kwargs(P.ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])) is None
    assert "tools" in chat.template_kwargs(_body(tool_choice="none"))
    assert chat.template_kwargs(_body(tool_choice="none"))["tools"]
    excluding = _chat(exclude_tools_when_tool_choice_none=True)
    assert excluding.template_kwargs(_body(tool_choice="none")) is None


def test_tool_choice_defaults_and_refusals():
    assert _body().tool_choice == "auto"
    assert P.ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]).tool_choice == "none"
    with pytest.raises(P.ParamValidationError) as e:
        P.ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tool_choice="auto")
    assert e.value.parameter == "tool_choice" and str(e.value).endswith("(parameter=tool_choice)")
    without = _chat(None)
    with pytest.raises(P.ParamValidationError, match='"auto" tool choice requires --enable-auto-tool-choice'):
        without.check_request(_body())
    with pytest.raises(P.ParamValidationError, match='tool_choice="required" requires --tool-call-parser'):
        without.check_request(_body(tool_choice="required"))
    without.check_request(_body(tool_choice="none"))
    _chat().check_request(_body())


def test_parser_flags_are_checked_at_start():
    with pytest.raises(ValueError, match="^Error: --enable-auto-tool-choice requires --tool-call-parser$"):
        ServerConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match=r"invalid tool call parser: x \(chose from \{ hermes,llama3_json \}\)"):
        ServerConfig(tool_call_parser="x")
    with pytest.raises(ValueError, match=r"invalid reasoning parser: x \(chose from \{ qwen3 \}\)"):
        ServerConfig(reasoning_parser="x")
    with pytest.raises(ValueError, match="--tool-call-parser llama3_json cannot be used with the tokenizer of 'm'"):
        ChatParsing(ServerConfig(enable_auto_tool_choice=True, tool_call_parser="llama3_json"), _Tokenizer(()), "m")
    # Without --enable-auto-tool-choice the parser is not used (as in vLLM).
    assert ChatParsing(ServerConfig(tool_call_parser="hermes"), _Tokenizer(), "m").tool_parser is None
