"""Tool calling through a real `rollout launch` process, driven by the official openai client: tools ->
tool_calls -> tool message -> answer, streamed and not, with the hermes and llama3_json parsers and qwen3
reasoning, on tiny checkpoints trained to write the scripted turns (tests/tool_checkpoints.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from server_launch import REPO_ROOT
from tool_checkpoints import LLAMA3_SCRIPT, QWEN_SCRIPT, TIME_TOOL, WEATHER_TOOL, make_tool_checkpoint, tool_result

pytestmark = pytest.mark.slow

MODEL = "tiny"
FLAGS = ("--served-model-name", MODEL, "--max-model-len", "1024")


@pytest.fixture(scope="module")
def qwen_path(tmp_path_factory):
    return make_tool_checkpoint(tmp_path_factory.mktemp("tool-qwen"), "qwen")


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return make_tool_checkpoint(tmp_path_factory.mktemp("tool-llama3"), "llama3")


@pytest.fixture(scope="module")
def qwen_server(launch_server, qwen_path):
    return launch_server(qwen_path, *FLAGS, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                         "--reasoning-parser", "qwen3")


@pytest.fixture(scope="module")
def qwen(qwen_server):
    return openai.OpenAI(base_url=qwen_server.base_url, api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llama(launch_server, llama_path):
    server = launch_server(llama_path, *FLAGS, "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json")
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def plain(launch_server, qwen_path):
    """No tool flags: tools reach the template, but no tool call is read."""
    return launch_server(qwen_path, *FLAGS)


def _create(client, turn, messages=None, **extra):
    body = turn.body(MODEL)
    if messages is not None:
        body["messages"] = messages
    extra_body = {"chat_template_kwargs": body.pop("chat_template_kwargs")} if "chat_template_kwargs" in body else {}
    extra_body.update(extra.pop("extra_body", {}))
    return client.chat.completions.create(temperature=0.0, extra_body=extra_body, **body, **extra)


def _stream(client, turn, messages=None, **extra):
    """A streamed answer put together: (message dict as a client sends it back, finish_reason, chunks)."""
    chunks = list(_create(client, turn, messages, stream=True, **extra))
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += (delta.model_extra or {}).get("reasoning") or ""
            for tc in delta.tool_calls or []:
                if tc.index not in calls:
                    # A call opens with its index, id, type and name, and no arguments yet (vLLM's shape).
                    assert tc.id.startswith("chatcmpl-tool-") and tc.type == "function" and tc.function.name
                    assert tc.function.arguments is None
                    calls[tc.index] = {"id": tc.id, "type": "function",
                                       "function": {"name": tc.function.name, "arguments": ""}}
                else:
                    assert tc.id is None and tc.function.name is None and tc.function.arguments
                    calls[tc.index]["function"]["arguments"] += tc.function.arguments
            finish = choice.finish_reason or finish
    message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    if reasoning:
        message["reasoning"] = reasoning
    return message, finish, chunks


def _answer(client, turn, stream: bool, messages=None, **extra):
    """(the message as a dict, finish_reason, the message as the client sends it back: the SDK's own
    message object when not streamed), streamed or not."""
    if stream:
        message, finish, _ = _stream(client, turn, messages, **extra)
        return message, finish, message
    (choice,) = _create(client, turn, messages, **extra).choices
    return choice.message.model_dump(exclude_unset=True), choice.finish_reason, choice.message


def _calls(message) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]


def _is_tool_call_id(call_id: str) -> bool:
    prefix, _, digits = call_id.rpartition("-")
    return prefix == "chatcmpl-tool" and len(digits) == 16 and all(c in "0123456789abcdef" for c in digits)


# ---------------------------------------------------------------------------- the flows


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("family", ["hermes", "llama3_json"])
def test_tools_then_call_then_tool_message_then_answer(qwen, llama, family, stream):
    client, script = (qwen, QWEN_SCRIPT) if family == "hermes" else (llama, LLAMA3_SCRIPT)
    first, finish, sent = _answer(client, script["call"], stream)
    assert finish == "tool_calls"
    assert _calls(first) == [("get_weather", '{"city": "Paris"}')]
    assert _is_tool_call_id(first["tool_calls"][0]["id"]) and first["tool_calls"][0]["type"] == "function"
    assert first["content"] is None and first.get("reasoning") is None
    # The answer goes back as the client has it, with the tool's result for its call id.
    call_id = first["tool_calls"][0]["id"]
    messages = [*script["call"].messages, sent, tool_result("sunny, 22 C", call_id)]
    second, finish, _ = _answer(client, script["answer"], stream, messages)
    assert (second["content"], finish, second.get("tool_calls")) == ("It is sunny and 22 C in Paris.", "stop", None)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_reasoning_goes_apart_and_comes_back(qwen, stream):
    """--reasoning-parser qwen3 with hermes: the <think> part is message.reasoning (vLLM 0.33's field), the
    call after it a tool call; the reasoning sent back reaches the template (reasoning_content)."""
    first, finish, sent = _answer(qwen, QWEN_SCRIPT["think_call"], stream)
    assert first["reasoning"] == "\nThe user wants Rome. I call the tool.\n"
    assert _calls(first) == [("get_weather", '{"city": "Rome"}')] and finish == "tool_calls"
    call_id = first["tool_calls"][0]["id"]
    messages = [*QWEN_SCRIPT["think_call"].messages, sent, tool_result("rain, 15 C", call_id)]
    second, finish, _ = _answer(qwen, QWEN_SCRIPT["think_answer"], stream, messages)
    assert second["reasoning"] == "\nThe tool says rain.\n"
    assert second["content"] == "\n\nIt is raining in Rome, 15 C." and finish == "stop"
    # include_reasoning false leaves it out.
    hidden, _, _ = _answer(qwen, QWEN_SCRIPT["think_answer"], stream, messages, extra_body={"include_reasoning": False})
    assert hidden.get("reasoning") is None and hidden["content"] == second["content"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_named_and_required_tool_choice_write_the_call_opening(qwen, llama, stream):
    named = QWEN_SCRIPT["named"]
    message, finish, _ = _answer(qwen, named, stream)
    # OpenAI's finish_reason for a named choice is "stop"; content "" (vLLM's forced-call answer).
    assert _calls(message) == [("get_weather", '{"city": "Oslo"}')] and finish == "stop"
    if not stream:
        assert message["content"] == ""
    # "required" with one tool forces that tool's name too: the same prompt, so the same call.
    required_one = named.__class__(named.messages, named.answer, tool_choice="required",
                                   chat_template_kwargs=named.chat_template_kwargs)
    message, finish, _ = _answer(qwen, required_one, stream)
    assert _calls(message) == [("get_weather", '{"city": "Oslo"}')] and finish == "tool_calls"
    # With two tools the model picks the name.
    message, finish, _ = _answer(qwen, QWEN_SCRIPT["required"], stream)
    assert _calls(message) == [("get_time", '{"city": "Tokyo"}')] and finish == "tool_calls"
    message, finish, _ = _answer(llama, LLAMA3_SCRIPT["named"], stream)
    assert _calls(message) == [("get_weather", '{"city": "Oslo"}')] and finish == "stop"


def test_the_forced_opening_is_prompt_and_the_sampled_rest_is_output(qwen, qwen_path):
    from tool_checkpoints import rendered_prompt

    tokenizer = AutoTokenizer.from_pretrained(qwen_path)
    turn = QWEN_SCRIPT["named"]
    out = _create(qwen, turn, extra_body={"return_token_ids": True})
    text, ids = rendered_prompt(tokenizer, "qwen", turn)
    assert text.endswith('<tool_call>\n{"name": "get_weather", "arguments":')
    assert out.model_extra["prompt_token_ids"] == ids
    (choice,) = out.choices
    assert tokenizer.decode(choice.model_extra["token_ids"]) == turn.answer + "<|im_end|>"
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == len(choice.model_extra["token_ids"])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_parallel_calls_and_parallel_tool_calls_false(llama, stream):
    message, finish, _ = _answer(llama, LLAMA3_SCRIPT["parallel"], stream)
    assert _calls(message) == [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Rome"}')]
    assert finish == "tool_calls" and len({c["id"] for c in message["tool_calls"]}) == 2
    message, _, _ = _answer(llama, LLAMA3_SCRIPT["parallel"], stream, parallel_tool_calls=False)
    assert _calls(message) == [("get_weather", '{"city": "Paris"}')]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_choice_none_reads_no_calls(qwen, stream):
    turn = QWEN_SCRIPT["call"]
    message, finish, _ = _answer(qwen, turn.__class__(turn.messages, turn.answer, tool_choice="none",
                                                   chat_template_kwargs=turn.chat_template_kwargs), stream)
    assert message["content"] == turn.answer and not message.get("tool_calls") and finish == "stop"


def test_stream_sends_the_name_first_then_argument_pieces(qwen):
    _, finish, chunks = _stream(qwen, QWEN_SCRIPT["call"])
    pieces = [tc for chunk in chunks for choice in chunk.choices for tc in choice.delta.tool_calls or []]
    assert pieces[0].function.name == "get_weather" and len(pieces) > 2  # the arguments came in several pieces
    assert "".join(p.function.arguments or "" for p in pieces[1:]) == '{"city": "Paris"}'
    assert finish == "tool_calls" and chunks[-1].choices[0].finish_reason == "tool_calls"


# ---------------------------------------------------------------------------- the prompt


@pytest.mark.parametrize("family", ["qwen", "llama3"])
def test_the_template_gets_tools_and_tool_calls_as_transformers_gives_them(qwen, llama, qwen_path, llama_path, family):
    """The server's prompt for a turn with tools, an assistant call and a tool result is the template
    rendered by transformers' apply_chat_template from the OpenAI messages (arguments as objects)."""
    client, path, turn = ((qwen, qwen_path, QWEN_SCRIPT["answer"]) if family == "qwen"
                          else (llama, llama_path, LLAMA3_SCRIPT["answer"]))
    tokenizer = AutoTokenizer.from_pretrained(path)
    hf_messages = json.loads(json.dumps(turn.messages))
    for m in hf_messages:
        m["content"] = m["content"] or ""
        for call in m.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    kwargs = turn.chat_template_kwargs or {}
    expected = tokenizer.apply_chat_template(hf_messages, tools=turn.tools, tokenize=False, add_generation_prompt=True,
                                             **kwargs)
    assert '"name": "get_weather"' in expected and "sunny, 22 C" in expected
    out = _create(client, turn, extra_body={"return_token_ids": True})
    assert out.model_extra["prompt_token_ids"] == tokenizer.encode(expected, add_special_tokens=False)


# ---------------------------------------------------------------------------- refusals


def _error(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text
    return response.json()["error"]


def test_bad_tool_requests_get_vllms_errors(qwen, qwen_server):
    http = httpx.Client(base_url=qwen_server.url, timeout=60)
    base = {"model": MODEL, "messages": QWEN_SCRIPT["call"].messages}
    cases = [
        ({"tools": []}, "`tools` must not be an empty array. Either provide at least one tool or omit the field "
                        "entirely. (parameter=tools)", "tools"),
        ({"tool_choice": "auto"}, "When using `tool_choice`, `tools` must be set. (parameter=tool_choice)",
         "tool_choice"),
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
         "The tool specified in `tool_choice` does not match any of the specified `tools` (parameter=tool_choice)",
         "tool_choice"),
    ]
    for extra, message, param in cases:
        error = _error(http.post("/v1/chat/completions", json={**base, **extra}))
        assert (error["message"], error["type"], error["param"]) == (message, "BadRequestError", param)
    # A tool that is not a function definition: the field that is wrong, as a failed type is named.
    error = _error(http.post("/v1/chat/completions",
                             json={**base, "tools": [{"type": "function", "function": {"description": "no name"}}]}))
    assert error["type"] == "Bad Request" and error["param"] == "body.tools.0.function.name"
    error = _error(http.post("/v1/chat/completions", json={
        **base, "tools": [{"type": "function", "function": {"name": "f", "parameters": "not a schema"}}]}))
    assert error["param"] == "body.tools.0.function.parameters"
    # The openai client reads them as BadRequestError.
    with pytest.raises(openai.BadRequestError, match="does not match any of the specified"):
        qwen.chat.completions.create(model=MODEL, messages=base["messages"], tools=[WEATHER_TOOL],
                                     tool_choice={"type": "function", "function": {"name": "get_time"}})


def test_without_the_flags_tool_choice_is_refused_as_vllm_refuses_it(plain):
    http = httpx.Client(base_url=plain.url, timeout=60)
    base = {"model": MODEL, "messages": QWEN_SCRIPT["call"].messages, "tools": [WEATHER_TOOL]}
    for choice, message in [
        (None, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'),
        ("required", 'tool_choice="required" requires --tool-call-parser to be set'),
        ({"type": "function", "function": {"name": "get_weather"}},
         'tool_choice=function "get_weather" requires --tool-call-parser to be set'),
    ]:
        body = base if choice is None else {**base, "tool_choice": choice}
        error = _error(http.post("/v1/chat/completions", json=body))
        assert (error["message"], error["type"], error["param"]) == (message, "BadRequestError", None)
    # tool_choice "none": the tools still reach the template, and the text stays content.
    out = http.post("/v1/chat/completions", json={**base, "tool_choice": "none", "temperature": 0,
                                                  "tools": [WEATHER_TOOL, TIME_TOOL],
                                                  "chat_template_kwargs": {"enable_thinking": False}})
    assert out.status_code == 200 and "tool_calls" not in out.json()["choices"][0]["message"]


@pytest.mark.parametrize("flags, message", [
    (["--enable-auto-tool-choice"], "Error: --enable-auto-tool-choice requires --tool-call-parser"),
    (["--enable-auto-tool-choice", "--tool-call-parser", "nope"],
     "invalid tool call parser: nope (chose from { hermes,llama3_json })"),
    (["--reasoning-parser", "nope"], "invalid reasoning parser: nope (chose from { qwen3 })"),
])
def test_bad_parser_flags_fail_at_launch(flags, message):
    done = subprocess.run([sys.executable, "-m", "rollout.cli", "launch", "--model", "tiny-llama", *flags],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr
