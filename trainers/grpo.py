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
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from trainers.advantages import dapo_keep_groups, dr_grpo_advantages, grpo_advantages
from trainers.async_rollouts import AsyncRolloutProducer, pad_token_id_of, sample_staleness, stale_sample_weights
from trainers.cli import parse_config, to_dict
from trainers.config import AlgorithmConfig, TrainerConfig
from trainers.losses import DAPOLoss, DrGRPOLoss, GRPOLoss, PolicyBatch, PolicyLoss
from trainers.policy import Policy, init_distributed
from trainers.rollouts import RolloutBatch, collate, generate_rollouts
from weight_transfer import trainer_init
from weight_transfer.clients import LocalWeightSyncClient
from weight_transfer.local import LocalTrainerInitInfo

# batched reward: (completions, per-sample items) -> one float per completion
RewardFn = Callable[[list[str], list[Any]], Sequence[float]]
LogFn = Callable[[dict[str, float], int], None]
# (name, values, step): records a distribution, e.g. MetricsLogger.log_histogram
HistogramFn = Callable[[str, Sequence[float], int], None]

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


def single_reward(fn: Callable[[str, Any], float]) -> RewardFn:
    """Adapts a per-sample reward `fn(completion, item) -> float` to the batched form the trainer calls."""

    def batched(completions: list[str], items: list[Any]) -> list[float]:
        return [float(fn(c, item)) for c, item in zip(completions, items)]

    return batched


def console_log(metrics: dict[str, float], step: int) -> None:
    """The default `log`: one line per step on stdout."""
    keys = ("reward_mean", "reward_std", "loss", "kl", "entropy", "clip_fraction", "mismatch_abs", "grad_norm")
    shown = " ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics)
    print(f"step {step}: {shown}", flush=True)


def _prompt_of(item: Any) -> Any:
    """An item's prompt: its `.prompt` attribute (task problems) or the item itself (a string or token-id dict)."""
    return getattr(item, "prompt", item)


class GRPOTrainer:
    """One GRPO-family run (sync, or async with rollout.async_mode): the sharded policy, the loss, the rollout worker (rank 0) and the weight sync.

    `worker` is a RolloutWorker (rank 0 only; other ranks pass None); when None on rank 0, one
    is started on the checkpoint and shut down by close(). `reward_fn(completions, items)` scores
    each sample against the item it was generated from.
    """

    def __init__(self, config: TrainerConfig, reward_fn: RewardFn, *, worker=None, log: LogFn | None = None,
                 log_histogram: HistogramFn | None = None) -> None:
        self.config = config
        self.reward_fn = reward_fn
        self.log = log or console_log
        self.log_histogram = log_histogram
        self.rank, self.world_size = init_distributed(config.model.device)
        torch.manual_seed(config.seed)
        self.policy = Policy(config.model, config.optim, reference=config.algorithm.kl_coef > 0)
        self.loss = make_loss(config.algorithm)
        self._owns_worker = False
        if self.rank == 0 and worker is None:
            worker = self._start_worker()
            self._owns_worker = True
        self.worker = worker if self.rank == 0 else None
        if self.worker is not None:
            self._check_worker_logprobs()
        client = LocalWeightSyncClient(self.worker) if self.rank == 0 else None
        self.sync = trainer_init(LocalTrainerInitInfo(encoding="tensors"), client=client, source=self.policy.weight_source())
        self.weight_version = self.worker.get_weight_version() if self.worker is not None else None
        self.step_count = 0
        # Version name -> integer version (0: the weights served before training, k: after step k);
        # staleness is measured in these. Rank 0 only (the other ranks get staleness broadcast).
        self._version_index: dict[str, int] = {} if self.weight_version is None else {self.weight_version: 0}
        self.producer: AsyncRolloutProducer | None = None
        self._last_take: float | None = None

    def _start_worker(self):
        from rollout import RolloutWorker

        cfg = self.config
        return RolloutWorker(
            model=cfg.model.path,
            multiprocess=cfg.rollout.multiprocess,
            device=cfg.model.device,
            dtype="bfloat16" if cfg.model.param_dtype == "bfloat16" else "float32",
            max_model_len=cfg.rollout.max_model_len,
            seed=cfg.rollout.seed,
            # Logprobs after temperature: the distribution the engine sampled from, which the trainer recomputes.
            logprobs_mode="processed_logprobs",
        )

    def _check_worker_logprobs(self) -> None:
        mode = getattr(getattr(getattr(self.worker, "config", None), "model", None), "logprobs_mode", None)
        if mode == "raw_logprobs" and self.config.rollout.temperature != 1.0:
            raise ValueError(
                "worker: logprobs_mode 'raw_logprobs' ignores rollout.temperature="
                f"{self.config.rollout.temperature}; start the worker with logprobs_mode='processed_logprobs'"
            )

    # ---- one step ------------------------------------------------------------------------------

    def _generate(self, items: Sequence[Any]) -> tuple[RolloutBatch, torch.Tensor, dict[str, Any]]:
        """Rank 0: samples, rewards and rollout metrics for `items`; every rank gets the same (broadcast)."""
        cfg = self.config.rollout
        payload: list[Any] = [None]
        if self.rank == 0:
            start = time.perf_counter()
            batch = generate_rollouts(
                self.worker,
                [_prompt_of(item) for item in items],
                n=cfg.num_samples_per_prompt,
                temperature=cfg.temperature,
                max_tokens=cfg.max_tokens,
                seed=cfg.seed + self.step_count * 1_000_003,  # fresh samples every step, repeatable runs
            )
            generated = time.perf_counter()
            rewards = self._score(batch, items)
            metrics = {
                "time_generate": generated - start,
                "time_reward": time.perf_counter() - generated,
                "tokens_per_s": float(batch.response_mask.sum()) / max(generated - start, 1e-9),
                # Sync mode: every sample should come from the weights of the previous sync (all zeros).
                "staleness/values": self._staleness(batch),
            }
            payload = [(batch, rewards, metrics)]
        if self.world_size > 1:
            dist.broadcast_object_list(payload, src=0)
        return payload[0]

    def _generate_async(self) -> tuple[RolloutBatch, torch.Tensor, dict[str, Any]]:
        """Rank 0: the next step's finished groups from the producer, scored; every rank gets the same (broadcast)."""
        cfg = self.config.rollout
        payload: list[Any] = [None]
        if self.rank == 0:
            start = time.perf_counter()
            groups = self.producer.take(cfg.num_prompts_per_step)
            taken = time.perf_counter()
            groups.sort(key=lambda g: g.index)  # finish order varies; submission order keeps runs comparable
            batch = collate([g.output for g in groups], self._pad_token_id, cfg.num_samples_per_prompt)
            items = [g.item for g in groups]
            rewards = self._score(batch, items)
            # Throughput of the pipeline: tokens handed over per second between two takes.
            since = taken - (self._last_take if self._last_take is not None else start)
            self._last_take = taken
            metrics = {
                # only the wait for groups not finished yet: the rest of generation overlapped training
                "time_generate": taken - start,
                "time_reward": time.perf_counter() - taken,
                "tokens_per_s": float(batch.response_mask.sum()) / max(since, 1e-9),
                "mixed_version_fraction": sum(len(v) > 1 for v in batch.sample_versions()) / batch.num_samples,
                "staleness/values": self._staleness(batch),
            }
            payload = [(batch, rewards, metrics)]
        if self.world_size > 1:
            dist.broadcast_object_list(payload, src=0)
        return payload[0]

    def _score(self, batch: RolloutBatch, items: Sequence[Any]) -> torch.Tensor:
        rewards = self.reward_fn(batch.completions, [items[i] for i in batch.prompt_ids])
        rewards = torch.as_tensor(list(rewards), dtype=torch.float32)
        if rewards.shape != (batch.num_samples,):
            raise ValueError(f"reward_fn: returned {rewards.numel()} rewards for {batch.num_samples} completions")
        return rewards

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
            if self.policy.reference is not None:
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
                mask = mb.response_mask.to(device)
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
        return self._mean_over_ranks(means)

    def _mean_over_ranks(self, metrics: dict[str, float]) -> dict[str, float]:
        if self.world_size == 1:
            return metrics
        names = sorted(metrics)  # same keys on every rank: same config, same code path
        values = torch.tensor([metrics[n] for n in names], dtype=torch.float64, device=self.policy.device)
        dist.all_reduce(values)
        return dict(zip(names, (values / self.world_size).tolist()))

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
        metrics["reward_mean"] = float(rewards.mean())
        metrics["reward_std"] = float(rewards.std()) if rewards.numel() > 1 else 0.0
        metrics["response_len_mean"] = float(batch.response_mask.sum(-1).mean())

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
        if keep.numel() >= self.world_size:
            train_batch = batch if keep.numel() == batch.num_samples else batch.select(keep)
            metrics.update(self._train(train_batch, advantages[keep]))
        metrics["time_train"] = time.perf_counter() - start

        start = time.perf_counter()
        version = f"step-{step}"
        # Async: freeze the requests in flight (they keep their KV) so no token is computed with
        # half-updated weights; on resume they recompute with the new ones.
        paused = self.rank == 0 and rollout.async_mode
        if paused:
            self.worker.pause("keep")
        try:
            self.sync.send_weights(weight_version=version)
        finally:
            if paused:
                self.worker.resume()
        self.weight_version = version
        self._version_index[version] = step
        if self.producer is not None:
            self.producer.advance_version(step)
        metrics["time_sync"] = time.perf_counter() - start
        metrics["weight_version"] = float(step)
        if self.rank == 0 and step % self.config.logging.log_every == 0:
            self.log({k: v for k, v in metrics.items() if not isinstance(v, list)}, step)
            if self.log_histogram is not None and metrics["staleness/values"]:
                self.log_histogram("staleness", metrics["staleness/values"], step)
        return metrics

    def items_for_step(self, problems: Sequence[Any], step: int) -> list[Any]:
        """The num_prompts_per_step problems of 1-based `step`, cycling through `problems` in order."""
        num = self.config.rollout.num_prompts_per_step
        return [problems[((step - 1) * num + i) % len(problems)] for i in range(num)]

    def train(self, problems: Sequence[Any], num_steps: int | None = None) -> list[dict[str, Any]]:
        """Runs num_steps (default config.num_steps) steps over `problems`, saving on logging.save_every."""
        if not problems:
            raise ValueError("problems: empty; training needs at least one prompt")
        num_steps = self.config.num_steps if num_steps is None else num_steps
        if self.config.rollout.async_mode:
            return self._train_async(problems, num_steps)
        history = []
        for _ in range(num_steps):
            history.append(self.step(self.items_for_step(problems, self.step_count + 1)))
            self._maybe_save()
        return history

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

    def _maybe_save(self) -> None:
        every = self.config.logging.save_every
        if every and self.step_count % every == 0:
            self.policy.save(os.path.join(self.config.logging.output_dir, f"step-{self.step_count}"))

    def close(self) -> None:
        """Shuts the weight sync down (and the worker, if this trainer started it)."""
        if self.producer is not None:
            self.producer.close()
            self.producer = None
        self.sync.shutdown()
        if self._owns_worker and self.worker is not None:
            self.worker.shutdown()

    def __enter__(self) -> GRPOTrainer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---- command line ----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """`python -m trainers.grpo`: train on config.task, evaluate held-out accuracy before and after, save."""
    config = parse_config(TrainerConfig, argv, prog="python -m trainers.grpo")
    task = importlib.import_module(config.task.module)
    problems = task.make_problems(config.task.num_train_problems, config.seed, "train")
    eval_problems = (
        task.make_problems(config.task.num_eval_problems, config.seed, "eval")
        if config.task.num_eval_problems and hasattr(task, "evaluate")
        else []
    )
    summary: dict[str, Any] = {"config": to_dict(config)}
    with GRPOTrainer(config, reward_fn=task.batched_reward) as trainer:
        if trainer.rank == 0 and eval_problems:
            summary["accuracy_before"] = task.evaluate(trainer.worker, eval_problems)
            print(f"held-out accuracy before: {summary['accuracy_before']:.3f}", flush=True)
        history = trainer.train(problems)
        if trainer.rank == 0 and eval_problems:
            summary["accuracy_after"] = task.evaluate(trainer.worker, eval_problems)
            print(f"held-out accuracy after: {summary['accuracy_after']:.3f}", flush=True)
        if config.logging.save_final:
            trainer.policy.save(os.path.join(config.logging.output_dir, "final"))
        if trainer.rank == 0:
            summary["history"] = history
            os.makedirs(config.logging.output_dir, exist_ok=True)
            with open(os.path.join(config.logging.output_dir, "summary.json"), "w") as f:
                json.dump(summary, f, indent=2)
    if dist.is_initialized():
        dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:  # bad configuration: a one-line message naming the field, not a traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
