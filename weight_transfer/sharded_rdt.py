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

init_info (engine, JSON):  {"backend": "sharded_rdt", "timeout_s": 120.0, "num_recv_buffers": 2, "nixl_backend": "UCX"}
update_info (JSON):        {"sync_id": int, "names": [...], "dtypes": [...], "shapes": [...],
                            "group_sizes": [int, ...], "chunk_bytes": int, "num_slots": int,
                            "producers": [{"rank", "agent_name", "agent_metadata_b64", "mem_type",
                                           "device_id", "slots": [[addr, nbytes], ...], "status": [addr, nbytes]}]}

Failure: every wait (slot free, group published, READ done, every ack) is bounded by
timeout_s. A dead or stalled producer makes the engine's receive raise (the worker restores
the previous weights); a trainer that fails marks the sync aborted in its producers' status
words, which engines see at their next poll.
"""

from __future__ import annotations

import base64
import binascii
import concurrent.futures
import dataclasses
import math
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from weight_transfer.base import (
    INT64_MAX,
    MAX_TIMEOUT_S,
    Rendezvous,
    SyncStats,
    TrainerWeightTransferEngine,
    WeightSource,
    WeightTransferEngine,
    WeightUpdateInfo,
    check_timeout_s,
)
from weight_transfer.clients import call_in_background
from weight_transfer.packing import PackSlot, copy_into, nbytes_of, parse_tensor_list, tensor_list, view_of
from weight_transfer.rdt_plan import ByteRanges, SyncPlan, bake_consumed_ranges, build_plan, group_sizes
from weight_transfer.rdt_producer import EMPTY, GROUP_LIMIT, RDTProducer, make_agent, mem_type_of, tag_of

MiB = 1 << 20
_MARGIN_S = 10.0  # extra wait on the trainer for answers the other side itself bounds by timeout_s
_MAX_RECV_BUFFERS = 64


@dataclass(frozen=True)
class ShardedRDTTrainerInitInfo:
    """Trainer-side settings of a sharded_rdt transfer; every rank passes the same values."""

    backend: ClassVar[str] = "sharded_rdt"

    lookahead_groups: int = 2
    """Layer groups a producer holds at once (its slots): the trainer's memory bound and an engine's read-ahead."""
    chunk_bytes: int = 64 * MiB
    """Pack size in a group: one NIXL READ each; an engine's receive buffers are this large (or one larger tensor)."""
    num_recv_buffers: int = 2
    """Receive buffers per engine worker: READs of later packs overlap the landing of earlier ones."""
    timeout_s: float = 120.0
    """Limit of every wait on either side (a slot to free, a group to appear, a READ, the acks) before it fails."""
    nixl_backend: str = "UCX"
    """NIXL backend of producers and engines."""
    producer_device: str = "cpu"
    """Where the producer's slots live: "cpu" (host memory) or "cuda" (VRAM; give the actor producer_num_gpus)."""
    producer_num_gpus: float = 0.0
    """GPUs the producer actor asks Ray for (a fraction shares the trainer's GPU)."""
    name: str = "sharded-rdt"
    """Prefix of the producer actors' Ray names ("<name>-producer-<rank>"); unique per trainer on a shared cluster."""
    rank: int | None = None
    """This trainer rank; None: torch.distributed's rank, or 0 without a process group."""
    world_size: int | None = None
    """Trainer ranks (one producer each); None: torch.distributed's world size, or 1."""
    startup_timeout_s: float = 300.0
    """Limit on starting a producer actor (a fresh Ray worker process) and finding the other ranks' producers."""
    ray_address: str | None = None
    """Passed to ray.init() when this process is not connected to Ray yet (None: Ray's default)."""
    producer_host: str = "ray"
    """Where each trainer rank's producer runs: "ray" (a Ray actor; any number of trainer ranks) or "thread"
    (inside the trainer process, its calls on a few threads: no Ray needed, for a one-rank trainer)."""

    def __post_init__(self) -> None:
        def need(ok: bool, field_name: str, what: str) -> None:
            if not ok:
                raise ValueError(f"init_info.{field_name}: {what}, got {getattr(self, field_name)!r}")

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and abs(v) <= INT64_MAX

        need(is_int(self.lookahead_groups) and self.lookahead_groups >= 1, "lookahead_groups", "expected an int >= 1")
        need(is_int(self.chunk_bytes) and self.chunk_bytes >= 256, "chunk_bytes", "expected an int >= 256")
        need(is_int(self.num_recv_buffers) and 1 <= self.num_recv_buffers <= _MAX_RECV_BUFFERS, "num_recv_buffers",
             f"expected an int in [1, {_MAX_RECV_BUFFERS}]")
        need(_timeout(self.timeout_s), "timeout_s", f"expected a positive number of seconds up to {MAX_TIMEOUT_S:g}")
        need(_timeout(self.startup_timeout_s), "startup_timeout_s",
             f"expected a positive number of seconds up to {MAX_TIMEOUT_S:g}")
        need(isinstance(self.nixl_backend, str) and bool(self.nixl_backend), "nixl_backend", "expected a backend name")
        need(self.producer_device in ("cpu", "cuda") or str(self.producer_device).startswith("cuda:"),
             "producer_device", 'expected "cpu" or "cuda"')
        need(_number(self.producer_num_gpus) and self.producer_num_gpus >= 0, "producer_num_gpus",
             "expected a number >= 0")
        need(isinstance(self.name, str) and bool(self.name), "name", "expected a non-empty string")
        need(self.producer_host in ("ray", "thread"), "producer_host", 'expected "ray" or "thread"')
        need(self.rank is None or (is_int(self.rank) and self.rank >= 0), "rank", "expected None or an int >= 0")
        need(self.world_size is None or (is_int(self.world_size) and self.world_size >= 1),
             "world_size", "expected None or an int >= 1")
        if self.rank is not None and self.world_size is not None:
            need(self.rank < self.world_size, "rank", f"expected < world_size {self.world_size}")

    @classmethod
    def from_dict(cls, info: dict) -> ShardedRDTTrainerInitInfo:
        if info.get("backend", cls.backend) != cls.backend:
            raise ValueError(f"init_info.backend: expected {cls.backend!r}, got {info.get('backend')!r}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(info) - fields - {"backend"})
        if unknown:
            raise ValueError(f"init_info: unknown field(s) {unknown} for backend 'sharded_rdt'")
        return cls(**{k: v for k, v in info.items() if k != "backend"})

    def engine_init_info(self) -> dict:
        """What rank 0 sends to the engine's init_weight_transfer_engine (JSON)."""
        return {
            "backend": self.backend,
            "timeout_s": float(self.timeout_s),
            "num_recv_buffers": self.num_recv_buffers,
            "nixl_backend": self.nixl_backend,
        }


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _timeout(v: Any) -> bool:
    """A timeout in seconds: finite, positive and at most MAX_TIMEOUT_S (a day)."""
    return _number(v) and 0 < v <= MAX_TIMEOUT_S


# =======================================================================================
# Trainer side
# =======================================================================================


class ShardedRDTTrainerWeightTransferEngine(TrainerWeightTransferEngine):
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

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None) -> ShardedRDTTrainerWeightTransferEngine:
        if isinstance(init_info, dict):
            init_info = ShardedRDTTrainerInitInfo.from_dict(init_info)
        if not isinstance(init_info, ShardedRDTTrainerInitInfo):
            raise ValueError(f"init_info: expected a ShardedRDTTrainerInitInfo, got {type(init_info).__name__}")
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
        src = self._source(source)
        metas = src.metadata
        names = [m.name for m in metas]
        plan = build_plan(names, [m.dtype for m in metas], [m.shape for m in metas], group_sizes(names),
                          self.init_info.chunk_bytes)
        self._sync_id += 1
        sync_id = self._sync_id
        started = time.perf_counter()
        update = None
        try:
            if self.rank == 0:
                update = self._start_sync(plan, sync_id)
            bytes_sent = self._publish_all(src, plan, sync_id, update)
            self._await(self.producer.submit("wait_drained", sync_id), update, "engines to read every group")
            if update is not None:
                update.result(timeout=self.init_info.timeout_s + _MARGIN_S)
                self.client.finish_weight_update(weight_version)
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
            seconds=time.perf_counter() - started,
            weight_version=weight_version,
            extra={"sync_id": sync_id, "num_groups": len(plan.groups),
                   "lookahead_groups": self.init_info.lookahead_groups},
        )

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
        """Rank 0: begins the sync on every producer and starts the engine's update in the background."""
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
        self.client.start_weight_update()
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

    def _fail(self, sync_id: int, update) -> str | None:
        """Best effort after a failure: mark the sync aborted, let the engine finish failing, restore its weights.

        Returns the engine's own error, if its update call failed too.
        """
        for producer in self.producers or [self.producer]:
            try:
                producer.result(producer.submit("abort", sync_id), timeout=5)
            except Exception:  # a dead producer needs no abort: engines reading it fail by themselves
                pass
        if update is None:
            return None
        engine_error = None
        try:
            update.result(timeout=self.init_info.timeout_s + _MARGIN_S)
        except Exception as e:  # the engine failed too (it restored and ended the update itself)
            engine_error = f"{type(e).__name__}: {e}"
        try:
            self.client.abort_weight_update()  # covers an engine that received everything before we failed
        except Exception:
            pass
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


@dataclass(frozen=True)
class _EngineConfig:
    timeout_s: float
    num_recv_buffers: int
    nixl_backend: str


@dataclass(frozen=True)
class _Producer:
    rank: int
    agent_name: str
    metadata: bytes
    mem_type: str
    device_id: int
    slots: tuple[tuple[int, int], ...]  # (address, nbytes)
    status: tuple[int, int]


_INIT_FIELDS = {"backend", "timeout_s", "num_recv_buffers", "nixl_backend"}
_UPDATE_FIELDS = {"sync_id", "names", "dtypes", "shapes", "group_sizes", "chunk_bytes", "num_slots", "producers"}
_PRODUCER_FIELDS = {"rank", "agent_name", "agent_metadata_b64", "mem_type", "device_id", "slots", "status"}


class ShardedRDTWeightTransferEngine(WeightTransferEngine):
    """One engine worker's consumer: a NIXL agent, a ring of receive buffers, and the baked consumed ranges."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.model: nn.Module | None = None
        self.config: _EngineConfig | None = None
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

    def parse_init_info(self, init_info: dict) -> _EngineConfig:
        if not isinstance(init_info, dict):
            raise ValueError(f"init_info: expected a dict, got {type(init_info).__name__}")
        unknown = sorted(set(init_info) - _INIT_FIELDS)
        if unknown:
            raise ValueError(f"init_info: unknown field(s) {unknown} for backend 'sharded_rdt'")
        timeout_s = check_timeout_s(init_info.get("timeout_s", 120.0), "init_info.timeout_s")
        num_recv_buffers = init_info.get("num_recv_buffers", 2)
        if not (_nonneg_int(num_recv_buffers) and 1 <= num_recv_buffers <= _MAX_RECV_BUFFERS):
            raise ValueError(f"init_info.num_recv_buffers: expected an int in [1, {_MAX_RECV_BUFFERS}], "
                             f"got {num_recv_buffers!r}")
        nixl_backend = init_info.get("nixl_backend", "UCX")
        if not isinstance(nixl_backend, str) or not nixl_backend:
            raise ValueError(f"init_info.nixl_backend: expected a backend name, got {nixl_backend!r}")
        return _EngineConfig(float(timeout_s), num_recv_buffers, nixl_backend)

    def rendezvous(self, init_info: _EngineConfig) -> Rendezvous:
        # init makes a local NIXL agent and connects nowhere: the producers' agents (and the
        # addresses in their metadata) arrive with each update_info, not in init_info.
        return Rendezvous(init_info.timeout_s, "the local NIXL agent")

    def init_transfer(self, init_info: _EngineConfig) -> None:
        self.config = init_info
        self.agent = make_agent(f"rdt-consumer-{uuid.uuid4().hex[:12]}", init_info.nixl_backend)

    def parse_update_info(self, update_info: dict) -> WeightUpdateInfo:
        if not isinstance(update_info, dict):
            raise ValueError(f"update_info: expected a dict, got {type(update_info).__name__}")
        unknown = sorted(set(update_info) - _UPDATE_FIELDS)
        missing = sorted(_UPDATE_FIELDS - set(update_info))
        if unknown or missing:
            raise ValueError(
                f"update_info: unknown field(s) {unknown}, missing field(s) {missing} for backend 'sharded_rdt'"
            )
        sync_id = update_info["sync_id"]
        if not _nonneg_int(sync_id) or sync_id >= 1 << 38:
            raise ValueError(f"update_info.sync_id: expected an int in [0, 2**38), got {sync_id!r}")
        names, dtypes, shapes = parse_tensor_list(update_info)
        sizes = update_info["group_sizes"]
        if not (isinstance(sizes, list) and all(_nonneg_int(s) and s > 0 for s in sizes) and sum(sizes) == len(names)):
            raise ValueError(f"update_info.group_sizes: expected positive ints adding to {len(names)}, got {sizes!r}")
        if len(sizes) >= GROUP_LIMIT:
            raise ValueError(f"update_info.group_sizes: {len(sizes)} groups; at most {GROUP_LIMIT - 1}")
        chunk_bytes = update_info["chunk_bytes"]
        if not (_nonneg_int(chunk_bytes) and chunk_bytes >= 256):
            raise ValueError(f"update_info.chunk_bytes: expected an int >= 256, got {chunk_bytes!r}")
        num_slots = update_info["num_slots"]
        if not (_nonneg_int(num_slots) and num_slots >= 1):
            raise ValueError(f"update_info.num_slots: expected an int >= 1, got {num_slots!r}")
        plan = build_plan(names, dtypes, shapes, sizes, chunk_bytes)
        producers = _parse_producers(update_info["producers"], num_slots, plan.slot_bytes)
        return WeightUpdateInfo(names, dtypes, shapes, extra={"plan": plan, "sync_id": sync_id, "producers": producers})

    def receive_weights(self, info: WeightUpdateInfo) -> Iterator[tuple[str, torch.Tensor]]:
        if self.agent is None or self.config is None:
            raise RuntimeError("sharded_rdt: receive_weights before init_transfer")
        plan: SyncPlan = info.extra["plan"]
        producers: list[_Producer] = info.extra["producers"]
        return self._replay(plan, info.extra["sync_id"], producers, self._consumed(plan))

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
        self, plan: SyncPlan, sync_id: int, producers: list[_Producer], consumed: dict[str, ByteRanges]
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

    def _read_pack(self, plan: SyncPlan, g: int, p: int, num_ranks: int, producer: _Producer, buffer: torch.Tensor,
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
        self, plan: SyncPlan, g: int, sync_id: int, num_ranks: int, producer: _Producer, block: bool
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

    def _post(self, local: list, local_mem: str, remote: list, remote_mem: str, producer: _Producer, what: str):
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

    def _connect(self, producers: list[_Producer]) -> None:
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


def _nonneg_int(v: Any) -> bool:
    """An int (not a bool) in [0, 2**63): no larger value reaches torch or NIXL."""
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= INT64_MAX


def _zero(buffer: torch.Tensor, slot: PackSlot) -> None:
    buffer[slot.offset : slot.offset + slot.nbytes].zero_()


def _release(handle) -> None:
    if handle is None:
        return
    try:
        handle.release()
    except Exception:  # releasing a transfer still in flight aborts it; nothing more to do
        pass


def _parse_producers(value: Any, num_slots: int, slot_bytes: int) -> list[_Producer]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"update_info.producers: expected a non-empty list, got {type(value).__name__}")
    producers = []
    for i, entry in enumerate(value):
        where = f"update_info.producers[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected a dict, got {type(entry).__name__}")
        unknown, missing = sorted(set(entry) - _PRODUCER_FIELDS), sorted(_PRODUCER_FIELDS - set(entry))
        if unknown or missing:
            raise ValueError(f"{where}: unknown field(s) {unknown}, missing field(s) {missing}")
        if entry["rank"] != i:
            raise ValueError(f"{where}.rank: expected {i} (producers in rank order), got {entry['rank']!r}")
        if not isinstance(entry["agent_name"], str) or not entry["agent_name"]:
            raise ValueError(f"{where}.agent_name: expected a non-empty string, got {entry['agent_name']!r}")
        try:
            metadata = base64.b64decode(entry["agent_metadata_b64"], validate=True)
        except (binascii.Error, TypeError, ValueError) as e:
            raise ValueError(f"{where}.agent_metadata_b64: not valid base64: {e}") from None
        if not metadata:
            raise ValueError(f"{where}.agent_metadata_b64: empty")
        if entry["mem_type"] not in ("DRAM", "VRAM"):
            raise ValueError(f"{where}.mem_type: expected 'DRAM' or 'VRAM', got {entry['mem_type']!r}")
        if not _nonneg_int(entry["device_id"]):
            raise ValueError(f"{where}.device_id: expected an int >= 0, got {entry['device_id']!r}")
        slots = entry["slots"]
        if not (isinstance(slots, list) and len(slots) == num_slots and all(_region(s) for s in slots)):
            raise ValueError(f"{where}.slots: expected {num_slots} [address, nbytes] pairs, got {slots!r}")
        if any(n < slot_bytes for _, n in slots):
            raise ValueError(f"{where}.slots: slots of {[n for _, n in slots]} bytes cannot hold {slot_bytes} bytes")
        status = entry["status"]
        if not (_region(status) and status[1] == 8 * (1 + num_slots)):
            raise ValueError(f"{where}.status: expected [address, {8 * (1 + num_slots)}], got {status!r}")
        producers.append(_Producer(i, entry["agent_name"], metadata, entry["mem_type"], entry["device_id"],
                                   tuple((a, n) for a, n in slots), (status[0], status[1])))
    return producers


def _region(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and len(value) == 2 and all(_nonneg_int(v) for v in value)
