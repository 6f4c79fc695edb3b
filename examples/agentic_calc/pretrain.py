"""Pre-trains the agentic_calc model (a tiny Llama) on chat transcripts of a teacher that mostly answers in its head and seldom calls the calculator.

The teacher's transcripts (supervised on the assistant turns only):

    direct (1 - tool_rate):  user a*b | assistant <a*b>                                    (right, but not learnable by heart)
    tool (tool_rate):        user a*b | assistant calc:a*b | tool <a*b> | assistant <a*b>
    retry (retry_rate of the tool transcripts): a malformed call first, the tool's "error", then as above

So the model learns the format and to copy the tool's answer, while greedy decoding prefers the
direct answer it cannot compute: the headroom GRPO removes by rewarding right final answers.
"""

from __future__ import annotations

import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from examples.agentic_calc import task
from examples.grpo_tiny.pretrain import check_schedule, fresh_model, run_cli, supervised_step, write_checkpoint


@dataclass
class PretrainConfig:
    """Model shape, teacher mixture and supervised schedule; the defaults produce the committed checkpoint."""

    hidden_size: int = 128
    """Width of the residual stream."""
    num_hidden_layers: int = 2
    """Transformer blocks."""
    num_attention_heads: int = 4
    """Query heads."""
    num_key_value_heads: int = 2
    """Key/value heads (grouped-query attention)."""
    intermediate_size: int = 256
    """MLP width."""
    max_position_embeddings: int = 128
    """Longest sequence the checkpoint supports; a three-turn episode needs under 100 tokens."""
    steps: int = 1500
    """Optimizer steps."""
    batch_size: int = 64
    """Transcripts per step."""
    lr: float = 3e-3
    """Peak AdamW learning rate (linear warm-up, cosine decay)."""
    warmup_steps: int = 50
    """Linear warm-up steps."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    tool_rate: float = 0.2
    """Fraction of transcripts in which the teacher calls the calculator (the rest answer directly)."""
    retry_rate: float = 0.1
    """Fraction of the tool transcripts whose first call is malformed (the tool says "error" and the teacher calls again)."""
    seed: int = 0
    """Seeds the initial weights and the data."""
    num_threads: int = 2
    """CPU threads; fixed so that reruns produce the same bytes."""

    def __post_init__(self) -> None:
        check_schedule(self, min_positions=100)  # a three-turn episode needs under 100 tokens
        for name in ("tool_rate", "retry_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}: must be in [0, 1], got {getattr(self, name)}")


def transcript(a: int, b: int, kind: str) -> list[dict]:
    """The teacher's conversation of a*b: kind "direct", "tool" or "retry"."""
    question, answer = task.format_question(a, b), str(a * b)
    messages = [{"role": "user", "content": question}]
    if kind == "retry":
        bad = f"{a}*"  # the expression is cut short: the calculator refuses it
        messages += [{"role": "assistant", "content": task.TOOL_PREFIX + bad},
                     {"role": "tool", "content": task.calculator(bad)}]
    if kind in ("tool", "retry"):
        messages += [{"role": "assistant", "content": task.TOOL_PREFIX + question},
                     {"role": "tool", "content": task.calculator(question)}]
    return messages + [{"role": "assistant", "content": answer}]


def encode(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of the chat template's rendering of `messages` and a 0/1 list marking the assistant's
    tokens (its content and end-of-turn token: what a session samples), built message by message as
    the template writes it: <|im_start|>role\\n content <|im_end|>\\n."""
    ids: list[int] = []
    trained: list[int] = []

    def add(text: str, train: int) -> None:
        piece = tokenizer.encode(text).ids
        ids.extend(piece)
        trained.extend([train] * len(piece))

    for message in messages:
        add(f"<|im_start|>{message['role']}\n", 0)
        assistant = int(message["role"] == "assistant")
        add(message["content"], assistant)
        add("<|im_end|>", assistant)
        add("\n", 0)
    # The last assistant turn ends the transcript at its end-of-turn token, as an episode does.
    return ids[:-1], trained[:-1]


def _batch(tokenizer, examples: list[list[dict]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [N, L] and a loss mask [N, L] that is 1 where the *next* token is the assistant's."""
    rows = [encode(tokenizer, m) for m in examples]
    length = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.float32)
    for i, (row, trained) in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        # position p predicts token p + 1
        mask[i, : len(row) - 1] = torch.tensor(trained[1:], dtype=torch.float32)
    return ids, mask


def train(cfg: PretrainConfig, out_dir: str | Path, log_every: int = 100) -> dict:
    """Writes a trained checkpoint into `out_dir` (replacing it) and returns a summary dict."""
    from engine.tiny_models import EOS_TOKEN

    out_dir = Path(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=".agentic_calc-", dir=out_dir.parent if out_dir.parent.exists() else None))
    try:
        tokenizer, model = fresh_model(cfg, tmp)
        pad_id = tokenizer.token_to_id(EOS_TOKEN)
        pairs = task.split_pairs("train")
        rng = random.Random(cfg.seed)
        torch.manual_seed(cfg.seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
        start = time.perf_counter()
        for step in range(cfg.steps):
            examples = []
            for a, b in rng.sample(pairs, cfg.batch_size):
                tool = rng.random() < cfg.tool_rate
                kind = ("retry" if rng.random() < cfg.retry_rate else "tool") if tool else "direct"
                examples.append(transcript(a, b, kind))
            loss = supervised_step(model, optimizer, *_batch(tokenizer, examples, pad_id), step, cfg, log_every)
        train_seconds = time.perf_counter() - start
        write_checkpoint(model, cfg, tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"train_seconds": train_seconds, "final_loss": loss}


def measure(model_dir: str | Path, num_eval: int = 200, num_samples: int = 8, seed: int = 0) -> dict:
    """Greedy accuracy (as task.evaluate measures it), and at temperature 1.0 the sample accuracy, pass@num_samples
    and how often the first turn calls the tool, with a RolloutWorker on CPU."""
    from rollout import RolloutWorker

    problems = task.make_problems(num_eval, seed=seed, split="eval")
    with RolloutWorker(model=str(model_dir), device="cpu", dtype="float32", max_model_len=128) as worker:
        greedy = task.episodes(worker, problems)
        sampled = task.episodes(worker, problems, temperature=1.0, n=num_samples, seed=seed)
    repeated = [p for p in problems for _ in range(num_samples)]
    rewards = task.batched_reward(sampled.completions, repeated)
    return {
        "greedy_accuracy": sum(task.batched_reward(greedy.completions, problems)) / len(problems),
        "greedy_tool_use": sum(t > 1 for t in greedy.extra["num_turns"]) / len(problems),
        "sample_accuracy": sum(rewards) / len(rewards),
        f"pass@{num_samples}": sum(max(rewards[i:i + num_samples]) for i in range(0, len(rewards), num_samples)) / len(problems),
        "sample_tool_use": sum(t > 1 for t in sampled.extra["num_turns"]) / len(rewards),
    }


def main(argv: list[str] | None = None) -> None:
    run_cli(argv, __doc__, PretrainConfig, train, measure, task.MODEL_DIR)


if __name__ == "__main__":
    main()
