"""Elastic expert parallelism of a lockstep RolloutGroup: change its engine count in two phases, prepare (reconfigure) and commit (route and resume).

Scale up, S -> N engines:

    prepare  1. start engines S..N-1 (data_parallel_size N, their ranks, data_parallel_join_later:
                they load the checkpoint and join no group yet) while the group serves
             2. pause the group ("keep": in-flight requests freeze, new ones queue on the old
                engines); give the new engines the group's weight version
             3. the coordinator process now routes waves among N engines
             4. every engine at once (reconfigure_elastic_ep, engine/dp_core_proc.py): the workers
                leave the old EP group and join a new one of size N (a fresh port); rank 0
                broadcasts the non-expert weights (the group's CURRENT weights, updates included);
                every expert moves from its old owner to its new one (engine/worker/elastic_ep.py);
                the engine cores join the DP sync group's next generation (size N), agree on
                the old engines' wave counter, and the new ones connect to the coordinator
             The new engines get no requests yet; the group stays paused.
    commit   5. wait (bounded by ready_timeout_s) until the coordinator has heard every engine
                identity 0..N-1; 6. route to all N engines; 7. resume every engine (a barrier)

Scale down, S -> N engines:

    prepare  1. stop routing to engines N..S-1 and wait (bounded by drain_timeout_s) until their
                in-flight requests finish; on timeout routing is restored and nothing changed
             2. pause the group ("keep")
             3. every engine at once: experts move off the leaving ranks over the old EP group;
                the staying workers join a new EP group of size N, their cores the DP sync
                group's next generation; the leaving ones leave both
             4. the coordinator routes waves among N engines; the group's engine list is 0..N-1
    commit   5. shut the leaving engines down; 6. resume (a barrier)

The expert-to-rank map is recomputed for the new size (contiguous ranges, uneven when N does not
divide the number of experts); there are no redundant (replicated) experts yet. A failure in
step 4 (up) or 3 (down) leaves the engines in different groups: the group must be restarted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.async_llm import AsyncLLM
from engine.engine_args import create_engine_config, num_routed_experts
from rollout.dp_coordinator import free_port

if TYPE_CHECKING:
    from rollout.group import RolloutGroup

logger = logging.getLogger(__name__)



class ElasticEPStateError(RuntimeError):
    """An elastic EP call at the wrong time: a prepare while a change is prepared, a commit with none, two at once."""


@dataclass
class ElasticChange:
    """A prepared, not yet committed, size change."""

    old_size: int
    new_size: int
    generation: int
    joining: list[AsyncLLM] = field(default_factory=list)  # started, not routed to yet (scale up)
    leaving: list[AsyncLLM] = field(default_factory=list)  # out of the groups, shut down at commit (scale down)

    def describe(self) -> dict:
        return {"old_data_parallel_size": self.old_size, "new_data_parallel_size": self.new_size,
                "generation": self.generation}


class ElasticEP:
    """The elastic EP controls of one lockstep RolloutGroup (see the module doc)."""

    def __init__(
        self,
        group: RolloutGroup,
        engine_args: dict[str, Any],
        *,
        multiprocess: bool = True,
        model_name: str | None = None,
        ready_timeout_s: float = 120.0,
        drain_timeout_s: float = 300.0,
    ) -> None:
        self.group = group
        self.engine_args = dict(engine_args)  # flat engine args the group was started with
        self.multiprocess = multiprocess
        self.model_name = model_name
        self.ready_timeout_s = ready_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self.generation = 0  # of the DP sync group (and the EP group's rendezvous)
        self.pending: ElasticChange | None = None
        self._busy = False  # a prepare or commit is running
        self._requested: int | None = None  # the size the running (or prepared) change goes to
        self.last_error: str | None = None  # the last scale()'s failure
        config = create_engine_config(**self.engine_args)
        self.base_seed = config.model.seed
        hf_config = config.model.hf_config_dict()
        self.num_experts = num_routed_experts(hf_config)

    def state(self) -> dict:
        return {
            "data_parallel_size": self.group.num_engines,
            "generation": self.generation,
            "pending": self.pending.describe() if self.pending is not None else None,
        }

    def scaling_status(self) -> dict:
        """vLLM's /is_scaling_elastic_ep body: "preparing" while a prepare runs or a prepared change waits
        for its commit, "committing" while the commit runs, else "idle" (or "failed" after a failed
        scale_elastic_ep, with its "error"); "epoch" is the DP group's generation."""
        if self._busy:
            phase = "committing" if self.pending is not None else "preparing"
        elif self.pending is not None:
            phase = "preparing"
        else:
            phase = "failed" if self.last_error is not None else "idle"
        requested = self._requested if phase in ("preparing", "committing") else None
        return {"is_scaling_elastic_ep": phase in ("preparing", "committing"), "phase": phase,
                "epoch": self.generation, "error": self.last_error if phase == "failed" else None,
                "requested_data_parallel_size": requested}

    async def scale(self, new_size: int, drain_timeout_s: float) -> None:
        """vLLM's one-call scale: prepare then commit; a failed commit of a prepared change stays prepared."""
        self._requested, self.last_error = new_size, None
        try:
            await self.prepare(new_size, drain_timeout_s)
            await self.commit()
        except Exception as e:
            self.last_error = f"{type(e).__name__}: {e}"
            raise

    # ---- prepare ------------------------------------------------------------------------------

    async def prepare(self, new_size: int, drain_timeout_s: float | None = None) -> dict:
        """Reconfigures the group for `new_size` engines; the new size serves requests after commit().

        drain_timeout_s (scale down): how long the leaving engines' requests may take to finish
        (default self.drain_timeout_s); past it, TimeoutError and nothing changed.
        """
        if type(new_size) is not int or new_size < 1:
            raise ValueError(f"new_data_parallel_size must be a positive int, got {new_size!r}")
        _check_timeout("drain_timeout_s", drain_timeout_s)
        if self.pending is not None:
            raise ElasticEPStateError(f"prepare_elastic_ep: a change to {self.pending.new_size} engines is prepared; "
                               "commit_elastic_ep() first")
        if self._busy:
            raise ElasticEPStateError("prepare_elastic_ep: another elastic EP call is running")
        old_size = self.group.num_engines
        self._requested = new_size
        if new_size == old_size:
            raise ValueError(f"new_data_parallel_size: the group has {old_size} engines already")
        if self.num_experts and new_size > self.num_experts:
            raise ValueError(f"new_data_parallel_size: {new_size} engines exceed the model's {self.num_experts} experts")
        self._busy = True
        try:
            if await self.group.is_sleeping():
                raise ElasticEPStateError("prepare_elastic_ep: the group is asleep; wake_up() first")
            if new_size > old_size:
                change = await self._prepare_up(old_size, new_size)
            else:
                change = await self._prepare_down(old_size, new_size, drain_timeout_s or self.drain_timeout_s)
        finally:
            self._busy = False
        self.pending = change
        logger.info("elastic EP: prepared %d -> %d engines (generation %d)", old_size, new_size, change.generation)
        return self.state()

    def _plan(self, old_size: int, new_size: int, old_rank: int | None, new_rank: int | None, ep_port: int) -> dict:
        host = self.group.dp_coordinator.host
        return {"old_size": old_size, "new_size": new_size, "old_rank": old_rank, "new_rank": new_rank,
                "generation": self.generation + 1, "ep_init_method": f"tcp://{host}:{ep_port}"}

    async def _prepare_up(self, old_size: int, new_size: int) -> ElasticChange:
        group = self.group
        # The new engines load while the group still serves; it pauses only for the reconfiguration.
        joining = await asyncio.to_thread(self._start_engines, range(old_size, new_size), new_size)
        try:
            await group.pause_generation("keep")
        except BaseException:
            for engine in joining:
                engine.shutdown()
            raise
        try:
            version = await group.get_weight_version()
            if version is not None:
                await asyncio.gather(*(engine.update_weight_version(version) for engine in joining))
            await asyncio.to_thread(group.dp_coordinator.resize, new_size)
        except BaseException:
            for engine in joining:
                engine.shutdown()
            await asyncio.to_thread(group.dp_coordinator.resize, old_size)
            await group.resume_generation()
            raise
        ep_port = free_port(group.dp_coordinator.host)
        plans = [self._plan(old_size, new_size, r, r, ep_port) for r in range(old_size)]
        plans += [self._plan(old_size, new_size, None, r, ep_port) for r in range(old_size, new_size)]
        try:
            await self._reconfigure([*group.engines, *joining], plans)
        except BaseException:
            for engine in joining:
                engine.shutdown()
            raise
        self.generation += 1
        return ElasticChange(old_size, new_size, self.generation, joining=joining)

    def _start_engines(self, ranks: range, new_size: int) -> list[AsyncLLM]:
        """Starts the engines of `ranks` (in parallel) for a group of `new_size`; they join later."""
        coordinator = self.group.dp_coordinator
        devices = _devices(self.engine_args, new_size)

        from rollout.group import start_engines

        per_engine = [
            {**self.engine_args, "device": devices[rank], "seed": self.base_seed + rank,
             "data_parallel_size": new_size, "data_parallel_rank": rank,
             "data_parallel_master_ip": coordinator.host, "data_parallel_master_port": coordinator.port,
             "data_parallel_join_later": True}
            for rank in ranks
        ]
        return start_engines(per_engine, multiprocess=self.multiprocess, model_name=self.model_name)

    async def _prepare_down(self, old_size: int, new_size: int, drain_timeout_s: float) -> ElasticChange:
        group = self.group
        group.num_routable = new_size  # nothing new reaches the leaving engines
        try:
            await self._drain(new_size, drain_timeout_s)
            await group.pause_generation("keep")
        except BaseException:
            group.num_routable = old_size
            raise
        ep_port = free_port(group.dp_coordinator.host)
        plans = [self._plan(old_size, new_size, r, r if r < new_size else None, ep_port) for r in range(old_size)]
        await self._reconfigure(group.engines, plans)
        self.generation += 1
        await asyncio.to_thread(group.dp_coordinator.resize, new_size)
        leaving = group.engines[new_size:]
        group.set_engines(group.engines[:new_size])
        group.num_routable = new_size
        return ElasticChange(old_size, new_size, self.generation, leaving=leaving)

    async def _drain(self, new_size: int, timeout_s: float) -> None:
        """Waits until no request the group routed is in flight on engines new_size.. (at most timeout_s)."""
        deadline = time.monotonic() + timeout_s
        while any(index >= new_size for index in self.group._owners.values()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"prepare_elastic_ep: requests on engines {new_size}.. did not finish within "
                                   f"{timeout_s} s; nothing was changed")
            await asyncio.sleep(0.02)

    async def _reconfigure(self, engines: list[AsyncLLM], plans: list[dict]) -> None:
        results = await asyncio.gather(
            *(engine.reconfigure_elastic_ep(plan) for engine, plan in zip(engines, plans)), return_exceptions=True
        )
        failed = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
        if failed:
            index, error = failed[0]
            raise RuntimeError(f"elastic EP: reconfiguring engine {index} failed ({error}); the engines may be in "
                               "different groups now: restart the group") from error

    # ---- commit -------------------------------------------------------------------------------

    async def commit(self, ready_timeout_s: float | None = None) -> dict:
        """Routes to the prepared size's engines (once every one is connected to the coordinator) and resumes.

        ready_timeout_s: how long to wait for the connections (default self.ready_timeout_s); past
        it, TimeoutError and the change stays prepared (commit may be called again).
        """
        _check_timeout("ready_timeout_s", ready_timeout_s)
        change = self.pending
        if change is None:
            raise ElasticEPStateError("commit_elastic_ep: no elastic EP change is prepared; call prepare_elastic_ep first")
        if self._busy:
            raise ElasticEPStateError("commit_elastic_ep: another elastic EP call is running")
        self._busy = True
        try:
            group = self.group
            await self._wait_connected(change.new_size, ready_timeout_s or self.ready_timeout_s)
            if change.joining:
                group.set_engines([*group.engines, *change.joining])
            for engine in change.leaving:
                engine.shutdown()
            await group.resume_generation()
        finally:
            self._busy = False
        self.pending = None
        logger.info("elastic EP: committed %d -> %d engines", change.old_size, change.new_size)
        return self.state()

    async def _wait_connected(self, num_engines: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            state = await asyncio.to_thread(self.group.dp_coordinator.state)
            missing = sorted(set(range(num_engines)) - set(state["connected"]))
            if not missing:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"commit_elastic_ep: engine(s) {missing} did not connect to the DP coordinator "
                                   f"within {timeout_s} s; the change stays prepared")
            await asyncio.sleep(0.02)

    def shutdown(self) -> None:
        """Stops the engines of a change that was prepared and never committed."""
        if self.pending is not None:
            for engine in [*self.pending.joining, *self.pending.leaving]:
                engine.shutdown()
            self.pending = None


def _check_timeout(name: str, value: float | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


def _devices(engine_args: dict, num_engines: int) -> list[str]:
    from rollout.group import engine_devices

    config = create_engine_config(**engine_args)
    return engine_devices(config.device.resolve(), num_engines, config.parallel.tensor_parallel_size)


