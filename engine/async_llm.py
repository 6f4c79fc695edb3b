"""AsyncLLM: the asyncio frontend - streams RequestOutputs from an EngineCore in its own process."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator

from transformers import AutoTokenizer

from engine.config import EngineConfig
from engine.core_client import EngineCoreClient
from engine.engine_args import create_engine_config
from engine.exceptions import EngineDeadError, MaxQueuedTokensError, QueueOverflowError
from engine.metrics.loggers import StatLoggerManager
from engine.output_processor import OutputProcessor, ParentRequest
from engine.outputs import RequestOutput
from engine.processor import Processor, PromptType
from engine.sampling_params import SamplingParams
from engine.wire import EngineCoreRequest

logger = logging.getLogger(__name__)


class AsyncLLM:
    """One frontend: tokenizes in a thread pool, admits or refuses, streams outputs per request.

    Invariant: every request in `_streams` has its engine-side requests in the output
    processor, and each stream ends with a finished output or an exception.
    """

    def __init__(self, config: EngineConfig, *, multiprocess: bool = True, model_name: str | None = None) -> None:
        self.config = config
        self.model_name = model_name or config.model.model
        self.tokenizer = AutoTokenizer.from_pretrained(config.model.tokenizer)
        self.processor = Processor(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stat_loggers = StatLoggerManager(config, self.model_name)
        self.engine_core = EngineCoreClient.make_client(config, multiprocess=multiprocess, asyncio_mode=True)
        # Tokenization and chat templates run here, off the event loop.
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
        self._streams: dict[str, asyncio.Queue] = {}  # user request id -> its outputs
        # Engine requests admitted but not yet scheduled (no output yet): id -> prompt tokens.
        self._queued: dict[str, int] = {}
        self._output_task: asyncio.Task | None = None
        self._dead: BaseException | None = None
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
    ) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs (per sampling_params.output_kind) until it finishes.

        Bad input raises ValueError before anything reaches the engine; a full queue raises
        an AdmissionError; a dead engine raises EngineDeadError. Leaving the loop early
        (break, cancellation, a client disconnect) aborts the request in the engine.
        """
        self._ensure_output_handler()
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already running")
        loop = asyncio.get_running_loop()
        text, request = await loop.run_in_executor(
            self._pool, self.processor.process, request_id, prompt, sampling_params, priority
        )
        self.check_admission(request)
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        finished = False
        try:
            await self._add_request(text, request)
            while True:
                item = queue.get_nowait() if not queue.empty() else await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished and self._dead is None:
                await self.abort(request_id)

    def check_admission(self, request: EngineCoreRequest) -> None:
        """Refuses (HTTP 503) when the engine's queue is at its configured limit."""
        limits = self.config.admission
        num_children = request.sampling_params.n
        if limits.max_num_queued_reqs is not None and len(self._queued) + num_children > limits.max_num_queued_reqs:
            self.stat_loggers.record_admission_rejection(QueueOverflowError.reason)
            raise QueueOverflowError(
                f"{len(self._queued)} requests are queued (max_num_queued_reqs={limits.max_num_queued_reqs})"
            )
        if limits.max_num_queued_tokens is not None:
            queued_tokens = sum(self._queued.values())
            if queued_tokens + num_children * len(request.prompt_token_ids) > limits.max_num_queued_tokens:
                self.stat_loggers.record_admission_rejection(MaxQueuedTokensError.reason)
                raise MaxQueuedTokensError(
                    f"{queued_tokens} prompt tokens are queued (max_num_queued_tokens={limits.max_num_queued_tokens})"
                )

    async def _add_request(self, prompt_text: str | None, request: EngineCoreRequest) -> None:
        params = request.sampling_params
        if params.n == 1:
            children = [(request, None, 0)]
        else:
            parent = ParentRequest(request.request_id, params)
            children = [(child, parent, i) for i, child in enumerate(parent.make_child_requests(request))]
        for child, parent, index in children:
            self.output_processor.add_request(child, prompt_text, parent, index)
            self._queued[child.request_id] = len(child.prompt_token_ids)
            self.stat_loggers.on_request_added(
                child.request_id, child.arrival_time, len(child.prompt_token_ids),
                parent.request_id if parent is not None else None,
            )
        for child, _, _ in children:
            await self.engine_core.add_request_async(child)

    async def abort(self, request_id: str | list[str]) -> None:
        """Stops requests (user ids; n > 1 parents expand to their children) and frees their KV."""
        req_ids = [request_id] if isinstance(request_id, str) else list(request_id)
        engine_ids = self.output_processor.abort_requests(req_ids)
        for engine_id in engine_ids:
            self._queued.pop(engine_id, None)
        self.stat_loggers.on_requests_aborted(engine_ids)
        if engine_ids and self._dead is None:
            await self.engine_core.abort_requests_async(engine_ids)

    # ---- the output loop ---------------------------------------------------------------------

    def _ensure_output_handler(self) -> None:
        if self._output_task is None or self._output_task.done() and self._dead is None:
            self._output_task = asyncio.get_running_loop().create_task(self._output_handler())

    async def _output_handler(self) -> None:
        """Pulls engine outputs and routes them to their streams, forever."""
        try:
            while True:
                engine_outputs = await self.engine_core.get_output_async()
                for out in engine_outputs.outputs:
                    self._queued.pop(out.request_id, None)
                processed = self.output_processor.process_outputs(engine_outputs.outputs)
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

    async def reset_prefix_cache(self) -> bool:
        return await self.engine_core.call_utility_async("reset_prefix_cache")

    def shutdown(self) -> None:
        """Stops the engine; callers still waiting for output get EngineDeadError at once."""
        if self._dead is None:
            self._fail_all(EngineDeadError("the engine was shut down"))
        if self._output_task is not None:
            self._output_task.cancel()
        self.engine_core.shutdown()
        self._pool.shutdown(wait=False, cancel_futures=True)
