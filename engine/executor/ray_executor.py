"""RayExecutor: one Ray actor per tensor-parallel rank, placed together by a placement group, with collective_rpc's semantics.

The executor joins the Ray cluster this process is connected to (ray.init done by the caller),
else one already running on this node, else starts a local one (and shuts it down with itself).
One bundle per rank ({"CPU": 1} on CPU, {"GPU": 1} on CUDA), placed by
ParallelConfig.ray_placement_strategy (PACK: on one node when it fits, so the ranks' per-layer
collectives stay on one host, else across nodes). An actor that dies (ray.exceptions.RayActorError) makes the executor dead: is_alive()
turns False and the call raises WorkerDiedError, as with a worker process.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from typing import Any

from engine.config import EngineConfig
from engine.executor.base import Executor, WorkerDiedError, WorkerReply, call_worker, results_or_raise

_PLACEMENT_TIMEOUT_S = 120.0  # a placement group the cluster cannot hold must fail, not wait forever
_POLL_S = 1.0
_ERROR_GRACE_S = 30.0  # as in MultiprocExecutor: after one rank fails, how long the others get


class RayWorkerWrapper:
    """The Ray actor of one rank: builds its Worker when asked, then runs calls on it (answers are WorkerReplys)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.worker = None

    def node_ip_and_free_port(self) -> tuple[str, int]:
        """Where rank 0 can host the group's rendezvous (tcp://ip:port)."""
        import ray

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def init_worker(
        self,
        config: EngineConfig,
        max_model_len: int,
        world_size: int,
        init_method: str | None,
        device_index: int | None,
    ) -> WorkerReply:
        from engine.worker.worker import Worker

        try:
            self.worker = Worker(config, max_model_len, self.rank, world_size, init_method, device_index)
        except BaseException as e:
            return WorkerReply.failed(self.rank, e, traceback.format_exc())
        return WorkerReply(self.rank, os.getpid())

    def execute_method(self, method: str, args: tuple, kwargs: dict, reply_rank: int | None) -> WorkerReply:
        return call_worker(self.worker, self.rank, method, args, kwargs, reply_rank)


class RayExecutor(Executor):
    """tensor_parallel_size RayWorkerWrapper actors in one placement group."""

    def __init__(self, config: EngineConfig, max_model_len: int) -> None:
        super().__init__(config, max_model_len)
        self.placement_strategy = config.parallel.ray_placement_strategy
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._owns_ray = _connect_ray()
        self.actors: list = []
        self.placement_group = None
        try:
            use_gpu = _uses_gpu(config.device.device, ray.cluster_resources())
            bundle = {"GPU": 1} if use_gpu else {"CPU": 1}
            self.placement_group = placement_group([bundle] * self.world_size, strategy=self.placement_strategy)
            ready, _ = ray.wait([self.placement_group.ready()], timeout=_PLACEMENT_TIMEOUT_S)
            if not ready:
                raise RuntimeError(
                    f"RayExecutor: a placement group of {self.world_size} x {bundle} ({self.placement_strategy}) "
                    f"could not be placed within {_PLACEMENT_TIMEOUT_S:g} s; "
                    f"the cluster has {ray.available_resources()} available"
                )
            actor_cls = ray.remote(RayWorkerWrapper)
            for rank in range(self.world_size):
                strategy = PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=rank)
                self.actors.append(
                    actor_cls.options(
                        num_cpus=0 if use_gpu else 1,
                        num_gpus=1 if use_gpu else 0,
                        max_restarts=0,  # a restarted rank would have lost its model and its group
                        scheduling_strategy=strategy,
                    ).remote(rank)
                )
            init_method = None
            if self.world_size > 1:
                [(ip, port)] = self._gather_refs([self.actors[0].node_ip_and_free_port.remote()], 0.0, raw=True)
                init_method = f"tcp://{ip}:{port}"
            # Ray shows each actor only its own GPU, as device 0.
            device_index = 0 if use_gpu else None
            refs = [
                a.init_worker.remote(config, max_model_len, self.world_size, init_method, device_index)
                for a in self.actors
            ]
            self.worker_pids = results_or_raise(self._gather_refs(refs, 0.0))
        except BaseException:
            self.shutdown()
            raise

    def collective_rpc(
        self, method: str, args: tuple = (), kwargs: dict | None = None, unique_reply_rank: int | None = None
    ) -> list[Any]:
        self.check_alive()
        refs = [a.execute_method.remote(method, args, kwargs or {}, unique_reply_rank) for a in self.actors]
        return results_or_raise(self._gather_refs(refs, _ERROR_GRACE_S))

    def _gather_refs(self, refs: list, error_grace_s: float, raw: bool = False) -> list:
        """Waits for refs[i] (rank i's answer) in short waits; WorkerDiedError if an actor dies.

        raw: the refs hold plain values (rank 0 only), not WorkerReplys.
        """
        import ray

        pending = {ref: rank for rank, ref in enumerate(refs)}
        results: list = []
        give_up_at: float | None = None
        while pending:
            wait_s = _POLL_S if give_up_at is None else max(0.0, min(_POLL_S, give_up_at - time.monotonic()))
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=wait_s)
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    result = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    self._mark_dead(f"Ray worker actor of tensor-parallel rank {rank} died: {e}")
                    raise WorkerDiedError(self.dead_reason) from e
                except (
                    ray.exceptions.RayTaskError
                ) as e:  # the wrapper itself failed (e.g. arguments that do not deserialize)
                    result = WorkerReply(rank, error_text=f"{type(e).__name__}: {e}", traceback=str(e))
                results.append(result)
                if not raw and not result.ok and give_up_at is None:
                    give_up_at = time.monotonic() + error_grace_s
            if pending and give_up_at is not None and time.monotonic() >= give_up_at:
                self._give_up(results, sorted(pending.values()))
        return results

    def is_alive(self) -> bool:
        return self.dead_reason is None

    def shutdown(self) -> None:
        """Kills the actors and removes the placement group (and stops Ray if this executor started it)."""
        if self.dead_reason is None:
            self.dead_reason = "the executor was shut down"
        import ray

        if not ray.is_initialized():
            return
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass
        self.actors = []
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.placement_group)
            except Exception:
                pass
            self.placement_group = None
        if self._owns_ray:
            ray.shutdown()


def _connect_ray() -> bool:
    """Joins Ray: this process's connection, else a cluster running on this node (`ray start`, or
    the local cluster of the process that started this engine), else a new local one; True if new."""
    import ray

    if ray.is_initialized():
        return False
    try:
        ray.init(address="auto")
        return False
    except ConnectionError:
        ray.init(include_dashboard=False)
        return True


def _uses_gpu(device: str, cluster_resources: dict) -> bool:
    """CUDA devices ask for GPU bundles; "auto" does when the cluster has GPUs."""
    if device == "auto":
        return cluster_resources.get("GPU", 0) > 0
    return device.startswith("cuda")
