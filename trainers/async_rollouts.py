"""Async rollouts: a background producer keeps GRPO groups generating on a RolloutWorker while the trainer trains, and the staleness rules for what it produced.

    producer = AsyncRolloutProducer(worker, problems, n=4, temperature=1.0, max_tokens=32, seed=0,
                                    groups_per_step=8, lookahead_steps=2)
    groups = producer.take(8)          # blocks until 8 groups have finished
    ...train, pause_generation("keep"), sync, resume_generation()...
    producer.advance_version(step)     # admits the next step's groups

Versions are counted as integers: 0 is the weights the worker served when training began,
k the weights sent after step k. A group is one request with n samples of one prompt.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.outputs import RequestOutput
from engine import SamplingParams

# How often a blocked take() looks at the producer's health, so a dead producer surfaces as its
# error instead of a hang.
_POLL_S = 0.5


@dataclass
class FinishedGroup:
    """One finished request of n samples and the item it was generated from."""

    index: int
    """Submission order of the group (0, 1, ...); item i of the producer's items cycles with it."""
    item: Any
    """The item (a problem with .prompt, or a prompt) the group was sampled from."""
    output: RequestOutput
    """The finished RequestOutput: n completions with sampled-token logprobs and weight_versions spans."""
    submitted_version: int
    """The version the producer knew of when it submitted the group (its tokens are at least this new)."""


def pad_token_id_of(worker) -> int:
    """The token id that pads rollouts: the tokenizer's pad, else its eos, else 0."""
    tokenizer = worker.tokenizer if hasattr(worker, "tokenizer") else worker.get_tokenizer()
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return token_id
    return 0


class AsyncRolloutProducer:
    """Submits groups to `worker` from its own thread and event loop; the trainer takes finished groups in finish order.

    Admission keeps the queue bounded and the samples fresh: with the trainer's weights at
    version v (told by advance_version), groups are submitted only while
    `num_submitted < (v + lookahead_steps) * groups_per_step`. Taking groups in submission order,
    group g trains at step g // groups_per_step + 1 on version g // groups_per_step and was
    submitted at a version >= that minus (lookahead_steps - 1), so lookahead_steps =
    max_staleness + 1 keeps ordered groups within the bound; groups that finish out of order can
    still be older, which is why the trainer checks every sample's versions anyway.
    """

    def __init__(
        self,
        worker,
        items: Sequence[Any],
        *,
        n: int,
        temperature: float,
        max_tokens: int,
        seed: int,
        groups_per_step: int,
        lookahead_steps: int,
        start_version: int = 0,
    ) -> None:
        if not items:
            raise ValueError("items: empty; the producer needs at least one prompt")
        if groups_per_step < 1:
            raise ValueError(f"groups_per_step: must be >= 1, got {groups_per_step}")
        if lookahead_steps < 1:
            raise ValueError(f"lookahead_steps: must be >= 1, got {lookahead_steps}")
        self.worker = worker
        self.items = list(items)
        self.n = n
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.seed = seed
        self.groups_per_step = groups_per_step
        self.lookahead_steps = lookahead_steps
        self._version = start_version
        self._first_version = start_version
        self.num_submitted = 0
        self._num_taken = 0
        self._num_finished = 0
        self._finished_cond = threading.Condition()
        self._ready: queue.Queue[FinishedGroup] = queue.Queue()  # bounded by admission, not by maxsize
        self._error: BaseException | None = None
        self._stopping = False
        self._loop = asyncio.new_event_loop()
        self._wake: asyncio.Event | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._main, name="async-rollout-producer", daemon=True)
        self._thread.start()
        self._started.wait()

    # ---- the producer thread -------------------------------------------------------------------

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._run())
        finally:
            self._loop.close()

    def _admission_limit(self) -> int:
        return (self._version - self._first_version + self.lookahead_steps) * self.groups_per_step

    def _admissible(self) -> bool:
        return self.num_submitted < self._admission_limit()

    async def _run(self) -> None:
        self._wake = asyncio.Event()
        self._started.set()
        tasks: set[asyncio.Task] = set()
        try:
            while not self._stopping:
                while self._admissible() and not self._stopping:
                    task = asyncio.ensure_future(self._generate(self.num_submitted, self._version))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    self.num_submitted += 1
                await self._wake.wait()
                self._wake.clear()
        finally:
            for task in tasks:  # cancelling agenerate aborts the request in the engine
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _generate(self, index: int, version: int) -> None:
        item = self.items[index % len(self.items)]
        params = SamplingParams(
            n=self.n,
            temperature=self.temperature,
            max_tokens=self.max_tokens,
            logprobs=0,  # the sampled token's logprob only
            seed=self.seed + index * self.n,  # the engine adds the sample index: no two samples share a seed
        )
        try:
            output = await self.worker.agenerate(getattr(item, "prompt", item), params)
        except Exception as e:  # noqa: BLE001 - take() re-raises it in the trainer (cancellation passes through)
            self._error = e
        else:
            self._ready.put(FinishedGroup(index=index, item=item, output=output, submitted_version=version))
        with self._finished_cond:
            self._num_finished += 1
            self._finished_cond.notify_all()

    def _notify(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self._wake.set)
        except RuntimeError:  # the loop is closed: the producer has stopped
            pass

    # ---- the trainer's side --------------------------------------------------------------------

    @property
    def num_finished(self) -> int:
        """Groups whose request has ended (successfully or not) since the producer started."""
        with self._finished_cond:
            return self._num_finished

    def wait_finished(self, count: int, timeout: float) -> bool:
        """Blocks until at least `count` groups have finished or `timeout` seconds pass; True if they have."""
        with self._finished_cond:
            return self._finished_cond.wait_for(lambda: self._num_finished >= count, timeout=timeout)

    def advance_version(self, version: int) -> None:
        """The worker now serves `version` (the trainer's step count): admits that many more steps' groups."""
        if version < self._version:
            raise ValueError(f"version: {version} is older than the producer's current version {self._version}")
        self._version = version
        self._notify()

    def take(self, num_groups: int) -> list[FinishedGroup]:
        """The next `num_groups` finished groups in finish order; blocks until they exist. Re-raises a generation error."""
        limit = self._admission_limit()
        if self._num_taken + num_groups > limit:  # these could never all be submitted: waiting would hang
            raise ValueError(
                f"num_groups: {num_groups} more groups than the {limit - self._num_taken} that admission allows at "
                f"version {self._version}; call advance_version() after each weight sync"
            )
        groups: list[FinishedGroup] = []
        while len(groups) < num_groups:
            if self._error is not None:
                raise RuntimeError("async rollout producer: a generation request failed") from self._error
            if not self._thread.is_alive():
                raise RuntimeError("async rollout producer: stopped before the groups were generated")
            try:
                groups.append(self._ready.get(timeout=_POLL_S))
            except queue.Empty:
                continue
        self._num_taken += len(groups)
        return groups

    def close(self) -> None:
        """Stops submitting, aborts the requests in flight and joins the thread. Idempotent."""
        if self._stopping:
            return
        self._stopping = True
        self._notify()
        self._thread.join(timeout=60)

    def __enter__(self) -> AsyncRolloutProducer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def sample_staleness(weight_versions: Sequence[Sequence[tuple[str, int, int]]], version_index: dict[str, int],
                     current: int) -> list[int]:
    """Per sample, how many versions its oldest token is behind `current` (the version being trained).

    `weight_versions` are the samples' (version, start, end) spans; `version_index` maps each
    version name the trainer has served to its integer version.
    """
    staleness = []
    for i, spans in enumerate(weight_versions):
        if not spans:
            raise ValueError(f"weight_versions[{i}]: no spans; every generated token must carry its weight version")
        try:
            oldest = min(version_index[name] for name, _, _ in spans)
        except KeyError as e:
            raise ValueError(
                f"weight_versions[{i}]: version {e.args[0]!r} was never sent by this trainer "
                f"(known: {sorted(version_index)})"
            ) from None
        staleness.append(current - oldest)
    return staleness


def stale_sample_weights(staleness: torch.Tensor, max_staleness: int, policy: str,
                         stale_weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep [B] bool, weight [B] float) for samples of `staleness` [B] under the stale policy.

    drop: samples older than max_staleness are not kept, the others weigh 1. downweight: all are
    kept, and a sample `e` versions past the bound weighs stale_weight ** e (a factor on its
    advantage, which scales its clipped-surrogate loss by the same factor).
    """
    if policy not in ("drop", "downweight"):
        raise ValueError(f"policy: {policy!r} is not one of ['drop', 'downweight']")
    excess = (staleness - max_staleness).clamp(min=0).to(torch.float32)  # [B]
    if policy == "drop":
        return excess == 0, torch.ones_like(excess)
    return torch.ones_like(excess, dtype=torch.bool), torch.full_like(excess, stale_weight) ** excess
