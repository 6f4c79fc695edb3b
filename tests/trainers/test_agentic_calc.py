"""The agentic_calc example: the calculator environment, the final-answer reward, session batches that train on the model's tokens only, the committed model's headroom, and a short GRPO run end to end."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from examples.agentic_calc import task
from examples.agentic_calc.pretrain import PretrainConfig, encode, train, transcript
from rollout.session import Trajectory, Turn
from trainers.rollouts import collate_sessions


def test_problems_are_deterministic_disjoint_and_right():
    first = task.make_problems(50, seed=3)
    assert first == task.make_problems(50, seed=3, split="train") != task.make_problems(50, seed=4)
    for problem in first:
        a, b = map(int, problem.question.split("*"))
        assert 100 <= a <= 999 and 10 <= b <= 99 and problem.answer == str(a * b)
    train_pairs, eval_pairs = set(task.split_pairs("train")), set(task.split_pairs("eval"))
    assert not train_pairs & eval_pairs and len(eval_pairs) == task.NUM_EVAL_PAIRS
    for kwargs, field in [(dict(n=5, seed=0, split="test"), "split"), (dict(n=-1, seed=0), "n"),
                          (dict(n=task.NUM_EVAL_PAIRS + 1, seed=0, split="eval"), "n")]:
        with pytest.raises(ValueError, match=field):
            task.make_problems(**kwargs)


@pytest.mark.parametrize(
    "turn, reply",
    [
        ("calc:417*38", "15846"),
        (" calc:417*38 ", "15846"),
        ("calc:12+30", "42"),
        ("calc:417*", "error"),  # malformed: the calculator says so, the episode goes on
        ("calc:417*38*2", "error"),
        ("calc:1234567*2", "error"),  # operands of at most 6 digits
        ("15846", None),  # not a tool call: the final answer
        ("the answer is calc:1*1", None),
    ],
)
def test_the_environment_answers_tool_calls_only(turn, reply):
    problem = task.Problem("417*38", "15846")
    answer = task.environment.reply(problem, turn)
    assert answer == (None if reply is None else [{"role": "tool", "content": reply}])
    assert task.environment.messages(problem) == [{"role": "user", "content": "417*38"}]


def test_the_reward_grades_the_final_turn_exactly():
    problem = task.Problem("417*38", "15846")
    assert task.batched_reward(["15846", " 15846\n", "15847", "calc:417*38", "015846", ""], [problem] * 6) == \
        [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="final_turns"):
        task.batched_reward(["1"], [problem, problem])
    with pytest.raises(ValueError, match="final_turn"):
        task.reward(None, problem)


def test_pretraining_transcripts_tokenize_as_the_chat_template_renders_them():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(task.MODEL_DIR)
    for kind in ("direct", "tool", "retry"):
        messages = transcript(417, 38, kind)
        ids, trained = encode(tokenizer.backend_tokenizer, messages)
        # The session's view: the template's text, ending at the last turn's end-of-turn token.
        text = tokenizer.apply_chat_template(messages, tokenize=False).removesuffix("\n")
        assert ids == tokenizer.encode(text, add_special_tokens=False)
        assistant = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
        assert tokenizer.decode([t for t, m in zip(ids, trained) if m]) == "".join(assistant)
    assert [m["content"] for m in transcript(417, 38, "retry") if m["role"] == "tool"] == ["error", "15846"]
    for kwargs, field in [(dict(steps=0), "steps"), (dict(tool_rate=1.5), "tool_rate"), (dict(lr=0.0), "lr")]:
        with pytest.raises(ValueError, match=field):
            PretrainConfig(**kwargs)


def _trajectory(prompt, pieces, version="v1"):
    """A Trajectory of `prompt` then (token_ids, sampled) pieces."""
    token_ids, mask, logprobs, turns, spans = list(prompt), [0] * len(prompt), [0.0] * len(prompt), [], []
    for ids, sampled in pieces:
        if sampled:
            start = len(token_ids)
            turns.append(Turn(start=start, token_ids=ids, text="t", finish_reason="stop", stop_reason=None,
                              num_prompt_tokens=start, num_cached_tokens=None))
            spans.append((version, start, start + len(ids)))
        token_ids += ids
        mask += [int(sampled)] * len(ids)
        logprobs += [-0.5 if sampled else 0.0] * len(ids)
    return Trajectory(token_ids=token_ids, mask=mask, logprobs=logprobs, weight_versions=spans,
                      prompt_len=len(prompt), turns=turns, messages=[])


def test_session_batches_train_on_the_model_tokens_only():
    a = _trajectory([1, 2, 3], [([10, 11], True), ([20, 21, 22], False), ([12], True)])
    b = _trajectory([1, 2], [([13, 14, 15], True)])
    batch = collate_sessions([a, b], pad_token_id=0, group_size=2)
    assert batch.input_ids.tolist() == [[1, 2, 3, 10, 11, 20, 21, 22, 12], [1, 2, 13, 14, 15, 0, 0, 0, 0]]
    assert batch.prompt_lens.tolist() == [3, 2] and batch.prompt_ids == [0, 0]
    assert batch.response_mask.tolist() == [[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]]
    assert batch.train_mask.tolist() == [[1, 1, 0, 0, 0, 1], [1, 1, 1, 0, 0, 0]]
    assert batch.rollout_logprobs.tolist() == [[-0.5, -0.5, 0, 0, 0, -0.5], [-0.5, -0.5, -0.5, 0, 0, 0]]
    assert batch.weight_versions == [[("v1", 0, 2), ("v1", 5, 6)], [("v1", 0, 3)]]  # spans index the response
    assert batch.extra["num_turns"] == [2, 1] and batch.completions == ["t", "t"]
    picked = batch.select([1])
    assert picked.train_mask.tolist() == [[1, 1, 1]] and picked.input_ids.shape == (1, 5)
    with pytest.raises(ValueError, match="trajectories"):
        collate_sessions([a, b, a], pad_token_id=0, group_size=2)
    # Single-turn batches are unchanged: no loss mask, the response mask is the one trained on.
    from trainers.rollouts import RolloutBatch

    plain = RolloutBatch(**{**batch.__dict__, "loss_mask": None})
    assert torch.equal(plain.train_mask, plain.response_mask)


@pytest.mark.slow
def test_session_rollouts_on_the_committed_model():
    from rollout import RolloutWorker

    problems = task.make_problems(8, seed=1, split="eval")
    with RolloutWorker(model=task.MODEL_DIR, device="cpu", dtype="float32", max_model_len=128) as worker:
        batch = task.episodes(worker, problems, temperature=1.0, n=4, seed=5)
        again = task.episodes(worker, problems, temperature=1.0, n=4, seed=5)
        tokenizer = worker.tokenizer
    assert torch.equal(batch.input_ids, again.input_ids)  # seeded episodes repeat
    tool_rows = [i for i, n in enumerate(batch.extra["num_turns"]) if n > 1]
    assert tool_rows, "no episode called the tool"
    for i in tool_rows:
        response = batch.response_ids[i, : batch.response_lens[i]].tolist()
        trained = batch.train_mask[i, : batch.response_lens[i]].tolist()
        # the tool's message is in the sequence, and none of it is trained on
        env_text = tokenizer.decode([t for t, m in zip(response, trained) if not m])
        assert "<|im_start|>tool\n" in env_text and ("<|im_start|>assistant\n" in env_text)
        model_text = tokenizer.decode([t for t, m in zip(response, trained) if m], skip_special_tokens=True)
        assert model_text.startswith(task.TOOL_PREFIX)


@pytest.mark.slow
def test_committed_model_needs_the_tool_and_samples_it_sometimes():
    from examples.agentic_calc.pretrain import measure

    numbers = measure(task.MODEL_DIR, num_eval=100, num_samples=8, seed=0)
    assert numbers["greedy_accuracy"] <= 0.1 and numbers["greedy_tool_use"] <= 0.1, numbers  # greedy answers in its head
    assert 0.05 <= numbers["sample_tool_use"] <= 0.5, numbers  # but sampling calls the calculator now and then
    assert numbers["pass@8"] >= numbers["greedy_accuracy"] + 0.3, numbers


@pytest.mark.slow
def test_pretrain_is_deterministic(tmp_path):
    digests = []
    for name in ("a", "b"):
        train(PretrainConfig(steps=4, warmup_steps=1, batch_size=8), tmp_path / name, log_every=0)
        digests.append(hashlib.sha256((tmp_path / name / "model.safetensors").read_bytes()).hexdigest())
    assert digests[0] == digests[1]


@pytest.mark.slow
def test_a_short_agentic_run_learns_and_writes_the_run_record(tmp_path):
    out = tmp_path / "agent"
    cmd = [sys.executable, "-m", "trainers.grpo", "--config", "examples/agentic_calc/grpo.toml", "--num-steps", "12",
           "--task.num-eval-problems", "50", "--logging.output-dir", str(out), "--logging.console", "lines"]
    repo = Path(__file__).resolve().parents[2]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False, cwd=repo)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accuracy_after"] >= summary["accuracy_before"] + 0.2, summary
    rewards = [m["reward/mean"] for m in summary["history"]]
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2, rewards
    # The trainer scored the model's tokens as the engine did: environment tokens would not match.
    assert all(m["mismatch/abs"] < 1e-4 for m in summary["history"])
    png = out / "reward_curve.png"
    assert summary["reward_curve"] == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_multi_turn_task_is_refused_by_ppo(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "trainers.ppo", "--model.path", task.MODEL_DIR, "--task.module", "examples.agentic_calc.task",
         "--num-steps", "1", "--logging.output-dir", str(tmp_path / "ppo")],
        capture_output=True, text=True, timeout=300, check=False, cwd=Path(__file__).resolve().parents[2],
    )
    assert result.returncode == 2 and "multi-turn task" in result.stderr, result.stderr[-2000:]
