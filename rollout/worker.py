"""RolloutWorker: the Python face of one engine for trainer scripts - generate, pause/resume, sleep, weights.

    with RolloutWorker(model=DIR, max_model_len=1024) as worker:
        outputs = worker.generate(prompts, SamplingParams(max_tokens=64))
        worker.pause_generation("wait")
        worker.init_weight_transfer_engine({"backend": "local"})
        ...
        worker.resume_generation()

It is an AsyncLLM (the engine in this process with multiprocess=False, or in its own process
with multiprocess=True: same API), or with data_parallel_size=N a RolloutGroup of N of them,
driven by a private event loop in a background thread, so plain scripts call the sync methods
and asyncio code awaits `agenerate` / iterates `astream` from its own loop. The control methods
are the ones declared in engine/control.py (EngineControls), blocking, with the names of the HTTP routes.

A trainer driver runs workers as Ray actors and syncs them all through one client:

    actors = [RolloutWorker.as_ray_actor(model=DIR, num_gpus=1, placement_group=pg, bundle_index=i)
              for i in range(2)]
    client = RayWeightSyncClient(actors)      # every weight-sync call fans out to both
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
from typing import TYPE_CHECKING, Any, AsyncIterator, Coroutine, Sequence, TypeVar

from tqdm.auto import tqdm

from engine.async_llm import AsyncLLM
from engine.control import Control, forward_controls
from engine.lora.request import LoRARequest
from engine.outputs import RequestOutput
from engine.processor import PromptType
from engine.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    import ray.actor

    from rollout.session import RolloutSession

T = TypeVar("T")

_END = object()  # astream: the request finished


class _Failed:
    """astream: the request ended with this exception."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


@forward_controls(asynchronous=False)
class RolloutWorker:
    """`RolloutWorker(model=DIR, *, multiprocess=False, data_parallel_size=1, **engine_args)`; engine_args as for LLM.

    With data_parallel_size > 1 the worker drives a RolloutGroup (each engine in its own
    process when multiprocess=True); get_world_size() then counts the workers of all engines.
    """

    def __init__(
        self,
        model: str,
        *,
        multiprocess: bool = False,
        model_name: str | None = None,
        data_parallel_size: int = 1,
        **engine_args: Any,
    ) -> None:
        if type(data_parallel_size) is not int or data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be a positive int, got {data_parallel_size!r}")
        self._ids = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollout-worker-loop", daemon=True)
        self._thread.start()
        self._closed = False
        # A rollout worker feeds a trainer batches, as vLLM's LLM class does: its default step budget.
        engine_args = {"usage_context": "llm_class", **engine_args}
        try:
            if data_parallel_size > 1:
                from rollout.group import RolloutGroup

                self.engine = RolloutGroup.from_engine_args(
                    data_parallel_size=data_parallel_size, multiprocess=multiprocess, model_name=model_name,
                    model=model, **engine_args,
                )
            else:
                self.engine = AsyncLLM.from_engine_args(
                    multiprocess=multiprocess, model_name=model_name, model=model, **engine_args
                )
        except BaseException:
            self._stop_loop()
            raise
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer

    @classmethod
    def as_ray_actor(
        cls,
        model: str,
        *,
        num_cpus: float = 1,
        num_gpus: float = 0,
        placement_group: Any = None,
        bundle_index: int = -1,
        runtime_env: dict | None = None,
        name: str | None = None,
        ready_timeout_s: float | None = 600.0,
        **worker_args: Any,
    ) -> "ray.actor.ActorHandle":
        """A RolloutWorker in its own Ray actor; returns the handle once its engine serves.

        `placement_group` / `bundle_index` (-1: any bundle) pin the actor into a placement
        group the trainer reserved; `worker_args` are RolloutWorker's (engine args,
        multiprocess, data_parallel_size). Ray is started (ray.init()) if this process has
        not connected yet. An engine that fails to start, or is not serving after
        ready_timeout_s (None: no limit), kills the actor and raises.
        """
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if num_cpus < 0:
            raise ValueError(f"num_cpus must be >= 0, got {num_cpus}")
        if num_gpus < 0:
            raise ValueError(f"num_gpus must be >= 0, got {num_gpus}")
        if bundle_index < -1:
            raise ValueError(f"bundle_index must be >= -1 (-1: any bundle), got {bundle_index}")
        if placement_group is None and bundle_index != -1:
            raise ValueError("bundle_index: given without a placement_group")
        options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus}
        if placement_group is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=placement_group,
                placement_group_bundle_index=bundle_index,
                placement_group_capture_child_tasks=True,
            )
        if runtime_env is not None:
            options["runtime_env"] = runtime_env
        if name is not None:
            options["name"] = name
        actor = ray.remote(cls).options(**options).remote(model, **worker_args)
        try:
            ray.get(actor.get_world_size.remote(), timeout=ready_timeout_s)
        except BaseException:
            ray.kill(actor)
            raise
        return actor

    # ---- plumbing ----------------------------------------------------------------------------

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs `coro` on the worker's loop and waits for it (from any thread but that loop's)."""
        return self._start(coro).result()

    def _start(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Starts `coro` on the worker's loop; its Future answers (wait on it from any thread but that loop's)."""
        if self._closed:
            coro.close()
            raise RuntimeError("the RolloutWorker is shut down")
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a sync RolloutWorker method was called from its own event loop; await the async form")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _on_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        """Awaits `coro` on the worker's loop from the caller's loop (cancelling it cancels the request)."""
        if self._closed:
            coro.close()
            raise RuntimeError("the RolloutWorker is shut down")
        if asyncio.get_running_loop() is self._loop:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    def _next_id(self) -> str:
        return f"rw-{next(self._ids)}"

    # ---- generation --------------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion (batched together); outputs come in the order of `prompts`.

        lora_request: the adapter of every prompt, or one per prompt (None: the base model), as LLM.generate.
        A bad prompt raises ValueError and aborts the others of the call.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"sampling_params: {len(params_list)} given for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"lora_request: {len(loras)} given for {len(prompts)} prompts")
        return self._run(self._generate_all(prompts, params_list, use_tqdm, loras))

    async def _generate_all(self, prompts: list, params_list: list[SamplingParams], use_tqdm: bool,
                            loras: list[LoRARequest | None]) -> list[RequestOutput]:
        bar = tqdm(total=len(prompts), desc="Generating", disable=not use_tqdm, dynamic_ncols=True)
        tasks = [asyncio.ensure_future(self._final(p, sp, self._next_id(), lora))
                 for p, sp, lora in zip(prompts, params_list, loras)]
        for task in tasks:
            task.add_done_callback(lambda _: bar.update(1))
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:  # a cancelled generate() aborts its request in the engine
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            bar.close()

    async def _final(self, prompt: PromptType, sampling_params: SamplingParams, request_id: str,
                     lora_request: LoRARequest | None = None) -> RequestOutput:
        params = sampling_params.clone(output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        async for out in self.engine.generate(prompt, params, request_id, lora_request=lora_request):
            final = out
        assert final is not None and final.finished
        return final

    async def agenerate(
        self, prompt: PromptType, sampling_params: SamplingParams | None = None, request_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestOutput:
        """The finished output of one request (with the adapter `lora_request`, None: the base model); await it
        from any event loop. Cancelling aborts it."""
        return await self._on_loop(self._final(prompt, sampling_params or SamplingParams(), request_id or self._next_id(),
                                               lora_request))

    async def astream(
        self, prompt: PromptType, sampling_params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Streams one request's outputs (per sampling_params.output_kind) into the caller's loop.

        Leaving the loop early aborts the request.
        """
        if self._closed:
            raise RuntimeError("the RolloutWorker is shut down")
        params = sampling_params or SamplingParams()
        request_id = request_id or self._next_id()
        caller = asyncio.get_running_loop()
        items: asyncio.Queue = asyncio.Queue()

        def put(item: Any) -> None:
            try:
                caller.call_soon_threadsafe(items.put_nowait, item)
            except RuntimeError:  # the caller's loop is gone: nobody is listening
                pass

        async def pump() -> None:
            try:
                async for out in self.engine.generate(prompt, params, request_id):
                    put(out)
            except BaseException as e:
                put(_Failed(e))
                raise
            put(_END)

        if caller is self._loop:
            async for out in self.engine.generate(prompt, params, request_id):
                yield out
            return
        future = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while True:
                item = await items.get()
                if item is _END:
                    return
                if isinstance(item, _Failed):
                    raise item.error
                yield item
        finally:
            future.cancel()  # a no-op once finished; else the request is aborted

    def session(self, messages: list[dict] | None = None, sampling_params: SamplingParams | None = None, *,
                prompt_token_ids: Sequence[int] | None = None) -> "RolloutSession":
        """A multi-turn RolloutSession on this worker: one exact token history with a mask of the model's tokens (rollout/session.py)."""
        from rollout.session import RolloutSession

        return RolloutSession(self, messages, sampling_params, prompt_token_ids=prompt_token_ids)

    # ---- RL controls: every control declared in engine/control.py, blocking ---------------------

    def _forward_control(self, declared: Control, args: tuple) -> Any:
        """The engine's (AsyncLLM's or RolloutGroup's) control of the same name, run on the worker's loop."""
        return self._run(getattr(self.engine, declared.name)(*args))

    def _start_control(self, name: str, args: tuple) -> concurrent.futures.Future:
        """The control `name` (arguments in declared order) started on the worker's loop, its Future at once: for a
        weight-sync client in this process (LocalWeightSyncClient.submit), with no thread of its own to wait in."""
        return self._start(getattr(self.engine, name)(*args))

    def get_metrics_snapshot(self) -> dict:
        return self.engine.get_metrics_snapshot()

    # ---- lifecycle ---------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stops the engine (waiting callers get EngineDeadError) and the worker's loop. Idempotent."""
        if self._closed:
            return
        self._closed = True

        async def stop_engine() -> None:
            self.engine.shutdown()  # on the loop's thread: the async client's sockets live there

        try:
            asyncio.run_coroutine_threadsafe(stop_engine(), self._loop).result(timeout=60)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        async def cancel_tasks() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(cancel_tasks(), self._loop).result(timeout=10)
        except Exception:
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> "RolloutWorker":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            try:
                self.shutdown()
            except Exception:
                pass
