"""AsyncLLM: the asyncio frontend - streams RequestOutputs from an EngineCore in its own process."""

from __future__ import annotations

import asyncio
import builtins
import itertools
import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, get_args

from transformers import AutoTokenizer

from engine import exceptions as engine_exceptions
from engine.config import EngineConfig
from engine.control import (
    Control,
    FaultToleranceStatus,
    PauseMode,
    SleepLevel,
    Where,
    fault_tolerance_report,
    forward_controls,
    group_only_error,
    idle_elastic_ep_status,
    plain_arguments,
)
from engine.core_client import EngineCoreClient, EngineUtilityError, check_fault_tolerance_instruction
from engine.engine_args import create_engine_config
from engine.exceptions import (
    AdmissionError,
    EngineDeadError,
    EngineNotReadyError,
    MaxQueuedTokensError,
    QueueOverflowError,
)
from engine.lora.names import LoRAAdapters, check_lora_adapter_layout
from engine.lora.request import LoRARequest
from engine.metrics.loggers import StatLoggerManager
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.processor import Processor, PromptType
from engine.sampling_params import SamplingParams
from engine.wire import EngineCoreOutput, EngineCoreRequest, EngineStatus, FinishReason

logger = logging.getLogger(__name__)

# The weight-update lifecycle calls whose durations the metrics record, by operation name.
_WEIGHT_OPERATIONS = {
    "init_weight_transfer_engine": "init", "start_weight_update": "start", "update_weights": "update",
    "finish_weight_update": "finish", "shutdown_weight_transfer_engine": "shutdown",
    "start_draft_weight_update": "start_draft", "apply_weight_update": "apply",
}


class Admission:
    """Places in an engine's queue taken by AsyncLLM.admit for requests not yet tokenized; release() gives
    them back (the request then counts as queued, or is gone). Releasing more than is held is a no-op."""

    def __init__(self, llm: AsyncLLM, num_requests: int) -> None:
        self.llm = llm
        self.num_held = num_requests

    def release(self, num_requests: int | None = None) -> None:
        num = self.num_held if num_requests is None else min(num_requests, self.num_held)
        self.num_held -= num
        self.llm._num_admitting -= num


@forward_controls(asynchronous=True)
class AsyncLLM:
    """One frontend: tokenizes in a thread pool, admits or refuses, streams outputs per request.

    Invariant: every request in `_streams` has its engine-side requests in the output
    processor, and each stream ends with a finished output or an exception.
    """

    def __init__(self, config: EngineConfig, *, multiprocess: bool = True, model_name: str | None = None) -> None:
        self.config = config
        self.model_name = model_name or config.model.model_name  # the name given: a hub name, not its snapshot path
        self.tokenizer = AutoTokenizer.from_pretrained(config.model.tokenizer, truncation_side="left")  # as vLLM loads it for generation
        self.processor = Processor(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stat_loggers = StatLoggerManager(config, self.model_name)
        self.engine_core = EngineCoreClient.make_client(config, multiprocess=multiprocess, asyncio_mode=True)
        self.stat_loggers.log_engine_initialized(self.engine_core.num_blocks)  # vllm:cache_config_info
        # Tokenization and chat templates run here, off the event loop.
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
        self._streams: dict[str, asyncio.Queue] = {}  # user request id -> its outputs
        self._ft_outcome: dict[str, str] = {}  # the last failed fault-tolerance instruction's error
        # Engine requests admitted but not yet scheduled (no output yet): id -> prompt tokens.
        self._queued: dict[str, int] = {}
        self._num_queued_tokens = 0  # sum(_queued.values()), kept up to date
        self._num_admitting = 0  # engine requests admitted and being tokenized (not in _queued yet)
        self._output_task: asyncio.Task | None = None
        self._dead: BaseException | None = None
        self.engine_status = EngineStatus.HEALTHY  # the last status the engine pushed (fault tolerance)
        # Adapters the engine validated for this frontend's requests (most recent last): a request naming one
        # goes straight in; if the engine has forgotten it meanwhile, it validates it again on arrival.
        self._checked_loras: OrderedDict[LoRARequest, None] = OrderedDict()
        self.lora_adapters = LoRAAdapters(self.model_name)  # the adapters served by name (load_lora_adapter)
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, *, multiprocess: bool = True, model_name: str | None = None, **engine_args: Any) -> "AsyncLLM":
        return cls(create_engine_config(**engine_args), multiprocess=multiprocess, model_name=model_name)

    # ---- requests ----------------------------------------------------------------------------

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        admission: Admission | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs (per sampling_params.output_kind) until it finishes.

        Bad input raises ValueError before anything reaches the engine; a full queue raises
        an AdmissionError; a dead engine raises EngineDeadError. Leaving the loop early
        (break, cancellation, a client disconnect) aborts the request in the engine.
        `admission`: the place admit() already took for it (a server takes it on arrival, before
        it starts this generator); None takes one here. `lora_request`: the adapter to run with (None:
        the base model); the first request naming an adapter waits for the engine to read and validate
        it (add_lora), so a bad adapter is a ValueError here too.
        """
        self._ensure_output_handler()
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already running")
        # Admission comes first, from counts alone: a refusal never waits behind tokenization.
        self.processor.check_params(sampling_params, priority)
        lora_request = self.processor.check_lora(lora_request)
        num_children = sampling_params.n
        admission = admission if admission is not None else self.admit(num_children)
        try:
            if lora_request is not None:
                await self._check_lora(lora_request)
            loop = asyncio.get_running_loop()
            text, request = await loop.run_in_executor(
                self._pool, self.processor.process, request_id, prompt, sampling_params, priority, lora_request
            )
        finally:
            admission.release(num_children)  # from here on the request counts in _queued
        self.check_admission(0, num_children * len(request.prompt_token_ids))
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        finished = False
        try:
            await self._add_request(text, request)
            while True:
                item = queue.get_nowait() if not queue.empty() else await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    self._raise_if_refused(item)
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished and self._dead is None:
                await self.abort(request_id)

    async def _check_lora(self, lora_request: LoRARequest) -> None:
        """Has the engine read and validate the adapter, once per adapter (as many as it keeps: max_cpu_loras)."""
        if lora_request in self._checked_loras:
            self._checked_loras.move_to_end(lora_request)
            return
        await self.add_lora(lora_request)
        self._checked_loras[lora_request] = None
        while len(self._checked_loras) > self.config.lora.max_cpu_loras:
            self._checked_loras.popitem(last=False)

    def admit(self, num_requests: int) -> Admission:
        """Takes `num_requests` places in the queue now, or raises AdmissionError (HTTP 503).

        A request counts as queued from its arrival: a burst that arrives before any of it is
        tokenized cannot all pass, and a refusal is decided before any work is spent on it.
        """
        self.check_admission(num_requests)
        self._num_admitting += num_requests
        return Admission(self, num_requests)

    def check_admission(self, num_requests: int, num_prompt_tokens: int = 0) -> None:
        """Refuses (HTTP 503) `num_requests` more engine requests, or `num_prompt_tokens` more queued
        prompt tokens, when the engine's queue would pass its configured limit."""
        refusal = self.admission_refusal(num_requests, num_prompt_tokens)
        if refusal is not None:
            self.stat_loggers.record_admission_rejection(refusal.reason)
            raise refusal

    def admission_refusal(self, num_requests: int, num_prompt_tokens: int = 0) -> AdmissionError | None:
        """What check_admission would raise (None: admitted), without recording it."""
        limits = self.config.admission
        num_queued = len(self._queued) + self._num_admitting
        if limits.max_num_queued_reqs is not None and num_queued + num_requests > limits.max_num_queued_reqs:
            return QueueOverflowError(
                f"{num_queued} requests are queued (max_num_queued_reqs={limits.max_num_queued_reqs})"
            )
        # Before tokenization a request counts as one token: only a queue already at its limit refuses.
        limit = limits.max_num_queued_tokens
        if limit is not None and self._num_queued_tokens + max(num_prompt_tokens, 1) > limit:
            return MaxQueuedTokensError(
                f"{self._num_queued_tokens} prompt tokens are queued (max_num_queued_tokens={limit})"
            )
        return None

    def _dequeue(self, engine_id: str) -> None:
        """The engine request left the queue (scheduled, finished or aborted)."""
        num_tokens = self._queued.pop(engine_id, None)
        if num_tokens is not None:
            self._num_queued_tokens -= num_tokens

    async def _add_request(self, prompt_text: str | None, request: EngineCoreRequest) -> None:
        parent_id = request.request_id if request.sampling_params.n > 1 else None
        engine_requests = self.output_processor.add_user_request(request, prompt_text)
        for child in engine_requests:
            self._queued[child.request_id] = len(child.prompt_token_ids)
            self._num_queued_tokens += len(child.prompt_token_ids)
            self.stat_loggers.on_request_added(
                child.request_id, child.arrival_time, len(child.prompt_token_ids), parent_id,
                request.sampling_params.max_tokens, request.sampling_params.n,
            )
        for child in engine_requests:
            await self.engine_core.add_request_async(child)

    async def abort(self, request_id: str | list[str]) -> None:
        """Stops requests (user ids; n > 1 parents expand to their children) and frees their KV."""
        req_ids = [request_id] if isinstance(request_id, str) else list(request_id)
        engine_ids = self.output_processor.abort_requests(req_ids)
        for engine_id in engine_ids:
            self._dequeue(engine_id)
        self.stat_loggers.on_requests_aborted(engine_ids)
        if engine_ids and self._dead is None:
            await self.engine_core.abort_requests_async(engine_ids)

    # ---- the output loop ---------------------------------------------------------------------

    def _ensure_output_handler(self) -> None:
        if self._dead is not None:  # shut down or dead: no handler is (re)started
            return
        if self._output_task is None or self._output_task.done():
            self._output_task = asyncio.get_running_loop().create_task(self._output_handler())

    async def _output_handler(self) -> None:
        """Pulls engine outputs and routes them to their streams, forever."""
        try:
            while True:
                engine_outputs = await self.engine_core.get_output_async()
                if engine_outputs.engine_status is not None:
                    self.engine_status = engine_outputs.engine_status
                for out in engine_outputs.outputs:
                    self._dequeue(out.request_id)
                processed = self.output_processor.process_outputs(
                    engine_outputs.outputs, engine_outputs.weight_version, engine_outputs.lora_weight_versions)
                for request_output in processed.request_outputs:
                    stream = self._streams.get(request_output.request_id)
                    if stream is not None:
                        stream.put_nowait(request_output)
                if processed.reqs_to_abort:
                    await self.engine_core.abort_requests_async(processed.reqs_to_abort)
                self.stat_loggers.record_engine_outputs(
                    engine_outputs, time.time(), stopped_req_ids=processed.reqs_to_abort
                )
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # the engine died (or the client broke): fail every caller
            dead = e if isinstance(e, EngineDeadError) else EngineDeadError(f"engine output loop failed: {e!r}")
            logger.error("AsyncLLM: %s", dead)
            self._fail_all(dead)

    def _fail_all(self, error: EngineDeadError) -> None:
        """Ends every open stream with `error`; no new request is accepted afterwards."""
        self._dead = error
        for stream in self._streams.values():
            stream.put_nowait(error)

    # ---- health, metrics, lifecycle ----------------------------------------------------------

    @property
    def is_dead(self) -> bool:
        return self._dead is not None or self.engine_core.is_dead

    async def check_health(self) -> None:
        if self.is_dead:
            raise EngineDeadError(str(self._dead) if self._dead else "the engine process is dead")

    def prometheus_text(self) -> bytes:
        return self.stat_loggers.prometheus_text()

    def get_metrics_snapshot(self) -> dict:
        return self.stat_loggers.get_metrics_snapshot()

    # ---- RL controls (declared in engine/control.py) -------------------------------------------
    # Every declared control this class does not define below is forwarded by `_forward_control`
    # to the EngineCore method of the same name (forward_controls). A remote ValueError (bad mode,
    # level, tag, weight name...) comes back as ValueError, so the HTTP server answers 400; the
    # engine validates before it changes anything.

    _OWN_CONTROLS = staticmethod(lambda declared: declared.where is Where.FRONTEND)

    async def _forward_control(self, declared: Control, args: tuple) -> Any:
        """A declared control run by the EngineCore (a utility call); a weight-update lifecycle call's
        duration is recorded by operation (successful calls only)."""
        if declared.where is Where.GROUP:
            raise group_only_error(declared.name)
        operation = _WEIGHT_OPERATIONS.get(declared.name)
        start = time.perf_counter()
        result = await self._control(declared.name, *plain_arguments(declared, args))
        if operation is not None:
            self.stat_loggers.record_weight_update(operation, time.perf_counter() - start)
        return result

    async def _control(self, method: str, *args: Any) -> Any:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        self._ensure_output_handler()
        try:
            result = await self.engine_core.call_utility_async(method, *args)
        except EngineUtilityError as e:
            raise self._local_error(str(e)) from None
        # The answer's stats (pause, sleep and wake_up move gauges while no step runs) reach the stat
        # loggers through the output handler: wait until it has taken them, so that a /metrics scrape
        # right after a control's answer sees their effect. Unless the handler is gone (a dead engine).
        # Usually it has already (the answer's stats are queued before the answer wakes us): no wait then.
        if not self.engine_core.outputs_pending():
            return result
        taken = asyncio.ensure_future(self.engine_core.outputs_taken())
        await asyncio.wait({taken, self._output_task}, return_when=asyncio.FIRST_COMPLETED)
        if not taken.done():
            taken.cancel()
        return result

    @staticmethod
    def _local_error(remote: str) -> Exception:
        """The local form of a remote "ExcType: message" failure: ValueError (and subclasses),
        EngineNotReadyError, WeightTransferError and PeerTimeoutError keep their meaning; anything else stays an EngineUtilityError."""
        name, _, message = remote.partition(": ")
        if name == EngineNotReadyError.__name__:
            return EngineNotReadyError(message)
        if name == engine_exceptions.WeightTransferError.__name__:
            return engine_exceptions.WeightTransferError(message)
        if name == engine_exceptions.PeerTimeoutError.__name__:
            return engine_exceptions.PeerTimeoutError(message)
        cls = getattr(builtins, name, None) or getattr(engine_exceptions, name, None)
        if isinstance(cls, type) and issubclass(cls, ValueError):
            return ValueError(message)
        return EngineUtilityError(remote)

    # What EngineCore raises on a refused add_request while paused/asleep; the engine process
    # sends it back as an ERROR output with the message in stop_reason.
    _NOT_READY_MESSAGES = {"the engine is paused": "paused", "the engine is asleep": "sleeping",
                           "the weights were discarded": "weights_discarded"}

    @classmethod
    def _raise_if_refused(cls, output: RequestOutput) -> None:
        """Raises EngineNotReadyError for a request the engine refused (paused or asleep) before
        generating anything, as the in-process engine does, and EngineDeadError for one a dying
        engine refused; other outputs pass."""
        completions = output.outputs
        if not completions or any(c.finish_reason != "error" or c.token_ids for c in completions):
            return
        message = completions[0].stop_reason
        if not isinstance(message, str):
            return
        if message.startswith("EngineDeadError: "):  # refused by an engine that is going down (a worker died)
            raise EngineDeadError(message.split(": ", 1)[1])
        message = message.removeprefix(f"{EngineNotReadyError.__name__}: ")
        for prefix, reason in cls._NOT_READY_MESSAGES.items():
            if message.startswith(prefix):
                raise EngineNotReadyError(message, reason=reason)

    async def pause_generation(self, mode: PauseMode = "abort", clear_cache: bool = True) -> None:
        """EngineControls.pause_generation; the frontend ends the streams of what the engine aborted
        ("abort") or waits until nothing is left to finish ("wait"), then resets the prefix cache
        (clear_cache; not in keep mode, whose frozen requests hold their blocks)."""
        modes = get_args(PauseMode)
        if mode not in modes:
            raise ValueError(f"mode: unknown pause mode {mode!r}; expected one of {', '.join(modes)}")
        if not isinstance(clear_cache, bool):
            raise ValueError(f"clear_cache: expected true or false, got {clear_cache!r}")
        await self._control("pause_generation", mode)
        if mode == "abort":
            # The engine has dropped them; end their streams here (a no-op for any whose abort
            # output already arrived).
            await self.abort_requests(list(self._streams))
        elif mode == "wait":
            while await self._control("has_unfinished_requests"):
                await asyncio.sleep(0.02)
        if clear_cache and mode != "keep":
            await self._control("reset_prefix_cache", False, False)

    async def abort_requests(self, request_ids: list[str] | None = None) -> list[str]:
        """Aborts requests by user id (None or empty: every request in flight); their streams end with
        finish_reason "abort".

        Returns the ids that were running (unknown or finished ids are ignored).
        """
        if request_ids is not None and (not isinstance(request_ids, list)
                                        or not all(isinstance(r, str) for r in request_ids)):
            raise ValueError("request_ids: expected a list of request id strings")
        if not request_ids:
            request_ids = list(self._streams)
        parents = self.output_processor.parent_requests
        states = self.output_processor.request_states
        found, engine_ids = [], []
        for req_id in dict.fromkeys(request_ids):
            children = parents[req_id].child_req_ids if req_id in parents else [req_id]
            running = [c for c in children if c in states]
            if running:
                found.append(req_id)
                engine_ids += running
        if not engine_ids:
            return []
        # Exactly what the engine sends for an abort, so each stream ends as its kind expects.
        aborted = [EngineCoreOutput(engine_id, [], finish_reason=FinishReason.ABORT) for engine_id in engine_ids]
        processed = self.output_processor.process_outputs(aborted)
        for request_output in processed.request_outputs:
            stream = self._streams.get(request_output.request_id)
            if stream is not None:
                stream.put_nowait(request_output)
        for engine_id in engine_ids:
            self._dequeue(engine_id)
        self.stat_loggers.on_requests_aborted(engine_ids)
        if self._dead is None:
            await self.engine_core.abort_requests_async(engine_ids)
        return found

    async def sleep(self, level: SleepLevel = 1, mode: PauseMode = "abort") -> None:
        """EngineControls.sleep; mode "wait" first lets the requests in flight finish (a "wait" pause,
        ended once asleep: sleeping refuses new requests by itself)."""
        if mode == "wait" and not await self.is_paused():
            await self.pause_generation("wait", clear_cache=False)
            try:
                await self._control("sleep", level, mode)
            finally:
                await self._control("resume_generation")
            return
        await self._control("sleep", level, mode)

    # ---- LoRA adapters by name (vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter) ---------------

    async def load_lora_adapter(self, lora_name: str, lora_path: str, load_inplace: bool = False,
                                is_3d_lora_weight: bool = False) -> None:
        """Loads the adapter (add_lora) and serves it under lora_name (self.lora_adapters); see the control."""
        check_lora_adapter_layout(is_3d_lora_weight)
        await self.lora_adapters.load(lora_name, lora_path, load_inplace, add=self.add_lora, remove=self.remove_lora)

    async def unload_lora_adapter(self, lora_name: str, lora_int_id: int | None = None) -> None:
        """Stops serving the adapter by that name (remove_lora); LoRAAdapterNotFoundError for an unknown name."""
        await self.lora_adapters.unload(lora_name, remove=self.remove_lora)

    async def is_scaling_elastic_ep(self) -> dict[str, Any]:
        """Always idle: only a lockstep RolloutGroup changes its size."""
        return idle_elastic_ep_status()

    async def get_dp_state(self) -> dict:
        """A lockstep engine's wave and step counters (engine/dp_core_proc.py); EngineUtilityError on any other engine."""
        return await self._control("get_dp_state")

    async def reconfigure_elastic_ep(self, plan: dict) -> None:
        """A lockstep engine's part of an elastic EP size change (DPEngineCoreProc.reconfigure_elastic_ep); RolloutGroup drives it."""
        await self._control("reconfigure_elastic_ep", plan)

    def shutdown(self) -> None:
        """Stops the engine; callers still waiting for output get EngineDeadError at once."""
        if self._dead is None:
            self._fail_all(EngineDeadError("the engine was shut down"))
        if self._output_task is not None:
            # Forgotten as well as cancelled: the finished task keeps its CancelledError, whose traceback holds
            # the handler's frame and so `self`, which would make AsyncLLM -> task -> ... -> AsyncLLM a cycle.
            self._output_task.cancel()
            self._output_task = None
        self.engine_core.shutdown()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- fault tolerance ---------------------------------------------------------------------

    async def fault_tolerance_status(self) -> FaultToleranceStatus:
        """vLLM's status of this one engine (id 0), plus the status itself and whether fault tolerance is on.

        Unhealthy: a step failed, its requests ended with finish reason "error", new ones are
        refused the same way until `retry` (or the engine exits after engine_recovery_timeout_sec).
        """
        enabled = self.config.fault_tolerance.enable_fault_tolerance
        status = str(EngineStatus.DEAD) if self.is_dead else await self.engine_core.fault_tolerance_status_async()
        return fault_tolerance_report([{"id": 0, "status": status, **self._ft_outcome}], enabled)

    async def apply_fault_tolerance_instruction(self, instruction: str, params: dict[str, Any] | None = None) -> None:
        """Applies "retry": an unhealthy engine resets and serves again when this returns.

        Unknown instructions raise ValueError; a dead engine raises EngineDeadError. A failure is kept
        for fault_tolerance_status ("ft_error"), as vLLM reports it.
        """
        check_fault_tolerance_instruction(instruction)
        if params is not None and not isinstance(params, dict):
            raise ValueError("params: expected an object")
        try:
            if self._dead is not None:
                raise EngineDeadError(str(self._dead))
            status = await self.engine_core.apply_fault_tolerance_instruction_async(instruction)
        except Exception as e:
            self._ft_outcome = {"ft_error": f"{type(e).__name__}: {e}"}
            raise
        self._ft_outcome = {}
        self.engine_status = EngineStatus[status.upper()]
