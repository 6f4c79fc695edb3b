"""Tool-call and reasoning parsing against vLLM 0.33's own parsers (vllm.parser, vllm.tool_parsers):
the same model text read by vLLM's hermes / llama3_json / qwen3 parsers and message assembly, and by
ours, gives the same answer (reasoning, content, tool calls, finish_reason), whole and streamed token
by token; vLLM's request model refuses bad tool requests with the words and param ours answers with."""

from __future__ import annotations

import json

import pytest
from tokenizers import AddedToken
from transformers import PreTrainedTokenizerFast

from engine.tiny_models import train_tokenizer
from rollout.server import protocol as P
from rollout.server.chat_tools import ChatParsing, finish_reason
from rollout.server.config import ServerConfig

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
]
PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
HERMES = f"<tool_call>\n{PARIS}\n</tool_call>"
LLAMA = '{"name": "get_weather", "parameters": {"city": "Paris"}}'

# (tool parser, reasoning parser, request fields, model text, how vLLM's own stream differs from its answer)
CASES = [
    ("hermes", None, {}, "It is sunny.", None),
    ("hermes", None, {}, HERMES, None),
    ("hermes", None, {}, "Let me check. " + HERMES, None),
    ("hermes", None, {}, f'{HERMES}\n<tool_call>{{"name": "f", "arguments": {{"a": [1, 2.5], "b": true, "c": null}}}}'
                         "</tool_call>", None),
    ("hermes", None, {}, '<tool_call>{"name": "f", "arguments": {"x": "caf\\u00e9 \\"q\\""}}</tool_call>',
     "raw arguments"),  # vLLM streams the arguments as written, answers them re-encoded
    ("hermes", None, {}, '<tool_call>{"name":"f","arguments":{"a":1}}</tool_call>', "raw arguments"),
    ("hermes", None, {}, "<tool_call>\nnot json\n</tool_call>", "broken call"),
    ("hermes", None, {}, '<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>', "announced early"),
    ("hermes", None, {"parallel_tool_calls": False}, HERMES + HERMES.replace("Paris", "Rome"), None),
    ("hermes", None, {"tool_choice": "none"}, HERMES, None),
    ("hermes", None, {"tool_choice": "required"}, HERMES, None),
    ("hermes", None, {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, HERMES, None),
    ("hermes", "qwen3", {}, "<think>\nThe user wants Paris.\n</think>\n\n" + HERMES, "whitespace content"),
    ("hermes", "qwen3", {}, "I should call it." + HERMES, None),
    ("hermes", "qwen3", {}, "still thinking", None),
    ("hermes", "qwen3", {}, "<think>\nabc\n</think>\n\nHello there", None),
    ("hermes", "qwen3", {"include_reasoning": False}, "abc</think>Hello", None),
    ("hermes", "qwen3", {"chat_template_kwargs": {"enable_thinking": False}}, "Hello " + HERMES, None),
    (None, "qwen3", {}, "a<think>b</think>c<think>d", None),
    (None, "qwen3", {}, "x</think>  ", None),
    (None, "qwen3", {}, "abc</think>de</think>f", "repeated end"),
    ("llama3_json", None, {}, LLAMA, None),
    ("llama3_json", None, {}, "<|python_tag|>" + LLAMA, None),
    ("llama3_json", None, {}, LLAMA + '; {"name": "f", "arguments": {"n": [1, {"m": -2e3}]}}', None),
    ("llama3_json", None, {}, "The weather is fine.", None),
    ("llama3_json", None, {}, '{"city": "Paris"}', "not a call"),
    ("llama3_json", None, {}, "Sure: " + LLAMA, "starts with content"),
]


@pytest.fixture(scope="module")
def tokenizer():
    tok = train_tokenizer()
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t in ("<tool_call>", "</tool_call>", "<think>", "</think>")])
    tok.add_special_tokens([AddedToken("<|python_tag|>", special=True, normalized=False)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")


@pytest.fixture(scope="module")
def vllm(vllm_import):
    class V:
        protocol = vllm_import("vllm.entrypoints.openai.chat_completion.protocol")
        assembly = vllm_import("vllm.entrypoints.openai.chat_completion.message_assembly")
        stream = vllm_import("vllm.entrypoints.openai.chat_completion.stream_processor")
        manager = vllm_import("vllm.parser.parser_manager").ParserManager
        errors = vllm_import("vllm.entrypoints.serve.exception_handling.error_response")
        exceptions = vllm_import("vllm.exceptions")
        tool_calls_utils = vllm_import("vllm.entrypoints.serve.utils.tool_calls_utils")

    return V


def _fields(fields: dict) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, **fields}


def _tokens(tokenizer, text: str) -> list[tuple[str, int]]:
    """(text delta, token id) per token, as an engine streams them."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    out, previous = [], ""
    for i in range(len(ids)):
        now = tokenizer.decode(ids[: i + 1], skip_special_tokens=False)
        out.append((now[len(previous):], ids[i]))
        previous = now
    return out


def _accumulated(deltas) -> dict:
    answer = {"reasoning": "", "content": "", "calls": {}}
    for delta in deltas:
        answer["reasoning"] += delta.get("reasoning") or ""
        answer["content"] += delta.get("content") or ""
        for tc in delta.get("tool_calls") or []:
            call = answer["calls"].setdefault(tc["index"], ["", ""])
            function = tc.get("function") or {}
            call[0] += function.get("name") or ""
            call[1] += function.get("arguments") or ""
    return {"reasoning": answer["reasoning"] or None, "content": answer["content"] or None,
            "calls": [tuple(answer["calls"][i]) for i in sorted(answer["calls"])]}


def _theirs(vllm, tokenizer, tool, reasoning, fields, text):
    request = vllm.protocol.ChatCompletionRequest(model="m", **_fields(fields))
    cls = vllm.manager.get_parser(tool_parser_name=tool, reasoning_parser_name=reasoning, enable_auto_tools=True,
                                  tokenizer=tokenizer)
    kwargs = {"chat_template_kwargs": request.chat_template_kwargs or {}}
    r, c, calls = cls(tokenizer, request.tools, **kwargs).parse(text, request, enable_auto_tools=True)
    msg = vllm.assembly.assemble_chat_message_fields(request, r, c, calls, enable_auto_tools=True, parser_cls=cls)
    whole = {"reasoning": msg.reasoning, "content": msg.content,
             "calls": [(t.function.name, t.function.arguments) for t in msg.tool_calls]}
    whole_finish = vllm.tool_calls_utils.resolve_finish_reason("stop", request, bool(msg.tool_calls))
    processor = vllm.stream.ChatStreamProcessor(request, cls(tokenizer, request.tools, **kwargs),
                                                enable_auto_tools=True, parser_cls=cls)
    prompt_ids = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    tokens = _tokens(tokenizer, text)
    deltas, stream_finish = [], None
    for i, (delta_text, token_id) in enumerate(tokens):
        delta, stream_finish = processor.step(delta_text, [token_id], "stop" if i == len(tokens) - 1 else None,
                                              prompt_ids)
        if delta is not None:
            deltas.append(delta.model_dump(exclude_none=True))
    return (whole, whole_finish), (_accumulated(deltas), stream_finish)


def _ours(tokenizer, tool, reasoning, fields, text):
    body = P.ChatCompletionRequest(**_fields(fields))
    chat = ChatParsing(ServerConfig(enable_auto_tool_choice=tool is not None, tool_call_parser=tool,
                                    reasoning_parser=reasoning), tokenizer, "m")
    prompt = "<|im_start|>assistant\n"
    msg = chat.choice(body, prompt, "").message(text)
    whole = {"reasoning": msg.reasoning, "content": msg.content,
             "calls": [(t.function.name, t.function.arguments) for t in msg.tool_calls or []]}
    parser = chat.choice(body, prompt, "")
    tokens = _tokens(tokenizer, text)
    deltas = [d.model_dump(exclude_none=True) for i, (delta_text, _) in enumerate(tokens)
              if (d := parser.delta(delta_text, i == len(tokens) - 1)) is not None]
    return ((whole, finish_reason("stop", body, bool(msg.tool_calls))),
            (_accumulated(deltas), finish_reason("stop", body, parser.tools_streamed)))


@pytest.mark.parametrize("tool, reasoning, fields, text, vllm_stream_differs", CASES,
                         ids=[f"{i}-{c[0]}-{c[1]}" for i, c in enumerate(CASES)])
def test_our_answers_are_vllms(vllm, tokenizer, tool, reasoning, fields, text, vllm_stream_differs):
    (their_whole, their_stream) = _theirs(vllm, tokenizer, tool, reasoning, fields, text)
    (our_whole, our_stream) = _ours(tokenizer, tool, reasoning, fields, text)
    assert our_whole == their_whole
    # A stream cannot send content "" (a forced call's answer has it): compared as no content.
    (their_message, their_finish), (our_message, our_finish) = their_whole, our_whole
    their_whole = ({**their_message, "content": their_message["content"] or None}, their_finish)
    our_whole = ({**our_message, "content": our_message["content"] or None}, our_finish)
    if vllm_stream_differs is None:
        assert our_stream == their_stream == their_whole
    else:
        # vLLM's stream and answer disagree here (the reason says how); the entry must stay true.
        assert their_stream != their_whole, f"vLLM's stream now agrees with its answer: {vllm_stream_differs}"
        if vllm_stream_differs != "announced early" and vllm_stream_differs != "starts with content":
            assert our_stream == our_whole  # ours adds up to the answer (the two left are vLLM's rules too)


def test_template_tools_are_vllms(vllm, tokenizer):
    fields = {**_fields({}), "tools": [*TOOLS, {"type": "function", "function": {"name": "g", "strict": True}}]}
    theirs = [tool.model_dump() for tool in vllm.protocol.ChatCompletionRequest(model="m", **fields).tools]
    chat = ChatParsing(ServerConfig(), tokenizer, "m")
    assert chat.template_kwargs(P.ChatCompletionRequest(**fields))["tools"] == theirs


BAD = [
    {"tools": []},
    {"tools": None, "tool_choice": "auto"},
    {"tools": None, "tool_choice": "required"},
    {"tool_choice": "sometimes"},
    {"tool_choice": {"type": "function"}},
    {"tool_choice": {"type": "function", "function": {}}},
    {"tool_choice": {"type": "function", "function": {"name": ""}}},
    {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
]


@pytest.mark.parametrize("fields", BAD, ids=[json.dumps(f) for f in BAD])
def test_bad_tool_requests_are_refused_as_vllm_refuses_them(vllm, fields):
    body = {**_fields({}), **fields}
    with pytest.raises(vllm.exceptions.VLLMValidationError) as theirs:
        vllm.protocol.ChatCompletionRequest(model="m", **body)
    their_error = vllm.errors.create_error_response(theirs.value).error
    with pytest.raises(P.ParamValidationError) as ours:
        P.ChatCompletionRequest.model_validate(body)
    assert (str(ours.value), ours.value.parameter) == (their_error.message, their_error.param)
    assert their_error.type == "BadRequestError" and their_error.code == 400


def test_tool_call_ids_look_like_vllms(vllm):
    from rollout.server.chat_tools import make_tool_call_id

    theirs = vllm.protocol.ToolCall(function={"name": "f", "arguments": "{}"}).id  # vLLM's default id
    ours = make_tool_call_id()
    assert theirs.startswith("chatcmpl-tool-") and ours.startswith("chatcmpl-tool-")
    assert len(ours) == len(theirs) and ours != make_tool_call_id()
