"""The "sharded_rdt" backend: engines pull the layer-group bytes they consume from per-trainer-rank Ray actors via NIXL.

Trainer (every rank):  trainer_init starts this rank's producer actor (weight_transfer/rdt_producer.py);
send_weights walks the source once, packs each layer group it owns and publishes it into a
producer slot; the producer holds at most `lookahead_groups` groups, so the trainer's extra
memory is bounded by that many groups. Rank 0 alone talks to the engine:

    start_weight_update -> update_weights(update_info) [in the background] -> finish_weight_update

Engine (every worker): the first update BAKEs - the model's weight loaders (the worker hands
its model over with bind_model) run against placeholder tensors (rdt_plan.bake_consumed_ranges)
to learn which bytes of which source tensor this worker consumes; without a model every
tensor is consumed whole. Every update REPLAYs: per group, poll the owner producer's status
word until the group is published, NIXL-READ each pack's consumed byte ranges into one of
`num_recv_buffers` receive buffers (reads of later packs overlap the landing of earlier
ones), yield the tensors as views, and ack the group with a NIXL notification.

init_info (engine, ShardedRDTInitInfo):
    {"backend": "sharded_rdt", "timeout_s": 120.0, "num_recv_buffers": 2, "nixl_backend": "UCX"}
update_info (ShardedRDTUpdateInfo):
    {"sync_id": int, "names": [...], "dtypes": [...], "shapes": [...],
     "group_sizes": [int, ...], "chunk_bytes": int, "num_slots": int,
     "producers": [{"rank", "agent_name", "agent_metadata_b64", "mem_type",
                    "device_id", "slots": [[addr, nbytes], ...], "status": [addr, nbytes]}]}

Failure: every wait (slot free, group published, READ done, every ack) is bounded by
timeout_s. A dead or stalled producer makes the engine's receive raise (the worker restores
the previous weights); a trainer that fails marks the sync aborted in its producers' status
words, which engines see at their next poll.
"""

from __future__ import annotations

import concurrent.futures
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

import msgspec
import torch
from torch import nn

from weight_transfer.base import (
    InitInfo,
    Rendezvous,
    SyncStats,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
    WeightTransferEngine,
    WeightUpdateInfo,
)
from weight_transfer.clients import call_in_background
from weight_transfer.messages import Message, NonEmptyStr, NonNegFloat, NonNegInt, TimeoutS, int_in
from weight_transfer.packing import PackSlot, TensorList, copy_into, nbytes_of, tensor_list, view_of
from weight_transfer.rdt_plan import ByteRanges, SyncPlan, bake_consumed_ranges, build_plan, group_sizes
from weight_transfer.rdt_producer import EMPTY, GROUP_LIMIT, RDTProducer, make_agent, mem_type_of, tag_of

MiB = 1 << 20
_MARGIN_S = 10.0  # extra wait on the trainer for answers the other side itself bounds by timeout_s
_MAX_RECV_BUFFERS = 64


class ShardedRDTTrainerInitInfo(TrainerInitInfo):
    """Trainer-side settings of a sharded_rdt transfer; every rank passes the same values."""

    backend: ClassVar[str] = "sharded_rdt"

    lookahead_groups: int_in(1) = 2
    """Layer groups a producer holds at once (its slots): the trainer's memory bound and an engine's read-ahead."""
    chunk_bytes: int_in(256) = 64 * MiB
    """Pack size in a group: one NIXL READ each; an engine's receive buffers are this large (or one larger tensor)."""
    num_recv_buffers: int_in(1, _MAX_RECV_BUFFERS) = 2
    """Receive buffers per engine worker: READs of later packs overlap the landing of earlier ones."""
    timeout_s: TimeoutS = 120.0
    """Limit of every wait on either side (a slot to free, a group to appear, a READ, the acks) before it fails."""
    nixl_backend: NonEmptyStr = "UCX"
    """NIXL backend of producers and engines."""
    producer_device: Annotated[str, msgspec.Meta(pattern=r"^(cpu|cuda)\Z|^cuda:", description='"cpu" or "cuda"')] = "cpu"
    """Where the producer's slots live: "cpu" (host memory) or "cuda" (VRAM; give the actor producer_num_gpus)."""
    producer_num_gpus: NonNegFloat = 0.0
    """GPUs the producer actor asks Ray for (a fraction shares the trainer's GPU)."""
    name: NonEmptyStr = "sharded-rdt"
    """Prefix of the producer actors' Ray names ("<name>-producer-<rank>"); unique per trainer on a shared cluster."""
    rank: int_in(0) | None = None
    """This trainer rank; None: torch.distributed's rank, or 0 without a process group."""
    world_size: int_in(1) | None = None
    """Trainer ranks (one producer each); None: torch.distributed's world size, or 1."""
    startup_timeout_s: TimeoutS = 300.0
    """Limit on starting a producer actor (a fresh Ray worker process) and finding the other ranks' producers."""
    ray_address: str | None = None
    """Passed to ray.init() when this process is not connected to Ray yet (None: Ray's default)."""
    producer_host: Literal["ray", "thread"] = "ray"
    """Where each trainer rank's producer runs: "ray" (a Ray actor; any number of trainer ranks) or "thread"
    (inside the trainer process, its calls on a few threads: no Ray needed, for a one-rank trainer)."""

    def check(self) -> None:
        if self.rank is not None and self.world_size is not None and self.rank >= self.world_size:
            raise ValueError(f".rank: expected < world_size {self.world_size}, got {self.rank}")

    def engine_init_info(self) -> dict:
        """What rank 0 sends to the engine's init_weight_transfer_engine (JSON)."""
        return {
            "backend": self.backend,
            "timeout_s": float(self.timeout_s),
            "num_recv_buffers": self.num_recv_buffers,
            "nixl_backend": self.nixl_backend,
        }


# =======================================================================================
# Trainer side
# =======================================================================================


class ShardedRDTTrainerWeightTransferEngine(TrainerWeightTransferEngine[ShardedRDTTrainerInitInfo]):
    """One trainer rank: its producer actor, and (rank 0) the engine's update lifecycle."""

    backend = "sharded_rdt"

    def __init__(
        self, init_info: ShardedRDTTrainerInitInfo, client, source, rank: int, world_size: int, producer
    ) -> None:
        super().__init__(init_info, client, source, rank)
        self.world_size = world_size
        self.producer = producer  # this rank's actor handle
        self.producers: list = []  # rank 0: every rank's handle, in rank order
        # Counted in lockstep on every rank (each calls send_weights once per sync). Tags live in this
        # engine's own producers, so ids never meet an older producer's.
        self._sync_id = 0
        self._aborted_sync_id = 0  # the last sync this rank marked aborted in the producers (0: none)

    @classmethod
    def _start(cls, init_info: ShardedRDTTrainerInitInfo, *, client, source) -> ShardedRDTTrainerWeightTransferEngine:
        rank, world_size = _rank_and_world(init_info)
        args = (rank, init_info.lookahead_groups, float(init_info.timeout_s), init_info.nixl_backend,
                init_info.producer_device)
        if init_info.producer_host == "thread":
            if world_size != 1:
                raise ValueError(
                    f"init_info.producer_host: 'thread' serves a one-rank trainer (rank 0 must reach every rank's "
                    f"producer), this trainer has {world_size} ranks; use 'ray'"
                )
            producer = _ThreadProducer(RDTProducer(*args))
        else:
            import ray

            if not ray.is_initialized():
                ray.init(address=init_info.ray_address)
            producer = _ActorProducer(
                ray.remote(RDTProducer)
                .options(
                    name=_producer_name(init_info, rank),
                    num_cpus=0,
                    num_gpus=init_info.producer_num_gpus,
                    max_concurrency=4,  # publish blocks on slots while abort/stats still answer
                )
                .remote(*args)
            )
        try:
            producer.result(producer.submit("ready"), timeout=init_info.startup_timeout_s)
            engine = cls(init_info, client, source, rank, world_size, producer)
            if rank == 0:
                engine.producers = [producer] + [_find_producer(init_info, r) for r in range(1, world_size)]
                engine.connect_engines(client)
        except BaseException:
            producer.kill()  # no half-started transfer keeps an actor (and its name) alive
            raise
        return engine

    def connect_engines(self, client) -> None:
        """Rank 0: (re)joins engines - e.g. restarted ones - to this transfer; the producers and their slots stay."""
        self._require_rank0("connect_engines")
        self.client = client
        client.init_weight_transfer_engine(self.init_info.engine_init_info())

    def producer_stats(self) -> dict:
        """This rank's producer counters (groups published, high-water mark of groups held, ...)."""
        return self.producer.result(self.producer.submit("stats"), timeout=self.init_info.timeout_s)

    def send_weights(self, source=None, *, weight_version: str | None = None) -> SyncStats:
        # Counted on every rank before anything can fail (rank 0's start_weight_update included), so
        # that the ranks' sync ids stay in lockstep whatever became of this sync.
        self._sync_id += 1
        return super().send_weights(source, weight_version=weight_version)

    def _send(self, source: WeightSource) -> SyncStats:
        """Every rank's part of a sync (rank 0's between start_ and finish_weight_update): publish this rank's
        groups, and on rank 0 post the engine's update_weights and see it answered."""
        metas = source.metadata
        names = [m.name for m in metas]
        plan = build_plan(names, [m.dtype for m in metas], [m.shape for m in metas], group_sizes(names),
                          self.init_info.chunk_bytes)
        sync_id = self._sync_id
        update = None
        try:
            if self.rank == 0:
                update = self._start_sync(plan, sync_id)
            bytes_sent = self._publish_all(source, plan, sync_id, update)
            self._await(self.producer.submit("wait_drained", sync_id), update, "engines to read every group")
            if update is not None:
                update.result(timeout=self.init_info.timeout_s + _MARGIN_S)
        except BaseException as e:
            engine_error = self._fail(sync_id, update)
            raise RuntimeError(
                f"sharded_rdt: sync {sync_id} failed on trainer rank {self.rank}: {type(e).__name__}: {e}; "
                + (f"the engine reported: {engine_error}; " if engine_error else "")
                + "the engine keeps its previous weights"
            ) from e
        return SyncStats(
            backend=self.backend,
            num_tensors=len(names),
            bytes_sent=bytes_sent,
            dense_bytes=plan.total_bytes,
            extra={"sync_id": sync_id, "num_groups": len(plan.groups),
                   "lookahead_groups": self.init_info.lookahead_groups},
        )

    def _follow(self, source: WeightSource) -> SyncStats:
        # Every rank publishes the groups it owns; only rank 0 talks to the engine.
        started = time.perf_counter()
        stats = self._send(source)
        stats.seconds = time.perf_counter() - started
        return stats

    def shutdown(self) -> None:
        if self.rank == 0 and self.client is not None:
            try:
                self.client.shutdown_weight_transfer_engine()
            except Exception:  # the engine may be gone already; the producer still has to go
                pass
        self.producer.kill()

    # ---- internals -----------------------------------------------------------------------------

    def _require_rank0(self, method: str) -> None:
        if self.rank != 0:
            raise RuntimeError(f"{method}: only trainer rank 0 talks to the engine (this is rank {self.rank})")

    def _start_sync(self, plan: SyncPlan, sync_id: int):
        """Rank 0: begins the sync on every producer and posts the engine's update_weights in the background."""
        num_consumers = self.client.get_world_size()
        calls = [(p, p.submit("begin_sync", sync_id, num_consumers, plan.slot_bytes)) for p in self.producers]
        descriptors = [p.result(call, timeout=self.init_info.timeout_s) for p, call in calls]
        update_info = {
            "sync_id": sync_id,
            **tensor_list(plan.names, plan.dtypes, plan.shapes),
            "group_sizes": [g.end - g.start for g in plan.groups],
            "chunk_bytes": plan.chunk_bytes,
            "num_slots": self.init_info.lookahead_groups,
            "producers": descriptors,
        }
        return call_in_background(self.client.update_weights, update_info)

    def _publish_all(self, src: WeightSource, plan: SyncPlan, sync_id: int, update) -> int:
        """Walks the source once (every rank: a sharded source gathers) and publishes this rank's groups."""
        tensors = src.iter_full()
        sent = 0
        for g, group in enumerate(plan.groups):
            members = [_next_tensor(tensors, plan, i) for i in range(group.start, group.end)]
            if plan.owner(g, self.world_size) != self.rank:
                continue
            payload = _pack_group(plan, g, members, self.producer.payload_device)
            del members  # only the packed copy stays alive while it travels
            slot = plan.slot(g, self.world_size, self.init_info.lookahead_groups)
            if self.producer.payload_device.type == "cpu":
                payload = payload.numpy()  # what Ray ships without pickling a torch tensor
            self._await(self.producer.submit("publish", sync_id, g, slot, payload), update,
                        f"group {g} ({plan.names[group.start]}) to be published")
            sent += sum(s.nbytes for p in group.packs for s in p.slots)
        return sent

    def _await(self, call, update, what: str):
        """The producer call's result, failing early if the engine's update already failed; TimeoutError past
        timeout_s + margin."""
        deadline = time.monotonic() + self.init_info.timeout_s + _MARGIN_S
        while True:
            if self.producer.wait(call, timeout=0.05):
                return self.producer.result(call)
            if update is not None and update.done() and update.exception() is not None:
                raise update.exception()
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {self.init_info.timeout_s + _MARGIN_S} s for {what}")

    def _abandon_update(self, begun: bool) -> None:
        # Rank 0's update failed, maybe before any group was published (its start_weight_update):
        # the other ranks' publishes and the engines' polls stop now, not at their timeouts.
        self._abort_producers(self._sync_id)
        super()._abandon_update(begun)

    def _abort_producers(self, sync_id: int) -> None:
        """Marks sync_id aborted in every producer this rank reaches (rank 0: all), once."""
        if sync_id == self._aborted_sync_id:
            return
        self._aborted_sync_id = sync_id
        for producer in self.producers or [self.producer]:
            try:
                producer.result(producer.submit("abort", sync_id), timeout=5)
            except Exception:  # a dead producer needs no abort: engines reading it fail by themselves
                pass

    def _fail(self, sync_id: int, update) -> str | None:
        """Best effort after a failure: mark the sync aborted and let the engine's call finish failing
        (rank 0 then tells it to restore its weights). Returns the engine's own error, if its call failed too."""
        self._abort_producers(sync_id)
        if update is None:
            return None
        engine_error = None
        try:
            update.result(timeout=self.init_info.timeout_s + _MARGIN_S)
        except Exception as e:  # the engine failed too (it restored and ended the update itself)
            engine_error = f"{type(e).__name__}: {e}"
        return engine_error


def _rank_and_world(info: ShardedRDTTrainerInitInfo) -> tuple[int, int]:
    initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
    rank = info.rank if info.rank is not None else (torch.distributed.get_rank() if initialized else 0)
    world = info.world_size if info.world_size is not None else (
        torch.distributed.get_world_size() if initialized else 1
    )
    if rank >= world:
        raise ValueError(f"init_info.rank: {rank} is not below the world size {world}")
    return rank, world


def _producer_name(info: ShardedRDTTrainerInitInfo, rank: int) -> str:
    return f"{info.name}-producer-{rank}"


def _find_producer(info: ShardedRDTTrainerInitInfo, rank: int):
    """Rank 0 looks the other ranks' producers up by name (they start concurrently)."""
    import ray

    deadline = time.monotonic() + info.startup_timeout_s
    while True:
        try:
            return _ActorProducer(ray.get_actor(_producer_name(info, rank)))
        except ValueError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"trainer rank {rank}'s producer {_producer_name(info, rank)!r} did not appear "
                                   f"within {info.startup_timeout_s} s") from None
            time.sleep(0.2)


class _ActorProducer:
    """A producer that is a Ray actor: calls return ObjectRefs."""

    payload_device = torch.device("cpu")  # payloads travel through Ray's object store

    def __init__(self, actor) -> None:
        self.actor = actor

    def submit(self, method: str, *args):
        return getattr(self.actor, method).remote(*args)

    def wait(self, call, timeout: float) -> bool:
        import ray

        ready, _ = ray.wait([call], timeout=timeout)
        return bool(ready)

    def result(self, call, timeout: float | None = None):
        import ray

        return ray.get(call, timeout=timeout)

    def kill(self) -> None:
        import ray

        ray.kill(self.actor)


class _ThreadProducer:
    """A producer in this process (producer_host="thread"): calls run on a few threads, as an actor's would
    (publish blocks on a slot while abort and stats still answer), and return Futures."""

    def __init__(self, producer: RDTProducer) -> None:
        self.producer = producer
        # The trainer packs straight onto the slots' device: GPU slots take a device-to-device copy, no host trip.
        self.payload_device = producer.device
        self.pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="rdt-producer")

    def submit(self, method: str, *args) -> concurrent.futures.Future:
        return self.pool.submit(getattr(self.producer, method), *args)

    def wait(self, call: concurrent.futures.Future, timeout: float) -> bool:
        concurrent.futures.wait([call], timeout=timeout)
        return call.done()

    def result(self, call: concurrent.futures.Future, timeout: float | None = None):
        try:
            return call.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"the producer did not answer within {timeout} s") from None

    def kill(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.producer.close()


def _next_tensor(tensors: Iterator[tuple[str, torch.Tensor]], plan: SyncPlan, index: int) -> torch.Tensor:
    try:
        name, tensor = next(tensors)
    except StopIteration:
        raise RuntimeError(f"source: ended before {plan.names[index]!r}; its metadata lists more tensors") from None
    if name != plan.names[index] or tensor.dtype != plan.dtypes[index] or tuple(tensor.shape) != plan.shapes[index]:
        raise RuntimeError(
            f"source: yielded {name!r} {tensor.dtype} {list(tensor.shape)} where its metadata says "
            f"{plan.names[index]!r} {plan.dtypes[index]} {list(plan.shapes[index])}"
        )
    return tensor


def _pack_group(
    plan: SyncPlan, group: int, members: list[torch.Tensor], device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The group's slot image on `device`: packs at their offsets, tensors at their pack slots."""
    layout = plan.groups[group]
    payload = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
    for pack, pack_offset in zip(layout.packs, layout.pack_offsets):
        region = payload[pack_offset : pack_offset + pack.nbytes]
        for slot in pack.slots:
            copy_into(region, slot, members[slot.index - layout.start])
    if payload.is_cuda or any(t.is_cuda for t in members):
        torch.cuda.synchronize()  # copy_into is non_blocking from and to the device
    return payload


# =======================================================================================
# Engine side
# =======================================================================================


class ShardedRDTInitInfo(InitInfo):
    """init_info of an engine worker's consumer (ShardedRDTTrainerInitInfo.engine_init_info)."""

    timeout_s: TimeoutS = 120.0
    num_recv_buffers: int_in(1, _MAX_RECV_BUFFERS) = 2
    nixl_backend: NonEmptyStr = "UCX"


Region = tuple[NonNegInt, NonNegInt]  # [address, nbytes] in a producer's memory


class ProducerInfo(Message):
    """One trainer rank's producer as its begin_sync describes it (weight_transfer/rdt_producer.py)."""

    rank: NonNegInt
    agent_name: NonEmptyStr
    metadata: Annotated[bytes, msgspec.Meta(min_length=1)] = msgspec.field(name="agent_metadata_b64")
    mem_type: Literal["DRAM", "VRAM"]
    device_id: NonNegInt
    slots: list[Region]
    status: Region  # its status words: int64 [1 + num_slots]


class ShardedRDTUpdateInfo(TensorList):
    """update_info: the sync's tensors, their layout (group sizes, chunk bytes) and every producer holding them."""

    sync_id: int_in(0, (1 << 38) - 1)  # a producer's tags keep 2**24 groups below it in an int64
    group_sizes: Annotated[list[int_in(1)], msgspec.Meta(max_length=GROUP_LIMIT - 1)]
    chunk_bytes: int_in(256)
    num_slots: int_in(1)
    producers: Annotated[list[ProducerInfo], msgspec.Meta(min_length=1)]  # in rank order

    def check(self) -> None:
        super().check()
        if sum(self.group_sizes) != len(self.names):
            raise ValueError(f".group_sizes: expected positive ints adding to {len(self.names)}, got {self.group_sizes}")
        for i, producer in enumerate(self.producers):
            where = f".producers[{i}]"
            if producer.rank != i:
                raise ValueError(f"{where}.rank: expected {i} (producers in rank order), got {producer.rank}")
            if len(producer.slots) != self.num_slots:
                raise ValueError(f"{where}.slots: expected {self.num_slots} [address, nbytes] pairs, got {producer.slots}")
            if producer.status[1] != 8 * (1 + self.num_slots):
                raise ValueError(f"{where}.status: expected [address, {8 * (1 + self.num_slots)}], got {list(producer.status)}")


@dataclass(kw_only=True)
class ShardedRDTWeightUpdate(WeightUpdateInfo):
    plan: SyncPlan
    sync_id: int
    producers: list[ProducerInfo]


class ShardedRDTWeightTransferEngine(WeightTransferEngine[ShardedRDTInitInfo, ShardedRDTUpdateInfo]):
    """One engine worker's consumer: a NIXL agent, a ring of receive buffers, and the baked consumed ranges."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.model: nn.Module | None = None
        self.config: ShardedRDTInitInfo | None = None
        self.agent = None
        self._peers: dict[str, bytes] = {}  # remote agent name -> the metadata loaded for it
        self._recv: list[torch.Tensor] = []
        self._recv_reg = None
        self._status: dict[int, torch.Tensor] = {}  # producer rank -> local copy of its status words
        self._status_reg: dict[int, Any] = {}
        self._baked: tuple[tuple, dict[str, ByteRanges]] | None = None
        self.num_bakes = 0
        self.last_bytes_read = 0  # payload bytes the last receive pulled (less than the tensors' when slices suffice)

    def bind_model(self, model: nn.Module) -> None:
        """The model this worker serves; BAKE runs its weight loaders (against placeholders) to plan what to pull."""
        self.model = model
        self._baked = None

    # ---- lifecycle ---------------------------------------------------------------------------

    def rendezvous(self, init_info: ShardedRDTInitInfo) -> Rendezvous:
        # init makes a local NIXL agent and connects nowhere: the producers' agents (and the
        # addresses in their metadata) arrive with each update_info, not in init_info.
        return Rendezvous(init_info.timeout_s, "the local NIXL agent")

    def init_transfer(self, init_info: ShardedRDTInitInfo) -> None:
        self.config = init_info
        self.agent = make_agent(f"rdt-consumer-{uuid.uuid4().hex[:12]}", init_info.nixl_backend)

    def plan_update(self, update_info: ShardedRDTUpdateInfo) -> ShardedRDTWeightUpdate:
        u = update_info
        plan = build_plan(u.names, u.dtypes, u.shapes, u.group_sizes, u.chunk_bytes)
        for i, producer in enumerate(u.producers):
            if any(n < plan.slot_bytes for _, n in producer.slots):
                raise ValueError(f"update_info.producers[{i}].slots: slots of {[n for _, n in producer.slots]} bytes "
                                 f"cannot hold {plan.slot_bytes} bytes")
        return ShardedRDTWeightUpdate(u.names, u.dtypes, u.shapes, plan=plan, sync_id=u.sync_id, producers=u.producers)

    def receive_weights(self, info: ShardedRDTWeightUpdate) -> Iterator[tuple[str, torch.Tensor]]:
        if self.agent is None or self.config is None:
            raise RuntimeError("sharded_rdt: receive_weights before init_transfer")
        return self._replay(info.plan, info.sync_id, info.producers, self._consumed(info.plan))

    def shutdown(self) -> None:
        if self.agent is None:
            return
        for name in list(self._peers):
            self._forget_peer(name)
        if self._recv_reg is not None:
            self.agent.deregister_memory(self._recv_reg)
        for reg in self._status_reg.values():
            self.agent.deregister_memory(reg)
        self._recv, self._recv_reg, self._status, self._status_reg = [], None, {}, {}
        self.agent = None

    # ---- BAKE ----------------------------------------------------------------------------------

    def _consumed(self, plan: SyncPlan) -> dict[str, ByteRanges]:
        """Byte ranges this worker pulls per tensor: baked once per tensor list (whole tensors without a model)."""
        key = (plan.names, plan.dtypes, plan.shapes)
        if self._baked is None or self._baked[0] != key:
            if self.model is None:
                ranges = {n: [(0, nbytes_of(d, s))] for n, d, s in zip(plan.names, plan.dtypes, plan.shapes)}
            else:
                ranges = bake_consumed_ranges(self.model, plan.names, plan.dtypes, plan.shapes)
                self.num_bakes += 1
            self._baked = (key, ranges)
        return self._baked[1]

    # ---- REPLAY --------------------------------------------------------------------------------

    def _replay(
        self, plan: SyncPlan, sync_id: int, producers: list[ProducerInfo], consumed: dict[str, ByteRanges]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Reads pack k into receive buffer k % R while earlier packs land; yields views into the buffers.

        Reads run ahead only into groups already published, so received tensors never wait for
        a later group; the loop blocks on a group only when it needs that group's first pack,
        by which time every earlier group is acked (a one-slot producer needs that to go on).
        """
        self._connect(producers)
        self._ensure_recv_buffers(plan.max_pack_bytes)
        num_ranks, num_buffers = len(producers), len(self._recv)
        schedule = [(g, p) for g, group in enumerate(plan.groups) for p in range(len(group.packs))]
        pending: dict[int, _Read] = {}  # pack number -> its posted READ
        published: set[int] = set()
        self.last_bytes_read = 0

        def issue(k: int, block: bool) -> bool:
            g, p = schedule[k]
            producer = producers[plan.owner(g, num_ranks)]
            if g not in published:
                if not self._published(plan, g, sync_id, num_ranks, producer, block):
                    return False
                published.add(g)
            handle = self._read_pack(plan, g, p, num_ranks, producer, self._recv[k % num_buffers], consumed)
            pending[k] = _Read(handle, f"group {g} pack {p} ({plan.names[plan.groups[g].packs[p].slots[0].index]!r})")
            return True

        def read_ahead(last: int) -> None:
            """Posts reads up to pack `last` (buffers free), in order, stopping at a group not yet published."""
            for j in range(k_next, min(last, len(schedule) - 1) + 1):
                if j not in pending and not issue(j, block=False):
                    return

        k_next = 0  # packs below it were landed; their buffers are free again
        try:
            read_ahead(num_buffers - 1)
            for k, (g, p) in enumerate(schedule):
                if k not in pending:
                    issue(k, block=True)
                pending.pop(k).finish(self)
                group = plan.groups[g]
                if p == len(group.packs) - 1:  # every pack of g is here: its producer slot may be reused
                    producer = producers[plan.owner(g, num_ranks)]
                    self.agent.send_notif(producer.agent_name, f"ack:{sync_id}:{g}".encode())
                buffer = self._recv[k % num_buffers]
                for slot in group.packs[p].slots:
                    i = slot.index
                    yield plan.names[i], view_of(buffer, slot, plan.dtypes[i], plan.shapes[i])
                # The worker has landed every view of buffer k % R: it may take pack k + R.
                k_next = k + 1
                read_ahead(k + num_buffers)
        finally:
            for read in pending.values():
                _release(read.handle)

    def _read_pack(self, plan: SyncPlan, g: int, p: int, num_ranks: int, producer: ProducerInfo, buffer: torch.Tensor,
                   consumed: dict[str, ByteRanges]):
        """Posts one NIXL READ of a pack's consumed byte ranges into `buffer`; None when nothing is consumed."""
        group = plan.groups[g]
        remote_base = producer.slots[plan.slot(g, num_ranks, len(producer.slots))][0] + group.pack_offsets[p]
        mem_type, device_id = mem_type_of(buffer.device)
        local, remote = [], []
        for slot in group.packs[p].slots:
            ranges = consumed[plan.names[slot.index]]
            if ranges != [(0, slot.nbytes)]:
                _zero(buffer, slot)  # bytes this worker does not consume read as zeros, never stale data
            for start, end in ranges:
                if end == start:  # an empty tensor: nothing to move
                    continue
                local.append((buffer.data_ptr() + slot.offset + start, end - start, device_id))
                remote.append((remote_base + slot.offset + start, end - start, producer.device_id))
                self.last_bytes_read += end - start
        if not local:
            return None
        if buffer.is_cuda:
            # NIXL writes outside torch's streams: the kernels queued on this buffer (the worker landing the
            # views of the pack it held before, the zeros above) must have run before the READ lands in it.
            torch.cuda.synchronize(buffer.device)
        where = f"READ of group {g} pack {p} ({plan.names[group.start]!r}) from trainer rank {producer.rank}"
        return self._post(local, mem_type, remote, producer.mem_type, producer, where)

    def _wait_read(self, handle, what: str) -> None:
        if handle is None:
            return
        deadline = time.monotonic() + self.config.timeout_s
        pause = 1e-5
        try:
            while (state := self.agent.check_xfer_state(handle)) == "PROC":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"sharded_rdt: READ of {what} did not finish within {self.config.timeout_s} s")
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)
        except TimeoutError:
            raise
        except Exception as e:
            raise RuntimeError(f"sharded_rdt: READ of {what} failed: {type(e).__name__}: {e}") from e
        finally:
            _release(handle)
        if state != "DONE":
            raise RuntimeError(f"sharded_rdt: READ of {what} failed ({state})")

    def _published(
        self, plan: SyncPlan, g: int, sync_id: int, num_ranks: int, producer: ProducerInfo, block: bool
    ) -> bool:
        """Whether group g of this sync is in its producer slot; with block, polls until it is (or abort, timeout)."""
        status = self._status[producer.rank]
        slot = plan.slot(g, num_ranks, len(producer.slots))
        want = tag_of(sync_id, g)
        what = f"group {g} ({plan.names[plan.groups[g].start]!r}) of sync {sync_id} from trainer rank {producer.rank}"
        deadline = time.monotonic() + self.config.timeout_s
        pause = 1e-4
        while True:
            local = [(status.data_ptr(), status.numel() * 8, 0)]
            remote = [(producer.status[0], producer.status[1], 0)]
            handle = self._post(local, "DRAM", remote, "DRAM", producer, f"status poll for {what}")
            self._wait_read(handle, f"the status words for {what}")
            if int(status[0]) == sync_id:
                raise RuntimeError(f"sharded_rdt: the trainer aborted sync {sync_id} (waiting for {what})")
            if int(status[1 + slot]) == want:
                return True
            if not block:
                return False
            if time.monotonic() > deadline:
                raise TimeoutError(f"sharded_rdt: {what} was not published within {self.config.timeout_s} s")
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)

    def _post(self, local: list, local_mem: str, remote: list, remote_mem: str, producer: ProducerInfo, what: str):
        """Posts a NIXL READ of remote (address, nbytes, device) regions into local ones; returns its handle."""
        try:
            handle = self.agent.initialize_xfer(
                "READ", self.agent.get_xfer_descs(local, local_mem), self.agent.get_xfer_descs(remote, remote_mem),
                producer.agent_name,
            )
            state = self.agent.transfer(handle)
        except Exception as e:  # NIXL raises when the producer's process is gone
            raise RuntimeError(f"sharded_rdt: {what} failed: {type(e).__name__}: {e}") from e
        if state == "ERR":
            _release(handle)
            raise RuntimeError(f"sharded_rdt: {what} failed to post")
        return handle

    # ---- connections and buffers ---------------------------------------------------------------

    def _connect(self, producers: list[ProducerInfo]) -> None:
        """Loads each producer's metadata (again when it changed: a restarted producer or re-registered slots)."""
        current = {p.agent_name for p in producers}
        for name in [n for n in self._peers if n not in current]:
            self._forget_peer(name)
        for p in producers:
            if self._peers.get(p.agent_name) != p.metadata:
                if p.agent_name in self._peers:
                    self._forget_peer(p.agent_name)
                loaded = self.agent.add_remote_agent(p.metadata)
                loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
                if loaded != p.agent_name:
                    raise ValueError(f"update_info.producers[{p.rank}].agent_name: {p.agent_name!r}, "
                                     f"but its metadata is agent {loaded!r}")
                self._peers[p.agent_name] = p.metadata
        ranks = sorted(p.rank for p in producers)
        num_words = 1 + len(producers[0].slots)
        if sorted(self._status) != ranks or any(t.numel() != num_words for t in self._status.values()):
            for reg in self._status_reg.values():
                self.agent.deregister_memory(reg)
            self._status = {r: torch.full((num_words,), EMPTY, dtype=torch.int64) for r in ranks}
            self._status_reg = {r: self.agent.register_memory(t) for r, t in self._status.items()}

    def _forget_peer(self, name: str) -> None:
        try:
            self.agent.remove_remote_agent(name)
        except Exception:  # already disconnected
            pass
        self._peers.pop(name, None)

    def _ensure_recv_buffers(self, nbytes: int) -> None:
        if len(self._recv) == self.config.num_recv_buffers and self._recv[0].numel() >= nbytes:
            return
        if self._recv_reg is not None:
            self.agent.deregister_memory(self._recv_reg)
        num = self.config.num_recv_buffers
        self._recv = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(num)]
        self._recv_reg = self.agent.register_memory(self._recv)


class _Read:
    """One posted READ; finish() waits for it once (a finished read stays finished)."""

    def __init__(self, handle, what: str) -> None:
        self.handle, self.what, self.done = handle, what, False

    def finish(self, engine: ShardedRDTWeightTransferEngine) -> None:
        if not self.done:
            self.done = True
            engine._wait_read(self.handle, self.what)


def _zero(buffer: torch.Tensor, slot: PackSlot) -> None:
    buffer[slot.offset : slot.offset + slot.nbytes].zero_()


def _release(handle) -> None:
    if handle is None:
        return
    try:
        handle.release()
    except Exception:  # releasing a transfer still in flight aborts it; nothing more to do
        pass
