"""GRPO (and Dr.GRPO / DAPO) on FSDP2: generate -> reward -> advantages -> update -> weight sync, synchronous or async with bounded staleness.

    python -m trainers.grpo --model.path examples/grpo_tiny/model --num-steps 20
    torchrun --nproc-per-node 2 -m trainers.grpo --config run.toml --optim.lr 1e-5

Rank 0 owns the rollout worker: it generates, scores and broadcasts each step's samples; every
rank trains on its share (FSDP2 averages the gradients) and takes part in the weight sync, which
gathers the sharded parameters one tensor at a time and lands them in the worker under
weight_version "step-N". Logging goes through one `log(metrics, step)` callable.

With rollout.async_mode, a producer thread keeps generating the next steps' groups while the
trainer trains (trainers.async_rollouts); a keep-mode pause brackets each weight sync, so
requests in flight freeze and recompute with the new weights on resume. Every sample's
staleness (how many versions its oldest token is behind the policy being trained) is measured
from its weight_versions spans; samples past rollout.max_staleness are dropped or down-weighted.

A multi-turn task (its module's `environment`, trainers.rollouts.Environment) rolls out
RolloutSessions (rollout/session.py): each sample is one token sequence of the model's turns and
the environment's messages between them, and the loss averages over the model's tokens only
(RolloutBatch.loss_mask); rewards read the last turn.

With rollout.colocate, trainer and engine share the device: weights sync through the ipc
backend and the worker sleeps (KV cache freed, weights offloaded) during each train phase.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from trainers.advantages import dapo_keep_groups, dr_grpo_advantages, grpo_advantages
from trainers.async_rollouts import AsyncRolloutProducer, pad_token_id_of, sample_staleness, stale_sample_weights
from trainers.common import (
    HistogramFn,
    LogFn,
    RewardFn,
    RolloutTrainer,
    broadcast_from_rank0,
    cli_entry,
    generate_and_score,
    rename_loss_metrics,
    reward_metrics,
    run_main,
    score,
    single_reward,  # noqa: F401 - part of this module's API
    step_seed,
    worker_asleep,
)
from trainers.config import AlgorithmConfig, TrainerConfig
from trainers.losses import DAPOLoss, DrGRPOLoss, GRPOLoss, PolicyBatch, PolicyLoss
from trainers.policy import Policy, mean_over_ranks
from trainers.rollouts import Environment, RolloutBatch, collate

_LOSSES: dict[str, type[PolicyLoss]] = {"grpo": GRPOLoss, "dr_grpo": DrGRPOLoss, "dapo": DAPOLoss}


def make_loss(algorithm: AlgorithmConfig) -> PolicyLoss:
    """The configured loss class with its own defaults, overridden only where the algorithm config says so."""
    loss_cls = _LOSSES[algorithm.loss]
    overrides = {
        name: getattr(algorithm, name)
        for name in ("clip_low", "clip_high", "dual_clip", "aggregation")
        if getattr(algorithm, name) is not None
    }
    config = loss_cls.config_cls(
        kl_coef=algorithm.kl_coef,
        kl_estimator=algorithm.kl_estimator,
        entropy_coef=algorithm.entropy_coef,
        mismatch=algorithm.mismatch,
        mismatch_cap=algorithm.mismatch_cap,
        **overrides,
    )
    return loss_cls(config)


class GRPOTrainer(RolloutTrainer):
    """One GRPO-family run (sync, or async with rollout.async_mode): the sharded policy, the loss, the rollout worker (rank 0) and the weight sync.

    `worker` is a RolloutWorker (rank 0 only; other ranks pass None); when None on rank 0, one
    is started on the checkpoint and shut down by close(). `reward_fn(completions, items)` scores
    each sample against the item it was generated from. With `environment` every sample is a
    multi-turn session against it (sync mode only).
    """

    def __init__(self, config: TrainerConfig, reward_fn: RewardFn, *, worker=None, log: LogFn | None = None,
                 log_histogram: HistogramFn | None = None, environment: Environment | None = None) -> None:
        if environment is not None and config.rollout.async_mode:
            raise ValueError("rollout.async_mode: multi-turn rollouts (an environment) are generated synchronously")
        super().__init__(config, reward_fn, log=log, log_histogram=log_histogram)
        self.environment = environment
        self.loss = make_loss(config.algorithm)
        policy = Policy(config.model, config.optim, reference=config.algorithm.kl_coef > 0, lora=config.lora)
        self._connect_worker(policy, worker)
        # Version name -> integer version (0: the weights served before training, k: after step k);
        # staleness is measured in these. Rank 0 only (the other ranks get staleness broadcast).
        self._version_index: dict[str, int] = {} if self.weight_version is None else {self.weight_version: 0}
        self.producer: AsyncRolloutProducer | None = None
        self._last_take: float | None = None

    # ---- one step ------------------------------------------------------------------------------

    def _generate(self, items: Sequence[Any]) -> tuple[RolloutBatch, torch.Tensor, dict[str, Any]]:
        """Rank 0: samples, rewards and rollout metrics for `items`; every rank gets the same (broadcast)."""
        payload = None
        if self.rank == 0:
            batch, rewards, metrics = generate_and_score(self.worker, items, self.reward_fn, self.config.rollout,
                                                         step_seed(self.config.rollout, self.step_count),
                                                         self.environment)
            # Sync mode: every sample should come from the weights of the previous sync (all zeros).
            metrics["staleness/values"] = self._staleness(batch)
            payload = (batch, rewards, metrics)
        return broadcast_from_rank0(payload, self.world_size)

    def _generate_async(self) -> tuple[RolloutBatch, torch.Tensor, dict[str, Any]]:
        """Rank 0: the next step's finished groups from the producer, scored; every rank gets the same (broadcast)."""
        cfg = self.config.rollout
        payload = None
        if self.rank == 0:
            start = time.perf_counter()
            groups = self.producer.take(cfg.num_prompts_per_step)
            taken = time.perf_counter()
            groups.sort(key=lambda g: g.index)  # finish order varies; submission order keeps runs comparable
            batch = collate([g.output for g in groups], self._pad_token_id, cfg.num_samples_per_prompt)
            items = [g.item for g in groups]
            rewards = score(self.reward_fn, batch, items)
            # Throughput of the pipeline: tokens handed over per second between two takes.
            since = taken - (self._last_take if self._last_take is not None else start)
            self._last_take = taken
            metrics = {
                # only the wait for groups not finished yet: the rest of generation overlapped training
                "time/generate": taken - start,
                "time/reward": time.perf_counter() - taken,
                "tokens_per_s": float(batch.train_mask.sum()) / max(since, 1e-9),
                "mixed_version_fraction": sum(len(v) > 1 for v in batch.sample_versions()) / batch.num_samples,
                "staleness/values": self._staleness(batch),
            }
            payload = (batch, rewards, metrics)
        return broadcast_from_rank0(payload, self.world_size)

    def _staleness(self, batch: RolloutBatch) -> list[int]:
        # The policy being trained at step k holds the weights of version k - 1.
        return sample_staleness(batch.weight_versions, self._version_index, self.step_count - 1)

    def _advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        algo, group = self.config.algorithm, self.config.rollout.num_samples_per_prompt
        if algo.loss == "dr_grpo":
            return dr_grpo_advantages(rewards, group)
        return grpo_advantages(rewards, group, scale=algo.advantage_scale)

    def _train(self, batch: RolloutBatch, advantages: torch.Tensor) -> dict[str, float]:
        """Minibatch updates on this rank's share of `batch`; metrics averaged over minibatches and ranks."""
        algo, temperature = self.config.algorithm, self.config.rollout.temperature
        mine = list(range(self.rank, batch.num_samples, self.world_size))
        # Every rank must run the same number of optimizer steps (FSDP collectives), so the
        # minibatch count comes from the smallest share, which all ranks compute alike.
        num_minibatches = min(algo.num_minibatches, batch.num_samples // self.world_size)
        chunks = [mine[i::num_minibatches] for i in range(num_minibatches)]
        minibatches = [(batch.select(c), advantages[c]) for c in chunks]
        reuse_old = algo.num_minibatches == 1 and algo.num_epochs == 1
        old: list[torch.Tensor | None] = [None] * len(minibatches)
        ref: list[torch.Tensor | None] = [None] * len(minibatches)
        for i, (mb, _) in enumerate(minibatches):
            if not reuse_old:
                with torch.no_grad():
                    old[i], _ = self.policy.response_logprobs(mb.input_ids, mb.prompt_lens, mb.response_ids,
                                                               temperature=temperature)
            if self.policy.has_reference:
                ref[i], _ = self.policy.response_logprobs(mb.input_ids, mb.prompt_lens, mb.response_ids,
                                                           temperature=temperature, use_reference=True)
        totals: dict[str, float] = {}
        num_updates = 0
        for _epoch in range(algo.num_epochs):
            for i, (mb, adv) in enumerate(minibatches):
                logprobs, entropy = self.policy.response_logprobs(
                    mb.input_ids, mb.prompt_lens, mb.response_ids, temperature=temperature,
                    with_entropy=True, entropy_grad=algo.entropy_coef > 0,
                )
                device = logprobs.device
                # With one update per step the behaviour policy is the current one: its logprobs
                # are this forward's, detached (bit-identical to a separate no-grad pass).
                old_logprobs = logprobs.detach() if reuse_old else old[i]
                mask = mb.train_mask.to(device)  # the model's tokens: a session's environment tokens are not trained on
                policy_batch = PolicyBatch(
                    logprobs=logprobs,
                    old_logprobs=old_logprobs,
                    advantages=adv.to(device).unsqueeze(1).expand_as(logprobs),  # sequence-level, broadcast over tokens
                    mask=mask,
                    ref_logprobs=ref[i],
                    rollout_logprobs=mb.rollout_logprobs.to(device),
                    entropy=entropy,
                )
                loss, metrics = self.loss(policy_batch)
                loss.backward()
                metrics.update(self.policy.optimizer_step())
                for k, v in metrics.items():
                    totals[k] = totals.get(k, 0.0) + v
                num_updates += 1
        means = {k: v / num_updates for k, v in totals.items()}
        return rename_loss_metrics(mean_over_ranks(means, self.world_size, self.policy.device))

    def step(self, items: Sequence[Any]) -> dict[str, Any]:
        """One synchronous step on `items` (prompts, or objects with .prompt that reward_fn understands); every rank calls it."""
        if self.config.rollout.async_mode:
            raise ValueError(
                "rollout.async_mode: step(items) generates for given items; async training runs through train(problems)"
            )
        if not items:
            raise ValueError("items: empty; a step needs at least one prompt")
        self.step_count += 1
        batch, rewards, metrics = self._generate(items)
        return self._update(batch, rewards, metrics)

    def _update(self, batch: RolloutBatch, rewards: torch.Tensor, metrics: dict[str, Any]) -> dict[str, Any]:
        """The rest of step self.step_count: advantages, the staleness rule, the update, the weight sync, logging."""
        step = self.step_count
        metrics = dict(metrics)
        rollout = self.config.rollout
        group = rollout.num_samples_per_prompt
        metrics.update(reward_metrics(rewards, batch))

        # Advantages use whole groups (a stale sample's reward is still a fair baseline); the
        # staleness rule then drops samples or scales their advantage (and so their loss).
        advantages = self._advantages(rewards)
        keep_mask = torch.ones(batch.num_samples, dtype=torch.bool)  # [B]
        if self.config.algorithm.drops_uniform_groups:
            keep_mask &= dapo_keep_groups(rewards, group).repeat_interleave(group)
        staleness = torch.tensor(metrics.pop("staleness/values"), dtype=torch.int64)  # [B]
        fresh, weights = stale_sample_weights(
            staleness, rollout.max_staleness, rollout.stale_policy, rollout.stale_weight
        )
        metrics["stale_fraction"] = float((staleness > 0).float().mean())
        metrics["num_stale_dropped"] = float((~fresh).sum())
        keep_mask &= fresh
        advantages = advantages * weights
        keep = keep_mask.nonzero().squeeze(1)
        trained = staleness[keep]
        metrics["staleness/values"] = trained.tolist()
        metrics["staleness/mean"] = float(trained.float().mean()) if keep.numel() else float("nan")
        metrics["staleness/max"] = float(trained.max()) if keep.numel() else float("nan")
        metrics["staleness/weight_mean"] = float(weights[keep].mean()) if keep.numel() else float("nan")
        metrics["num_samples_trained"] = float(keep.numel())

        start = time.perf_counter()
        # Colocated: the engine's KV cache and weights leave the device while the trainer uses it.
        with worker_asleep(self.worker, rollout.colocate):
            if keep.numel() >= self.world_size:
                train_batch = batch if keep.numel() == batch.num_samples else batch.select(keep)
                metrics.update(self._train(train_batch, advantages[keep]))
        metrics["time/train"] = time.perf_counter() - start

        start = time.perf_counter()
        version = f"step-{step}"
        # Async: freeze the requests in flight (they keep their KV) so no token is computed with
        # half-updated weights; on resume they recompute with the new ones.
        paused = self.rank == 0 and rollout.async_mode
        if paused:
            self.worker.pause_generation("keep")
        try:
            self.sync.send_weights(weight_version=version)
        finally:
            if paused:
                self.worker.resume_generation()
        self.weight_version = version
        self._version_index[version] = step
        if self.producer is not None:
            self.producer.advance_version(step)
        metrics["time/sync"] = time.perf_counter() - start
        metrics["weight_version"] = float(step)
        if self.rank == 0 and step % self.config.logging.log_every == 0:
            self.log({k: v for k, v in metrics.items() if not isinstance(v, list)}, step)
            if self.log_histogram is not None and metrics["staleness/values"]:
                self.log_histogram("staleness", metrics["staleness/values"], step)
        return metrics

    def train(self, problems: Sequence[Any], num_steps: int | None = None) -> list[dict[str, Any]]:
        """Runs num_steps (default config.num_steps) steps over `problems`, saving on logging.save_every."""
        if self.config.rollout.async_mode:
            if not problems:
                raise ValueError("problems: empty; training needs at least one prompt")
            return self._train_async(problems, self.config.num_steps if num_steps is None else num_steps)
        return super().train(problems, num_steps)

    def _train_async(self, problems: Sequence[Any], num_steps: int) -> list[dict[str, Any]]:
        """num_steps steps fed by a producer that generates ahead while this thread trains; stopped at the end."""
        cfg = self.config.rollout
        if self.rank == 0:
            self._pad_token_id = pad_token_id_of(self.worker)
            # continue where the last call stopped
            offset = (self.step_count * cfg.num_prompts_per_step) % len(problems)
            self.producer = AsyncRolloutProducer(
                self.worker,
                list(problems[offset:]) + list(problems[:offset]),
                n=cfg.num_samples_per_prompt,
                temperature=cfg.temperature,
                max_tokens=cfg.max_tokens,
                seed=cfg.seed + self.step_count * 1_000_003,
                groups_per_step=cfg.num_prompts_per_step,
                lookahead_steps=cfg.lookahead_steps,
                start_version=self.step_count,
            )
            self._last_take = None
        history = []
        try:
            for _ in range(num_steps):
                self.step_count += 1
                batch, rewards, metrics = self._generate_async()
                history.append(self._update(batch, rewards, metrics))
                self._maybe_save()
        finally:
            # Groups generated ahead of the last step are not used: their requests are aborted.
            if self.producer is not None:
                self.producer.close()
                self.producer = None
        return history

    def close(self) -> None:
        """Stops the async producer, then shuts the weight sync down (and the worker, if this trainer started it)."""
        if self.producer is not None:
            self.producer.close()
            self.producer = None
        super().close()


# ---- command line ----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """`python -m trainers.grpo`: train on config.task, evaluate held-out accuracy before and after, save the policy and the run record."""
    return run_main(TrainerConfig, GRPOTrainer, argv, prog="python -m trainers.grpo")


if __name__ == "__main__":
    cli_entry(main)
