"""EngineCore: the engine's inner loop, schedule -> execute -> update, one step at a time."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from engine.config import EngineConfig
from engine.control import (
    MEMORY_TAGS,
    RPC_METHODS,
    Combine,
    Control,
    PauseMode,
    SleepLevel,
    Where,
    WeightCheckerAction,
    check_pause_mode,
    combine_answers,
    forward_controls,
    init_info_of,
    update_info_of,
    vllm_weight_checker,
)
from engine.control_state import ControlState
from engine.core.request import Request, RequestStatus
from engine.core.sched_output import SchedulerOutput
from engine.core.scheduler import Scheduler
from engine.core.stats import SchedulerStats
from engine.deferred import DeferredResult
from engine.exceptions import EngineNotReadyError, WeightTransferError
from engine.executor import Executor, WorkerDiedError, get_executor_class
from engine.executor.base import OUTPUT_RANK, check_rank_baseline, combine_rank_dicts
from engine.lora.registry import LoRARegistry
from engine.lora.request import LoRARequest, lora_request_of, split_lora_name
from engine.wire import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from engine.worker.worker import Worker  # the executor's rpc names worker methods by reference
from weight_transfer import sync_trace

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable)


def between_steps(method: F) -> F:
    """Marks a control that changes what steps run or with which weights: it starts with drain() (see there)."""

    @functools.wraps(method)
    def drained(self: EngineCore, *args, **kwargs):
        self.drain()
        return method(self, *args, **kwargs)

    return drained  # type: ignore[return-value]


@forward_controls(asynchronous=False, include=lambda declared: declared.where is Where.WORKER)
class EngineCore:
    # Opaque label of the weights being served; stamped on every step's EngineCoreOutputs.
    weight_version: str = "default"
    _draft_update = False  # start_draft_weight_update: update_info without a "model" lands in the draft
    # The update in progress: whether a call landed tensors in a model (target or draft), and the adapters
    # (lora_int_ids) whose tensors it staged (update_info "lora_name"). finish acts on what it changed.
    _model_updated = False
    _synced_loras: frozenset[int] = frozenset()

    def _forward_control(self, declared: Control, args: tuple) -> Any:
        """A control the workers implement (engine/control.py: Where.WORKER): every rank runs it, and the
        ranks' answers combine by the control's rule."""
        answers = self.executor.rpc(getattr(Worker, declared.name), *args)
        if declared.combine is Combine.CONCAT:  # one item per rank
            return list(answers)
        return combine_answers(declared, answers,
                               lambda ranks: RuntimeError(f"{declared.name}: the tensor-parallel ranks disagree: {ranks}"))

    def __init__(self, config: EngineConfig, executor_class: type[Executor] | None = None) -> None:
        """executor_class: None picks it from config.parallel (uni, mp or ray)."""
        assert config.model.max_model_len is not None, "resolve max_model_len before building the core"
        self.config = config
        self.max_model_len = config.model.max_model_len
        hf = config.model.hf_config_dict()
        self.vocab_size = hf["vocab_size"]
        self.has_routed_experts = has_routed_experts(hf)
        self.executor = (executor_class or get_executor_class(config))(config, self.max_model_len)
        try:
            # Every rank sizes its cache; ranks must agree, so the smallest count is what all of them allocate.
            self.num_blocks = min(self.executor.rpc(Worker.determine_num_blocks))
            # The step budget's default depends on the device, which the workers know (ranks share one kind).
            self.default_token_budget = min(self.executor.rpc(Worker.default_token_budget))
            self.executor.rpc(Worker.initialize_kv_cache, self.num_blocks)
        except BaseException:
            self.executor.shutdown()  # no worker processes outlive a failed start
            raise
        # The RL control plane's state (pause, sleep, weight updates, transfer init); the scheduler
        # reads its pause state from it.
        self.control = ControlState(config.fault_tolerance.weight_update_idle_timeout_s)
        self.scheduler = self._new_scheduler()
        self._fault_pending = False  # tests only: inject_fault() makes the next step raise
        # ABORT outputs of requests ended by pause("abort") or sleep(); the next step() emits them.
        self._pending_outputs: list[EngineCoreOutput] = []
        # Whether the checkpoint's weights serve (no update finished since they were loaded), and their
        # version: what weight_version returns to when sleep(2) -> wake_up re-reads the checkpoint.
        self._serving_checkpoint = True
        self._checkpoint_weight_version = self.weight_version
        # Whether the last step() ran a forward pass: a lockstep engine (engine/dp_core_proc.py)
        # runs a dummy batch instead when it did not, so every rank runs one forward per step.
        self.last_step_ran_model = False
        # Async scheduling: the step launched last, whose outputs the next step() collects
        # after launching its own (so the host schedules while the device computes).
        lockstep = config.parallel.enable_expert_parallel and config.parallel.data_parallel_size > 1
        # Speculative steps run synchronously: the next step's drafts are proposed from this step's
        # verified tokens, so there is nothing to schedule before they are known.
        self.async_scheduling = (config.scheduler.async_scheduling and self.executor.supports_async_steps
                                 and not lockstep and config.speculative.settings is None)
        self._in_flight: tuple[SchedulerOutput, Any] | None = None
        # Outputs of a step collected by drain(), stamped with the weights that computed them;
        # the next step() returns them before anything else.
        self._drained: EngineCoreOutputs | None = None
        # The adapters the workers validated (LoRA serving), with their prefix-cache keys.
        self.loras = LoRARegistry(config.lora.max_cpu_loras)
        # No gc.freeze() here: an in-process engine (LLM, InprocClient) shares the caller's heap, which is
        # not the engine's to pin. The engine's own process freezes once it is built (core_proc.py).

    def _new_scheduler(self) -> Scheduler:
        return Scheduler(self.config.scheduler, self.config.cache, self.max_model_len, self.num_blocks,
                         self.config.speculative.settings, control=self.control, lora=self.config.lora,
                         default_token_budget=self.default_token_budget)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Admits a request, or raises ValueError naming what is wrong and changes nothing.

        EngineNotReadyError (retryable) while asleep, or paused in abort or wait mode; a
        keep-mode pause queues the request and schedules it after resume(). WorkerDiedError
        (an EngineDeadError) once a worker is gone.
        """
        self.executor.check_alive()  # a dead worker: EngineDeadError (WorkerDiedError) for every new request
        if self.control.sleeping:
            raise EngineNotReadyError("the engine is asleep: no requests until wake_up()", reason="sleeping")
        if self.control.weights_discarded:
            raise EngineNotReadyError(
                "the weights were discarded by sleep(level=2) and not all written since: push them with a weight "
                "update (start_weight_update, update_weights, finish_weight_update) or wake_up(reload_weights=True) "
                "to read the checkpoint", reason="weights_discarded")
        validate_request(request, self.max_model_len, self.vocab_size, self.has_routed_experts)
        core_request = Request.from_engine_core_request(request)
        if request.lora_request is not None:  # read and validated here, before the request is queued
            core_request.lora_cache_key = self._load_lora(lora_request_of(request.lora_request))
        self.scheduler.add_request(core_request)

    def abort_requests(self, req_ids: list[str]) -> list[EngineCoreOutput]:
        finished = self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)
        return [EngineCoreOutput(r.request_id, [], finish_reason=FinishReason.ABORT) for r in finished]

    def has_unfinished_requests(self) -> bool:
        """True while step() has work: requests it may schedule, a step in flight, or outputs it has yet to emit.

        Requests frozen by a keep-mode pause or by sleep do not count, so that the busy loop
        idles instead of spinning; scheduler.has_unfinished_requests() counts them.
        """
        return (bool(self._pending_outputs) or self._in_flight is not None or self._drained is not None
                or self._can_schedule())

    def _can_schedule(self) -> bool:
        return self.control.may_schedule and self.scheduler.has_unfinished_requests()

    def step(self) -> EngineCoreOutputs:
        """Schedules and runs one step and returns the outputs of a finished one.

        With async scheduling the step launched here is collected by the next call: each call
        schedules and launches step N+1, then waits for step N and returns its outputs, so the
        host's scheduling, input preparation and output handling overlap the device's work.
        """
        self.executor.check_alive()  # first: a dead executor leaves the scheduler and pending outputs as they were
        if self._in_flight is not None and self.scheduler.history_req_ids:
            self.drain()  # sampling needs every output so far on the host: no step may be in flight
        pending, self._pending_outputs = self._pending_outputs, []
        self.last_step_ran_model = False
        if self._drained is not None:  # a drained step's outputs go out on their own, with their weight version
            outputs, self._drained = self._drained, None
            return self._emit(pending, outputs)
        scheduler_output = self._schedule()
        outputs = self._execute(scheduler_output)  # the scheduler's update from the step that finished
        if outputs is None:  # nothing ran and nothing was in flight
            if not pending:
                return self._stamp(EngineCoreOutputs(timestamp=time.time()))
            outputs = EngineCoreOutputs(timestamp=time.time())
        return self._emit(pending, self._stamp(outputs))

    def _stamp(self, outputs: EngineCoreOutputs) -> EngineCoreOutputs:
        """Labels `outputs` with the versions that computed them: the model's, and each synced adapter's."""
        outputs.weight_version = self.weight_version
        outputs.lora_weight_versions = self.loras.synced_versions()
        return outputs

    def _schedule(self) -> SchedulerOutput | None:
        """This step's SchedulerOutput; None when nothing may be scheduled (idle, paused, asleep, updating)."""
        if not self._can_schedule():
            return None
        scheduler_output = self.scheduler.schedule()
        if self._fault_pending:  # the state a real mid-step failure leaves behind
            self._fault_pending = False
            raise InjectedFault("injected fault (enable_fault_injection, tests only)")
        return scheduler_output

    def _execute(self, scheduler_output: SchedulerOutput | None) -> EngineCoreOutputs | None:
        """Runs the scheduled step and returns the outputs of the step that finished (with async scheduling
        the one launched before, and empty outputs at the first); None when nothing ran or was in flight."""
        if scheduler_output is None or scheduler_output.is_empty:
            outputs = self._finish_in_flight()
            if scheduler_output is None:
                return outputs
            self.executor.execute_model(scheduler_output)  # an empty step: the runner still forgets finished requests
            return outputs if outputs is not None else EngineCoreOutputs(timestamp=time.time())
        self.last_step_ran_model = True
        if not self.async_scheduling:
            return self.scheduler.update_from_output(scheduler_output, self.executor.execute_model(scheduler_output))
        handle = self.executor.launch_model(scheduler_output)
        previous, self._in_flight = self._in_flight, (scheduler_output, handle)
        if previous is None:
            return EngineCoreOutputs(timestamp=time.time())
        return self.scheduler.update_from_output(previous[0], self.executor.finish_model(previous[1]))

    def _emit(self, pending: list[EngineCoreOutput], outputs: EngineCoreOutputs) -> EngineCoreOutputs:
        """A step's outputs as step() returns them: the pending ABORT outputs first, then fresh stats."""
        outputs.outputs = pending + outputs.outputs
        outputs.scheduler_stats = self.make_stats()
        return outputs

    def _finish_in_flight(self) -> EngineCoreOutputs | None:
        """Collects the step in flight, if any: its outputs, or None when there is none."""
        if self._in_flight is None:
            return None
        scheduler_output, handle = self._in_flight
        self._in_flight = None
        return self.scheduler.update_from_output(scheduler_output, self.executor.finish_model(handle))

    def drain(self) -> None:
        """Collects the step in flight; its outputs go out with the next step(), stamped with the
        weight version that computed them.

        Every control call that changes what steps run or with which weights (pause, sleep,
        wake-up, weight updates, synchronize: @between_steps) starts with it, so it sees the
        engine with no step half done, as in synchronous scheduling.
        """
        outputs = self._finish_in_flight()
        if outputs is None:
            return
        self._stamp(outputs)
        if self._drained is not None:
            outputs.outputs = self._drained.outputs + outputs.outputs
        self._drained = outputs

    def execute_dummy_batch(self) -> None:
        """One forward pass of one dummy token on every worker, touching no request state: a lockstep engine
        with no work of its own runs it so that its data-parallel peers' collectives have a partner."""
        self.executor.execute_dummy_batch()

    @between_steps
    def synchronize(self) -> None:
        """Waits until the device has finished everything queued on it (the step in flight collected)."""
        self.executor.rpc(Worker.synchronize)

    def make_stats(self) -> SchedulerStats:
        """The scheduler's stats (which resets its since-last-stats counters) plus the sleep level."""
        stats = self.scheduler.make_stats()
        stats.sleep_level = self.control.sleep_level
        return stats

    # ---- pause / sleep (the RL control plane; vocabulary in engine/control.py) ----------------
    # Utility calls run between steps, so each of these sees the engine idle: no step is half done.
    # Pause and sleep are independent; self.control derives the scheduler's PauseState from both.

    @between_steps
    def pause_generation(self, mode: PauseMode = "abort", clear_cache: bool = True) -> list[str]:
        """Pauses generation; returns the ids of the requests it aborted (abort mode only).
        clear_cache: in abort mode the prefix cache is reset too (in wait mode the frontend resets it
        once the requests are done; a keep-mode pause keeps it: its frozen requests hold their blocks).

        abort: every in-flight request ends with finish reason abort (its ABORT output is
            emitted by the next step, so every frontend ends it), new requests are refused.
        wait: new requests are refused (EngineNotReadyError); in-flight ones keep running. This
            call does not wait for them: the frontend polls has_unfinished_requests() until it
            is False (a utility call cannot block the loop that would finish them).
        keep: nothing is scheduled; in-flight requests keep their KV cache and new requests
            queue. resume() continues them exactly where they stopped.
        Pausing again switches the mode. Returns with the device synchronized.
        """
        mode = self.control.pause(mode)  # ValueError for an unknown mode: nothing changed
        aborted = self._abort_all() if mode == "abort" else []
        if clear_cache and mode == "abort":
            self.scheduler.reset_prefix_cache()
        self.executor.rpc(Worker.synchronize)
        return aborted

    def resume_generation(self) -> None:
        """Ends a pause (a no-op when not paused); does not wake a sleeping engine."""
        self.control.resume()

    def is_paused(self) -> bool:
        return self.control.paused

    @between_steps
    def sleep(self, level: SleepLevel = 1, mode: PauseMode = "abort") -> None:
        """Stops scheduling (level 0), and frees the KV cache and offloads (1) or discards (2) the weights.

        Requests in flight are aborted, except with mode "keep" at level 0, which freezes them like a
        keep pause (at level >= 1 their KV cache is about to be freed, so they are aborted). Mode
        "wait" is the frontend's: it lets them finish before it calls this. While asleep, new requests
        get EngineNotReadyError(reason="sleeping"). Sleeping again at the same level is a no-op; at
        another level, wake up first.
        """
        mode = check_pause_mode(mode)
        level = self.control.plan_sleep(level)
        if level is None:  # asleep at that level already
            return
        if level >= 1 or mode != "keep":
            aborted = self._abort_all()
            if aborted:
                logger.warning("EngineCore: sleep(%d) aborted %d in-flight requests", level, len(aborted))
        self.executor.rpc(Worker.sleep, level)
        if level >= 1:
            self.scheduler.reset_prefix_cache()  # the KV it points at is gone
        self.control.record_sleep(level)
        self.executor.rpc(Worker.synchronize)
        logger.info("EngineCore: asleep at level %d", level)

    @between_steps
    def wake_up(self, tags: list[str] | None = None, reload_weights: bool = False) -> bool:
        """Wakes the given parts ("weights", "kv_cache", "scheduling"; None: all); awake parts are skipped.

        Scheduling needs the memory back: it wakes by itself with the last of weights and
        kv_cache, and asking for it while one of them still sleeps is a ValueError. After
        sleep(2), "weights" brings the weights' memory back zero-filled and nothing is served
        (add_request: EngineNotReadyError, reason "weights_discarded") until a finished weight
        update has written every weight: the RL order sleep(2) -> wake_up(["weights"]) -> weight
        update -> wake_up(["kv_cache"]) serves exactly the update, under its version. With
        reload_weights, the checkpoint is read from disk instead and serves under the checkpoint's
        weight_version ("default" unless update_weight_version labelled it).
        The KV cache comes back with the same number of blocks and an empty prefix cache.
        """
        to_wake = self.control.plan_wake_up(tags)
        memory = to_wake & MEMORY_TAGS
        if memory:
            self.executor.rpc(Worker.wake_up, sorted(memory), reload_weights)
            if "weights" in memory and self.control.sleep_level == 2:
                if reload_weights:
                    # The checkpoint was re-read from disk: outputs must not carry a trained version's
                    # label until a weight update lands.
                    self.control.weights_discarded = False
                    self._serve_checkpoint()
                else:  # zeros until the trainer's weights land (the RL order updates right after this call)
                    self.control.weights_discarded = True
        self.control.record_wake_up(to_wake)
        if to_wake:
            logger.info("EngineCore: woke up %s%s", sorted(to_wake), "" if self.control.sleeping else "; awake")
        return not self.control.sleeping

    @between_steps
    def release_kv_cache_memory(self) -> None:
        """Frees the KV cache's memory while the weights stay (vLLM's); needs a completed pause with nothing
        left in flight, and every part awake (ValueError otherwise: the caller's order of calls, HTTP 400;
        vLLM's uncaught RuntimeError answers 500). The engine then sleeps ("kv_cache", "scheduling") until
        wake_up(["kv_cache"]) (or wake_up()) brings the cache back, empty."""
        if not self.control.paused or self.scheduler.has_unfinished_requests():
            raise ValueError("release_kv_cache_memory() requires a completed pause first")
        if self.control.sleeping:
            raise ValueError("release_kv_cache_memory() requires all executor memory to be resident")
        self.executor.rpc(Worker.release_kv_cache)
        self.scheduler.reset_prefix_cache()  # the KV it points at is gone
        self.control.record_kv_cache_released()
        self.executor.rpc(Worker.synchronize)

    def is_sleeping(self) -> bool:
        return self.control.sleeping

    def _abort_all(self) -> list[str]:
        finished = self.scheduler.finish_requests(list(self.scheduler.requests), RequestStatus.FINISHED_ABORTED)
        self._pending_outputs += [EngineCoreOutput(r.request_id, [], finish_reason=FinishReason.ABORT) for r in finished]
        return [r.request_id for r in finished]

    @between_steps
    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Drops the prefix cache; False while running requests hold cached blocks, unless
        reset_running_requests, which makes them drop their KV and recompute it when next scheduled.
        reset_connector: there is no external (connector) cache to reset."""
        for name, flag in (("reset_running_requests", reset_running_requests), ("reset_connector", reset_connector)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name}: expected true or false, got {flag!r}")
        if reset_running_requests:
            self.scheduler.recompute_running()
        return self.scheduler.reset_prefix_cache()

    def reset_after_fault(self) -> None:
        """Forgets every request and all cached KV after a failed step; the model and weights stay.

        The scheduler is rebuilt (its queues, block pool and prefix cache may be half-updated,
        and cached blocks may hold KV that was never written) and the runner drops its
        per-request state. A pause or sleep outlives it: the new scheduler reads self.control.
        """
        self._fault_pending = False
        self._in_flight = self._drained = None  # their requests are failed with the rest
        self.executor.rpc(Worker.reset_requests)
        self.scheduler = self._new_scheduler()
        self._pending_outputs = []  # their requests were failed with the rest

    def inject_fault(self, kind: str = "step") -> None:
        """Tests only: makes the next step raise InjectedFault. Needs enable_fault_injection."""
        if not self.config.fault_tolerance.enable_fault_injection:
            raise RuntimeError("fault injection is off (enable_fault_injection=False; it is for tests only)")
        if kind != "step":
            raise ValueError(f"kind: unknown fault kind {kind!r}; expected 'step'")
        self._fault_pending = True

    # ---- weights: versions, updates (engine/worker/weight_update.py), checks -------------------
    # Utility calls run between steps, so no step ever sees a half-applied update_weights call.
    # With a draft model (speculative decoding) init_info / update_info {"model": "draft"} update the
    # draft instead of the target, on the same lifecycle: the draft's KV lives in the same blocks,
    # so a draft update resets the prefix cache and recomputes running requests like a target update.
    # Every rank lands its part of an update; rank 0's answer (OUTPUT_RANK) speaks for the engine.

    @between_steps  # tokens of the step in flight belong to the version they were computed with
    def update_weight_version(self, new_version: str) -> None:
        self.weight_version = checked_version("new_version", new_version)
        if self._serving_checkpoint:  # a label for the checkpoint's own weights, kept across re-loads
            self._checkpoint_weight_version = new_version

    def _serve_checkpoint(self) -> None:
        """The weights are the checkpoint's again (re-loaded after sleep(2)): so is the version."""
        if self.weight_version != self._checkpoint_weight_version:
            logger.info("EngineCore: weights re-loaded from the checkpoint; weight_version %r -> %r",
                        self.weight_version, self._checkpoint_weight_version)
        self.weight_version = self._checkpoint_weight_version
        self._serving_checkpoint = True

    def get_weight_version(self, lora_name: str | None = None) -> str:
        if lora_name is not None:
            if not self.config.lora.enable_lora:
                raise ValueError("lora_name: LoRA is off; start the engine with enable_lora=True (--enable-lora)")
            return self.loras.weight_version(lora_name)
        return self.weight_version

    # Utilities with a deferred form: the engine process (engine/core_proc.py) calls the form named
    # here, which returns a DeferredResult it polls between steps, so that a wait on a peer never
    # holds the busy loop; in-process callers call the plain name, which waits for the answer.
    DEFERRED_UTILITIES = {"init_weight_transfer_engine": "begin_weight_transfer_init"}

    def init_weight_transfer_engine(self, request: Any) -> None:
        """Sets the weight transfer backend up (waiting for its rendezvous with the trainer); see begin_weight_transfer_init.
        request: vLLM's WeightTransferInitRequest, {"init_info": ...} or the init_info dict."""
        self.begin_weight_transfer_init(init_info_of(request)).wait()

    def begin_weight_transfer_init(self, init_info: dict[str, Any]) -> DeferredResult:
        """Starts init_weight_transfer_engine: ValueError now for bad init_info or a peer outside
        weight_transfer_allowed_hosts; the rendezvous runs in the workers' background (bounded by
        init_info's timeout_s: PeerTimeoutError) and the result says when every rank is done.

        Until then every other weight-update call is refused (WeightUpdateStateError), and a
        failed init leaves the previous transfer engine in place: nothing changes in the engine.
        The ranks install their new transfer engines together once all are ready, or drop them
        together when one failed (engine/worker/transfer_init.py)."""
        self.control.begin_init()  # here, not in the workers: a failed begin drops every rank's pending init
        try:
            self._init_rpc(Worker.begin_weight_transfer_init, init_info)
        except BaseException:
            self.control.end_init()
            raise

        def poll() -> tuple[bool, None]:
            try:
                ready = all(self._init_rpc(Worker.poll_weight_transfer_init))
                if ready:
                    self.executor.rpc(Worker.commit_weight_transfer_init)
            except BaseException:
                self.control.end_init()
                raise
            if ready:
                self.control.end_init()
            return ready, None

        return DeferredResult(poll)

    def _init_rpc(self, method: Callable, *args: Any) -> list[Any]:
        """executor.rpc(method, *args) of the init; when a rank raises, every rank's pending init is dropped first."""
        try:
            return self.executor.rpc(method, *args)
        except WorkerDiedError:
            raise
        except BaseException:
            try:
                self.executor.rpc(Worker.cancel_weight_transfer_init)
            except Exception as e:  # a worker gone meanwhile: the loop's liveness check reports it
                logger.warning("cancel_weight_transfer_init after a failed init: %s", e)
            raise

    @between_steps
    def start_weight_update(self) -> None:
        """Begins an update; until it finishes or aborts nothing is scheduled (requests queue)."""
        self.executor.rpc(Worker.start_weight_update)
        self.control.start_weight_update()
        self._draft_update = False
        self._end_update_record()

    def start_draft_weight_update(self) -> None:
        """start_weight_update for the draft model: until it ends, an update_info without "model" lands in the draft."""
        settings = self.config.speculative.settings
        if settings is None or settings.method != "draft_model":
            raise ValueError("start_draft_weight_update: this engine has no draft model "
                             '(speculative_config {"method": "draft_model", ...})')
        self.start_weight_update()
        self._draft_update = True

    @between_steps
    def update_weights(self, request: Any) -> int:
        """Lands one atomic batch of HF-named tensors; returns how many. ValueError: nothing changed.

        WeightTransferError: the transfer failed, the update is over and the previous weights
        are back. The prefix cache is reset here too (not only at finish), so that even
        between the calls of one update no request hits a block computed with older weights.
        """
        update_info = update_info_of(request)  # a list: every rank picks its own entry (Worker.update_weights)
        lora_name, update_info = split_lora_name(update_info)
        if lora_name is not None:
            return self._update_lora_weights(lora_name, update_info)
        if self._draft_update:
            entries = update_info if isinstance(update_info, list) else [update_info]
            entries = [entry if "model" in entry else {**entry, "model": "draft"} for entry in entries]
            update_info = entries if isinstance(update_info, list) else entries[0]
        try:
            num_loaded = self.executor.rpc(Worker.update_weights, update_info)[OUTPUT_RANK]
        except WeightTransferError:
            self._end_failed_update()
            raise
        finally:
            self.scheduler.reset_prefix_cache()
            self.control.record_weight_call()
        self._model_updated = True
        return num_loaded

    def _update_lora_weights(self, lora_name: str, update_info: dict | list[dict]) -> int:
        """update_weights of one adapter's PEFT-named tensors (engine/worker/lora_weight_update.py): checked
        against the loaded adapter and staged on every rank; they serve from finish_weight_update on. The
        prefix cache stays: nothing that serves has changed yet."""
        if not self.config.lora.enable_lora:
            raise ValueError("update_info.lora_name: LoRA is off; start the engine with enable_lora=True (--enable-lora)")
        entries = update_info if isinstance(update_info, list) else [update_info]
        if self._draft_update or any(isinstance(e, dict) and "model" in e for e in entries):
            raise ValueError("update_info.lora_name: adapters are the target model's; an update_info naming an "
                             "adapter cannot name a \"model\" (nor be part of a draft update)")
        lora = self.loras.find(lora_name, "update_info.lora_name")
        try:
            num_received = self.executor.rpc(Worker.update_lora_weights, update_info, lora)[OUTPUT_RANK]
        except WeightTransferError:
            self._end_failed_update()
            raise
        finally:
            self.control.record_weight_call()
        self._synced_loras = self._synced_loras | {lora.lora_int_id}
        return num_received

    def _end_failed_update(self) -> None:
        """A failed transfer ends the update (the worker restored what it had changed)."""
        self.control.end_weight_update(consistent=self._weights_consistent())
        self._draft_update = False
        self._end_update_record()

    def _end_update_record(self) -> None:
        self._model_updated, self._synced_loras = False, frozenset()

    def expire_idle_weight_update(self) -> bool:
        """Aborts an update in progress whose trainer went silent (weight_update_idle_timeout_s); True if it did.

        The engine process's loop calls this while it waits: a trainer that dies between two
        calls must not leave the engine holding its requests forever.
        """
        if not self.control.weight_update_idle_expired():
            return False
        logger.warning("weight update got no call for %.0f s: aborting it and restoring the previous weights",
                       self.control.weight_update_idle_timeout_s)
        self.abort_weight_update()
        return True

    @between_steps
    def abort_weight_update(self) -> bool:
        """Ends an update in progress and restores the weights it changed; False if none was in progress."""
        aborted = self.executor.rpc(Worker.abort_weight_update)[OUTPUT_RANK]
        self.control.end_weight_update(consistent=self._weights_consistent())
        self._draft_update = False
        self._end_update_record()  # staged adapter tensors were dropped: every adapter keeps its tensors and key
        return aborted

    @between_steps
    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Ends the update, forgets the prefix cache and, if given, switches the weight version.

        KV computed by the old weights never serves again: the prefix cache is reset, and
        in-flight requests (e.g. frozen by a keep-mode pause) drop their KV and recompute
        prompt + output so far with the new weights when they are next scheduled.

        An update that synced only adapters (update_info "lora_name") leaves the base model's cache,
        version and running requests alone: each synced adapter serves its new tensors from the next
        step, under `weight_version` as its own version, with a new prefix-cache key, so no request
        admitted from now on (nor one still waiting to start) hits a block its old tensors computed.
        Requests already running with it go on vLLM-style: their next tokens come from the new tensors
        over the KV cache the old ones computed (only they can hit those blocks).
        """
        if weight_version is not None:
            checked_version("weight_version", weight_version)
        self.executor.rpc(Worker.finish_weight_update)
        if self.control.weights_discarded:
            unwritten = sorted({name for rank in self.executor.rpc(Worker.unwritten_weights) for name in rank})
            self.control.weights_discarded = bool(unwritten)
            if unwritten:
                logger.warning("EngineCore: %d weights discarded by sleep(2) are still unwritten (e.g. %s): "
                               "generation stays refused until an update writes them", len(unwritten), unwritten[:3])
        self._draft_update = False
        model_updated = self._model_updated or not self._synced_loras  # an empty update counts as the model's
        synced = self._synced_loras
        self._end_update_record()
        self.control.end_weight_update(consistent=True)
        if model_updated:
            self._serving_checkpoint = False
            self.scheduler.recompute_running()
            self.scheduler.reset_prefix_cache()
            if weight_version is not None:
                self.weight_version = weight_version
        for lora_id in sorted(synced):
            cache_key = self.loras.resync(lora_id, weight_version)
            if cache_key is not None:
                self.scheduler.rekey_waiting_lora(lora_id, cache_key)

    @between_steps
    def apply_weight_update(self, request: Any, weight_version: str | None = None) -> int:
        """start_weight_update, update_weights(request) and finish_weight_update(weight_version) in one call,
        between two steps (engine/control.py); returns how many tensors landed.

        Nothing of it serves unless all of it does: a bad weight_version is refused before the update starts;
        a call rejected by validation (ValueError: it changed nothing) aborts the update it started; a failed
        transfer (WeightTransferError) has ended the update and restored the weights already."""
        if weight_version is not None:
            checked_version("weight_version", weight_version)
        self.start_weight_update()  # WeightUpdateStateError while another update is in progress: nothing started
        try:
            num_loaded = self.update_weights(request)
        except WeightTransferError:
            raise
        except BaseException:
            try:
                self.abort_weight_update()
            except Exception as e:  # e.g. a worker died: the first error is the one to report
                logger.warning("apply_weight_update: aborting the update after its failed call: %s", e)
            raise
        sync_trace.mark("engine: tensors landed")
        self.finish_weight_update(weight_version)
        sync_trace.mark("engine: update finished")
        return num_loaded

    @between_steps
    def shutdown_weight_transfer_engine(self) -> None:
        self.executor.rpc(Worker.shutdown_weight_transfer_engine)  # aborts an update in progress
        self.control.end_weight_update(consistent=self._weights_consistent())
        self._draft_update = False
        self._end_update_record()

    def _weights_consistent(self) -> bool:
        """Whether every rank's weights are of one version (a failed transfer that could not roll back leaves a mix)."""
        return all(self.executor.rpc(Worker.weights_consistent))

    def weight_info(self, model: str = "target") -> dict:
        """{"weight_version": str, "weights": {hf_name: {"shape": [...], "dtype": str, "shard": ...}}} (rank 0's),
        plus "ranks": [each tensor-parallel rank's "weights"] when the engine has more than one rank
        (shard: the slice of the HF tensor that rank holds).

        model: "target" (the served model) or "draft" (speculative decoding's draft model; ValueError
        when the engine has none)."""
        per_rank = self.executor.rpc(Worker.weight_info, model)
        info = {"weight_version": self.weight_version, "weights": per_rank[OUTPUT_RANK]}
        if len(per_rank) > 1:
            info["ranks"] = per_rank
        return info

    def weight_checker(self, baseline: dict[str, Any] | None = None, model: str = "target",
                       action: WeightCheckerAction | None = None) -> dict:
        """With `action`: vLLM's checker over compute_weight_checksums (control.vllm_weight_checker); "reset"
        zeroes every weight of every rank, as vLLM's does.

        Without: {"weight_version", "checksums": {hf_name: sha256}}, plus match/mismatches/missing/unexpected vs `baseline`,
        of `model` ("target" or "draft", as in weight_info); rank 0's, plus "ranks": [each rank's] with more than one.

        baseline: {hf_name: checksum} (every rank is compared with it) or {"ranks": [one such dict
        per rank]}. "match" is true only if every rank matches its baseline.
        """
        if action is not None:
            return vllm_weight_checker(action, baseline, self.compute_weight_checksums, self._reset_weights)
        check_rank_baseline(baseline, self.get_world_size())
        per_rank = self.executor.rpc(Worker.weight_checker, baseline, model)
        checked = combine_rank_dicts(per_rank)
        if baseline is not None and len(per_rank) > 1:
            checked["match"] = all(r["match"] for r in per_rank)
        return {"weight_version": self.weight_version, **checked}

    @between_steps
    def _reset_weights(self) -> None:
        self.executor.rpc(Worker.reset_weights)
        self.scheduler.reset_prefix_cache()  # its KV came from the weights that are gone

    def get_world_size(self, include_dp: bool = True) -> int:
        """The engine's worker count: one per tensor-parallel rank (one engine is its own data-parallel world)."""
        if not isinstance(include_dp, bool):
            raise ValueError(f"include_dp: expected true or false, got {include_dp!r}")
        return self.config.parallel.tensor_parallel_size

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Every rank's answer to the worker method `method` (one of control.RPC_METHODS; ValueError for any other).
        timeout: accepted for vLLM's signature; the ranks answer from between steps, bounded by the executor."""
        if method not in RPC_METHODS:
            raise ValueError(f"method: {method!r} is not a worker method collective_rpc runs; "
                             f"expected one of {sorted(RPC_METHODS)}")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ValueError(f"timeout: expected a positive number of seconds, got {timeout!r}")
        if not isinstance(args, (tuple, list)) or not isinstance(kwargs or {}, dict):
            raise ValueError("args: expected a list (kwargs: an object)")
        if method == "reset_weights":
            self._reset_weights()
            return [None] * self.get_world_size()
        return self.executor.rpc(getattr(Worker, method), *args, **(kwargs or {}))

    # ---- LoRA adapters (engine/control.py declares them; engine/lora/ has the rest) ----

    def add_lora(self, lora_request: LoRARequest) -> bool:
        self._load_lora(lora_request_of(lora_request))
        return True

    def remove_lora(self, lora_id: int) -> bool:
        self._check_lora_id(lora_id)
        known = self.loras.remove(lora_id)
        self._synced_loras = self._synced_loras - {lora_id}  # a sync of it in progress goes with it
        return any(self.executor.rpc(Worker.remove_lora, lora_id)) or known

    def pin_lora(self, lora_id: int) -> bool:
        self._check_lora_id(lora_id)
        lora = self.loras.get(lora_id)
        if lora is None:
            raise ValueError(f"lora_id: adapter {lora_id} is not loaded (add_lora it first)")
        self.executor.rpc(Worker.pin_lora, lora)
        self.loras.pin(lora_id)
        return True

    def list_loras(self) -> list[int]:
        return self.loras.ids()

    def _load_lora(self, lora: LoRARequest) -> int:
        """The adapter's prefix-cache key, reading and validating it on every rank first if it is new."""
        if not self.config.lora.enable_lora:
            raise ValueError("lora_request: LoRA is off; start the engine with enable_lora=True (--enable-lora)")
        key = self.loras.cache_key(lora)
        if key is None:
            self.executor.rpc(Worker.add_lora, lora)  # ValueError naming the problem; nothing is recorded then
            key = self.loras.add(lora)
        return key

    def _check_lora_id(self, lora_id: object) -> None:
        if not self.config.lora.enable_lora:
            raise ValueError("lora_id: LoRA is off; start the engine with enable_lora=True (--enable-lora)")
        if type(lora_id) is not int or lora_id < 1:
            raise ValueError(f"lora_id: expected a positive int (a lora_int_id), got {lora_id!r}")

    def get_worker_pids(self) -> list[int]:
        """Each tensor-parallel rank's worker pid (this process's for the in-process executor; a Ray
        actor's pid is on its own node)."""
        return list(self.executor.worker_pids)

    def shutdown(self) -> None:
        """Stops the workers, which give back every tensor they hold on the device (weights, KV cache, CUDA
        graphs, the draft model) before this returns; idempotent. Later calls that reach the workers raise
        WorkerDiedError (an EngineDeadError): "the executor was shut down"."""
        self._in_flight = self._drained = None  # a launched step holds its sampled ids on the device
        self.executor.shutdown()


def checked_version(name: str, version: object) -> str:
    """`version` if it can label weights (a non-empty string); else ValueError naming the argument `name`."""
    if not isinstance(version, str) or not version:
        raise ValueError(f"{name}: a weight_version is a non-empty string, got {version!r}")
    return version


class InjectedFault(RuntimeError):
    """The failure inject_fault() asked for (tests only)."""


def has_routed_experts(hf_config: dict) -> bool:
    """Whether a model (by its HF config) routes tokens to experts, i.e. can serve return_routed_experts."""
    return any((hf_config.get(key) or 0) > 0 for key in ("num_experts", "num_local_experts", "n_routed_experts"))


def validate_request(
    request: EngineCoreRequest, max_model_len: int, vocab_size: int, routed_experts: bool = False
) -> None:
    """Raises ValueError naming the bad field. routed_experts: the model has experts to report."""
    prompt = request.prompt_token_ids
    if not prompt:
        raise ValueError("prompt: the prompt is empty")
    if len(prompt) > max_model_len:
        raise ValueError(
            f"prompt: {len(prompt)} tokens is longer than max_model_len={max_model_len}"
        )
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise ValueError(f"prompt_token_ids: token ids must be in [0, {vocab_size})")
    request.sampling_params.validate_for_vocab(vocab_size)
    if request.sampling_params.return_routed_experts and not routed_experts:
        raise ValueError(
            "return_routed_experts: the model has no mixture-of-experts layers, so there is no expert routing to return"
        )
