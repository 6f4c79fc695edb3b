"""RolloutGroup: N engines (data parallel, each an AsyncLLM with its own engine process) behind the AsyncLLM interface.

    group = RolloutGroup.from_engine_args(data_parallel_size=2, model=DIR, device="cpu")
    app = build_app(group, ServerConfig())          # the server does not know it is a group

Requests go to one engine, chosen by a LoadBalancer (least outstanding tokens, prefix-cache
aware) that also reads the Coordinator (each engine's latest scheduler stats). Controls go to
every engine at once:

- pause(mode) is two-phase: every engine pauses, then each is checked to be paused; if any
  fails, the others are resumed and the call raises - the group never stays half paused.
- init_weight_transfer_engine with a "rank_offset" gives engine i the offset plus the world
  sizes of engines 0..i-1 (their workers take consecutive ranks of the transfer group).
- get_weight_version (and weight_info) raise WeightVersionMismatchError if engines disagree.
- get_world_size is the sum of the engines' world sizes.

Lockstep groups (enable_expert_parallel): the engines step together in waves and agree through
a DP state sync (engine/dp_core_proc.py); from_engine_args then also starts the coordinator
process that forwards START_WAVE between them (rollout/dp_coordinator.py) and hosts the sync
group's TCPStore at data_parallel_master_ip:data_parallel_master_port (a free port pair when
unset). pause() is the same fan-out: each engine answers once every engine has reached the
pause (consensus), so it returns with all of them paused at the same step; sleep() pauses first.

Elastic EP (lockstep groups): prepare_elastic_ep(N) reconfigures the group for N engines
(starting or draining engines, moving experts) without routing to added ones, and
commit_elastic_ep() starts routing and resumes; see rollout/elastic_ep.py.

A failure on engine i is raised with "engine i: " in front of its message (bad input, a
ValueError, fails alike on every engine and keeps its message so that it still names the field).
/metrics shows every engine's series under its own `engine` label.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, get_args

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.async_llm import Admission, AsyncLLM
from engine.control import (
    Combine,
    Control,
    FaultToleranceStatus,
    PauseMode,
    SleepLevel,
    WeightCheckerAction,
    combine_answers,
    fault_tolerance_report,
    forward_controls,
    idle_elastic_ep_status,
    init_info_of,
    vllm_weight_checker,
)
from engine.engine_args import create_engine_config
from engine.engine_core import checked_version
from engine.exceptions import EngineDeadError
from engine.lora.names import LoRAAdapters, check_lora_adapter_layout
from engine.lora.request import LoRARequest
from engine.metrics.loggers import LoggingStatLogger
from engine.metrics.multi_engine import MultiEngineMetrics
from engine.metrics.prometheus import PREFIX
from engine.outputs import RequestOutput
from engine.processor import PromptType
from engine.sampling_params import SamplingParams
from rollout.balancer import LoadBalancer
from rollout.coordinator import Coordinator
from rollout.dp_coordinator import DPCoordinatorHandle, free_port_pair

logger = logging.getLogger(__name__)



class WeightVersionMismatchError(RuntimeError):
    """The engines of a group serve different weight versions (a weight update reached only some)."""


def engine_devices(device: str, data_parallel_size: int, tensor_parallel_size: int = 1) -> list[str]:
    """The device of each engine: "cpu" for all on CPU; on CUDA engine i starts at cuda:<base + i * tp>.

    `device` is resolved ("cpu", "cuda" or "cuda:N"); each engine's ranks then take the next
    tensor_parallel_size devices from its own base.
    """
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
    if device == "cpu":
        return ["cpu"] * data_parallel_size
    if device != "cuda" and not device.startswith("cuda:"):
        raise ValueError(f"device: expected cpu, cuda or cuda:N for a data-parallel group, got {device!r}")
    base = int(device.partition(":")[2] or 0)
    return [f"cuda:{base + i * tensor_parallel_size}" for i in range(data_parallel_size)]


def start_engines(
    per_engine: list[dict[str, Any]],
    *,
    multiprocess: bool,
    model_name: str | None,
    on_failure: Callable[[], None] | None = None,
) -> list[AsyncLLM]:
    """One AsyncLLM per dict of flat engine args, started in parallel. If any fails, on_failure runs at
    once (e.g. to release peers waiting for it), the started ones are shut down, and the first error raised."""

    def start(args: dict) -> AsyncLLM:
        return AsyncLLM.from_engine_args(multiprocess=multiprocess, model_name=model_name, **args)

    with concurrent.futures.ThreadPoolExecutor(len(per_engine), thread_name_prefix="start-engine") as pool:
        futures = [pool.submit(start, args) for args in per_engine]
        concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
        if on_failure is not None and any(f.done() and f.exception() is not None for f in futures):
            on_failure()
        concurrent.futures.wait(futures)
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        for f in futures:
            if f.exception() is None:
                f.result().shutdown()
        raise failed[0]
    return [f.result() for f in futures]


def _check_enough_gpus(devices: list[str], tensor_parallel_size: int) -> None:
    if not devices[0].startswith("cuda"):
        return
    import torch

    needed = int(devices[-1].partition(":")[2]) + tensor_parallel_size
    available = torch.cuda.device_count()
    if needed > available:
        raise ValueError(
            f"data_parallel_size: {len(devices)} engines x tensor_parallel_size {tensor_parallel_size} "
            f"from {devices[0]} need GPUs up to index {needed - 1}; this machine has {available}"
        )


@forward_controls(asynchronous=True)
class RolloutGroup:
    """Data-parallel engines with one frontend interface (the AsyncLLM methods the server and RolloutWorker use)."""

    def __init__(
        self, engines: Sequence[AsyncLLM], model_name: str | None = None, dp_coordinator: DPCoordinatorHandle | None = None
    ) -> None:
        """dp_coordinator: the lockstep group's coordinator process and store (from_engine_args starts it); shut down with the group."""
        if not engines:
            raise ValueError("engines: a RolloutGroup needs at least one engine")
        self.engines = list(engines)
        self.dp_coordinator = dp_coordinator
        self._paused_for_sleep = False  # lockstep: sleep() paused the group, wake_up() resumes it
        self.config = self.engines[0].config
        self.model_name = model_name or self.engines[0].model_name
        self.tokenizer = self.engines[0].tokenizer
        self.processor = self.engines[0].processor  # its prompt checks and chat template; read-only, shared
        self.balancer = LoadBalancer(len(self.engines), self.config.cache.block_size)
        self.coordinator = Coordinator(len(self.engines))
        for index, engine in enumerate(self.engines):
            self._attach(index, engine)
        self._build_metrics()
        self._owners: dict[str, int] = {}  # request id -> index of the engine serving it
        self._ids = itertools.count()
        self.num_routable = len(self.engines)  # requests go to engines [0, num_routable) (elastic EP drains the rest)
        self.elastic = None  # rollout.elastic_ep.ElasticEP of a lockstep group from from_engine_args
        # The adapters served by name: loaded on every engine (add_lora), so any engine can run a request
        # naming one (an engine added later reads it on the first such request).
        self.lora_adapters = LoRAAdapters(self.model_name)

    def _attach(self, index: int, engine: AsyncLLM) -> None:
        """Feeds engine `index`'s stats to the coordinator (the balancer's secondary load) and names it in its log line."""
        # Each frontend reports its own engine as engine 0; its log line should say which it is.
        engine.stat_loggers.add_stat_logger(self.coordinator.listener(index), 0)
        for stat_logger in engine.stat_loggers.per_engine_loggers[0]:
            if isinstance(stat_logger, LoggingStatLogger):
                stat_logger.engine_index = index

    def _build_metrics(self) -> None:
        self.metrics = MultiEngineMetrics([e.stat_loggers.prometheus_logger.registry for e in self.engines])
        self.metrics.registry.register(_BalancerCollector(self))

    def set_engines(self, engines: Sequence[AsyncLLM]) -> None:
        """Elastic EP: the group's engines are now `engines` (the old ones first, in order; added ones
        at the end, removed ones from the end, none of them with requests in flight)."""
        num_old = len(self.engines)
        self.balancer.resize(len(engines))
        self.coordinator.resize(len(engines))
        self.engines = list(engines)
        for index in range(num_old, len(engines)):
            self._attach(index, self.engines[index])
        self._build_metrics()
        self.num_routable = len(self.engines)

    @classmethod
    def from_engine_args(
        cls,
        *,
        data_parallel_size: int,
        multiprocess: bool = True,
        model_name: str | None = None,
        **engine_args: Any,
    ) -> RolloutGroup:
        """Starts `data_parallel_size` engines (in parallel) from flat engine args, e.g. model=DIR, device="cpu".

        Engine i runs on engine_devices(...)[i] with seed + i, so that requests without their
        own seed do not draw the same samples on every engine.
        """
        if type(data_parallel_size) is not int or data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be a positive int, got {data_parallel_size!r}")
        base = create_engine_config(**engine_args)  # validates everything before a process starts
        tp = base.parallel.tensor_parallel_size
        devices = engine_devices(base.device.resolve(), data_parallel_size, tp)
        _check_enough_gpus(devices, tp)
        per_engine = [
            {**engine_args, "device": devices[i], "seed": base.model.seed + i,
             "data_parallel_size": data_parallel_size, "data_parallel_rank": i}
            for i in range(data_parallel_size)
        ]
        dp_coordinator = None
        if base.parallel.enable_expert_parallel and data_parallel_size > 1:  # lockstep engines
            host = base.parallel.data_parallel_master_ip
            port = base.parallel.data_parallel_master_port or free_port_pair(host)
            dp_coordinator = DPCoordinatorHandle(data_parallel_size, host, port)
            for args in per_engine:
                args["data_parallel_master_port"] = port

        # Lockstep peers wait for each other at start-up; without the store they fail at once.
        on_failure = dp_coordinator.shutdown if dp_coordinator is not None else None
        engines = start_engines(per_engine, multiprocess=multiprocess, model_name=model_name, on_failure=on_failure)
        group = cls(engines, model_name=model_name, dp_coordinator=dp_coordinator)
        if dp_coordinator is not None:
            from rollout.elastic_ep import ElasticEP

            group.elastic = ElasticEP(group, engine_args, multiprocess=multiprocess, model_name=model_name)
        return group

    @property
    def lockstep(self) -> bool:
        """Whether the engines step in lockstep (expert parallelism; engine/dp_core_proc.py)."""
        return self.dp_coordinator is not None

    @property
    def num_engines(self) -> int:
        return len(self.engines)

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
        """AsyncLLM.generate on the engine the balancer picks; leaving early aborts the request there.

        `admission`, `lora_request`: as in AsyncLLM.generate (admission from this group's admit()); None
        takes one here."""
        request_id = request_id or f"req-{next(self._ids)}"
        self.processor.check_params(sampling_params, priority)  # before any tokenization
        admission = admission if admission is not None else self.admit(sampling_params.n)
        try:
            routed_prompt, token_ids = await self._tokenized(prompt)
        except BaseException:
            admission.release(sampling_params.n)
            raise
        # No await between the check and the claim: the id is unique across all engines.
        if request_id in self._owners:
            raise ValueError(f"request_id: {request_id!r} is already running")
        live = [i for i, engine in enumerate(self.engines[:self.num_routable]) if not engine.is_dead]
        if not live:
            raise EngineDeadError("every engine of the group is dead")
        cost = self._cost(token_ids, sampling_params)
        index = self.balancer.pick(token_ids, cost, live, self.coordinator.num_waiting())
        self._owners[request_id] = index
        self.balancer.started(index, cost, token_ids)
        # The engine's generate releases the place (it may be another engine's: it is only held until tokenized).
        outputs = self.engines[index].generate(routed_prompt, sampling_params, request_id, priority, admission,
                                               lora_request)
        try:
            async for out in outputs:
                yield out
        finally:
            await outputs.aclose()  # a caller that stopped early aborts the request now, not at GC
            self._owners.pop(request_id, None)
            self.balancer.finished(index, cost)

    async def _tokenized(self, prompt: PromptType) -> tuple[PromptType, list[int] | None]:
        """(the prompt to send, its token ids): text is tokenized once here, for routing, and sent
        as {"prompt", "prompt_token_ids"} so the engine does not tokenize it again (a conversation is
        rendered here too). The engine's processor does it, so its checks apply (ValueError)."""
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt_token_ids"), list):
            return prompt, prompt["prompt_token_ids"]
        text, token_ids = await asyncio.to_thread(self.processor.tokenize, prompt)
        return {"prompt": text, "prompt_token_ids": token_ids}, token_ids

    def _cost(self, token_ids: list[int] | None, params: SamplingParams) -> int:
        num_prompt = len(token_ids) if token_ids else 0
        max_len = self.config.model.max_model_len
        max_tokens = params.max_tokens if getattr(params, "max_tokens", None) is not None else max_len - num_prompt
        n = getattr(params, "n", 1) or 1
        return LoadBalancer.request_cost(num_prompt, max(max_tokens, 1), n)

    def _by_engine(self, request_ids: Sequence[str]) -> dict[int, list[str]]:
        """The known request ids grouped by the engine that serves them (unknown ids dropped)."""
        groups: dict[int, list[str]] = {}
        for req_id in dict.fromkeys(request_ids):
            if req_id in self._owners:
                groups.setdefault(self._owners[req_id], []).append(req_id)
        return groups

    async def abort(self, request_id: str | list[str]) -> None:
        req_ids = [request_id] if isinstance(request_id, str) else list(request_id)
        await asyncio.gather(*(self.engines[i].abort(ids) for i, ids in self._by_engine(req_ids).items()))

    async def abort_requests(self, request_ids: list[str] | None = None) -> list[str]:
        """Aborts requests by user id on whichever engine serves each (None or empty: every request on
        every engine); returns those found, in the given order."""
        if not request_ids:
            return [req_id for ids in await self._fan_out("abort_requests", None) for req_id in ids]
        groups = self._by_engine(request_ids)
        found_lists = await asyncio.gather(*(self.engines[i].abort_requests(ids) for i, ids in groups.items()))
        found = {req_id for ids in found_lists for req_id in ids}
        return [req_id for req_id in dict.fromkeys(request_ids) if req_id in found]

    # ---- fan-out -----------------------------------------------------------------------------

    def _engine_error(self, index: int, error: BaseException) -> BaseException:
        """`error` with "engine <index>: " in front of its message; ValueErrors (bad input) stay as they are."""
        if isinstance(error, ValueError) or not isinstance(error, Exception) or self.num_engines == 1:
            return error
        try:
            tagged = type(error)(f"engine {index}: {error}")
        except Exception:  # an exception type with another constructor
            return error
        tagged.__dict__.update(error.__dict__)  # e.g. EngineNotReadyError.reason
        return tagged

    async def _each(self, call: Callable[[int, AsyncLLM], Awaitable[Any]]) -> list[Any]:
        """call(i, engine) on every engine at once; every call finishes before this returns or raises."""
        results = await asyncio.gather(*(call(i, e) for i, e in enumerate(self.engines)), return_exceptions=True)
        for index, result in enumerate(results):
            if isinstance(result, BaseException):
                raise self._engine_error(index, result) from result
        return results

    async def _fan_out(self, method: str, *args: Any) -> list[Any]:
        """engine.method(*args) on every engine; the per-engine results in engine order."""
        return await self._each(lambda i, engine: getattr(engine, method)(*args))

    # ---- RL controls (declared in engine/control.py) -------------------------------------------
    # A declared control this class does not define below runs on every engine at once and its
    # answers combine by the control's rule (Combine); those with Combine.OWN are defined here.

    _OWN_CONTROLS = staticmethod(lambda declared: declared.combine is Combine.OWN)

    async def _forward_control(self, declared: Control, args: tuple) -> Any:
        answers = await self._fan_out(declared.name, *args)
        return combine_answers(declared, answers, lambda versions: self._disagreement(declared.name, versions))

    @staticmethod
    def _disagreement(method: str, versions: list) -> WeightVersionMismatchError:
        serving = ", ".join(f"engine {i} serves {v!r}" for i, v in enumerate(versions))
        return WeightVersionMismatchError(f"{method}: the engines of the group disagree: {serving}")

    # ---- pause, sleep ------------------------------------------------------------------------

    async def pause_generation(self, mode: PauseMode = "abort", clear_cache: bool = True) -> None:
        """Pauses every engine in `mode` (AsyncLLM.pause_generation); returns once all are paused.

        Two-phase: all engines pause at once (the idle ones are paused at once, a busy one
        in "wait" mode once its requests finish), then each must report itself paused. If an
        engine fails either phase, every engine is resumed and the error is raised.
        """
        modes = get_args(PauseMode)
        if mode not in modes:
            raise ValueError(f"mode: unknown pause mode {mode!r}; expected one of {', '.join(modes)}")
        try:
            await self._fan_out("pause_generation", mode, clear_cache)
            states = await self._fan_out("is_paused")
            not_paused = [i for i, paused in enumerate(states) if not paused]
            if not_paused:
                raise RuntimeError(f"pause: engine(s) {not_paused} did not reach the paused state")
        except BaseException:
            await self._resume_quietly()
            raise

    async def _resume_quietly(self) -> None:
        """Resumes every live engine, logging (not raising) failures: the caller raises the first error."""
        live = [(i, e) for i, e in enumerate(self.engines) if not e.is_dead]
        results = await asyncio.gather(*(e.resume_generation() for _, e in live), return_exceptions=True)
        for (index, _), result in zip(live, results):
            if isinstance(result, BaseException):
                logger.warning("RolloutGroup: resuming engine %d after a failed pause failed: %s", index, result)

    async def sleep(self, level: SleepLevel = 1, mode: PauseMode = "abort") -> None:
        """Every engine sleeps; lockstep engines are paused ("keep") first, so that none sleeps mid-wave."""
        if self.lockstep and not self._paused_for_sleep and not await self.is_paused():
            await self.pause_generation("keep")
            self._paused_for_sleep = True
        await self._fan_out("sleep", level, mode)

    async def wake_up(self, tags: list[str] | None = None, reload_weights: bool = False) -> bool:
        """Every engine wakes (the given tags); lockstep engines paused by sleep() resume once fully awake.
        True once nothing sleeps on any engine."""
        await self._fan_out("wake_up", tags, reload_weights)
        awake = not await self.is_sleeping()
        if self._paused_for_sleep and awake:
            self._paused_for_sleep = False
            await self.resume_generation()
        return awake

    async def dp_states(self) -> list[dict]:
        """Lockstep engines: each engine's wave, its counters (real steps, dummy batches, syncs...), in engine order."""
        return await self._fan_out("get_dp_state")

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """True if every engine reset; the balancer forgets which engine holds which prefix."""
        self.balancer.forget_prefixes()
        return all(await self._fan_out("reset_prefix_cache", reset_running_requests, reset_connector))

    # ---- LoRA adapters by name ------------------------------------------------------------------

    async def load_lora_adapter(self, lora_name: str, lora_path: str, load_inplace: bool = False,
                                is_3d_lora_weight: bool = False) -> None:
        """AsyncLLM.load_lora_adapter for the group: every engine reads the adapter (add_lora), the group keeps the name."""
        check_lora_adapter_layout(is_3d_lora_weight)
        await self.lora_adapters.load(lora_name, lora_path, load_inplace, add=self.add_lora, remove=self.remove_lora)

    async def unload_lora_adapter(self, lora_name: str, lora_int_id: int | None = None) -> None:
        """AsyncLLM.unload_lora_adapter for the group: every engine forgets the adapter."""
        await self.lora_adapters.unload(lora_name, remove=self.remove_lora)

    # ---- elastic expert parallelism (rollout/elastic_ep.py) ----------------------------------------

    def _elastic(self):
        if self.elastic is None:
            raise ValueError("elastic EP needs a lockstep group (enable_expert_parallel, data_parallel_size > 1) "
                             "started by RolloutGroup.from_engine_args")
        return self.elastic

    async def prepare_elastic_ep(self, new_data_parallel_size: int, drain_timeout_s: float | None = None) -> dict[str, Any]:
        """Reconfigures the group for `new_data_parallel_size` engines without routing to added ones (ElasticEP.prepare)."""
        return await self._elastic().prepare(new_data_parallel_size, drain_timeout_s)

    async def commit_elastic_ep(self, ready_timeout_s: float | None = None) -> dict[str, Any]:
        """Finalizes the prepared change: routes to every engine of the new size and resumes (ElasticEP.commit)."""
        return await self._elastic().commit(ready_timeout_s)

    async def scale_elastic_ep(self, new_data_parallel_size: int, drain_timeout: int = 300) -> None:
        """vLLM's one-call scale (ElasticEP.scale): prepare_elastic_ep, then commit_elastic_ep."""
        if isinstance(drain_timeout, bool) or not isinstance(drain_timeout, int) or drain_timeout <= 0:
            raise ValueError("drain_timeout must be a positive integer")
        await self._elastic().scale(new_data_parallel_size, float(drain_timeout))

    async def is_scaling_elastic_ep(self) -> dict[str, Any]:
        """vLLM's scaling status (ElasticEP.scaling_status); a group that cannot scale is always idle."""
        return self.elastic.scaling_status() if self.elastic is not None else idle_elastic_ep_status()

    def elastic_ep_state(self) -> dict:
        """{"data_parallel_size", "pending": the prepared change or None, "generation"}."""
        return self._elastic().state()

    # ---- weights -----------------------------------------------------------------------------

    async def engine_world_sizes(self) -> list[int]:
        return [int(size) for size in await self._fan_out("get_world_size", False)]

    async def get_world_size(self, include_dp: bool = True) -> int:
        """Every engine's workers (include_dp), or one engine's (engine 0's: the engines are alike)."""
        sizes = await self.engine_world_sizes()
        return sum(sizes) if include_dp else sizes[0]

    async def init_weight_transfer_engine(self, request: Any) -> None:
        """Every engine's receiver; with "rank_offset", engine i's workers start at the offset
        plus the world sizes of engines 0..i-1. request: as AsyncLLM's (vLLM's request, {"init_info"}, or init_info)."""
        init_info = init_info_of(request)
        if "rank_offset" not in init_info:
            await self._fan_out("init_weight_transfer_engine", init_info)
            return
        offsets, next_offset = [], int(init_info["rank_offset"])
        for size in await self.engine_world_sizes():
            offsets.append(next_offset)
            next_offset += size
        await self._each(lambda i, e: e.init_weight_transfer_engine({**init_info, "rank_offset": offsets[i]}))

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Every engine finishes (and resets its prefix cache for the new weights); so the balancer forgets prefixes."""
        self.balancer.forget_prefixes()
        await self._fan_out("finish_weight_update", weight_version)

    async def apply_weight_update(self, request: Any, weight_version: str | None = None) -> None:
        """A whole update in one call (EngineControls.apply_weight_update). One engine: its own one call. Several:
        the update's three phases, each on every engine at once (a collective transport needs all of them in
        update_weights together), and finish only once every engine landed it: the group serves the new weights
        on all engines or on none (a failure aborts the update on every engine that started it)."""
        if self.num_engines == 1:
            await self.engines[0].apply_weight_update(request, weight_version)
            return
        if weight_version is not None:
            checked_version("weight_version", weight_version)  # refused before any engine starts the update
        starts = await asyncio.gather(*(e.start_weight_update() for e in self.engines), return_exceptions=True)
        started = [i for i, result in enumerate(starts) if not isinstance(result, BaseException)]
        try:
            for index, result in enumerate(starts):
                if isinstance(result, BaseException):
                    raise self._engine_error(index, result) from result
            await self._fan_out("update_weights", request)
        except BaseException:
            await self._abort_update_quietly(started)
            raise
        await self.finish_weight_update(weight_version)

    async def _abort_update_quietly(self, indexes: list[int]) -> None:
        """Aborts the update on these engines, logging (not raising) failures: the caller raises the first error."""
        results = await asyncio.gather(*(self.engines[i].abort_weight_update() for i in indexes),
                                       return_exceptions=True)
        for index, result in zip(indexes, results):
            if isinstance(result, BaseException):
                logger.warning("RolloutGroup: aborting engine %d's update after a failed one-call update failed: %s",
                               index, result)

    async def weight_info(self, model: str = "target") -> dict[str, Any]:
        """Engine 0's weight_info (of `model`: "target" or "draft"), once every engine is checked to serve the
        same version, with every engine's in `engines` (each has its tensor-parallel ranks' slices under "ranks")."""
        infos = await self._fan_out("weight_info", model)
        versions = [info["weight_version"] for info in infos]
        if len(set(versions)) > 1:
            raise self._disagreement("weight_info", versions)
        return {**infos[0], "engines": infos}

    async def weight_checker(self, baseline: dict[str, Any] | None = None, model: str = "target",
                             action: WeightCheckerAction | None = None) -> dict[str, Any]:
        """With `action`, vLLM's checker over every engine's workers (their keys carry the engine's dp index).
        Without: engine 0's report with `match` true only if every engine matches the baseline,
        `consistent` whether the engines agree on every weight they hold in common (under expert
        parallelism each holds other experts), and every report in `engines`."""
        if action == "reset":
            await self._fan_out("weight_checker", None, model, "reset")
            return {"status": "reset"}
        if action is not None:
            per_worker = await self.compute_weight_checksums() if action in ("checksum", "compare") else []
            return vllm_weight_checker(action, baseline, lambda: per_worker, lambda: None)
        reports = await self._fan_out("weight_checker", baseline, model)
        combined = dict(reports[0])
        if "match" in combined:
            combined["match"] = all(r.get("match") for r in reports)
        first = reports[0].get("checksums") or {}
        combined["consistent"] = all(
            all(checksums[n] == first[n] for n in checksums.keys() & first.keys())
            for checksums in (r.get("checksums") or {} for r in reports)
        )
        combined["engines"] = reports
        return combined

    def admit(self, num_requests: int) -> Admission:
        """AsyncLLM.admit on a routable engine with room; AdmissionError (HTTP 503) when none has."""
        self.check_admission(num_requests)
        engines = self.engines[:self.num_routable]
        engine = next((e for e in engines if e.admission_refusal(num_requests) is None), engines[0])
        return engine.admit(num_requests)

    def check_admission(self, num_requests: int, num_prompt_tokens: int = 0) -> None:
        """AdmissionError (HTTP 503) when no routable engine has room for `num_requests` more requests."""
        refusal = None
        for engine in self.engines[:self.num_routable]:
            refusal = engine.admission_refusal(num_requests, num_prompt_tokens)
            if refusal is None:
                return
        if refusal is not None:
            self.engines[0].stat_loggers.record_admission_rejection(refusal.reason)
            raise refusal

    # ---- health, metrics, fault tolerance, lifecycle -----------------------------------------

    @property
    def is_dead(self) -> bool:
        """True once any engine is dead, or a lockstep group's coordinator (the group no longer does what its controls promise)."""
        coordinator_dead = self.dp_coordinator is not None and not self.dp_coordinator.is_alive()
        return coordinator_dead or any(engine.is_dead for engine in self.engines)

    async def check_health(self) -> None:
        if self.dp_coordinator is not None and not self.dp_coordinator.is_alive():
            raise EngineDeadError("the DP coordinator process of the lockstep group is dead")
        for index, engine in enumerate(self.engines):
            try:
                await engine.check_health()
            except EngineDeadError as e:
                raise EngineDeadError(f"engine {index} of {self.num_engines}: {e}") from e

    def prometheus_text(self) -> bytes:
        return self.metrics.prometheus_text()

    def get_metrics_snapshot(self) -> dict:
        return self.metrics.snapshot()

    async def fault_tolerance_status(self) -> FaultToleranceStatus:
        """vLLM's status with one entry per engine ("id": its index), and the worst engine's status
        ("dead" > "unhealthy" > "healthy")."""
        reports = await self._fan_out("fault_tolerance_status")
        entries = [{**report["engines"][0], "id": i} for i, report in enumerate(reports)]
        return fault_tolerance_report(entries, reports[0]["enabled"])

    def shutdown(self) -> None:
        """Stops every engine; waiting callers get EngineDeadError."""
        for engine in self.engines:
            engine.shutdown()
        if self.elastic is not None:
            self.elastic.shutdown()
        if self.dp_coordinator is not None:
            self.dp_coordinator.shutdown()


class _BalancerCollector:
    """/metrics series of the group's own routing: requests routed and tokens outstanding per engine."""

    def __init__(self, group: RolloutGroup) -> None:
        self.group = group

    def collect(self):
        labels = ["model_name", "engine"]
        routed = CounterMetricFamily(PREFIX + "dp_requests_routed", "Requests the group routed to each engine.", labels=labels)
        outstanding = GaugeMetricFamily(
            PREFIX + "dp_outstanding_tokens",
            "Prompt + max new tokens of the requests in flight on each engine (what the balancer minimises).",
            labels=labels,
        )
        balancer = self.group.balancer
        for i in range(self.group.num_engines):
            routed.add_metric([self.group.model_name, str(i)], balancer.num_routed[i])
            outstanding.add_metric([self.group.model_name, str(i)], balancer.outstanding_tokens[i])
        yield routed
        yield outstanding
