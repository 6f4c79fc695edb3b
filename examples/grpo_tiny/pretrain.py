"""Pre-trains the grpo_tiny model (a tiny Llama) on addition by supervised next-token training, stopping early on purpose."""

from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from examples.grpo_tiny import task


@dataclass
class PretrainConfig:
    """Model shape and supervised schedule; the defaults produce the committed checkpoint."""

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
    max_position_embeddings: int = 64
    """Longest sequence the checkpoint supports; prompts plus answers need at most 10 tokens."""
    steps: int = 600
    """Optimizer steps; deliberately too few for full competence, leaving headroom for GRPO."""
    batch_size: int = 128
    """Problems per step."""
    lr: float = 3e-3
    """Peak AdamW learning rate (linear warm-up, cosine decay)."""
    warmup_steps: int = 50
    """Linear warm-up steps."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    carry_slip: float = 0.6
    """Probability that a pre-training answer drops its carries (29+17 -> "36"): the demonstrations
    come from a sloppy teacher, so greedy decoding copies the slip on problems with a carry while
    sampling still finds the right answer, which is the headroom GRPO with an exact-match reward removes."""
    seed: int = 0
    """Seeds the initial weights and the data order."""
    num_threads: int = 2
    """CPU threads; fixed so that reruns produce the same bytes."""

    def __post_init__(self) -> None:
        check_schedule(self, min_positions=16)
        if not 0.0 <= self.carry_slip <= 1.0:
            raise ValueError(f"carry_slip: must be in [0, 1], got {self.carry_slip}")


def check_schedule(cfg, min_positions: int) -> None:
    """ValueError naming the field unless `cfg`'s model shape and supervised schedule (PretrainConfig's fields) make sense."""
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "intermediate_size", "steps", "batch_size", "num_threads"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name}: must be at least 1, got {getattr(cfg, name)}")
    if cfg.hidden_size % cfg.num_attention_heads:
        raise ValueError(f"num_attention_heads: {cfg.num_attention_heads} does not divide hidden_size {cfg.hidden_size}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ValueError(f"num_key_value_heads: {cfg.num_key_value_heads} does not divide num_attention_heads")
    if cfg.max_position_embeddings < min_positions:
        raise ValueError(f"max_position_embeddings: must be at least {min_positions}, got {cfg.max_position_embeddings}")
    if not cfg.lr > 0:
        raise ValueError(f"lr: must be positive, got {cfg.lr}")
    if not 0 <= cfg.warmup_steps < cfg.steps:
        raise ValueError(f"warmup_steps: must be in [0, steps), got {cfg.warmup_steps}")
    if cfg.weight_decay < 0:
        raise ValueError(f"weight_decay: must be non-negative, got {cfg.weight_decay}")


def slipped_sum(a: int, b: int) -> int:
    """The sloppy teacher's answer: a + b with every carry dropped (29+17 -> 36, 94+32 -> 26)."""
    return (a % 10 + b % 10) % 10 + 10 * ((a // 10 + b // 10) % 10)


def _encode_examples(tokenizer, examples: list[tuple[str, str]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token ids [N, L] of prompt + answer + eos, and a loss mask [N, L] that is 1
    where the *next* token is part of the answer or the eos (the prompt is given, not learned)."""
    eos_id = tokenizer.token_to_id(task_eos_token())
    rows, targets_start = [], []
    for prompt, answer in examples:
        prompt_ids = tokenizer.encode(prompt).ids
        rows.append(prompt_ids + tokenizer.encode(answer).ids + [eos_id])
        targets_start.append(len(prompt_ids))
    length = max(len(r) for r in rows)
    ids = torch.full((len(rows), length), eos_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.float32)
    for i, (row, start) in enumerate(zip(rows, targets_start)):
        ids[i, : len(row)] = torch.tensor(row)
        # position p predicts token p + 1:  prompt ... '=' | answer digits | eos
        #                                   mask 0 ... 1   |  1 ..      1  | 0
        mask[i, start - 1 : len(row) - 1] = 1.0
    return ids, mask


def task_eos_token() -> str:
    from engine.tiny_models import EOS_TOKEN

    return EOS_TOKEN


def _lr_at(step: int, cfg: PretrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def train(cfg: PretrainConfig, out_dir: str | Path, log_every: int = 100) -> dict:
    """Writes a trained checkpoint into `out_dir` (replacing it) and returns a summary dict."""
    out_dir = Path(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=".grpo_tiny-", dir=out_dir.parent if out_dir.parent.exists() else None))
    try:
        tokenizer, model = fresh_model(cfg, tmp)
        train_pairs = task.split_pairs("train")
        eos_id = tokenizer.token_to_id(task_eos_token())
        prompts = [task.format_prompt(a, b) for a, b in train_pairs]
        right_ids, right_mask = _encode_examples(tokenizer, [(p, str(a + b)) for p, (a, b) in zip(prompts, train_pairs)])
        slip_ids, slip_mask = _encode_examples(tokenizer, [(p, str(slipped_sum(a, b))) for p, (a, b) in zip(prompts, train_pairs)])
        # Both encodings share one padded length, so rows can be mixed per example.
        length = max(right_ids.shape[1], slip_ids.shape[1])
        right_ids, right_mask, slip_ids, slip_mask = (
            torch.nn.functional.pad(t, (0, length - t.shape[1]), value=v)
            for t, v in ((right_ids, eos_id), (right_mask, 0.0), (slip_ids, eos_id), (slip_mask, 0.0))
        )
        generator = torch.Generator().manual_seed(cfg.seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
        start = time.perf_counter()
        for step in range(cfg.steps):
            index = torch.randint(len(train_pairs), (cfg.batch_size,), generator=generator)
            # Rows without a carry are identical in both encodings, so a slip changes only carry rows.
            slip = (torch.rand(cfg.batch_size, generator=generator) < cfg.carry_slip)[:, None]  # [B, 1]
            ids = torch.where(slip, slip_ids[index], right_ids[index])  # [B, L]
            mask = torch.where(slip, slip_mask[index], right_mask[index])  # [B, L]
            loss = supervised_step(model, optimizer, ids, mask, step, cfg, log_every)
        train_seconds = time.perf_counter() - start
        write_checkpoint(model, cfg, tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"train_seconds": train_seconds, "final_loss": loss}


def supervised_step(model, optimizer, ids: torch.Tensor, mask: torch.Tensor, step: int, cfg, log_every: int) -> float:
    """One AdamW step (at the schedule's lr) on the next-token loss where mask [B, L] is 1; returns the loss."""
    for group in optimizer.param_groups:
        group["lr"] = _lr_at(step, cfg)
    logits = model(input_ids=ids).logits  # [B, L, vocab]
    # Tokens per row never exceed the vocab: padding is eos, masked out of the loss.
    token_loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
    ).view(ids.shape[0], -1)
    loss = (token_loss * mask[:, :-1]).sum() / mask[:, :-1].sum()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    if log_every and (step % log_every == 0 or step == cfg.steps - 1):
        print(f"step {step:5d}  loss {loss.item():.4f}  lr {_lr_at(step, cfg):.2e}", flush=True)
    return loss.item()


def fresh_model(cfg, tmp: Path):
    """(tokenizer, HF model in train mode) of a freshly initialised tiny Llama of `cfg`'s shape written into `tmp`;
    also fixes the CPU threads and deterministic algorithms, so reruns produce the same bytes."""
    import transformers
    from tokenizers import Tokenizer

    from engine.tiny_models import make_tiny_checkpoint

    torch.set_num_threads(cfg.num_threads)
    torch.use_deterministic_algorithms(True)
    make_tiny_checkpoint(
        tmp, "llama", seed=cfg.seed,
        hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        intermediate_size=cfg.intermediate_size, max_position_embeddings=cfg.max_position_embeddings,
    )
    tokenizer = Tokenizer.from_file(str(tmp / "tokenizer.json"))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.float32)
    model.train()
    return tokenizer, model


def write_checkpoint(model, cfg, tmp: Path, out_dir: Path) -> None:
    """Saves `model`'s weights and `cfg` into the checkpoint directory `tmp`, which then replaces `out_dir`."""
    from safetensors.torch import save_file

    # Same layout as make_tiny_checkpoint writes, so only the weights file changes.
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "pretrain_config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    shutil.move(str(tmp), str(out_dir))
    # mkdtemp made the directory private; a committed checkpoint is world-readable.
    out_dir.chmod(0o755)
    for file in out_dir.iterdir():
        file.chmod(0o644)


def measure(model_dir: str | Path, num_eval: int = 200, num_samples: int = 8, seed: int = 0) -> dict:
    """Greedy accuracy (as task.evaluate measures it) and pass@num_samples at temperature 1.0, with engine.LLM on CPU."""
    from engine import LLM, SamplingParams

    problems = task.make_problems(num_eval, seed=seed, split="eval")
    llm = LLM(str(model_dir), device="cpu", dtype="float32", max_model_len=64)
    greedy = task.evaluate(llm, problems)
    params = SamplingParams(temperature=1.0, n=num_samples, seed=seed, max_tokens=task.MAX_ANSWER_TOKENS)
    outputs = llm.generate([p.prompt for p in problems], params, use_tqdm=False)
    rewards = [[task.reward(c.text, p) for c in out.outputs] for out, p in zip(outputs, problems)]
    return {
        "greedy_accuracy": greedy,
        "sample_accuracy": sum(map(sum, rewards)) / (num_samples * len(problems)),
        f"pass@{num_samples}": sum(max(r) for r in rewards) / len(problems),
    }


def main(argv: list[str] | None = None) -> None:
    run_cli(argv, __doc__, PretrainConfig, train, measure, task.MODEL_DIR)


def run_cli(argv: list[str] | None, description: str, config_cls, train_fn, measure_fn, default_out: str) -> None:
    """A pre-training command line: every config_cls field as a flag, --out and --no-measure; trains, then measures."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", default=default_out, help="checkpoint directory to (re)write")
    parser.add_argument("--no-measure", action="store_true", help="skip the accuracy measurement at the end")
    defaults = config_cls()
    for name, value in asdict(defaults).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    args = parser.parse_args(argv)
    cfg = config_cls(**{name: getattr(args, name) for name in asdict(defaults)})
    summary = train_fn(cfg, args.out)
    print(f"trained in {summary['train_seconds']:.1f} s, final loss {summary['final_loss']:.4f} -> {args.out}")
    if not args.no_measure:
        print(json.dumps(measure_fn(args.out), indent=2))


if __name__ == "__main__":
    main()
