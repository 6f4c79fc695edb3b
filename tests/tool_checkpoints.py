"""Tiny checkpoints whose chat templates carry tool markup, trained to answer scripted tool-calling turns.

A random tiny model writes noise, so a tool-calling flow through the real server needs a model that
writes the calls. Each checkpoint here is a tiny model (engine/tiny_models.py) with a tokenizer that
has its family's markup tokens, a chat template of that family (Qwen-style <tool_call>/<think> for the
hermes parser and qwen3 reasoning, Llama-3-style JSON calls for llama3_json), and weights trained on
CPU (a few seconds) until greedy decoding writes each script's answer exactly, for the very prompt the
server renders: the prompt comes from the server's own request model and ChatParsing, and the test
checks that prompt against transformers' apply_chat_template and against the server's prompt_token_ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Local time in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

# Qwen2.5/Qwen3-style: tools listed in the system turn, calls as <tool_call> JSON, results as a user
# turn in <tool_response>, reasoning in <think>, enable_thinking=false closing an empty think block.
QWEN_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\nTools:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall one as <tool_call>\\n{\"name\": ..., \"arguments\": ...}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.reasoning_content %}"
    "{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- message.content or '' }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- if not loop.first or message.content %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' }}"
    "{{- (call.function.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

# Llama-3.1-style JSON tool calling: the tools in the first user turn, a call as {"name", "parameters"}
# (several joined by "; "), a result as an ipython turn.
LLAMA3_TEMPLATE = (
    "{%- set ns = namespace(first=true) %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' and tools and ns.first %}{%- set ns.first = false %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}"
    "{{- 'Answer with a JSON call {\"name\": ..., \"parameters\": ...} of:\\n' }}"
    "{%- for tool in tools %}{{- (tool | tojson) + '\\n' }}{%- endfor %}"
    "{{- '\\n' + message.content + '<|eot_id|>' }}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n<|python_tag|>' }}"
    "{%- for call in message.tool_calls %}{%- if not loop.first %}{{- '; ' }}{%- endif %}"
    "{{- '{\"name\": \"' + call.function.name + '\", \"parameters\": ' + (call.function.arguments | tojson) + '}' }}"
    "{%- endfor %}"
    "{{- '<|eot_id|>' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


@dataclass
class Family:
    arch: str
    template: str
    eos: str
    added_tokens: list[tuple[str, bool]]  # (content, special)
    tool_call_parser: str


FAMILIES = {
    "qwen": Family("qwen3", QWEN_TEMPLATE, "<|im_end|>",
                   [("<tool_call>", False), ("</tool_call>", False), ("<think>", False), ("</think>", False)],
                   "hermes"),
    "llama3": Family("llama", LLAMA3_TEMPLATE, "<|eot_id|>",
                     [("<|start_header_id|>", True), ("<|end_header_id|>", True), ("<|eot_id|>", True),
                      ("<|python_tag|>", True)],
                     "llama3_json"),
}


@dataclass
class Turn:
    """One request of a script and the answer the model is trained to write for it."""

    messages: list[dict[str, Any]]
    answer: str
    """The text the model writes (its end-of-turn token follows)."""
    tools: list[dict[str, Any]] = field(default_factory=lambda: [WEATHER_TOOL])
    tool_choice: Any = None
    """None: the request sends none (so "auto")."""
    chat_template_kwargs: dict[str, Any] | None = None

    def body(self, model: str | None = None) -> dict[str, Any]:
        """The request body's tool-calling fields (as the openai SDK's create() takes them)."""
        body: dict[str, Any] = {"messages": self.messages, "tools": self.tools}
        if model is not None:
            body["model"] = model
        if self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        if self.chat_template_kwargs is not None:
            body["chat_template_kwargs"] = self.chat_template_kwargs
        return body


def assistant_call(name: str, arguments: dict, reasoning: str | None = None, call_id: str = "chatcmpl-tool-0") -> dict:
    """An assistant message that made one call, as a client sends an answer back."""
    message = {"role": "assistant", "content": None,
               "tool_calls": [{"id": call_id, "type": "function",
                               "function": {"name": name, "arguments": json.dumps(arguments)}}]}
    if reasoning is not None:
        message["reasoning"] = reasoning
    return message


def tool_result(content: str, call_id: str = "chatcmpl-tool-0") -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


NO_THINKING = {"enable_thinking": False}
PARIS = [{"role": "user", "content": "What is the weather in Paris?"}]
ROME = [{"role": "user", "content": "Think first: the weather in Rome?"}]
OSLO = [{"role": "user", "content": "Weather in Oslo please."}]
TOKYO = [{"role": "user", "content": "What time is it in Tokyo?"}]
TWO_CITIES = [{"role": "user", "content": "Weather in Paris and in Rome?"}]
ROME_THOUGHT = "The user wants Rome. I call the tool."

# Qwen-style: the hermes parser, and qwen3 reasoning (the flows without reasoning turn thinking off).
QWEN_SCRIPT = {
    "call": Turn(PARIS, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                 chat_template_kwargs=NO_THINKING),
    "answer": Turn(PARIS + [assistant_call("get_weather", {"city": "Paris"}), tool_result("sunny, 22 C")],
                   "It is sunny and 22 C in Paris.", chat_template_kwargs=NO_THINKING),
    "think_call": Turn(ROME, f'<think>\n{ROME_THOUGHT}\n</think>\n\n<tool_call>\n'
                             '{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'),
    "think_answer": Turn(ROME + [assistant_call("get_weather", {"city": "Rome"}, reasoning=f"\n{ROME_THOUGHT}\n"),
                                 tool_result("rain, 15 C")],
                         "<think>\nThe tool says rain.\n</think>\n\nIt is raining in Rome, 15 C."),
    # Named (and "required" with one tool): the call's opening is in the prompt, the model writes the rest.
    "named": Turn(OSLO, ' {"city": "Oslo"}}\n</tool_call>', chat_template_kwargs=NO_THINKING,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}}),
    # "required" with two tools: the opening up to the name; the model picks the tool.
    "required": Turn(TOKYO, ' "get_time", "arguments": {"city": "Tokyo"}}\n</tool_call>',
                     tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required", chat_template_kwargs=NO_THINKING),
}

LLAMA3_SCRIPT = {
    "call": Turn(PARIS, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'),
    "answer": Turn(PARIS + [assistant_call("get_weather", {"city": "Paris"}), tool_result("sunny, 22 C")],
                   "It is sunny and 22 C in Paris."),
    "parallel": Turn(TWO_CITIES, '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                                 '{"name": "get_weather", "parameters": {"city": "Rome"}}'),
    "named": Turn(OSLO, ' {"city": "Oslo"}}', tool_choice={"type": "function", "function": {"name": "get_weather"}}),
}

SCRIPTS = {"qwen": QWEN_SCRIPT, "llama3": LLAMA3_SCRIPT}


def _add_tokens(path: Path, family: Family) -> None:
    """The family's markup tokens added to the checkpoint's tokenizer, its end-of-turn token as EOS."""
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    for content, special in family.added_tokens:
        token = AddedToken(content, special=special, normalized=False)
        (tokenizer.add_special_tokens if special else tokenizer.add_tokens)([token])
    tokenizer.save(str(path / "tokenizer.json"))
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    tokenizer_config.update(chat_template=family.template, eos_token=family.eos)
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (path / "special_tokens_map.json").write_text(json.dumps({"eos_token": family.eos, "pad_token": family.eos}))
    eos_id = tokenizer.token_to_id(family.eos)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((path / name).read_text())
        config["eos_token_id"] = eos_id
        (path / name).write_text(json.dumps(config, indent=2))


def rendered_prompt(tokenizer, family_name: str, turn: Turn) -> tuple[str, list[int]]:
    """(text, token ids) of the prompt the server renders for `turn`: its request model's conversation and
    its ChatParsing's tools and forced call opening, through the checkpoint's chat template."""
    from rollout.server import protocol as P
    from rollout.server.chat_tools import ChatParsing
    from rollout.server.config import ServerConfig

    family = FAMILIES[family_name]
    body = P.ChatCompletionRequest(**turn.body())
    chat = ChatParsing(ServerConfig(enable_auto_tool_choice=True, tool_call_parser=family.tool_call_parser),
                       tokenizer, "tiny")
    text = tokenizer.apply_chat_template(body.conversation(), tokenize=False, add_generation_prompt=True,
                                         **(chat.template_kwargs(body) or {}))
    text += chat.forced_prefix(body)
    return text, tokenizer.encode(text, add_special_tokens=False)


def _train(path: Path, family_name: str, max_steps: int = 1500) -> None:
    """Trains the checkpoint until greedy decoding writes every script answer (and its EOS) exactly."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    examples = []
    for turn in SCRIPTS[family_name].values():
        _, prompt_ids = rendered_prompt(tokenizer, family_name, turn)
        answer_ids = tokenizer.encode(turn.answer, add_special_tokens=False) + [tokenizer.eos_token_id]
        examples.append((prompt_ids, answer_ids))
    length = max(len(p) + len(a) for p, a in examples)
    ids = torch.zeros(len(examples), length, dtype=torch.long)
    labels = torch.full((len(examples), length), -100, dtype=torch.long)
    mask = torch.zeros(len(examples), length, dtype=torch.long)
    for row, (prompt_ids, answer_ids) in enumerate(examples):
        seq = prompt_ids + answer_ids
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
        labels[row, len(prompt_ids) - 1: len(seq) - 1] = torch.tensor(answer_ids)  # predicts the next token

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    targets = labels != -100
    for step in range(max_steps):
        logits = model(input_ids=ids, attention_mask=mask).logits  # [batch, length, vocab]
        loss = torch.nn.functional.cross_entropy(logits[targets], labels[targets])
        # Stop once every answer token wins by a clear margin: each is then greedy's choice after the
        # answer before it, so greedy decoding writes the answers exactly.
        top2 = logits[targets].detach().topk(2, dim=-1)
        right = top2.indices[:, 0] == labels[targets]
        margin = (top2.values[:, 0] - top2.values[:, 1]).min()
        if bool(right.all()) and float(margin) > 2.0:
            break
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    else:
        raise AssertionError(f"{family_name} checkpoint did not learn its scripts in {max_steps} steps")
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()
             if not (model.config.tie_word_embeddings and k == "lm_head.weight")}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})


def make_tool_checkpoint(path, family_name: str) -> str:
    """Writes the `family_name` ("qwen" or "llama3") tool-calling checkpoint into `path` and returns it."""
    from engine.tiny_models import make_tiny_checkpoint

    family = FAMILIES[family_name]
    path = Path(path)
    # Room in the embedding for the added tokens (the trained vocabulary fills 512).
    make_tiny_checkpoint(path, family.arch, vocab_size=576)
    _add_tokens(path, family)
    _train(path, family_name)
    return str(path)
