"""RolloutSession: three turns over a RolloutWorker and over a real `rollout launch` server keep the exact token history, the mask, prefix-cache hits, HF's logprobs and the weight-version spans."""

from __future__ import annotations

import re

import httpx
import pytest

from engine import SamplingParams
from rollout import RolloutWorker
from rollout.session import GenerateClient, RolloutSession, generate_turns

EOS_ID = 0  # <|endoftext|> of the tiny tokenizer (engine/tiny_models.py: the first special token)
BLOCK_SIZE = 16  # the engine's default block_size
MAX_MODEL_LEN = 256
FIRST = [{"role": "user", "content": "What is the capital of France? Answer in a sentence."}]
TOOL = [{"role": "tool", "content": "Paris (population 2.1 million)"}]
USER = [{"role": "user", "content": "And of Italy?"}]


@pytest.fixture(scope="module")
def model_path(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def worker(model_path):
    with RolloutWorker(model=model_path, device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN) as w:
        yield w


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def three_turns(session: RolloutSession, end_of_turn: int) -> list[list[int]]:
    """Turn 0 is cut by max_tokens, turn 1 ends on the end-of-turn token, turn 2 is cut again; returns what was appended between them."""
    # No end-of-turn or EOS token in turns 0 and 2 (biased away) ...
    base = SamplingParams(temperature=1.0, seed=7, max_tokens=9, logit_bias={end_of_turn: -100.0, EOS_ID: -100.0})
    session.generate(base)
    appended = [session.add_messages(TOOL)]
    # ... while in turn 1 min_tokens holds the end-of-turn token back for 4 tokens and the bias makes it the 5th.
    session.generate(base.clone(min_tokens=4, max_tokens=30, logit_bias={end_of_turn: 30.0}))
    appended.append(session.add_messages(USER))
    session.generate(base)
    return appended


def check_three_turns(session: RolloutSession, appended: list[list[int]], tokenizer, model_path: str) -> None:
    from hf_reference import hf_token_logprobs

    t = session.trajectory()
    im_end, eot_text = tokenizer.convert_tokens_to_ids("<|im_end|>"), "<|im_end|>\n"
    turns = t.turns
    assert [turn.finish_reason for turn in turns] == ["length", "stop", "length"]
    assert len(turns[1].token_ids) == 5 and turns[1].token_ids[-1] == im_end and turns[1].stop_reason == im_end

    # The environment's tokens, spelled independently of the session: the template's text for the new messages.
    def env(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    prompt = env(tokenizer.apply_chat_template(FIRST, tokenize=False, add_generation_prompt=True))
    tool_env = env(f"{eot_text}<|im_start|>tool\n{TOOL[0]['content']}<|im_end|>\n<|im_start|>assistant\n")
    # turn 1 ended on <|im_end|> itself: only the closing's newline follows it
    user_env = env(f"\n<|im_start|>user\n{USER[0]['content']}<|im_end|>\n<|im_start|>assistant\n")
    assert appended == [tool_env, user_env]
    expected = prompt + turns[0].token_ids + tool_env + turns[1].token_ids + user_env + turns[2].token_ids
    assert t.token_ids == expected
    assert t.prompt_len == len(prompt) == turns[0].start
    assert [turn.start for turn in turns[1:]] == [turns[0].end + len(tool_env), turns[1].end + len(user_env)]

    sampled = {i for turn in turns for i in range(turn.start, turn.end)}
    assert t.mask == [int(i in sampled) for i in range(len(t.token_ids))]
    assert all(t.logprobs[i] == 0.0 for i in range(len(t.token_ids)) if i not in sampled)
    assert t.weight_versions == [("default", turn.start, turn.end) for turn in turns]
    assert [m["role"] for m in t.messages] == ["user", "assistant", "tool", "assistant", "user", "assistant"]
    assert t.final_text == turns[2].text

    # One HF float32 forward over the whole sequence gives every sampled token's logprob.
    chosen, _ = hf_token_logprobs(model_path, t.token_ids)
    for i in sorted(sampled):
        assert t.logprobs[i] == pytest.approx(chosen[i - 1], abs=1e-4), i


def expected_cached(turns) -> list[int]:
    """Each later turn finds every full block of the history before it in the prefix cache: all but the last
    sampled token of the turn before went through the model."""
    return [BLOCK_SIZE * ((prev.end - 1) // BLOCK_SIZE) for prev in turns[:-1]]


def test_three_turns_on_a_worker_keep_the_exact_tokens(worker, tokenizer, model_path):
    session = worker.session(FIRST)
    appended = three_turns(session, tokenizer.convert_tokens_to_ids("<|im_end|>"))
    check_three_turns(session, appended, tokenizer, model_path)
    turns = session.turns
    assert [turn.num_prompt_tokens for turn in turns] == [turn.start for turn in turns]
    assert [turn.num_cached_tokens for turn in turns[1:]] == expected_cached(turns)
    assert turns[0].num_cached_tokens == 0  # a fresh prompt (the first test on this worker)


def _cached_prompt_tokens(url: str) -> float:
    """vllm:prompt_tokens_cached_total: the prompt tokens of finished requests that the prefix cache served."""
    text = httpx.get(url + "/metrics").text
    return sum(float(m.group(1)) for m in re.finditer(r"^vllm:prompt_tokens_cached_total\{[^}]*\} (\S+)$", text, re.M))


@pytest.mark.slow
def test_three_turns_over_http_match_the_worker(launch_server, worker, tokenizer, model_path):
    server = launch_server(model_path)
    with GenerateClient(server.url) as client:
        assert client.max_model_len == MAX_MODEL_LEN
        before = _cached_prompt_tokens(server.url)
        session = RolloutSession(client, FIRST)
        appended = three_turns(session, tokenizer.convert_tokens_to_ids("<|im_end|>"))
        hits = _cached_prompt_tokens(server.url) - before
    check_three_turns(session, appended, tokenizer, model_path)
    turns = session.turns
    assert all(turn.num_cached_tokens is None for turn in turns)  # the route does not say; the server's metric does
    assert hits == sum(expected_cached(turns))
    # The same seeds on the same float32 weights in this process sample the same tokens.
    local = worker.session(FIRST)
    three_turns(local, tokenizer.convert_tokens_to_ids("<|im_end|>"))
    assert local.trajectory().token_ids == session.trajectory().token_ids


def test_sessions_generate_together_and_refuse_out_of_order_calls(worker):
    sessions = [worker.session(FIRST, SamplingParams(temperature=1.0, seed=s, max_tokens=6)) for s in range(3)]
    turns = generate_turns(sessions)
    assert [turn.start for turn in turns] == [s.prompt_len for s in sessions]
    assert len({tuple(turn.token_ids) for turn in turns}) > 1  # own seeds
    with pytest.raises(ValueError, match="add_messages"):
        sessions[0].generate()
    with pytest.raises(ValueError, match="add_messages"):
        generate_turns(sessions)
    assert [s.trajectory().turns for s in sessions] == [[t] for t in turns]  # nothing appended by the refusals
    sessions[0].add_messages(TOOL)
    with pytest.raises(ValueError, match="generate"):
        sessions[0].add_messages(TOOL)
    with pytest.raises(ValueError, match="session"):  # one refused session: no session of the batch moves
        generate_turns(sessions)
    assert len(sessions[0].turns) == 1 and sessions[0].awaiting_model


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(messages=None), "messages"),
        (dict(messages=FIRST, prompt_token_ids=[1, 2]), "messages"),
        (dict(messages=None, prompt_token_ids=[]), "prompt_token_ids"),
        (dict(messages=None, prompt_token_ids=[1, -2]), "prompt_token_ids"),
        (dict(messages=None, prompt_token_ids=[1] * MAX_MODEL_LEN), "prompt_token_ids"),
        (dict(messages=FIRST, sampling_params=SamplingParams(n=2)), "sampling_params.n"),
        (dict(messages=[{"role": "user"}]), "messages"),
    ],
)
def test_bad_session_input_names_the_field(worker, kwargs, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        worker.session(**kwargs)


def test_a_message_past_max_model_len_is_refused_and_the_session_goes_on(worker, tokenizer, model_path):
    session = worker.session(FIRST, SamplingParams(temperature=1.0, seed=3, max_tokens=8))
    session.generate()
    before = session.trajectory()
    too_long = [{"role": "tool", "content": " ".join(["fox"] * MAX_MODEL_LEN)}]
    with pytest.raises(ValueError, match=r"messages: .*max_model_len=256"):
        session.add_messages(too_long)
    assert session.trajectory() == before and not session.awaiting_model
    appended = session.add_messages(TOOL)
    turn = session.generate()
    assert turn.start == before.turns[0].end + len(appended)
    t = session.trajectory()
    assert t.token_ids[: len(before.token_ids)] == before.token_ids and len(t.turns) == 2
    # A turn that fills the context stops at max_model_len ("length"); the next message is refused, clearly.
    session.add_messages(USER)
    last = session.generate(SamplingParams(temperature=1.0, seed=4, max_tokens=MAX_MODEL_LEN,
                                           logit_bias={tokenizer.convert_tokens_to_ids("<|im_end|>"): -100.0,
                                                       EOS_ID: -100.0}))
    assert last.finish_reason == "length" and session.num_tokens == MAX_MODEL_LEN
    with pytest.raises(ValueError, match="no room for a model turn"):
        session.add_messages(TOOL)
    assert session.num_tokens == MAX_MODEL_LEN and len(session.trajectory().turns) == 3
