"""The agentic_calc task: multiply a 3-digit by a 2-digit number with a calculator tool over up to 3 turns, graded on the final turn.

An episode is a chat (rollout.session.RolloutSession):

    user:       417*38
    assistant:  calc:417*38          a tool call: the whole turn is "calc:" and an expression
    tool:       15846                 the calculator's answer ("error" for a malformed expression)
    assistant:  15846                 a turn that is not a tool call is the final answer

The reward is 1.0 when the final turn is exactly the product, else 0.0 (also when the third and
last turn is still a tool call). A tiny model cannot multiply such numbers in its head; it must
learn to call the tool and copy its answer.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from examples.grpo_tiny.task import PairSplits

# The committed checkpoint that `python -m examples.agentic_calc.pretrain` writes.
MODEL_DIR = str(Path(__file__).resolve().parent / "model")

A_RANGE = (100, 999)
B_RANGE = (10, 99)
# The held-out pool: this many (a, b) pairs, fixed once by SPLIT_SEED, never used for training.
NUM_EVAL_PAIRS = 1000
SPLIT_SEED = 20250125
MAX_TURNS = 3
# Longest turn: "calc:" + a 6-character expression + the end-of-turn token, with a little room.
MAX_TURN_TOKENS = 14

TOOL_PREFIX = "calc:"
TOOL_ERROR = "error"
_EXPRESSION = re.compile(r"(\d{1,6})([*+-])(\d{1,6})")
_OPERATIONS = {"*": lambda x, y: x * y, "+": lambda x, y: x + y, "-": lambda x, y: x - y}


@dataclass(frozen=True)
class Problem:
    """One multiplication: the question the user asks and the exact answer string."""

    question: str
    answer: str


def format_question(a: int, b: int) -> str:
    return f"{a}*{b}"


_SPLITS = PairSplits([(a, b) for a in range(A_RANGE[0], A_RANGE[1] + 1) for b in range(B_RANGE[0], B_RANGE[1] + 1)],
                     NUM_EVAL_PAIRS, SPLIT_SEED)


def split_pairs(split: str) -> list[tuple[int, int]]:
    """All (a, b) operand pairs of `split` ("train" or "eval"), in a fixed order."""
    return _SPLITS.pairs(split)


def make_problems(n: int, seed: int, split: str = "train") -> list[Problem]:
    """`n` distinct problems drawn from `split` with `seed`; the same arguments always give the same list."""
    return [Problem(format_question(a, b), str(a * b)) for a, b in _SPLITS.sample(n, seed, split)]


# ---- the tool and the environment -----------------------------------------------------------------


def tool_call(text: str) -> str | None:
    """The expression of a tool-call turn ("calc:417*38" -> "417*38", surrounding whitespace ignored), else None."""
    text = text.strip()
    return text[len(TOOL_PREFIX):] if text.startswith(TOOL_PREFIX) else None


def calculator(expression: str) -> str:
    """The calculator: "A*B", "A+B" or "A-B" on integers of up to 6 digits; "error" for anything else."""
    match = _EXPRESSION.fullmatch(expression.strip())
    if match is None:
        return TOOL_ERROR
    x, op, y = match.groups()
    return str(_OPERATIONS[op](int(x), int(y)))


class CalculatorEnvironment:
    """The user's question first; a tool-call turn gets the calculator's answer as a tool message, any other turn ends the episode."""

    max_turns = MAX_TURNS

    def messages(self, problem: Problem) -> list[dict]:
        return [{"role": "user", "content": problem.question}]

    def reply(self, problem: Problem, text: str) -> list[dict] | None:
        expression = tool_call(text)
        return None if expression is None else [{"role": "tool", "content": calculator(expression)}]


environment = CalculatorEnvironment()


# ---- reward and evaluation --------------------------------------------------------------------------


def reward(final_turn: str, problem: Problem) -> float:
    """1.0 if the final turn is exactly `problem.answer` (surrounding whitespace ignored), else 0.0; a tool call is no answer."""
    if not isinstance(final_turn, str):
        raise ValueError(f"final_turn: expected str, got {type(final_turn).__name__}")
    return 1.0 if final_turn.strip() == problem.answer else 0.0


def batched_reward(final_turns: Sequence[str], problems: Sequence[Problem]) -> list[float]:
    """reward() of each (final turn, problem) pair."""
    if len(final_turns) != len(problems):
        raise ValueError(f"final_turns: {len(final_turns)} given for {len(problems)} problems")
    return [reward(c, p) for c, p in zip(final_turns, problems)]


def episodes(worker: Any, problems: Sequence[Problem], *, temperature: float = 0.0, n: int = 1, seed: int = 0):
    """n episodes of each problem on `worker` (a RolloutWorker) as a trainers.rollouts.RolloutBatch."""
    from trainers.rollouts import generate_session_rollouts

    if not problems:
        raise ValueError("problems: empty; an evaluation needs at least one problem")
    return generate_session_rollouts(worker, problems, environment, n=n, temperature=temperature,
                                     max_tokens=MAX_TURN_TOKENS, seed=seed)


def evaluate(worker: Any, problems: Sequence[Problem]) -> float:
    """Greedy accuracy (fraction in [0, 1]) of full episodes on `problems`."""
    batch = episodes(worker, problems)
    return sum(batched_reward(batch.completions, problems)) / len(problems)
