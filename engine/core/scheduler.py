"""Scheduler: hands one step's token budget to requests whose computed tokens lag their tokens."""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Iterable, Iterator

import numpy as np

from engine.config import CacheConfig, LoRAConfig, SchedulerConfig, SpecDecodeSettings, UsageContext
from engine.control import PauseState
from engine.control_state import ControlState
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from engine.core.stats import SchedulerStats, SpecDecodingStats, StepWork
from engine.exceptions import EngineNotReadyError
from engine.sampling_params import RepetitionDetectionParams
from engine.wire import EngineCoreOutput, EngineCoreOutputs
from engine.worker.runner_output import ModelRunnerOutput

_DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
_GIB = 2**30


def default_max_num_batched_tokens(usage: UsageContext, device_type: str, total_memory: int = 0,
                                   device_name: str = "") -> int:
    """vLLM's default step budget (its EngineArgs.get_batch_defaults) for who drives the engine and on what device.

    Large GPUs take big prefill steps offline: fewer, fuller steps, and fewer eager mixed steps. A server keeps
    steps shorter for its requests' latency. A plain AsyncLLM (vLLM's engine context) and the CPU keep 2048:
    vLLM's CPU default for an LLM is 4096, ours stays 2048, which the CPU benchmarks are measured at.
    """
    if device_type != "cuda" or usage == "engine":
        return _DEFAULT_MAX_NUM_BATCHED_TOKENS
    if total_memory >= 160 * _GIB:
        return 16384
    # A100s lose throughput with the larger budget (vLLM PR 17885), so they stay on the small tier.
    if total_memory >= 70 * _GIB and "a100" not in device_name.lower():
        return 16384 if usage == "llm_class" else 8192
    return 8192 if usage == "llm_class" else 2048


def token_budget(config: SchedulerConfig, max_model_len: int, default: int = _DEFAULT_MAX_NUM_BATCHED_TOKENS) -> int:
    """One step's token budget: max_num_batched_tokens, or by default max(default, max_num_seqs),
    and at least max_model_len without chunked prefill (a whole prompt must fit). default: the device's
    (default_max_num_batched_tokens), which the worker knows."""
    if config.max_num_batched_tokens is not None:
        return config.max_num_batched_tokens
    budget = max(default, config.max_num_seqs)
    return budget if config.enable_chunked_prefill else max(budget, max_model_len)


class FCFSWaitingQueue:
    """Arrival order; a preempted request goes back to the front. Victim: the newest running."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def add_preempted(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove_ids(self, req_ids: set[str]) -> None:
        self._queue = deque(r for r in self._queue if r.request_id not in req_ids)

    @staticmethod
    def preemption_victim(running: list[Request]) -> Request:
        return running[-1]

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityWaitingQueue:
    """Lowest (priority, arrival_time) first (Request.__lt__); victim: the highest running."""

    def __init__(self) -> None:
        self._heap: list[Request] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    add_preempted = add  # its (priority, arrival) already says where it belongs

    def peek(self) -> Request:
        return self._heap[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)

    def remove_ids(self, req_ids: set[str]) -> None:
        self._heap = [r for r in self._heap if r.request_id not in req_ids]
        heapq.heapify(self._heap)

    @staticmethod
    def preemption_victim(running: list[Request]) -> Request:
        return max(running)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._heap))


class Scheduler:
    """Continuous batching with chunked prefill, prefix caching and preemption by recompute.

    One rule for everything: a request is owed num_tokens - num_computed_tokens tokens
    (a prompt, the rest of a prompt, or one decode token); a step pays out of one budget
    of max_num_batched_tokens over at most max_num_seqs requests. num_computed_tokens
    advances when a step is scheduled, so schedule() may run again before that step's
    outputs arrive. A scheduled row that reaches the request's last token samples one, which
    counts as a placeholder token until its value comes back (update_from_output): the next
    schedule() already gives it a row, at its position, and the model runner fills in its id
    on the device (async scheduling, one step in flight). A request whose in-flight tokens
    reach max_tokens or max_model_len is not scheduled again; one that stops on EOS or a stop
    token while its next step is in flight has that step's token dropped.

    Default budget when max_num_batched_tokens is None: max(2048, max_num_seqs) with
    chunked prefill, and at least max_model_len without it (a whole prompt must fit).

    Speculative decoding (spec): a running request's spec_token_ids (proposed after its last
    step) are owed too, after its last known token, and a step verifies them: the row's
    num_computed_tokens advances over them when scheduled and goes back by the rejected ones
    when the output comes (the KV at rejected positions is simply overwritten later). A draft
    model also writes its own KV a few positions ahead: those lookahead slots are allocated
    with the step but never cached. Speculative steps run without a step in flight.

    Pause states (pause_state, read from the engine's ControlState, engine/control_state.py):
    PAUSED_NEW refuses new requests but schedules everything already admitted (waiting and
    preempted ones too, so a wait-mode pause drains); PAUSED_ALL schedules nothing and queues
    new requests, so a request stops exactly between two steps and later continues from there.

    LoRA (lora.enable_lora): the running requests use at most max_loras distinct adapters, so every
    step fits the worker's resident adapter slots. A waiting request whose adapter would be one too
    many waits (keeping its place in the queue) while requests behind it that fit are admitted.
    """

    def __init__(
        self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, max_model_len: int, num_blocks: int,
        spec: SpecDecodeSettings | None = None, control: ControlState | None = None, lora: LoRAConfig | None = None,
        default_token_budget: int = _DEFAULT_MAX_NUM_BATCHED_TOKENS,
    ) -> None:
        """control: the engine core's ControlState, whose pause_state this scheduler obeys (None: one of its own).
        default_token_budget: the budget when max_num_batched_tokens is unset (the workers' device default)."""
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        budget = token_budget(scheduler_config, max_model_len, default_token_budget)
        if not self.enable_chunked_prefill and budget < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({budget}) must be >= max_model_len ({max_model_len}) "
                "when enable_chunked_prefill is off"
            )
        self.max_num_batched_tokens = budget
        block_size = cache_config.block_size
        if -(-max_model_len // block_size) > num_blocks:
            # Otherwise one long request could never fit and the engine would spin forever.
            raise ValueError(
                f"num_blocks ({num_blocks}) x block_size ({block_size}) cannot hold one "
                f"max_model_len ({max_model_len}) sequence"
            )
        self.kv_cache_manager = KVCacheManager(num_blocks, block_size, cache_config.enable_prefix_caching)

        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting = PriorityWaitingQueue() if scheduler_config.scheduling_policy == "priority" else FCFSWaitingQueue()
        self.running: list[Request] = []
        # Finished or aborted since the last schedule(): the runner drops their state.
        self.finished_req_ids: set[str] = set()
        # Requests whose KV was dropped outside schedule() (recompute_running); the runner
        # must forget them on the next step, like preempted ones.
        self.requeued_req_ids: set[str] = set()
        # Running requests whose sampling reads their output so far (penalties, bad words):
        # while there are any, the engine core steps without a step in flight. (A waiting one
        # has its whole output on the host when it is scheduled.)
        self.history_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.num_preemptions_since_stats = 0
        self.step_work_since_stats = StepWork()
        # Read, never set here: the pause state follows from what the RL controls did, so it outlives
        # a scheduler rebuilt after a fault and cannot drift from the engine core's view of it.
        self.control = control if control is not None else ControlState()
        self.num_spec_tokens = spec.num_speculative_tokens if spec is not None else 0
        # A draft model writes its KV up to num_spec_tokens positions past a step's last token.
        self.num_lookahead_tokens = self.num_spec_tokens if spec is not None and spec.method == "draft_model" else 0
        self.spec_stats = SpecDecodingStats(self.num_spec_tokens) if spec is not None else None
        self.spec_totals = SpecDecodingStats(self.num_spec_tokens) if spec is not None else None  # never reset
        self.max_loras = lora.max_loras if lora is not None and lora.enable_lora else None

    # ---- requests in and out ----

    def add_request(self, request: Request) -> None:
        if self.pause_state == PauseState.PAUSED_NEW:
            raise EngineNotReadyError("the engine is paused: no new requests until resume()", reason="paused")
        if not 0 < request.num_prompt_tokens <= self.max_model_len:
            raise ValueError(
                f"prompt_token_ids: prompt has {request.num_prompt_tokens} tokens; "
                f"it must have between 1 and max_model_len ({self.max_model_len})"
            )
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already running")
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, req_ids: str | Iterable[str], status: RequestStatus) -> list[Request]:
        """Finishes unfinished requests from outside (abort, error); unknown ids are ignored."""
        assert RequestStatus.is_finished(status), status
        req_ids = {req_ids} if isinstance(req_ids, str) else set(req_ids)
        finished = [self.requests.pop(i) for i in req_ids if i in self.requests]
        if not finished:
            return []
        done_ids = {r.request_id for r in finished}
        self.running = [r for r in self.running if r.request_id not in done_ids]
        self.waiting.remove_ids(done_ids)
        for request in finished:
            request.status = status
            self.kv_cache_manager.free(request)
        self.finished_req_ids |= done_ids
        self.history_req_ids -= done_ids
        return finished

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def pause_state(self) -> PauseState:
        return self.control.pause_state

    # ---- one step ----

    def schedule(self) -> SchedulerOutput:
        if self.pause_state == PauseState.PAUSED_ALL:
            # Nothing moves; finished_req_ids stay for the first step after the pause.
            return SchedulerOutput([], CachedRequestData(), {}, 0)
        kv = self.kv_cache_manager
        token_budget = self.max_num_batched_tokens
        num_scheduled_tokens: dict[str, int] = {}
        spec_tokens: dict[str, list[int]] = {}
        new_block_ids: dict[str, list[int] | None] = {}  # running requests: blocks appended this step (None: none)
        scheduled_running: list[Request] = []  # in the order of num_scheduled_tokens, which lists them first
        scheduled_new: list[Request] = []
        preempted_req_ids: set[str] = set()

        # 1. Running requests, in order. When blocks run out, preempt the policy's victim.
        # (A loop over every running request each step: attributes are read once into locals.)
        running = self.running  # changed in place below (preemption), never rebound during schedule()
        max_model_len = self.max_model_len
        allocate_slots = kv.allocate_slots
        req_index = 0
        while req_index < len(running) and token_budget > 0:
            request = running[req_index]
            drafts = request.spec_token_ids and self._schedulable_drafts(request)  # () without speculation
            num_computed = request.num_computed_tokens
            num_placeholders = request.num_output_placeholders
            num_new = min(
                len(request.all_token_ids) + num_placeholders + len(drafts) - num_computed,
                token_budget,
                max_model_len - num_computed,
            )
            if num_new <= 0 or (num_placeholders and self._ends_in_flight(request)):
                req_index += 1  # nothing to compute before its samples come back
                continue
            lookahead = self._lookahead(num_computed + num_new) if self.num_lookahead_tokens else 0
            while (blocks := allocate_slots(request, num_new, None, 0, lookahead)) is None:
                victim = self.waiting.preemption_victim(running)
                victim_index = running.index(victim)
                del running[victim_index]
                if victim_index < req_index:  # already visited this step: undo its share
                    req_index -= 1
                    if victim.request_id in num_scheduled_tokens:
                        scheduled_running.remove(victim)
                    token_budget += num_scheduled_tokens.pop(victim.request_id, 0)
                    new_block_ids.pop(victim.request_id, None)
                    spec_tokens.pop(victim.request_id, None)
                self._preempt(victim)
                preempted_req_ids.add(victim.request_id)
                if victim is request:
                    break
            if blocks is None:  # this request itself was preempted; the next one is now at req_index
                continue
            req_id = request.request_id
            scheduled_running.append(request)
            num_scheduled_tokens[req_id] = num_new
            new_block_ids[req_id] = blocks.get_block_ids() or None
            if drafts:
                num_drafts = num_computed + num_new - len(request.all_token_ids)  # the budget may cut drafts
                if num_drafts > 0:
                    spec_tokens[req_id] = drafts[:num_drafts]
            token_budget -= num_new
            req_index += 1

        # 2. Waiting requests (new or preempted), only if this step did not run short of blocks.
        running_lora_ids = {r.lora_int_id for r in self.running} - {0} if self.max_loras is not None else set()
        lora_skipped: list[Request] = []  # waiting for an adapter slot; back at the front of the queue below
        while not preempted_req_ids and self.waiting and token_budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            lora_id = request.lora_int_id
            if lora_id and lora_id not in running_lora_ids and len(running_lora_ids) >= self.max_loras:
                lora_skipped.append(self.waiting.pop())
                continue
            hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit_tokens
            if not self.enable_chunked_prefill and num_new > token_budget:
                break
            num_new = min(num_new, token_budget)
            lookahead = self._lookahead(num_hit_tokens + num_new) if self.num_lookahead_tokens else 0
            if kv.allocate_slots(request, num_new, hit_blocks, num_hit_tokens, num_lookahead_tokens=lookahead) is None:
                break
            self.waiting.pop()
            self.running.append(request)
            if lora_id:
                running_lora_ids.add(lora_id)
            if request.sampling_params.needs_output_history:
                self.history_req_ids.add(request.request_id)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            scheduled_new.append(request)
            num_scheduled_tokens[request.request_id] = num_new
            token_budget -= num_new
        for request in reversed(lora_skipped):  # in their order, ahead of the rest
            self.waiting.add_preempted(request)

        # 3. Describe the step (num_computed_tokens = where its tokens start), then advance.
        new_reqs_data = [
            NewRequestData(
                req_id=r.request_id,
                token_ids=list(r.all_token_ids),
                num_prompt_tokens=r.num_prompt_tokens,
                sampling_params=r.sampling_params,
                block_ids=kv.get_block_ids(r.request_id),
                num_computed_tokens=r.num_computed_tokens,
                eos_token_id=r.eos_token_id,
                lora_request=r.lora_request,
            )
            for r in scheduled_new
        ]
        cached_reqs_data = CachedRequestData(
            req_ids=list(new_block_ids),
            new_block_ids=list(new_block_ids.values()),
            num_computed_tokens=[r.num_computed_tokens for r in scheduled_running],
        )
        work = self.step_work_since_stats
        # Decode rows (one token that samples) are counted together: they differ only in where they start.
        num_decode_rows = decode_kv_context_sum = 0
        for request, num_new in zip(scheduled_running + scheduled_new, num_scheduled_tokens.values()):
            start = request.num_computed_tokens
            request.num_computed_tokens = end = start + num_new
            # A row samples when it reaches the request's last token; a mid-prompt chunk does not.
            samples = end >= len(request.all_token_ids) + request.num_output_placeholders
            if samples:
                request.num_output_placeholders += 1
                if num_new == 1:
                    num_decode_rows += 1
                    decode_kv_context_sum += end
                    continue
            work.add_row(start, num_new, samples=samples)
        if num_decode_rows:
            work.add_decode_rows(num_decode_rows, decode_kv_context_sum)
        if num_scheduled_tokens:
            work.num_steps += 1

        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs_data,
            scheduled_cached_reqs=cached_reqs_data,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=sum(num_scheduled_tokens.values()),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=preempted_req_ids | self.requeued_req_ids,
            scheduled_spec_decode_tokens=spec_tokens,
        )
        self.finished_req_ids = set()
        self.requeued_req_ids = set()
        return output

    @staticmethod
    def _schedulable_drafts(request: Request) -> list[int]:
        """The request's proposed tokens that may be verified: none past max_tokens (the step also
        samples one token of its own)."""
        drafts = request.spec_token_ids
        if drafts and request.max_tokens is not None:
            drafts = drafts[: max(0, request.max_tokens - request.num_output_tokens - 1)]
        return drafts

    def _lookahead(self, num_tokens_after_step: int) -> int:
        """Slots past a step's last token for the draft model's KV; none past max_model_len."""
        return min(self.num_lookahead_tokens, self.max_model_len - num_tokens_after_step)

    def _ends_in_flight(self, request: Request) -> bool:
        """Whether the tokens already being sampled for it reach max_tokens or max_model_len."""
        num_placeholders = request.num_output_placeholders
        if not num_placeholders:
            return False
        max_tokens = request.max_tokens
        return (max_tokens is not None and len(request.output_token_ids) + num_placeholders >= max_tokens) or (
            len(request.all_token_ids) + num_placeholders >= self.max_model_len
        )

    def _preempt(self, request: Request) -> None:
        """Preemption by recompute: drop its KV; it resumes later as a new request."""
        self._requeue_for_recompute(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.num_preemptions_since_stats += 1

    def _requeue_for_recompute(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        self.history_req_ids.discard(request.request_id)
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0  # an in-flight sample of it is dropped; it samples again
        request.spec_token_ids = ()
        self.waiting.add_preempted(request)

    def recompute_running(self) -> list[str]:
        """Drops the KV of every running request; each resumes by recomputing prompt + output.

        Used after a weight update, so tokens generated from then on come from the new
        weights over a context the new weights computed. Order is kept (they go back to the
        front of the waiting queue in running order); not counted as preemptions.
        """
        req_ids = [r.request_id for r in self.running]
        for request in reversed(self.running):
            self._requeue_for_recompute(request)
        self.running = []
        self.requeued_req_ids.update(req_ids)
        return req_ids

    def rekey_waiting_lora(self, lora_int_id: int, cache_key: int) -> int:
        """Gives the adapter's new prefix-cache key (after a weight sync of it) to its requests that have not
        started (status WAITING: never scheduled; a preempted one is PREEMPTED); returns how many. Those will
        compute everything with the new weights, so they must neither hit nor fill blocks under the old key.
        Requests that started keep theirs: their KV is partly the old adapter's, which only they may reuse."""
        num_rekeyed = 0
        for request in self.waiting:
            if request.lora_int_id == lora_int_id and request.status == RequestStatus.WAITING:
                request.lora_cache_key = cache_key
                request.block_hashes = []  # hashed under the old key by a lookup that found no room (recomputed)
                num_rekeyed += 1
        return num_rekeyed

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        outputs: list[EngineCoreOutput] = []
        finished_ids: set[str] = set()
        logprobs_rows = model_runner_output.logprobs
        # Usually empty: skip their per-row lookups.
        all_prompt_logprobs = model_runner_output.prompt_logprobs
        all_routed = model_runner_output.routed_experts
        all_spec = model_runner_output.spec_token_ids
        scheduled_spec = scheduler_output.scheduled_spec_decode_tokens
        # A loop over every row of the step: what it reads for each row is bound to locals first.
        requests, all_sampled, running = self.requests, model_runner_output.sampled_token_ids, RequestStatus.RUNNING
        check_stop = self._check_stop
        for row, req_id in enumerate(model_runner_output.req_ids):
            request = requests.get(req_id)
            # Finished, aborted or preempted since the step was scheduled: drop its results
            # (a preempted request recomputes and samples again).
            if request is None or request.status != running:
                continue
            new_token_ids = all_sampled[row]
            if new_token_ids:
                request.num_output_placeholders -= 1
                if scheduled_spec and (drafts := scheduled_spec.get(req_id)):
                    # The first len(new) - 1 drafts were accepted; the KV of the rest is recomputed later.
                    num_accepted = len(new_token_ids) - 1
                    request.num_computed_tokens -= len(drafts) - num_accepted
                    self.spec_stats.observe(len(drafts), num_accepted)
                    self.spec_totals.observe(len(drafts), num_accepted)
            if all_spec is not None:
                request.spec_token_ids = all_spec[row]
            prompt_logprobs = all_prompt_logprobs.get(req_id) if all_prompt_logprobs else None
            if all_routed and (routed := all_routed.get(req_id)) is not None:
                _collect_routed_experts(request, *routed)
            if not new_token_ids and prompt_logprobs is None:
                continue  # mid-prompt chunk: nothing to report
            # The request is RUNNING here, so only _check_stop can finish it.
            if len(new_token_ids) == 1:  # the usual row: Request.append_output_token_id, inlined
                request.output_token_ids.append(new_token_ids[0])
                request.all_token_ids.append(new_token_ids[0])
                stopped = check_stop(request)
            else:
                stopped = False
                for i, token_id in enumerate(new_token_ids):
                    request.append_output_token_id(token_id)
                    if check_stop(request):
                        new_token_ids = new_token_ids[: i + 1]  # tokens after a stop are dropped
                        stopped = True
                        break
            outputs.append(
                EngineCoreOutput(
                    request_id=req_id,
                    new_token_ids=new_token_ids,  # the runner's list of this row: made for this step only
                    new_logprobs=logprobs_rows[row] if logprobs_rows and new_token_ids else None,
                    new_prompt_logprobs=prompt_logprobs,
                    finish_reason=request.get_finish_reason() if stopped else None,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    num_preemptions=request.num_preemptions,
                    new_routed_experts=(
                        _take_routed_experts(request) if new_token_ids and request.pending_routed_experts else None
                    ),
                )
            )
            if stopped:
                finished_ids.add(req_id)
                self.kv_cache_manager.free(request)
                del requests[req_id]
        if finished_ids:
            self.running = [r for r in self.running if r.request_id not in finished_ids]
            self.finished_req_ids |= finished_ids
            self.history_req_ids -= finished_ids
        return EngineCoreOutputs(outputs=outputs, timestamp=time.time())

    def _check_stop(self, request: Request) -> bool:
        """Sets the finished status if the last appended token ends the request."""
        params = request.sampling_params
        output_token_ids = request.output_token_ids
        last_token_id = output_token_ids[-1]
        num_output_tokens = len(output_token_ids)
        if num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last_token_id == request.eos_token_id:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if params.stop_token_ids and last_token_id in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = last_token_id
                return True
        max_tokens = request.max_tokens
        if (max_tokens is not None and num_output_tokens >= max_tokens) or (
            len(request.all_token_ids) >= self.max_model_len
        ):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        if params.repetition_detection is not None and _ends_in_repetition(
            request.output_token_ids, params.repetition_detection
        ):
            request.status = RequestStatus.FINISHED_REPETITION
            return True
        return False

    # ---- stats and cache control ----

    def make_stats(self) -> SchedulerStats:
        queries, hits = self.kv_cache_manager.make_prefix_cache_stats()
        stats = SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            num_preemptions=self.num_preemptions,
            step_num_preemptions=self.num_preemptions_since_stats,
            step_work=self.step_work_since_stats,
            pause_state=int(self.pause_state),
            spec_decoding=self.spec_stats,
        )
        if self.spec_stats is not None:
            self.spec_stats = SpecDecodingStats(self.num_spec_tokens)
        self.num_preemptions_since_stats = 0
        self.step_work_since_stats = StepWork()
        return stats

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()


def _ends_in_repetition(token_ids: list[int], params: RepetitionDetectionParams) -> bool:
    """True if token_ids ends in some pattern of L tokens (min..max_pattern_size) repeated
    min_count times in a row."""
    num_tokens = len(token_ids)
    for size in range(params.min_pattern_size, params.max_pattern_size + 1):
        span = size * params.min_count
        if span > num_tokens:
            break
        if token_ids[num_tokens - span :] == token_ids[num_tokens - size :] * params.min_count:
            return True
    return False


def _collect_routed_experts(request: Request, start_pos: int, ids) -> None:
    """Keeps the routing of positions not reported yet. A recompute (preemption, weight update)
    runs positions again: their first routing, the one reported or waiting, is kept."""
    skip = request.num_routed_tokens - start_pos
    if skip < len(ids):
        request.pending_routed_experts = [*request.pending_routed_experts, ids[max(skip, 0):]]
        request.num_routed_tokens = start_pos + len(ids)


def _take_routed_experts(request: Request):
    """The routing waiting to be reported, as one [n, layers, k] array (None if nothing waits)."""
    parts = request.pending_routed_experts
    if not parts:
        return None
    request.pending_routed_experts = ()
    return parts[0] if len(parts) == 1 else np.concatenate(parts)
