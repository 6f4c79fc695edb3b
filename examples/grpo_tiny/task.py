"""The grpo_tiny task: two-number addition prompts ("12+35=") with an exact-match verifier and a greedy evaluator."""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The committed checkpoint that `python -m examples.grpo_tiny.pretrain` writes.
MODEL_DIR = str(Path(__file__).resolve().parent / "model")

# Operands are 0..MAX_OPERAND, so answers have 1 to 3 digits.
MAX_OPERAND = 99
# The held-out pool: this many (a, b) pairs, fixed once by SPLIT_SEED, never used for training.
NUM_EVAL_PAIRS = 1000
SPLIT_SEED = 20240601
# Longest answer (3 digits) plus the eos token, with room for a little babble.
MAX_ANSWER_TOKENS = 6

_FIRST_INTEGER = re.compile(r"-?\d+")


@dataclass(frozen=True)
class Problem:
    """One addition problem: the prompt the model continues and the exact answer string."""

    prompt: str
    answer: str


def format_prompt(a: int, b: int) -> str:
    # No spaces: the tokenizer then gives every digit, "+" and "=" its own token.
    return f"{a}+{b}="


class PairSplits:
    """Operand pairs split once into disjoint "train" and "eval" parts: one shuffle by `seed`, eval takes the first num_eval."""

    def __init__(self, pairs: list[tuple[int, int]], num_eval: int, seed: int) -> None:
        pairs = list(pairs)
        random.Random(seed).shuffle(pairs)
        # Disjoint by construction: one fixed shuffle, eval takes the head, train the rest.
        self._splits = {"eval": pairs[:num_eval], "train": pairs[num_eval:]}

    def pairs(self, split: str) -> list[tuple[int, int]]:
        """All (a, b) operand pairs of `split` ("train" or "eval"), in a fixed order."""
        if split not in self._splits:
            raise ValueError(f"split: {split!r} is not one of {sorted(self._splits)}")
        return list(self._splits[split])

    def sample(self, n: int, seed: int, split: str) -> list[tuple[int, int]]:
        """`n` distinct pairs drawn from `split` with `seed`; the same arguments always give the same list."""
        pairs = self.pairs(split)
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= len(pairs):
            raise ValueError(f"n: must be an int in [0, {len(pairs)}] for split {split!r}, got {n!r}")
        return random.Random(seed).sample(pairs, n)


_SPLITS = PairSplits([(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)], NUM_EVAL_PAIRS, SPLIT_SEED)


def split_pairs(split: str) -> list[tuple[int, int]]:
    """All (a, b) operand pairs of `split` ("train" or "eval"), in a fixed order."""
    return _SPLITS.pairs(split)


def make_problems(n: int, seed: int, split: str = "train") -> list[Problem]:
    """`n` distinct problems drawn from `split` with `seed`; the same arguments always give the same list."""
    return [Problem(prompt=format_prompt(a, b), answer=str(a + b)) for a, b in _SPLITS.sample(n, seed, split)]


def extract_answer(completion: str) -> str | None:
    """The first integer written in `completion`, as written, or None when there is none."""
    match = _FIRST_INTEGER.search(completion)
    return match.group(0) if match else None


def reward(completion: str, problem: Problem) -> float:
    """1.0 if the first integer in `completion` is exactly `problem.answer` (so "047" is wrong), else 0.0."""
    if not isinstance(completion, str):
        raise ValueError(f"completion: expected str, got {type(completion).__name__}")
    return 1.0 if extract_answer(completion) == problem.answer else 0.0


def batched_reward(completions: Sequence[str], problems: Sequence[Problem]) -> list[float]:
    """reward() of each (completion, problem) pair."""
    if len(completions) != len(problems):
        raise ValueError(f"completions: {len(completions)} given for {len(problems)} problems")
    return [reward(c, p) for c, p in zip(completions, problems)]


def _generate_fn(llm_or_worker_generate_fn: Any) -> Callable:
    # engine.LLM and rollout.RolloutWorker both have generate(prompts, params, use_tqdm=...).
    generate = getattr(llm_or_worker_generate_fn, "generate", None)
    if callable(generate):
        return lambda prompts, params: generate(prompts, params, use_tqdm=False)
    if callable(llm_or_worker_generate_fn):
        return llm_or_worker_generate_fn
    raise ValueError(
        "llm_or_worker_generate_fn: expected an object with generate(prompts, sampling_params) "
        f"or such a callable, got {type(llm_or_worker_generate_fn).__name__}"
    )


def evaluate(llm_or_worker_generate_fn: Any, problems: Sequence[Problem]) -> float:
    """Greedy accuracy (fraction in [0, 1]) on `problems`, with an engine.LLM, a RolloutWorker or
    a callable `generate(prompts, sampling_params) -> list[RequestOutput]`."""
    from engine import SamplingParams

    if not problems:
        raise ValueError("problems: empty; accuracy needs at least one problem")
    generate = _generate_fn(llm_or_worker_generate_fn)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_ANSWER_TOKENS)
    outputs = generate([p.prompt for p in problems], params)
    completions = [out.outputs[0].text for out in outputs]
    return sum(batched_reward(completions, problems)) / len(problems)
