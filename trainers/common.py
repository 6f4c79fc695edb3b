"""What the GRPO and PPO trainers share: starting the rollout worker (in-process, Ray or HTTP), generating and scoring a step on rank 0, the weight sync (local, colocated ipc, nccl or sharded_rdt), metric names, and the command-line run."""

from __future__ import annotations

import importlib
import inspect
import os
from abc import ABC, abstractmethod
import socket
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from trainers.cli import parse_config, to_dict
from trainers.config import LoRAConfig, ModelConfig, RolloutConfig
from trainers.lora import attach_adapter, lora_worker_args
from trainers.logging import MetricsLogger
from trainers.rollouts import Environment, RolloutBatch, generate_rollouts, generate_session_rollouts
from weight_transfer import trainer_init
from weight_transfer.clients import LocalWeightSyncClient
from weight_transfer.ipc import IPCTrainerInitInfo
from weight_transfer.local import LocalTrainerInitInfo
from weight_transfer.nccl import NCCLTrainerInitInfo
from weight_transfer.packing import ALIGN
from weight_transfer.sharded_rdt import ShardedRDTTrainerInitInfo

# batched reward: (completions, per-sample items) -> one float per completion
RewardFn = Callable[[list[str], list[Any]], Sequence[float]]
LogFn = Callable[[dict[str, float], int], None]
# (name, values, step): records a distribution, e.g. MetricsLogger.log_histogram
HistogramFn = Callable[[str, Sequence[float], int], None]

# The losses' metric names -> the names in trainers.logging.METRICS.
_LOSS_METRIC_NAMES = {"mismatch_abs": "mismatch/abs", "mismatch_kl": "mismatch/kl"}
_MAX_PACKED_BUFFER_BYTES = 512 << 20


def single_reward(fn: Callable[[str, Any], float]) -> RewardFn:
    """Adapts a per-sample reward `fn(completion, item) -> float` to the batched form the trainers call."""

    def batched(completions: list[str], items: list[Any]) -> list[float]:
        return [float(fn(c, item)) for c, item in zip(completions, items)]

    return batched


def prompt_of(item: Any) -> Any:
    """An item's prompt: its `.prompt` attribute (task problems) or the item itself (a string or token-id dict)."""
    return getattr(item, "prompt", item)


def start_worker(model: ModelConfig, rollout: RolloutConfig, lora: LoRAConfig | None = None):
    """The rollout worker of rollout.engine on the policy checkpoint, whose logprobs are those of the distribution it samples from.

    inprocess: a RolloutWorker; ray: a RolloutWorker Ray actor (trainers.engines.RayRolloutEngine);
    http: the server at rollout.server_url (trainers.engines.HTTPRolloutEngine), which must serve
    the same checkpoint and was launched with --logprobs-mode processed_logprobs. With `lora` (rank > 0)
    a worker started here serves one adapter of that rank (a server must be launched so: --enable-lora).
    """
    if rollout.engine == "http":
        from trainers.engines import HTTPRolloutEngine

        return HTTPRolloutEngine(rollout.server_url, model.path)
    worker_args = {
        "multiprocess": rollout.multiprocess,
        "device": model.device,
        "dtype": "bfloat16" if model.param_dtype == "bfloat16" else "float32",
        "max_model_len": rollout.max_model_len,
        "seed": rollout.seed,
        "logprobs_mode": "processed_logprobs",  # after temperature, as the trainer recomputes them
    }
    if rollout.batch_invariant:
        worker_args["batch_invariant"] = True  # the logprobs trainers/invariant_forward.py reproduces
    if rollout.colocate:
        worker_args["enable_sleep_mode"] = True  # it sleeps every step: its pinned host copy is made once, at start-up
    if rollout.gpu_memory_utilization is not None:
        worker_args["gpu_memory_utilization"] = rollout.gpu_memory_utilization
    if lora is not None and lora.enabled:
        worker_args.update(lora_worker_args(lora))
    if rollout.engine == "ray":
        from trainers.engines import RayRolloutEngine

        # The actor's workers join the trainer's nccl group at this node's address, which the engine's
        # default weight_transfer_allowed_hosts (loopback only) would refuse: this trainer started it, so allow it.
        worker_args["weight_transfer_allowed_hosts"] = ["127.0.0.1", "::1", "localhost", _address_towards(rollout)]
        return RayRolloutEngine.start(model.path, num_gpus=1.0 if model.device == "cuda" else 0.0, **worker_args)
    from rollout import RolloutWorker

    return RolloutWorker(model=model.path, **worker_args)


def check_worker_logprobs(worker, temperature: float) -> None:
    """ValueError if `worker` reports logprobs that ignore the sampling temperature the trainer scores at."""
    mode = getattr(getattr(getattr(worker, "config", None), "model", None), "logprobs_mode", None)
    if mode == "raw_logprobs" and temperature != 1.0:
        raise ValueError(
            f"worker: logprobs_mode 'raw_logprobs' ignores rollout.temperature={temperature}; "
            "start the worker with logprobs_mode='processed_logprobs'"
        )


def score(reward_fn: RewardFn, batch: RolloutBatch, items: Sequence[Any]) -> torch.Tensor:
    """Rewards [B] of the batch's completions, each against the item its prompt came from."""
    rewards = torch.as_tensor(list(reward_fn(batch.completions, [items[i] for i in batch.prompt_ids])),
                              dtype=torch.float32)
    if rewards.shape != (batch.num_samples,):
        raise ValueError(f"reward_fn: returned {rewards.numel()} rewards for {batch.num_samples} completions")
    return rewards


def generate_and_score(worker, items: Sequence[Any], reward_fn: RewardFn, rollout: RolloutConfig,
                       seed: int, environment: Environment | None = None) -> tuple[RolloutBatch, torch.Tensor, dict[str, float]]:
    """n samples of each item's prompt (n multi-turn sessions against `environment`, when given) and their
    rewards, with time/generate, time/reward and tokens_per_s (tokens the model generated)."""
    start = time.perf_counter()
    sampling = dict(n=rollout.num_samples_per_prompt, temperature=rollout.temperature, max_tokens=rollout.max_tokens,
                    seed=seed)
    if environment is not None:
        batch = generate_session_rollouts(worker, items, environment, **sampling)
    else:
        batch = generate_rollouts(worker, [prompt_of(item) for item in items], **sampling)
    generated = time.perf_counter()
    rewards = score(reward_fn, batch, items)
    metrics = {
        "time/generate": generated - start,
        "time/reward": time.perf_counter() - generated,
        "tokens_per_s": float(batch.train_mask.sum()) / max(generated - start, 1e-9),
    }
    return batch, rewards, metrics


def step_seed(rollout: RolloutConfig, step_count: int) -> int:
    """The base sampling seed of the step after `step_count`: fresh samples every step, repeatable runs."""
    return rollout.seed + step_count * 1_000_003


def broadcast_from_rank0(payload: Any, world_size: int) -> Any:
    """Rank 0's `payload` on every rank (other ranks pass anything)."""
    box = [payload]
    if world_size > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def reward_metrics(rewards: torch.Tensor, batch: RolloutBatch) -> dict[str, float]:
    """reward/mean, reward/std, accuracy (fraction of samples with reward 1: what an exact-match verifier accepts) and response length."""
    return {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "accuracy": float((rewards == 1.0).float().mean()),
        "response_len_mean": float(batch.response_mask.sum(-1).mean()),
    }


def rename_loss_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """The losses' metrics under trainers.logging.METRICS names (mismatch_abs -> mismatch/abs, ...)."""
    return {_LOSS_METRIC_NAMES.get(k, k): v for k, v in metrics.items()}


def items_for_step(problems: Sequence[Any], step: int, num_prompts: int) -> list[Any]:
    """The num_prompts problems of 1-based `step`, cycling through `problems` in order."""
    return [problems[((step - 1) * num_prompts + i) % len(problems)] for i in range(num_prompts)]


# ---- weight sync -----------------------------------------------------------------------------


def _packed_buffer_bytes(source) -> int:
    """A packed-transfer buffer as large as the model, or the adapter (at most _MAX_PACKED_BUFFER_BYTES): small models get small buffers."""
    if hasattr(source, "module"):
        total = sum(p.numel() * p.element_size() for p in source.module.parameters())
    else:  # an adapter (weight_transfer.lora.AdapterSource) knows its bytes
        total = getattr(source, "num_bytes", 0)
    return max(ALIGN, min(_MAX_PACKED_BUFFER_BYTES, -(-total // ALIGN) * ALIGN)) if total else _MAX_PACKED_BUFFER_BYTES


def _sync_client(worker):
    """The weight_transfer client that reaches `worker`: its own (Ray or HTTP adapters) or an in-process one."""
    make_client = getattr(worker, "weight_sync_client", None)
    return make_client() if callable(make_client) else LocalWeightSyncClient(worker)


def _address_towards(rollout: RolloutConfig) -> str:
    """This host's address as the engine's workers can reach it (they join the trainer's nccl group)."""
    if rollout.engine == "http":
        from urllib.parse import urlsplit

        host = urlsplit(rollout.server_url).hostname or "127.0.0.1"
        if host in ("localhost", "127.0.0.1", "::1"):
            return "127.0.0.1"
        # The source address of a route to the server (a UDP connect sends nothing).
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    if rollout.engine == "ray":
        import ray

        return ray.util.get_node_ip_address()
    return "127.0.0.1"


def make_weight_sync(rollout: RolloutConfig, worker, source, rank: int):
    """The trainer side of the weight sync into `worker` (rank 0's; None elsewhere), by rollout.weight_sync_backend.

    ipc (colocated): buffers live on the trainer's device (shared memory on CPU, CUDA IPC on GPU)
    and are freed after each sync, since between syncs the device belongs to training. local:
    tensors handed to an in-process worker. nccl: rank 0 broadcasts to the engine's workers, which
    join a group at this host's address (a free port, 1 sender + the engine's world size).
    sharded_rdt: every rank publishes into its own Ray producer actor and the engines pull.
    """
    backend = rollout.weight_sync_backend
    client = _sync_client(worker) if rank == 0 else None
    if backend == "ipc":
        info = IPCTrainerInitInfo(packed_buffer_size_bytes=_packed_buffer_bytes(source), keep_buffers=False)
    elif backend == "local":
        info = LocalTrainerInitInfo(encoding="tensors")
    elif backend == "nccl":
        # Every rank builds the same init info; only rank 0 can ask the engine its size.
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        address, num_engine_workers = broadcast_from_rank0(
            (_address_towards(rollout), client.get_world_size()) if rank == 0 else None, world_size
        )
        info = NCCLTrainerInitInfo(master_address=address, master_port=0, world_size=1 + num_engine_workers,
                                   packed_buffer_size_bytes=_packed_buffer_bytes(source))
    else:  # sharded_rdt
        info = ShardedRDTTrainerInitInfo()
    return trainer_init(info, client=client, source=source)


@contextmanager
def worker_asleep(worker, enabled: bool):
    """Colocated training: the worker sleeps (KV cache freed, weights offloaded) inside the block and wakes after it."""
    if not enabled or worker is None:
        yield
        return
    worker.sleep(1)
    try:
        yield
    finally:
        worker.wake_up()


# ---- the command-line run --------------------------------------------------------------------


def run_main(config_cls: type, trainer_cls: type, argv: Sequence[str] | None, prog: str) -> dict[str, Any]:
    """`python -m trainers.<algo>`: train on config.task, log every step through a MetricsLogger, evaluate held-out
    accuracy before and after, plot the reward curve, save the policy and summary.json; returns the summary."""
    config = parse_config(config_cls, argv, prog=prog)
    task = importlib.import_module(config.task.module)
    problems = task.make_problems(config.task.num_train_problems, config.seed, "train")
    eval_problems = (
        task.make_problems(config.task.num_eval_problems, config.seed, "eval")
        if config.task.num_eval_problems and hasattr(task, "evaluate")
        else []
    )
    summary: dict[str, Any] = {}
    rank = int(os.environ.get("RANK", "0"))
    # A multi-turn task (its module has an `environment`, trainers.rollouts.Environment) rolls out sessions.
    environment = {"environment": task.environment} if getattr(task, "environment", None) is not None else {}
    if environment and "environment" not in inspect.signature(trainer_cls).parameters:
        raise ValueError(f"task.module: {config.task.module} is a multi-turn task; {trainer_cls.__name__} "
                         "trains single-turn rollouts only (use python -m trainers.grpo)")
    with MetricsLogger(config.logging, to_dict(config), rank=rank, num_steps=config.num_steps) as logger:
        with trainer_cls(config, reward_fn=task.batched_reward, log=logger.log,
                         log_histogram=logger.log_histogram, **environment) as trainer:
            if trainer.rank == 0 and eval_problems:
                summary["accuracy_before"] = float(task.evaluate(trainer.worker, eval_problems))
                print(f"held-out accuracy before: {summary['accuracy_before']:.3f}", flush=True)
            history = trainer.train(problems)
            if trainer.rank == 0 and eval_problems:
                summary["accuracy_after"] = float(task.evaluate(trainer.worker, eval_problems))
                print(f"held-out accuracy after: {summary['accuracy_after']:.3f}", flush=True)
            if config.logging.save_final:
                trainer.policy.save(os.path.join(config.logging.output_dir, "final"))
            if trainer.rank == 0:
                if history:
                    summary["reward_curve"] = logger.plot_curve("reward/mean", os.path.join(logger.run_dir, "reward_curve.png"))
                summary["history"] = [{k: v for k, v in m.items() if not isinstance(v, list)} for m in history]
                summary["config"] = to_dict(config)
        logger.finish(summary)
    if dist.is_initialized():
        dist.destroy_process_group()
    return summary


def cli_entry(main: Callable[[], Any]) -> None:
    """Runs `main`, turning a bad configuration (ValueError naming the field) into a one-line error and exit code 2."""
    try:
        main()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


class RolloutTrainer(ABC):
    """What GRPOTrainer and PPOTrainer share: the run's config, reward and log callables, the rank,
    the rollout worker (started on rank 0 unless given, shut down by close() if started here), the
    weight sync of the policy into it, and the sync step loop with periodic saves.

    A subclass builds its policy (and losses) after RolloutTrainer.__init__, then calls
    _connect_worker(policy, worker); it provides step(items) and may extend train() and close().
    """

    def __init__(self, config, reward_fn: RewardFn, *, log: LogFn | None, log_histogram: HistogramFn | None) -> None:
        from trainers.policy import init_distributed

        self.config = config
        self.reward_fn = reward_fn
        self.log = log or (lambda metrics, step: None)
        self.log_histogram = log_histogram
        self.rank, self.world_size = init_distributed(config.model.device)
        torch.manual_seed(config.seed)
        self.step_count = 0

    def _connect_worker(self, policy, worker) -> None:
        """Starts the worker on rank 0 unless given and sets up the weight sync into it. With LoRA, the policy's
        adapter is loaded into it first (saved under logging.output_dir/lora-init) and self.worker generates
        with it (trainers.lora.AdapterWorker); a given worker must have been started with LoRA on."""
        self.policy = policy
        self._owns_worker = False
        lora = self.config.lora
        if self.rank == 0 and worker is None:
            worker = start_worker(self.config.model, self.config.rollout, lora)
            self._owns_worker = True
        engine = worker if self.rank == 0 else None
        self.worker = engine
        if lora.enabled:
            self.worker = attach_adapter(engine, policy, lora, os.path.join(self.config.logging.output_dir, "lora-init"))
        if self.worker is not None:
            check_worker_logprobs(self.worker, self.config.rollout.temperature)
        self.sync = make_weight_sync(self.config.rollout, engine, policy.weight_source(), self.rank)
        self.weight_version = self.worker.get_weight_version() if self.worker is not None else None

    @abstractmethod
    def step(self, items: Sequence[Any]) -> dict[str, Any]:
        """One training step over `items`: generate -> reward -> update -> weight sync; returns its metrics."""

    def items_for_step(self, problems: Sequence[Any], step: int) -> list[Any]:
        """The num_prompts_per_step problems of 1-based `step`, cycling through `problems` in order."""
        return items_for_step(problems, step, self.config.rollout.num_prompts_per_step)

    def train(self, problems: Sequence[Any], num_steps: int | None = None) -> list[dict[str, Any]]:
        """Runs num_steps (default config.num_steps) steps over `problems`, saving the policy on logging.save_every."""
        if not problems:
            raise ValueError("problems: empty; training needs at least one prompt")
        history = []
        for _ in range(self.config.num_steps if num_steps is None else num_steps):
            history.append(self.step(self.items_for_step(problems, self.step_count + 1)))
            self._maybe_save()
        return history

    def _maybe_save(self) -> None:
        every = self.config.logging.save_every
        if every and self.step_count % every == 0:
            self.policy.save(os.path.join(self.config.logging.output_dir, f"step-{self.step_count}"))

    def close(self) -> None:
        """Shuts the weight sync down (and the worker, if this trainer started it)."""
        self.sync.shutdown()
        if self._owns_worker and self.worker is not None:
            self.worker.shutdown()  # an AdapterWorker's is its engine's

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
