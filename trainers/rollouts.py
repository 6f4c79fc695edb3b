"""Rollouts for training: n samples per prompt from a RolloutWorker (or n multi-turn sessions), padded into tensors with the engine's logprobs, weight versions and a loss mask."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from engine import SamplingParams


@dataclass
class RolloutBatch:
    """B = num_prompts * n samples, those of one prompt adjacent; R = longest response, L = longest prompt + response.

    Per-token response tensors are [B, R], aligned with response_ids (position j is the j-th
    response token); input_ids holds prompt + response right-padded with pad_token_id. A multi-turn
    session's response holds its environment tokens too (tool results, template closings, later
    user messages): loss_mask is 0 there, so the trainer trains on the model's tokens only.
    """

    input_ids: torch.Tensor
    """[B, L] int64: prompt then response token ids, right-padded."""
    prompt_lens: torch.Tensor
    """[B] int64: prompt tokens of each sample (its response starts at that column of input_ids)."""
    response_ids: torch.Tensor
    """[B, R] int64: the generated token ids, right-padded."""
    response_mask: torch.Tensor
    """[B, R] float32: 1 on response tokens (generated, or a session's environment tokens), 0 on padding."""
    rollout_logprobs: torch.Tensor
    """[B, R] float32: the engine's logprob of each generated token (0 on environment tokens and padding)."""
    prompt_ids: list[int]
    """[B]: index into the step's prompts of each sample's prompt."""
    completions: list[str]
    """[B]: the detokenized responses."""
    finish_reasons: list[str | None]
    """[B]: why each response ended ("stop", "length", ...)."""
    weight_versions: list[list[tuple[str, int, int]]]
    """[B]: (weight_version, start, end) spans over each response's tokens: which weights produced which tokens."""
    group_size: int = 1
    """Samples per prompt."""
    loss_mask: torch.Tensor | None = None
    """[B, R] float32: 1 on the tokens the model generated (trained on), 0 on environment tokens and padding; None: response_mask."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_samples(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_lens(self) -> torch.Tensor:
        return self.response_mask.sum(-1).to(torch.int64)  # [B]

    @property
    def train_mask(self) -> torch.Tensor:
        """[B, R] the tokens a policy loss averages over: the model's own (loss_mask, else response_mask)."""
        return self.response_mask if self.loss_mask is None else self.loss_mask

    def sample_versions(self) -> list[set[str]]:
        """The distinct weight versions that produced each sample's tokens."""
        return [{version for version, _, _ in spans} for spans in self.weight_versions]

    def select(self, indices: Sequence[int] | torch.Tensor) -> RolloutBatch:
        """The samples at `indices` (in that order), with L and R trimmed to what they still need."""
        idx = torch.as_tensor(list(indices) if not isinstance(indices, torch.Tensor) else indices, dtype=torch.int64)
        keep = idx.tolist()
        response_mask = self.response_mask[idx]
        num_resp = int(response_mask.sum(-1).max().item()) if keep else 0
        lengths = self.prompt_lens[idx] + response_mask.sum(-1).to(torch.int64)
        num_cols = int(lengths.max().item()) if keep else 0
        return RolloutBatch(
            input_ids=self.input_ids[idx, :num_cols],
            prompt_lens=self.prompt_lens[idx],
            response_ids=self.response_ids[idx, :num_resp],
            response_mask=response_mask[:, :num_resp],
            rollout_logprobs=self.rollout_logprobs[idx, :num_resp],
            prompt_ids=[self.prompt_ids[i] for i in keep],
            completions=[self.completions[i] for i in keep],
            finish_reasons=[self.finish_reasons[i] for i in keep],
            weight_versions=[self.weight_versions[i] for i in keep],
            group_size=self.group_size,
            loss_mask=None if self.loss_mask is None else self.loss_mask[idx, :num_resp],
            extra=dict(self.extra),
        )


def collate(outputs: Sequence, pad_token_id: int, group_size: int) -> RolloutBatch:
    """Pads finished RequestOutputs (each with `group_size` completions that carry sampled-token logprobs) into a RolloutBatch."""
    prompts: list[list[int]] = []
    responses: list[list[int]] = []
    logprobs: list[list[float]] = []
    prompt_ids, completions, finish_reasons, versions = [], [], [], []
    for prompt_index, out in enumerate(outputs):
        if len(out.outputs) != group_size:
            raise ValueError(f"outputs[{prompt_index}]: {len(out.outputs)} completions, expected n={group_size}")
        for completion in sorted(out.outputs, key=lambda c: c.index):
            if completion.logprobs is None or len(completion.logprobs) != len(completion.token_ids):
                raise ValueError(
                    f"outputs[{prompt_index}].outputs[{completion.index}].logprobs: the engine returned no logprob "
                    "per sampled token; generate with SamplingParams(logprobs=0)"
                )
            prompts.append(list(out.prompt_token_ids))
            responses.append(list(completion.token_ids))
            # Each position's dict holds the sampled token (plus any top-k); pick the sampled one.
            logprobs.append([pos[tok].logprob for pos, tok in zip(completion.logprobs, completion.token_ids)])
            prompt_ids.append(prompt_index)
            completions.append(completion.text)
            finish_reasons.append(completion.finish_reason)
            versions.append(list(completion.weight_versions))
    return RolloutBatch(
        **_padded(prompts, responses, logprobs, pad_token_id),
        prompt_ids=prompt_ids,
        completions=completions,
        finish_reasons=finish_reasons,
        weight_versions=versions,
        group_size=group_size,
    )


def _ragged_rows(rows: list[list], num_cols: int, fill, dtype: np.dtype) -> np.ndarray:
    """[len(rows), num_cols] array of the rows right-padded with `fill`: one scatter, no per-row copy."""
    lens = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    out = np.full((len(rows), num_cols), fill, dtype=dtype)
    total = int(lens.sum())
    if total:
        starts = np.cumsum(lens) - lens  # [B] first flat index of each row
        row_of = np.repeat(np.arange(len(rows)), lens)  # [N]
        flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=dtype, count=total)
        out[row_of, np.arange(total) - starts[row_of]] = flat
    return out


def _padded(prompts: list[list[int]], responses: list[list[int]], logprobs: list[list[float]], pad_token_id: int,
            loss_masks: list[list[int]] | None = None) -> dict[str, torch.Tensor]:
    """RolloutBatch's tensors of per-sample token lists, right-padded: input_ids [B, L], prompt_lens [B], and the [B, R] ones."""
    prompt_lens = np.fromiter(map(len, prompts), dtype=np.int64, count=len(prompts))  # [B]
    response_lens = np.fromiter(map(len, responses), dtype=np.int64, count=len(responses))  # [B]
    num_resp = int(response_lens.max(initial=0))
    num_cols = int((prompt_lens + response_lens).max(initial=0))
    input_ids = _ragged_rows([p + r for p, r in zip(prompts, responses)], num_cols, pad_token_id, np.int64)  # [B, L]
    response_ids = _ragged_rows(responses, num_resp, pad_token_id, np.int64)  # [B, R]
    response_mask = (np.arange(num_resp)[None, :] < response_lens[:, None]).astype(np.float32)  # [B, R]
    rollout_logprobs = _ragged_rows(logprobs, num_resp, 0.0, np.float32)  # [B, R]
    loss_mask = None if loss_masks is None else torch.from_numpy(_ragged_rows(loss_masks, num_resp, 0.0, np.float32))
    return dict(input_ids=torch.from_numpy(input_ids), prompt_lens=torch.from_numpy(prompt_lens),
                response_ids=torch.from_numpy(response_ids), response_mask=torch.from_numpy(response_mask),
                rollout_logprobs=torch.from_numpy(rollout_logprobs), loss_mask=loss_mask)


def collate_sessions(trajectories: Sequence, pad_token_id: int, group_size: int) -> RolloutBatch:
    """Pads multi-turn session Trajectories (rollout.session; the `group_size` of one prompt adjacent) into a RolloutBatch.

    Each sample's prompt is its first prompt, its response everything after (the model's turns and
    the environment's tokens between them); loss_mask is the session's mask there, the weight-version
    spans are shifted to index the response, the completion is the last turn's text, and
    extra["num_turns"] counts each session's model turns.
    """
    if group_size < 1 or len(trajectories) % group_size:
        raise ValueError(f"trajectories: {len(trajectories)} is not a whole number of groups of {group_size}")
    prompts, responses, logprobs, masks, versions = [], [], [], [], []
    for t in trajectories:
        start = t.prompt_len
        prompts.append(t.token_ids[:start])
        responses.append(t.token_ids[start:])
        logprobs.append(t.logprobs[start:])
        masks.append(t.mask[start:])
        versions.append([(v, s - start, e - start) for v, s, e in t.weight_versions])
    return RolloutBatch(
        **_padded(prompts, responses, logprobs, pad_token_id, masks),
        prompt_ids=[i // group_size for i in range(len(trajectories))],
        completions=[t.final_text for t in trajectories],
        finish_reasons=[t.turns[-1].finish_reason if t.turns else None for t in trajectories],
        weight_versions=versions,
        group_size=group_size,
        extra={"num_turns": [len(t.turns) for t in trajectories]},
    )


def generate_rollouts(
    worker,
    prompts: Sequence,
    *,
    n: int,
    temperature: float = 1.0,
    max_tokens: int = 32,
    seed: int | None = None,
    pad_token_id: int | None = None,
) -> RolloutBatch:
    """n samples of each prompt (text or {"prompt_token_ids": [...]}) from `worker` (RolloutWorker or engine.LLM).

    With `seed`, prompt i samples with seed + i * n (the engine adds the sample index), so a
    repeated call repeats its samples and no two samples share a seed.
    """
    if not prompts:
        raise ValueError("prompts: empty; a rollout needs at least one prompt")
    if n < 1:
        raise ValueError(f"n: must be >= 1, got {n}")
    params = [
        SamplingParams(
            n=n,
            temperature=temperature,
            max_tokens=max_tokens,
            logprobs=0,  # the sampled token's logprob only
            seed=None if seed is None else seed + i * n,
        )
        for i in range(len(prompts))
    ]
    outputs = worker.generate(list(prompts), params, use_tqdm=False)
    if pad_token_id is None:
        tokenizer = worker.tokenizer if hasattr(worker, "tokenizer") else worker.get_tokenizer()
        pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        pad_token_id = pad_token_id if pad_token_id is not None else 0
    return collate(outputs, pad_token_id, n)


class Environment(Protocol):
    """A multi-turn task's side of the conversation: the first messages of an item, and its answer to each model turn."""

    max_turns: int
    """Model turns per episode at most; the episode ends after that many whatever the last turn said."""

    def messages(self, item: Any) -> list[dict]:
        """The conversation an episode of `item` starts from (the chat template renders it)."""

    def reply(self, item: Any, text: str) -> list[dict] | None:
        """The messages that answer the model's turn `text` (a tool result, a user's next question), or None: the episode is over."""


def generate_session_rollouts(
    worker,
    items: Sequence,
    env: Environment,
    *,
    n: int,
    temperature: float = 1.0,
    max_tokens: int = 32,
    seed: int | None = None,
) -> RolloutBatch:
    """n multi-turn sessions (rollout.session) of each item against `env`, every turn of all sessions generated together.

    Session j of item i samples with seed + i * n + j (plus its turn index), so a repeated call
    repeats its episodes. The batch trains on the model's tokens only (loss_mask).
    """
    from rollout.session import ContextFullError, RolloutSession, generate_turns

    if not items:
        raise ValueError("items: empty; a rollout needs at least one prompt")
    if n < 1:
        raise ValueError(f"n: must be >= 1, got {n}")
    if env.max_turns < 1:
        raise ValueError(f"env.max_turns: must be >= 1, got {env.max_turns}")
    sessions = [
        RolloutSession(worker, env.messages(item), SamplingParams(
            temperature=temperature, max_tokens=max_tokens, seed=None if seed is None else seed + i * n + j))
        for i, item in enumerate(items) for j in range(n)
    ]
    active = list(range(len(sessions)))
    for turn_index in range(env.max_turns):
        turns = generate_turns([sessions[k] for k in active])
        if turn_index == env.max_turns - 1:
            break
        still = []
        for k, turn in zip(active, turns):
            reply = env.reply(items[k // n], turn.text)
            if reply is None:
                continue
            try:
                sessions[k].add_messages(reply)
            except ContextFullError:  # the reply leaves no room for another turn: the episode ends where it is
                continue
            still.append(k)
        active = still
        if not active:
            break
    from trainers.async_rollouts import pad_token_id_of

    return collate_sessions([s.trajectory() for s in sessions], pad_token_id_of(worker), n)
