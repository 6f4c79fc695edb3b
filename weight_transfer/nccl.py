"""The "nccl" backend: trainer rank 0 broadcasts HF-named tensors to every engine worker (NCCL on CUDA, gloo on CPU).

The group is trainer rank 0 (the sender) plus every engine worker, at rank
rank_offset + dp_index * workers_per_engine + worker_rank (rank_offset is 1: the trainer is 0).

The wire is vLLM 0.33's (vllm.distributed.weight_transfer.nccl_engine), field for field:

init_info (NCCLInitInfo):
    {"master_address": str, "master_port": int  |  "nccl_unique_id_b64": str,
     "rank_offset": int, "world_size": int,
     "packed": bool, "packed_buffer_size_bytes": int, "packed_num_buffers": int}
  plus, only from our own trainer to our own engine (vLLM's server would refuse them, and our
  trainer sends them only in its default wire="rollout"; see NCCLTrainerInitInfo.wire):
    "backend", "dp_index", "timeout_s", "device_type", "group_generation"
update_info (NCCLUpdateInfo): {"names": [...], "dtype_names": [...], "shapes": [[...], ...]}
  (all three empty: the tensors of the previous call again, as vLLM's trainer sends an unchanged
  round), plus "call_id" from our trainer (rollout rendezvous only).

Two rendezvous, told apart by init_info's group_generation (our trainer always sends one):

  rollout (group_generation set): our trainer's protocol. A TCPStore at master_address on
    trainer rank 0, a torch ProcessGroupGloo (CPU) or ProcessGroupNCCL (CUDA) on it, and store
    keys beside the group: an engine worker says it joined and that it posted a call's
    receives, the trainer says it gave up on a call (weight_transfer/process_group.py). This
    is the only one that runs on CPU.
  vllm (no group_generation): vLLM's trainer. Its rank 0 serves a TCPStore (StatelessProcessGroup)
    and puts the pickled NCCL unique id under broadcast_from/0/0; the engine reads only that
    key, through an allow-listed unpickler (weight_transfer/vllm_nccl.py), or takes the id
    from nccl_unique_id_b64, and joins a raw NCCL communicator (ncclCommInitRank, then vLLM's
    one-element all_reduce warm-up). CUDA only: vLLM's trainer has no CPU data plane.

The engine's init connects out to master_address, so rendezvous() names it: the worker checks
it against the engine's weight_transfer_allowed_hosts before anything connects, and runs
init_transfer (store connect, group join) in a background thread bounded by timeout_s.

Packed mode, both rendezvous: vLLM's layout (packing.plan_nccl_packs: tensors end to end, a pack
closed once it passes packed_buffer_size_bytes), in packed_num_buffers rotating buffers, so that
the broadcast of one buffer overlaps filling (trainer) or unpacking (engine) of the others.
Unpacked mode: one broadcast per tensor.

One update_weights call, in time (rollout rendezvous; vLLM's has no store keys):

    trainer rank 0                             engine worker
    update_weights(info) in the background --> validate the metadata (the worker)
    wait for store key ready/<call>/<rank> <--  set it, post the first receives
    broadcast pack 0, 1, ...              ==>  wait, yield views, re-post the buffer
    the call returns                      <--  every tensor landed

A failure on either side aborts the group at both ends (a store key tells the engine when the
trainer gives up); the trainer's next send_weights joins a fresh group (a new generation).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal

import msgspec
import torch

from weight_transfer.base import (
    InitInfo,
    ParamMeta,
    Rendezvous,
    SyncStats,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
    WeightTransferEngine,
    WeightUpdateInfo,
    answer_of,
)
from weight_transfer.clients import call_in_background
from weight_transfer.messages import TimeoutS, int_in
from weight_transfer.packing import DtypeNamesTensorList, dtype_names_list, plan_nccl_packs
from weight_transfer.process_group import (
    Check,
    StoreKeys,
    TransferSettings,
    WeightSyncGroup,
    WeightSyncTransportError,
    WireSpec,
    connect_store,
    first_line,
    host_port,
    host_store,
    receive_items,
    send_items,
    wait_for_keys,
)

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 300.0
MAX_NUM_BUFFERS = 64  # pack buffers (or unpacked broadcasts) in flight at once
MAX_WORLD_SIZE = (1 << 31) - 1  # torch.distributed takes ranks and sizes as C int

Address = Annotated[str, msgspec.Meta(pattern=r"\S", description="a host name or IP address")]  # (not blank)
WorldSize = int_in(2, MAX_WORLD_SIZE)
BufferSize = int_in(1)
NumBuffers = int_in(1, MAX_NUM_BUFFERS)


# =======================================================================================
# Messages: the trainer's settings, the engine's init_info and update_info
# =======================================================================================


class NCCLTrainerInitInfo(TrainerInitInfo):
    """Trainer-side settings of the nccl backend; every trainer rank builds the same one.

    world_size is the size of the weight-sync group: 1 sender + every engine worker.
    master_port 0 lets the trainer pick a free port (the engine is told which).
    """

    backend: ClassVar[str] = "nccl"

    master_address: Address
    master_port: int_in(0, 65535)
    world_size: WorldSize
    packed: bool = True
    packed_buffer_size_bytes: BufferSize = 1 << 30
    packed_num_buffers: NumBuffers = 2
    # This process's trainer rank (0 sends) when torch.distributed is not initialized; when it
    # is, the default group's rank decides, so that every rank can pass the same init info.
    rank: int_in(0) = 0
    timeout_s: TimeoutS = DEFAULT_TIMEOUT_S  # the longest any single wait may take
    # Which rendezvous the engine is asked for. "rollout" (ours; CPU or CUDA): init_info and
    # update_info carry our extras (timeout_s, device_type, group_generation, call_id), which
    # only our engine reads. "vllm" (CUDA only): exactly vLLM's NCCLWeightTransferInitInfo /
    # NCCLWeightTransferUpdateInfo fields and vLLM's StatelessProcessGroup + NCCL unique id
    # rendezvous, which a vLLM server and ours both join.
    wire: Literal["rollout", "vllm"] = "rollout"

    @property
    def settings(self) -> TransferSettings:
        return TransferSettings(self.packed, self.packed_buffer_size_bytes, self.packed_num_buffers)


class NCCLInitInfo(InitInfo, kw_only=True):
    """init_info as the engine reads it: vLLM's NCCLWeightTransferInitInfo fields, then our optional extras.

    Exactly one rendezvous: master_address + master_port, or nccl_unique_id_b64 (vLLM's mode for
    torch-free trainers: standard base64 of the 128-byte ncclUniqueId). The defaults are vLLM's
    worker-side ones (packed False); both trainers always send packed and its sizes.
    """

    master_address: Address | None = None
    master_port: int_in(1, 65535) | None = None
    rank_offset: int_in(1) = 1  # the group rank of the engine's worker 0 (RayWeightSyncClient shifts it per engine)
    world_size: WorldSize
    nccl_unique_id_b64: str | None = None
    packed: bool = False
    packed_buffer_size_bytes: BufferSize = 1 << 30
    packed_num_buffers: NumBuffers = 2
    # Ours, sent only by our trainer (wire="rollout"); group_generation picks our rendezvous.
    dp_index: int_in(0) = 0
    timeout_s: TimeoutS = DEFAULT_TIMEOUT_S
    device_type: Literal["cpu", "cuda"] | None = None
    group_generation: int_in(0) | None = None

    def check(self) -> None:
        has_address = self.master_address is not None or self.master_port is not None
        if self.nccl_unique_id_b64 is not None:
            if has_address:
                raise ValueError("give nccl_unique_id_b64 or master_address/master_port, not both")
            if self.group_generation is not None:
                raise ValueError(".nccl_unique_id_b64: our trainer's rendezvous (group_generation) needs "
                                 "master_address/master_port")
            from weight_transfer.vllm_nccl import decode_unique_id_b64

            try:
                decode_unique_id_b64(self.nccl_unique_id_b64)
            except ValueError as e:
                raise ValueError(f".nccl_unique_id_b64: {e}") from None
        elif self.master_address is None or self.master_port is None:
            missing = "master_address" if self.master_address is None else "master_port"
            raise ValueError(f".{missing}: missing (give master_address and master_port, or nccl_unique_id_b64)")

    @property
    def protocol(self) -> Literal["rollout", "vllm"]:
        return "rollout" if self.group_generation is not None else "vllm"

    @property
    def settings(self) -> TransferSettings:
        return TransferSettings(self.packed, self.packed_buffer_size_bytes, self.packed_num_buffers)


class NCCLUpdateInfo(DtypeNamesTensorList):
    """update_info: vLLM's names / dtype_names / shapes, and (our trainer) the call's id, which names its store keys."""

    call_id: int_in(1) | None = None


@dataclass(kw_only=True)
class NCCLWeightUpdate(WeightUpdateInfo):
    call_id: int | None


# =======================================================================================
# Engine side
# =======================================================================================


class NCCLWeightTransferEngine(WeightTransferEngine[NCCLInitInfo, NCCLUpdateInfo]):
    """An engine worker's end of the group: joins it at init, receives each update_weights call's tensors."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        # self.worker_rank, self.workers_per_engine: this worker's tensor-parallel rank and the
        # engine's worker count (bind_worker, before parse_init_info), so each worker joins at its own rank.
        self.info: NCCLInitInfo | None = None
        self.rank = 0  # this worker's rank in the group
        self.store = None
        self.keys: StoreKeys | None = None
        self.group = None  # WeightSyncGroup (rollout rendezvous) or vllm_nccl.VllmNcclGroup (vLLM's)
        self._last_tensors: DtypeNamesTensorList | None = None  # what an empty update_info repeats

    # ---- init -------------------------------------------------------------------------------

    def _group_rank(self, init_info: NCCLInitInfo) -> int:
        return init_info.rank_offset + init_info.dp_index * self.workers_per_engine + self.worker_rank

    def check_init_info(self, init_info: NCCLInitInfo) -> None:
        rank = self._group_rank(init_info)
        if rank >= init_info.world_size:
            raise ValueError(
                f"init_info.world_size: {init_info.world_size} leaves no rank for this worker "
                f"(rank_offset {init_info.rank_offset} + dp_index {init_info.dp_index} * {self.workers_per_engine} "
                f"+ worker {self.worker_rank} = {rank})"
            )
        if init_info.device_type is not None and init_info.device_type != self.device.type:
            raise ValueError(
                f"init_info.device_type: the trainer sends from {init_info.device_type} but this engine runs on "
                f"{self.device.type}; both ends of the group need the same kind of device"
            )
        if init_info.protocol == "vllm" and self.device.type != "cuda":
            raise ValueError(
                "init_info.group_generation: missing, so this is vLLM's rendezvous (its trainer's NCCL "
                f"communicator), which needs a CUDA engine; this one runs on {self.device.type}. On CPU, "
                "sync with weight_transfer's own trainer engine (its gloo path)"
            )

    def rendezvous(self, init_info: NCCLInitInfo) -> Rendezvous:
        if init_info.master_address is None:  # vLLM's unique-id mode: NCCL connects to the id's bootstrap address
            from weight_transfer import vllm_nccl

            address = vllm_nccl.unique_id_address(vllm_nccl.decode_unique_id_b64(init_info.nccl_unique_id_b64))
            if address is None and self.allowed_hosts is not None and not self.allowed_hosts.any_host:
                raise ValueError("init_info.nccl_unique_id_b64: its NCCL bootstrap address cannot be read, so it "
                                 "cannot be checked against weight_transfer_allowed_hosts (allow '*' to skip)")
            return Rendezvous(init_info.timeout_s, f"the trainer's NCCL rank 0 at {address} (nccl_unique_id_b64)",
                              address, "init_info.nccl_unique_id_b64")
        # The store (then the group on it) at master_address: the address the worker checks first.
        peer = host_port(init_info.master_address, init_info.master_port)
        return Rendezvous(init_info.timeout_s, f"the trainer's TCPStore at {peer}", init_info.master_address,
                          "init_info.master_address")

    def init_transfer(self, init_info: NCCLInitInfo) -> None:
        rank = self._group_rank(init_info)
        if init_info.protocol == "vllm":
            from weight_transfer import vllm_nccl

            store = None
            if init_info.nccl_unique_id_b64 is not None:
                unique_id = vllm_nccl.decode_unique_id_b64(init_info.nccl_unique_id_b64)
            else:
                # As a StatelessProcessGroup member: vLLM's rank 0 waits for world_size members to connect.
                store = connect_store(init_info.master_address, init_info.master_port, init_info.timeout_s,
                                      world_size=init_info.world_size)
                unique_id = vllm_nccl.read_unique_id(store, init_info.timeout_s)
                # The store named where NCCL connects next: that address too must be an allowed host.
                vllm_nccl.check_unique_id_address(unique_id, self.allowed_hosts,
                                                  "the trainer's TCPStore key broadcast_from/0/0")
            self.group = vllm_nccl.VllmNcclGroup(unique_id, rank=rank, world_size=init_info.world_size,
                                                 device=self.device, timeout_s=init_info.timeout_s)
            self.info, self.rank, self.store, self.keys = init_info, rank, store, None
            return
        keys = StoreKeys(init_info.group_generation)
        store = connect_store(init_info.master_address, init_info.master_port, init_info.timeout_s)
        store.set(keys.joined(rank), "1")  # lets the trainer start its side of the rendezvous
        self.group = WeightSyncGroup(
            store, prefix=keys.group, rank=rank, world_size=init_info.world_size, device=self.device,
            timeout_s=init_info.timeout_s, address=init_info.master_address,
        )
        self.info, self.rank, self.store, self.keys = init_info, rank, store, keys

    # ---- one update_weights call --------------------------------------------------------------

    def _tensors_of(self, update_info: DtypeNamesTensorList) -> DtypeNamesTensorList:
        """The call's tensors: its own, or (all three lists empty, as vLLM's trainer sends an unchanged
        round) the previous call's."""
        if update_info.names:
            self._last_tensors = update_info
            return update_info
        if self._last_tensors is None:
            raise ValueError("update_info.names: empty, which repeats the previous call's tensors, and there was none")
        return self._last_tensors

    def _call_id(self, update_info: NCCLUpdateInfo) -> int | None:
        if self.info.protocol == "rollout" and update_info.call_id is None:
            raise ValueError("update_info.call_id: missing (our trainer's rendezvous names its store keys after it)")
        return update_info.call_id

    def plan_update(self, update_info: NCCLUpdateInfo) -> NCCLWeightUpdate:
        if self.info is None:
            self._require_group()  # raises: no init yet
        call_id = self._call_id(update_info)
        tensors = self._tensors_of(update_info)
        self._require_group()
        # A pack's views stay valid until the next pack is pulled (unpacked: each tensor is its own
        # allocation); runs of the same bounded size let the worker land a run at once.
        specs = [WireSpec(n, d, s) for n, d, s in zip(tensors.names, tensors.dtype_names, tensors.shapes)]
        packs = plan_nccl_packs([s.nbytes for s in specs], self.info.settings.buffer_size)
        return NCCLWeightUpdate(list(tensors.names), list(tensors.dtype_names), list(tensors.shapes),
                                group_sizes=[len(p.slots) for p in packs], call_id=call_id)

    def receive_weights(self, info: NCCLWeightUpdate) -> Iterator[tuple[str, torch.Tensor]]:
        specs = [WireSpec(n, d, s) for n, d, s in zip(info.names, info.dtypes, info.shapes)]
        stream = self._receive(info.call_id, specs)
        try:
            for name, tensor in zip(info.names, stream):
                yield name, tensor
            next(stream, None)  # runs the stream to its end (marks the call complete)
        finally:
            stream.close()  # after a failure or an early stop: aborts the group (see _receive)

    def _receive(self, call_id: int | None, specs: Sequence[WireSpec],
                 settings: TransferSettings | None = None) -> Iterator[torch.Tensor]:
        """The call's tensors off the wire; any failure, or a consumer that stops early, aborts the group."""
        group = self._require_group()
        settings = settings or self.info.settings
        check = None
        if self.keys is not None:  # our rendezvous: tell the trainer the receives are posted next
            self.store.set(self.keys.ready(call_id, self.rank), "1")
            check = self._abort_check(call_id)
        complete = False
        try:
            yield from receive_items(group, specs, settings, check)
            complete = True
        finally:
            if not complete:  # the trainer may still be sending: this group cannot pair up again
                group.abort()

    def _abort_check(self, call_id: int) -> Check:
        key = self.keys.abort(call_id)
        store = self.store

        def check() -> None:
            try:
                aborted = store.check([key])
                reason = store.get(key).decode(errors="replace") if aborted else ""
            except RuntimeError as e:  # the store lives in the trainer's rank 0
                raise WeightSyncTransportError(
                    f"lost the trainer (its TCPStore stopped answering): {first_line(e)}"
                ) from e
            if aborted:
                raise WeightSyncTransportError(f"the trainer gave up on this update: {reason}")

        return check

    def _require_group(self):
        if self.group is None:
            raise RuntimeError("no weight-sync group: call init_weight_transfer_engine first")
        if self.group.aborted:
            raise RuntimeError(
                "the weight-sync group was aborted by a failed transfer; the trainer must call "
                "init_weight_transfer_engine again (its next send_weights does)"
            )
        return self.group

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group = self.store = None


# =======================================================================================
# Trainer side
# =======================================================================================


def _device_of(source: WeightSource | None) -> torch.device:
    """Where the trainer's tensors live, which decides the transport (gloo on CPU, NCCL on CUDA)."""
    if source is not None and (source.implements_iter_local() or not any(m.sharded for m in source.metadata)):
        # iter_local moves nothing; a vLLM-style source may have only iter_full, which gathers only when sharded.
        pairs = source.iter_local() if source.implements_iter_local() else source.iter_full()
        for _, tensor in pairs:
            device = tensor.device
            break
        else:
            device = torch.device("cpu")
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _raise_engine_error(future: Future, must_be_pending: bool = False) -> Check:
    """A check that raises the engine's error as soon as its background call failed."""

    def check() -> None:
        if future.done():
            error = future.exception()
            if error is not None:
                raise error
            if must_be_pending:
                raise WeightSyncTransportError("the engine answered before it received anything")

    return check


def _in_metadata_order(metas: Sequence[ParamMeta], pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[torch.Tensor]:
    """The tensors of iter_full(), checked against the metadata's names and run to the end."""
    pairs = iter(pairs)
    for meta in metas:
        item = next(pairs, None)
        if item is None:
            raise ValueError(f"source: iter_full() ended before {meta.name!r}; its metadata lists more tensors")
        if item[0] != meta.name:
            raise ValueError(f"source: iter_full() yielded {item[0]!r} where its metadata has {meta.name!r}")
        yield item[1]
    extra = next(pairs, None)
    if extra is not None:
        raise ValueError(f"source: iter_full() yielded {extra[0]!r}, which its metadata does not list")


class NCCLTrainerWeightTransferEngine(TrainerWeightTransferEngine[NCCLTrainerInitInfo]):
    """The trainer's end: rank 0 hosts the store, joins the group with the engine and broadcasts."""

    backend = "nccl"

    def __init__(self, init_info: NCCLTrainerInitInfo, client, source, rank: int) -> None:
        super().__init__(init_info, client, source, rank)
        self.settings = init_info.settings
        self.device: torch.device | None = None
        self.store = None
        self.keys: StoreKeys | None = None
        self.group: WeightSyncGroup | None = None
        self.generation = -1
        self.call_id = 0

    @classmethod
    def _start(cls, init_info: NCCLTrainerInitInfo, *, client, source) -> NCCLTrainerWeightTransferEngine:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else init_info.rank
        engine = cls(init_info, client, source, rank)
        if engine.rank == 0:
            if client is None:
                raise ValueError("client: trainer rank 0 (the sender) needs a client to reach the engine")
            engine.device = _device_of(engine.source)
            engine._join()
        return engine

    # ---- the group ----------------------------------------------------------------------------

    def _join(self) -> None:
        """Starts a new group generation with the engine: the engine's init runs while we rendezvous."""
        info = self.init_info
        if self.store is None:
            self.store = host_store(info.master_address, info.master_port, self.timeout_s)
        num_workers = int(self._bounded("get_world_size", self.client.get_world_size))
        if info.world_size != 1 + num_workers:
            raise ValueError(
                f"world_size: {info.world_size}, but the engine has {num_workers} worker(s), so the group "
                f"(1 sender + the workers) has {1 + num_workers}"
            )
        self.generation += 1
        self.call_id = 0
        if info.wire == "vllm":
            self._join_vllm()
            return
        keys = StoreKeys(self.generation)
        future = call_in_background(self.client.init_weight_transfer_engine, self._engine_init_info())
        wait_for_keys(
            self.store, [keys.joined(r) for r in range(1, info.world_size)], self.timeout_s,
            "engine workers joining the weight-sync group", _raise_engine_error(future),
        )
        group = WeightSyncGroup(
            self.store, prefix=keys.group, rank=0, world_size=info.world_size, device=self.device,
            timeout_s=self.timeout_s, address=info.master_address,
        )
        try:
            answer_of(future, self.timeout_s, "init_weight_transfer_engine")
        except BaseException:
            group.close()
            raise
        self.keys, self.group = keys, group

    def _join_vllm(self) -> None:
        """vLLM's rendezvous as its trainer runs it: the pickled unique id under broadcast_from/0/0 of our
        store (a fresh store per generation: vLLM's workers read counter 0), then NCCL rank 0."""
        from weight_transfer import vllm_nccl

        if self.device.type != "cuda":
            raise ValueError("wire: 'vllm' is vLLM's NCCL rendezvous, CUDA only; on CPU use wire='rollout'")
        if self.generation > 0:  # the key is read at counter 0: a re-join needs a new store
            self.store = host_store(self.init_info.master_address, 0, self.timeout_s)
        unique_id = vllm_nccl.get_unique_id()
        self.store.set(vllm_nccl.UNIQUE_ID_KEY, vllm_nccl.unique_id_pickle(unique_id))
        future = call_in_background(self.client.init_weight_transfer_engine, self._engine_init_info())
        group = vllm_nccl.VllmNcclGroup(unique_id, rank=0, world_size=self.init_info.world_size,
                                        device=self.device, timeout_s=self.timeout_s)
        try:
            answer_of(future, self.timeout_s, "init_weight_transfer_engine")
        except BaseException:
            group.close()
            raise
        self.keys, self.group = None, group

    def _engine_init_info(self) -> dict:
        """vLLM's NCCLWeightTransferInitInfo fields; wire="rollout" adds our extras (our engine only)."""
        info = self.init_info
        payload = {
            "master_address": info.master_address,
            "master_port": int(self.store.port),
            "rank_offset": 1,
            "world_size": info.world_size,
            "packed": info.packed,
            "packed_buffer_size_bytes": info.packed_buffer_size_bytes,
            "packed_num_buffers": info.packed_num_buffers,
        }
        if info.wire == "rollout":
            payload.update(backend=self.backend, timeout_s=info.timeout_s, device_type=self.device.type,
                           group_generation=self.generation)
        return payload

    # ---- one sync -----------------------------------------------------------------------------

    def _before_update(self) -> None:
        if self.group is None or self.group.aborted:
            self._join()  # the last sync failed: both ends dropped that group

    def _send(self, source: WeightSource) -> SyncStats:
        metas = source.metadata
        specs = [WireSpec(m.name, m.dtype, tuple(m.shape)) for m in metas]
        update_info = dtype_names_list([m.name for m in metas], [m.dtype for m in metas], [m.shape for m in metas])
        sent = self._send_call(update_info, specs, _in_metadata_order(metas, source.iter_full()))
        return SyncStats(self.backend, num_tensors=len(metas), bytes_sent=sent, dense_bytes=sum(m.nbytes for m in metas))

    def _send_call(self, update_info: dict, specs: Sequence[WireSpec], tensors: Iterator[torch.Tensor],
                   settings: TransferSettings | None = None) -> int:
        """One update_weights call: the engine validates the metadata, then the tensors are broadcast."""
        if self.keys is None:  # vLLM's rendezvous: no store keys, the broadcasts pair up in NCCL
            return self._send_call_vllm(update_info, specs, tensors, settings or self.settings)
        self.call_id += 1
        call_id = self.call_id
        future = call_in_background(self.client.update_weights, {**update_info, "call_id": call_id})
        try:
            engine_ranks = range(1, self.init_info.world_size)
            wait_for_keys(
                self.store, [self.keys.ready(call_id, r) for r in engine_ranks], self.timeout_s,
                "engine workers validating the update", _raise_engine_error(future, must_be_pending=True),
            )
            sent = send_items(self.group, specs, tensors, self.settings, _raise_engine_error(future))
            next(tensors, None)  # lets the source check that it has nothing left
            answer_of(future, self.timeout_s, "update_weights")
            return sent
        except BaseException as e:
            try:  # tell the engine at once rather than letting it wait out its timeout
                self.store.set(self.keys.abort(call_id), f"{type(e).__name__}: {e}"[:2000])
            except RuntimeError:
                pass
            # Broadcasts may be in flight, or the engine may have dropped its end (or been given
            # another trainer's): the next sync joins a fresh group rather than guess.
            self.group.abort()
            raise

    def _send_call_vllm(self, update_info: dict, specs: Sequence[WireSpec], tensors: Iterator[torch.Tensor],
                        settings: TransferSettings) -> int:
        future = call_in_background(self.client.update_weights, update_info)
        try:
            sent = send_items(self.group, specs, tensors, settings, _raise_engine_error(future))
            next(tensors, None)
            answer_of(future, self.timeout_s, "update_weights")
            return sent
        except BaseException:
            self.group.abort()
            raise

    def shutdown(self) -> None:
        if self.rank == 0 and self.group is not None and self.client is not None:
            try:
                self._bounded("shutdown_weight_transfer_engine", self.client.shutdown_weight_transfer_engine)
            except Exception as e:
                logger.warning("shutdown_weight_transfer_engine failed: %s", e)
        if self.group is not None:
            self.group.close()
        self.group = self.store = None
