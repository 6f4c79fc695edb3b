"""DPEngineCoreProc: the engine process of a lockstep data-parallel group (expert parallelism) - waves, dummy batches, DP state sync.

Lockstep engines (ParallelConfig.lockstep) must run the same number of forward passes, because
a MoE layer's expert-parallel collectives span all of them. The group's work comes in waves:

    idle --(work or a pause arrives at any engine)--> wave N runs on every engine --(sync: nobody
    has work)--> wave N complete, counter N+1, idle (blocked on input, no spinning)

While wave N runs, every loop iteration every engine runs exactly one forward pass: a real step
if it has schedulable work, else a dummy batch. Engines agree through a small all-reduce of
(has unfinished work, pause pending, ready to pause) - the DP state sync - on the wave's first
step, then every dp_sync_interval steps, and on every step while a pause is pending on any
engine (a one-int "doorbell" all-reduce overlapped with each forward pass tells every engine
so at the same step). The sync's result is the same on every engine, so the wave ends (and a
pause completes) at the same step everywhere.

Waves start through the group's coordinator process (rollout/dp_coordinator.py): an idle engine
that gets work starts the next wave itself and sends START_WAVE(N) to the coordinator, which
forwards it to every other engine (keeping it for one that has not connected yet). A START_WAVE
for a wave this engine already finished is stale and ignored.

Pause is two-phase. The pause utility call takes effect here at once (EngineCore.pause: abort,
refuse new requests, or freeze) and is marked pending; its answer is deferred. An engine is
ready to pause once it has nothing left to step. When a sync shows every engine ready, each
completes the pause at that same step: synchronizes the device, answers the call. A pause at
an idle group starts a wave, so it completes after one dummy batch. resume() is local; the
group's frontend awaits every engine's answer (a barrier) and the engines restart stepping
together through the next wave's first sync. A resume while a pause is still pending cancels it.

The sync group is a standalone gloo group on the TCPStore at data_parallel_master_ip:
data_parallel_master_port (hosted by the group's frontend, which also publishes the coordinator's
addresses there), never torch.distributed's default group, so a tensor-parallel worker in this
process keeps that one; DPSyncGroup.rebuild(rank, size, generation) tears it down and builds it
again with another size (elastic EP).

Elastic EP (rollout/elastic_ep.py): an engine added to a running group starts with
data_parallel_join_later, joining neither group; the reconfigure_elastic_ep utility call, made
on every engine of the old and new group at once while the group is paused, has the workers
move experts and rebuild the EP group (engine/worker/elastic_ep.py), then joins this engine to
the sync group's next generation (connecting a new engine to the coordinator) or, for an engine
that leaves, leaves it.
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec
import zmq

from engine.config import EngineConfig
from engine.core_proc import EngineCoreProc
from engine.wire import EngineCoreOutputs, UtilityOutput

logger = logging.getLogger(__name__)

# The store key under which the group's frontend publishes the coordinator's addresses (JSON).
DP_COORDINATOR_KEY = "dp_coordinator"
# Internal input-queue type: a START_WAVE from the coordinator (never sent by a frontend).
START_WAVE = b"\xf0"
_SYNC_TIMEOUT_S = 1800.0  # a peer busy in a long utility call (weight update, wake-up) is not dead
_STORE_TIMEOUT_S = 300.0  # how long an engine waits for the frontend's store and its peers at start-up
_POLL_MS = 100


class WaveMessage(msgspec.Struct, array_like=True):
    """Engine <-> coordinator. kind: "hello" (engine connects), "start_wave" (either way)."""

    kind: str
    dp_rank: int
    wave: int = 0


@dataclass
class DPCounters:
    """What this engine's lockstep loop has done since it started (tests assert exact counts)."""

    num_real_steps: int = 0  # steps that ran a forward pass on scheduled work
    num_dummy_batches: int = 0  # forward passes of one dummy token (no work here, the wave runs)
    num_syncs: int = 0  # DP state all-reduces
    num_waves_completed: int = 0
    num_pauses: int = 0  # pauses completed by consensus
    last_pause_num_steps: int = 0  # forward passes here between the last pause's arrival and its completion


@dataclass
class _PendingPause:
    waiters: list[tuple[int, int]] = field(default_factory=list)  # (client index, call id) to answer
    aborted: list[str] = field(default_factory=list)  # request ids an abort-mode pause ended
    num_steps: int = 0  # forward passes since it arrived


class DPSyncGroup:
    """The engine cores' DP state sync: a gloo group of their own, built on a TCPStore client.

    Torn down and built again by rebuild(rank, size, generation): each generation rendezvouses
    under its own store prefix, so a group of a new size never meets the old one's keys.
    """

    def __init__(self, host: str, port: int, rank: int, size: int, generation: int = 0) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.store = dist.TCPStore(
            host, port, is_master=False, timeout=datetime.timedelta(seconds=_STORE_TIMEOUT_S)
        )
        self.pg = None
        self.rebuild(rank, size, generation)

    def rebuild(self, rank: int, size: int, generation: int) -> None:
        """Leaves the current group and joins generation `generation` as `rank` of `size` (blocks until all joined)."""
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is out of range [0, {size})")
        self.close_group()
        prefixed = self._dist.PrefixStore(f"dp_sync/{generation}", self.store)
        self.pg = self._dist.ProcessGroupGloo(prefixed, rank, size, datetime.timedelta(seconds=_SYNC_TIMEOUT_S))
        self.rank, self.size, self.generation = rank, size, generation

    def all_reduce(self, values: list[int]) -> list[int]:
        """The element-wise sum of `values` over the group."""
        return self.all_reduce_async(values)()

    def all_reduce_async(self, values: list[int]) -> Callable[[], list[int]]:
        """Starts the all-reduce (gloo runs it on its own thread); the returned function waits for the sum."""
        import torch

        tensor = torch.tensor(values, dtype=torch.int64)
        work = self.pg.allreduce([tensor])

        def wait() -> list[int]:
            work.wait()
            return tensor.tolist()

        return wait

    def coordinator_addresses(self) -> dict:
        """{"notify": PULL address for START_WAVE notices, "waves": ROUTER address for hello / START_WAVE}."""
        return json.loads(self.store.get(DP_COORDINATOR_KEY))

    def close_group(self) -> None:
        if self.pg is not None:
            try:
                self.pg.shutdown()
            except (AttributeError, RuntimeError):
                pass
            self.pg = None


class DPEngineCoreProc(EngineCoreProc):
    """EngineCoreProc whose busy loop steps in lockstep with the rest of its data-parallel group (see the module doc)."""

    def __init__(
        self, config: EngineConfig, input_addresses: list[str], output_addresses: list[str], engine_index: int = 0
    ) -> None:
        parallel = config.parallel
        if not parallel.lockstep:
            raise ValueError("DPEngineCoreProc needs enable_expert_parallel and data_parallel_size > 1")
        if parallel.data_parallel_master_port == 0:
            raise ValueError("data_parallel_master_port: a lockstep engine needs the group's rendezvous port (0 is unset)")
        self.parallel = parallel
        self.dp_rank = parallel.data_parallel_rank
        self.dp_size = parallel.data_parallel_size
        self.sync_interval = parallel.dp_sync_interval
        self.current_wave = 0  # the wave running now, or the next one while idle
        self.wave_running = False
        self.step_in_wave = 0  # forward passes of the running wave so far
        self.counters = DPCounters()
        self._pending_pause: _PendingPause | None = None
        self.dp_group: DPSyncGroup | None = None
        self._notify_socket: zmq.Socket | None = None
        self._coordinator_thread: threading.Thread | None = None
        super().__init__(config, input_addresses, output_addresses, engine_index)

    def _init_before_ready(self) -> None:
        if self.parallel.data_parallel_join_later:
            return  # elastic EP: joins by reconfigure_elastic_ep, once the group is ready for it
        # Blocks until every engine of the group has joined: the group starts them together.
        self._join(self.dp_rank, self.dp_size, generation=0)

    def _join(self, rank: int, size: int, generation: int) -> None:
        """Joins the DP sync group (generation `generation`) and connects to the coordinator as `rank`."""
        self.dp_group = DPSyncGroup(
            self.parallel.data_parallel_master_ip, self.parallel.data_parallel_master_port, rank, size, generation
        )
        self.dp_rank, self.dp_size = rank, size
        addresses = self.dp_group.coordinator_addresses()
        self._notify_socket = self.ctx.socket(zmq.PUSH)  # the busy loop's: START_WAVE notices out
        waves = self.ctx.socket(zmq.DEALER)  # the coordinator thread's: hello out, START_WAVE in
        try:
            self._notify_socket.setsockopt(zmq.SNDHWM, 0)
            self._notify_socket.connect(addresses["notify"])
            waves.setsockopt(zmq.IDENTITY, self.dp_rank.to_bytes(2, "little"))
            waves.setsockopt(zmq.RCVHWM, 0)
            waves.connect(addresses["waves"])
        except BaseException:  # the context is terminated next (FAILED handshake): no socket may stay open
            self._notify_socket.close(linger=0)
            waves.close(linger=0)
            raise
        self._coordinator_thread = threading.Thread(
            target=self._coordinator_loop, args=(waves,), name="engine-dp-coordinator", daemon=True
        )
        self._coordinator_thread.start()

    # ---- the lockstep busy loop --------------------------------------------------------------

    def run_busy_loop(self) -> None:
        while self.running:
            try:
                self.engine_core.executor.check_alive()
                self._process_input_queue()
                self.engine_core.expire_idle_weight_update()
                if not self.running:
                    break
                if not self.wave_running and self._needs_wave():
                    self._start_wave(self.current_wave, notify=True)
                if self.wave_running:
                    self._lockstep_step()
            except Exception as e:
                self._on_fault(e)

    def _needs_wave(self) -> bool:
        return self.engine_core.has_unfinished_requests() or self._pending_pause is not None

    def _is_idle(self) -> bool:
        return not self.wave_running and not self._needs_wave()

    def _start_wave(self, wave: int, notify: bool) -> None:
        if wave < self.current_wave or (self.wave_running and wave == self.current_wave):
            return  # a wave this engine finished already, or the one it runs
        if self.wave_running:  # cannot happen: every engine ends a wave at the same sync
            logger.error("DPEngineCoreProc %d: START_WAVE(%d) during wave %d; ignored", self.dp_rank, wave, self.current_wave)
            return
        self.current_wave = wave
        self.wave_running = True
        self.step_in_wave = 0
        if notify:
            msg = msgspec.msgpack.encode(WaveMessage("start_wave", self.dp_rank, wave))
            self._notify_socket.send(msg)

    def _lockstep_step(self) -> None:
        """One forward pass (real or dummy), then the DP state sync when it is due.

        The pause doorbell: a one-int all-reduce (is a pause pending here?) that runs alongside
        the forward pass. When it rings, every engine runs the state sync at this same step - a
        sync forced by one engine's local state alone would leave the others stepping into a
        forward pass whose collectives it never joins.
        """
        core = self.engine_core
        doorbell = self.dp_group.all_reduce_async([int(self._pending_pause is not None)])
        ran_model = False
        if core.has_unfinished_requests():
            self._step()
            ran_model = core.last_step_ran_model
        if ran_model:
            self.counters.num_real_steps += 1
        else:
            core.execute_dummy_batch()
            self.counters.num_dummy_batches += 1
        if self._pending_pause is not None:
            self._pending_pause.num_steps += 1
        (num_pending,) = doorbell()
        due = self.step_in_wave % self.sync_interval == 0 or num_pending > 0
        self.step_in_wave += 1
        if due:
            self._sync()

    def _sync(self) -> None:
        has_work = self.engine_core.has_unfinished_requests()
        pending = self._pending_pause is not None
        ready = pending and not has_work
        num_with_work, num_pending, num_ready = self.dp_group.all_reduce([int(has_work), int(pending), int(ready)])
        self.counters.num_syncs += 1
        if num_ready == self.dp_size:  # the same on every engine: all complete the pause at this step
            self._complete_pause()
            num_pending = 0
        if num_with_work == 0 and num_pending == 0:
            self.wave_running = False
            self.current_wave += 1
            self.counters.num_waves_completed += 1

    # ---- pause: pending -> consensus -> paused -----------------------------------------------

    def _call_utility(self, client_index: int, sender_index: int, call_id: int, method: str, args: list) -> None:
        if method == "pause_generation" and not self.engine_core.is_sleeping():  # a sleeping group cannot step
            try:
                aborted = self.engine_core.pause_generation(*args)
            except Exception as e:
                self._answer(client_index, UtilityOutput(call_id, failure_message=f"{type(e).__name__}: {e}"))
                return
            if self._pending_pause is None:
                self._pending_pause = _PendingPause()
            self._pending_pause.waiters.append((client_index, call_id))
            self._pending_pause.aborted += aborted
            return  # answered by _complete_pause
        if method == "resume_generation" and self._pending_pause is not None:
            pending, self._pending_pause = self._pending_pause, None
            for waiter_client, waiter_call in pending.waiters:
                failure = "RuntimeError: the pause was cancelled by resume_generation() before every engine reached it"
                self._answer(waiter_client, UtilityOutput(waiter_call, failure_message=failure))
        if method in ("get_dp_state", "rebuild_dp_group", "reconfigure_elastic_ep"):
            try:
                answer = UtilityOutput(call_id, result=getattr(self, method)(*args))
            except Exception as e:
                answer = UtilityOutput(call_id, failure_message=f"{type(e).__name__}: {e}")
            self._answer(client_index, answer)
            return
        super()._call_utility(client_index, sender_index, call_id, method, args)

    def _complete_pause(self) -> None:
        pending, self._pending_pause = self._pending_pause, None
        self.engine_core.synchronize()
        self.counters.num_pauses += 1
        self.counters.last_pause_num_steps = pending.num_steps
        stats = self.engine_core.make_stats()
        for client_index, call_id in pending.waiters:
            self._send(
                client_index,
                EngineCoreOutputs(
                    utility_output=UtilityOutput(call_id, result=pending.aborted),
                    timestamp=time.time(),
                    scheduler_stats=stats,
                ),
            )

    def _answer(self, client_index: int, answer: UtilityOutput) -> None:
        self._send(client_index, EngineCoreOutputs(utility_output=answer, timestamp=time.time()))

    def get_dp_state(self) -> dict[str, Any]:
        """{"dp_rank", "dp_size", "wave", "wave_running", "pause_pending", plus the DPCounters}."""
        return {
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            "wave": self.current_wave,
            "wave_running": self.wave_running,
            "pause_pending": self._pending_pause is not None,
            **asdict(self.counters),
        }

    def rebuild_dp_group(self, rank: int, size: int, generation: int) -> None:
        """Elastic EP: joins the sync group's generation `generation` as `rank` of `size`.

        Only between waves (every engine idle) and on every engine of the new group; the
        workers' expert-parallel group is rebuilt separately (engine/distributed).
        """
        if self.wave_running:
            raise RuntimeError("rebuild_dp_group: a wave is running; pause the group first")
        self.dp_group.rebuild(rank, size, generation)
        self.dp_rank, self.dp_size = rank, size

    def reconfigure_elastic_ep(self, plan: dict) -> None:
        """Elastic EP, this engine's part of a size change (every engine of the old and the new group at once, the group paused).

        plan: {"old_size", "new_size", "old_rank" (None: this engine joins), "new_rank" (None: it
        leaves), "generation" (of the new DP sync group), "ep_init_method" (the new EP group's
        rendezvous)}. The workers first move experts and rebuild the EP group
        (engine/worker/elastic_ep.py), then this engine joins the DP sync group's new generation
        (a joining engine also connects to the coordinator; a leaving one leaves the sync group).
        """
        if self.wave_running or self.engine_core.has_unfinished_requests():
            raise RuntimeError("reconfigure_elastic_ep: the engine is stepping; pause the group first")
        joining = self.dp_group is None
        if joining != (plan.get("old_rank") is None):
            raise RuntimeError(f"reconfigure_elastic_ep: plan {plan} does not match this engine (joined: {not joining})")
        from engine.worker.worker import Worker  # here: the group's coordinator process imports this module, without torch

        self.engine_core.executor.rpc(Worker.reconfigure_elastic_ep, plan)
        rank, size, generation = plan["new_rank"], plan["new_size"], plan["generation"]
        if rank is None:
            self.dp_group.close_group()
            self.dp_size = size
            return
        if joining:
            self._join(rank, size, generation)
        else:
            self.rebuild_dp_group(rank, size, generation)
        # A new engine takes the group's wave counter (the old engines all stand at the same one): a
        # START_WAVE it sent for its own wave 0 would be stale to them, and theirs must not be to it.
        total, num_old = self.dp_group.all_reduce([0 if joining else self.current_wave, int(not joining)])
        self.current_wave = total // num_old

    # ---- the coordinator connection ----------------------------------------------------------

    def _handle(self, request_type: bytes, client_index: int, payload: Any) -> None:
        if request_type == START_WAVE:
            self._start_wave(payload, notify=False)
        else:
            super()._handle(request_type, client_index, payload)

    def _coordinator_loop(self, sock: zmq.Socket) -> None:
        """Says hello, then queues every START_WAVE the coordinator forwards for the busy loop."""
        decoder = msgspec.msgpack.Decoder(WaveMessage)
        try:
            sock.send(msgspec.msgpack.encode(WaveMessage("hello", self.dp_rank)))
            while not self._stop_inputs.is_set():
                if not sock.poll(_POLL_MS):
                    continue
                try:
                    message = decoder.decode(sock.recv())
                except msgspec.DecodeError as e:
                    logger.error("DPEngineCoreProc: undecodable coordinator message: %s", e)
                    continue
                if message.kind == "start_wave":
                    self.input_queue.put((START_WAVE, -1, message.wave))
        finally:
            sock.close(linger=0)

    def close(self) -> None:
        # Our sockets close first: the base class terminates the ZMQ context, which waits for them.
        if self._notify_socket is not None:
            self._notify_socket.close(linger=0)
        self._stop_inputs.set()
        if self._coordinator_thread is not None:
            self._coordinator_thread.join(timeout=5)
        super().close()
        if self.dp_group is not None:
            self.dp_group.close_group()
