"""The "ipc" backend: a trainer and an engine on the same device share packed buffers (CUDA IPC, or POSIX shared memory on CPU).

The trainer's sender (rank 0) packs the tensors (packing.plan_packs) into a ring of
`packed_num_buffers` buffers on its device, plus one buffer of its own for tensors larger than
a buffer. Each buffer is exported once (a CUDA IPC handle of its storage, or a named segment in
/dev/shm on CPU) and each engine worker opens it once and caches it by (slot, generation), so
later syncs pay neither cost. Handles travel in JSON (ints, strings, base64 for bytes); nothing
of this shape is ever unpickled, so the same update_info works in-process, over Ray and over HTTP.

One update_weights call per pack, posted in the background *before* the trainer fills the
buffer, so the call's round trip overlaps the copy; the engine waits until the buffer's ready
word in a small shared control block says the pack is complete, yields views into the buffer
(the worker lands each before it pulls the next) and synchronizes before the call returns.
The trainer refills a buffer only after the call that read it returned, and keeps at most
packed_num_buffers calls in flight. A sync of one pack (a LoRA adapter's, usually) is one engine call
instead, apply_weight_update, posted the same way before the fill: it starts the update, lands the
pack once ready and finishes the update (weight_transfer/base.py: _send_in_one_call).

    engine init_info:  {"backend": "ipc", "control": "<segment name>", "host": "cpu:<boot id>",   (IPCInitInfo)
                        "timeout_s": float, "keep_buffers": bool}
    update_info:       {"names": [...], "dtypes": [...], "shapes": [...],   (packing.tensor_list: one pack)
                        "buffer_size": int,                               (packing.plan_packs' buffer size)
                        "slot": int, "seq": int,                          (which buffer, which fill of it)
                        "buffer": {device_key: {"slot", "gen", "capacity", "handle": {...}}}}   (IPCUpdateInfo)
    handle (CPU):      {"kind": "shm", "name": "wt-ipc-..."}                  (ShmHandle)
    handle (CUDA):     {"kind": "cuda", "handle_b64", "storage_size", "storage_offset", "ref_counter_b64",
                        "ref_counter_offset", "event_b64", "event_sync_required"}   (CudaHandle)

device_key is "cuda:<device uuid>" (CUDA_VISIBLE_DEVICES may number a GPU differently in each
process; its uuid is the same) or "cpu:<boot id>", so each colocated engine worker picks the
buffer on its own device. Today only the sender exports buffers, so the engine's workers must
all sit on the sender's device (an engine of one worker, colocated with trainer rank 0).

vLLM's shape of ipc (init_info {"packed": bool}, update_info with dtype_names and ipc_handles, CUDA
only) is read by the same engine side and written by IPCTrainerInitInfo(wire="vllm" or
"vllm_packed"): weight_transfer/ipc_vllm.py.

Failure handling: every wait has a limit (timeout_s). The engine's wait for a fill ends with
TimeoutError when a trainer stalls or dies (the worker then restores the previous weights); a
trainer that fails sets the control block's abort word, so a waiting engine stops at once,
and then calls abort_weight_update. Linux only (the segments live in /dev/shm).
"""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import functools
import logging
import mmap
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing import resource_tracker
from typing import Annotated, ClassVar, Literal

import msgspec
import numpy as np
import torch

from weight_transfer import ipc_vllm, packing, sync_trace
from weight_transfer.base import (
    DEFAULT_INIT_TIMEOUT_S,
    InitInfo,
    ParamMeta,
    Rendezvous,
    SyncStats,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
    WeightTransferEngine,
    WeightUpdateInfo,
)
from weight_transfer.messages import Message, NonEmptyStr, NonNegInt, TimeoutS, int_in, parse_message, replace_parsed

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
# Our segments' names: nothing else in /dev/shm can be named by a peer (\Z: no trailing newline either).
_SEGMENT_NAME = r"^wt-ipc-[0-9a-z-]{1,100}\Z"
_CONTROL_NAME = r"^wt-ipc-[0-9a-z-]{0,96}-ctl\Z"  # a segment name that ends in "-ctl"
_MAX_SLOTS = 64  # ring buffers + the oversize buffer; fixes the control block's size
_MAX_VIEW_SETS = 16  # per buffer: the distinct packs it carries (one per sync layout in practice)
_FILL_BATCH_BYTES = 256 << 20  # source bytes per multi-tensor copy into a buffer
_MAX_HANDLE_BYTES = 4096  # a CUDA IPC handle is 64 bytes; allow for longer formats, refuse garbage
_SHORT_WAIT_S = 2e-3  # the engine polls a fill's ready word at its shortest sleep for this long


# =======================================================================================
# Shared pieces: device keys, /dev/shm segments, the control block
# =======================================================================================


def device_key(device: torch.device) -> str:
    """The key a buffer on `device` is published under: "cuda:<uuid>" or "cpu:<boot id>"."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{torch.cuda.get_device_properties(index).uuid}"
    if device.type == "cpu":
        return f"cpu:{_boot_id()}"
    raise ValueError(f"device: the ipc backend shares cuda or cpu memory, not {device.type!r}")


@functools.cache
def _boot_id() -> str:
    """This machine's boot id, read once per process (it changes only with a reboot)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:  # pragma: no cover - not Linux
        return socket.gethostname()


def _segment_path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def _create_segment(name: str, nbytes: int) -> mmap.mmap:
    """A new /dev/shm segment of nbytes, its space reserved now (a full tmpfs fails here, not with SIGBUS later).

    The segment is registered with multiprocessing's resource tracker, which unlinks it if this
    process dies without unlinking it itself; a peer's mapping stays valid until it unmaps.
    """
    path = _segment_path(name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        resource_tracker.register("/" + name, "shared_memory")
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            _unlink_segment(name)
            raise RuntimeError(
                f"ipc: {SHM_DIR} has no room for a {nbytes}-byte buffer ({e}); "
                "lower packed_buffer_size_bytes or give the machine more shared memory"
            ) from e
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def _open_segment(name: str, nbytes: int, where: str) -> mmap.mmap:
    """Maps an existing segment (never creates one); ValueError naming `where` if it is missing or short."""
    try:
        fd = os.open(_segment_path(name), os.O_RDWR)
    except FileNotFoundError:
        raise ValueError(
            f"{where}: no shared-memory segment {name!r} on this host (trainer gone, or on another machine?)"
        ) from None
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise ValueError(f"{where}: segment {name!r} has {size} bytes, fewer than the {nbytes} announced")
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def _unlink_segment(name: str) -> None:
    try:
        os.unlink(_segment_path(name))
    except FileNotFoundError:
        pass
    resource_tracker.unregister("/" + name, "shared_memory")


class _Control:
    """int64 words in a small segment that both sides map; the only signalling of a sync besides the client calls.

        word 0          magic
        word 1          abort: the trainer abandoned the sync in progress (engine waits stop at once)
        2 + 3*s + 0     ready  (trainer): seq of the pack whose bytes are complete in slot s's buffer
        2 + 3*s + 1     taken  (engine):  seq of the pack the engine is waiting for or reading in slot s
        2 + 3*s + 2     opened (engine):  latest generation of slot s's buffer the engine opened (0: none);
                                          from then on that export's CUDA reference is the engine's to give back

    Each word has one writer. The trainer writes `ready` only after the pack's bytes are complete
    (a host copy, or a device copy it synchronized), and the engine reads the buffer only after it
    sees `ready`, so the word orders the data (aligned 8-byte stores; x86 keeps store order).
    """

    MAGIC = 0x5754_4950_4301  # "WTIPC" + layout version 1
    NUM_WORDS = 2 + 3 * _MAX_SLOTS
    NBYTES = NUM_WORDS * 8

    def __init__(self, name: str, segment: mmap.mmap, owner: bool) -> None:
        self.name = name
        self.owner = owner
        self._segment = segment
        self._words = np.frombuffer(segment, dtype=np.int64, count=self.NUM_WORDS)

    @classmethod
    def create(cls, name: str) -> _Control:
        control = cls(name, _create_segment(name, cls.NBYTES), owner=True)
        control._words[:] = 0
        control._words[0] = cls.MAGIC
        return control

    @classmethod
    def attach(cls, name: str, where: str) -> _Control:
        control = cls(name, _open_segment(name, cls.NBYTES, where), owner=False)
        if int(control._words[0]) != cls.MAGIC:
            control.close()
            raise ValueError(f"{where}: segment {name!r} is not an ipc control block of this version")
        return control

    def _word(self, slot: int, field: int) -> int:
        return 2 + 3 * slot + field

    @property
    def aborted(self) -> bool:
        return bool(self._words[1])

    def set_aborted(self, value: bool) -> None:
        self._words[1] = int(value)

    def ready(self, slot: int) -> int:
        return int(self._words[self._word(slot, 0)])

    def set_ready(self, slot: int, seq: int) -> None:
        self._words[self._word(slot, 0)] = seq

    def taken(self, slot: int) -> int:
        return int(self._words[self._word(slot, 1)])

    def set_taken(self, slot: int, seq: int) -> None:
        self._words[self._word(slot, 1)] = seq

    def opened(self, slot: int) -> int:
        return int(self._words[self._word(slot, 2)])

    def set_opened(self, slot: int, gen: int) -> None:
        self._words[self._word(slot, 2)] = gen

    def close(self) -> None:
        """Unmaps (and, on the trainer, unlinks) the segment. Idempotent."""
        if self._segment is None:
            return
        del self._words
        self._words = np.zeros(self.NUM_WORDS, dtype=np.int64)  # later reads see an idle block
        self._segment.close()
        self._segment = None
        if self.owner:
            _unlink_segment(self.name)


def _b64(data: bytes | None) -> str:
    return base64.b64encode(data or b"").decode("ascii")


# =======================================================================================
# Messages: init_info, update_info and the buffer handles in it
# =======================================================================================

# A CUDA IPC handle is 64 bytes; allow for longer formats, refuse garbage.
_HandleBytes = Annotated[bytes, msgspec.Meta(min_length=1, max_length=_MAX_HANDLE_BYTES)]
_Slot = int_in(0, _MAX_SLOTS - 1)


class IPCInitInfo(InitInfo):
    """init_info: the trainer's control block, its machine, and the settings the engine side needs."""

    control: Annotated[str, msgspec.Meta(pattern=_CONTROL_NAME, description="an ipc control block name (wt-ipc-...-ctl)")]
    host: str  # the trainer's device_key of its CPU ("cpu:<boot id>"): the same machine?
    timeout_s: TimeoutS
    keep_buffers: bool


class ShmHandle(Message, tag_field="kind", tag="shm"):
    """A buffer in a /dev/shm segment of the trainer's."""

    name: Annotated[str, msgspec.Meta(pattern=_SEGMENT_NAME, description="an ipc segment name (wt-ipc-...)")]


class CudaHandle(Message, tag_field="kind", tag="cuda"):
    """A CUDA buffer as torch's storage._share_cuda_() describes it (the bytes travel as base64)."""

    handle: _HandleBytes = msgspec.field(name="handle_b64")
    storage_size: int_in(1)
    storage_offset: NonNegInt
    ref_counter: _HandleBytes = msgspec.field(name="ref_counter_b64")
    ref_counter_offset: NonNegInt
    event: Annotated[bytes, msgspec.Meta(max_length=_MAX_HANDLE_BYTES)] = msgspec.field(name="event_b64")
    event_sync_required: bool


class BufferDescriptor(Message):
    """A buffer as update_info announces it; the same (slot, gen) always comes with the same descriptor."""

    slot: _Slot
    gen: int_in(1)
    capacity: int_in(1)  # bytes the buffer holds
    handle: ShmHandle | CudaHandle

    def check(self) -> None:
        if isinstance(self.handle, CudaHandle) and self.handle.storage_size < self.capacity:
            raise ValueError(
                f".handle.storage_size: {self.handle.storage_size} bytes, fewer than the capacity {self.capacity}"
            )


class IPCUpdateInfo(packing.TensorList):
    """update_info: one pack (its tensors), where it lies (slot, seq) and the buffers holding it, by device."""

    names: Annotated[list[NonEmptyStr], msgspec.Meta(min_length=1)]  # a call carries one pack of >= 1 tensor
    buffer_size: int_in(packing.ALIGN)  # packing.plan_packs' buffer size
    slot: _Slot
    seq: int_in(1)
    # Every entry is checked, also those meant for workers on other devices.
    buffer: Annotated[dict[str, BufferDescriptor], msgspec.Meta(min_length=1)]


class _CallFields(Message):
    """IPCUpdateInfo's fields but its tensor list: what a recurring call's repeats change (_parse)."""

    buffer_size: int_in(packing.ALIGN)
    slot: _Slot
    seq: int_in(1)
    buffer: Annotated[dict[str, BufferDescriptor], msgspec.Meta(min_length=1)]


_UPDATE_INFO_KEYS = frozenset(IPCUpdateInfo.__struct_fields__)  # (every field is required: no defaults)


# =======================================================================================
# Buffer handles: export (trainer) and open (engine)
# =======================================================================================


def _export_cuda(tensor: torch.Tensor) -> tuple[dict, tuple[bytes, int]]:
    """The JSON handle of a CUDA buffer's storage, and its (ref counter, offset) for releasing an unopened export.

    Each export sets a reference counter (in a small shared file of torch's) to 1; the
    importer's mapping decrements it when it is closed, and torch keeps the memory (in "limbo")
    until then even if the exporter frees it. So: one export, exactly one open-and-close.
    """
    storage = tensor.untyped_storage()
    (_device, handle, size, offset, ref_counter, ref_counter_offset, event, event_sync) = storage._share_cuda_()
    json_handle = {
        "kind": "cuda",
        "handle_b64": _b64(handle),
        "storage_size": int(size),
        "storage_offset": int(offset),
        "ref_counter_b64": _b64(ref_counter),
        "ref_counter_offset": int(ref_counter_offset),
        "event_b64": _b64(event),
        "event_sync_required": bool(event_sync),
    }
    return json_handle, (ref_counter, int(ref_counter_offset))


def _open_cuda(handle: CudaHandle, device: torch.device) -> torch.Tensor:
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        device.index if device.index is not None else torch.cuda.current_device(),
        handle.handle,
        handle.storage_size,
        handle.storage_offset,
        handle.ref_counter,
        handle.ref_counter_offset,
        handle.event or None,
        handle.event_sync_required,
    )
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


# =======================================================================================
# Engine side
# =======================================================================================


@dataclass
class _Mapped:
    """One opened buffer of the trainer's, held until the keep_buffers policy lets it go."""

    descriptor: BufferDescriptor
    tensor: torch.Tensor  # uint8 [capacity], the trainer's memory
    # (names, dtypes, shapes) of a pack -> its tensors' views into `tensor` and, when they lie end to end in one
    # dtype, the flat view of them all (WeightUpdateInfo.flat): a model's packs recur every sync, so the views
    # are made once and the same objects yielded again (WeightUpdateInfo.reuse_key).
    views: dict[tuple, tuple[list[torch.Tensor], torch.Tensor | None]] = dataclasses.field(default_factory=dict)


@dataclass(kw_only=True)
class IPCWeightUpdate(WeightUpdateInfo):
    pack: packing.Pack  # where the call's tensors lie in the buffer
    mapped: _Mapped  # the buffer, opened
    slot: int
    seq: int  # which fill of the slot's buffer the call reads
    views: list[torch.Tensor]  # the tensors' views into the buffer, in pack order


class IPCWeightTransferEngine(WeightTransferEngine[IPCInitInfo, IPCUpdateInfo]):
    """Receives packs from buffers the trainer shares on this worker's device; opens each buffer once."""

    views_stable_per_call = True  # one pack per call; the trainer refills it only after the call returned

    def __init__(self, device: torch.device) -> None:
        super().__init__(torch.device(device))
        self.key = device_key(self.device)
        self._control: _Control | None = None
        self._settings: IPCInitInfo | None = None
        self._mapped: dict[int, _Mapped] = {}  # slot -> the buffer of that slot currently mapped
        # slot -> (layout, buffer size) of its last pack and the pack's plan: a slot carries the same
        # pack every sync, so its plan is made once. layout is (names, dtypes, shapes) as tuples.
        self._packs: dict[int, tuple[tuple, packing.Pack]] = {}
        self._vllm: ipc_vllm.VLLMIPCReceiver | None = None  # set when init_info was vLLM's shape
        # _parse's last full parse: the raw names, dtypes and shapes lists, and the message they were part of.
        self._last_parsed: tuple[list, list, list, IPCUpdateInfo] | None = None
        self._layout: tuple[list | None, tuple] = (None, ())  # plan_update's last: (names list, its layout)

    # ---- init ----------------------------------------------------------------------------------

    def parse_init_info(self, init_info: dict) -> IPCInitInfo | ipc_vllm.VLLMIPCInitInfo:
        if ipc_vllm.is_vllm_init_info(init_info):  # vLLM's trainer: {"packed": bool}, nothing to attach
            return parse_message(init_info, ipc_vllm.VLLMIPCInitInfo, "init_info")
        return super().parse_init_info(init_info)

    def check_init_info(self, init_info: IPCInitInfo) -> None:
        if init_info.host != device_key(torch.device("cpu")):
            raise ValueError(
                f"init_info.host: the trainer runs on host {init_info.host!r}, this engine on another; "
                "ipc needs one machine"
            )

    def rendezvous(self, init_info: IPCInitInfo) -> Rendezvous:
        if isinstance(init_info, ipc_vllm.VLLMIPCInitInfo):
            return Rendezvous(DEFAULT_INIT_TIMEOUT_S, "nobody (vLLM's ipc shape has no rendezvous)")
        # Same machine only (init_info.host is a boot id, not an address): init opens a shared-memory
        # segment and connects nowhere, so there is no host to check against the allowed hosts.
        return Rendezvous(init_info.timeout_s, f"the trainer's ipc control block {init_info.control}")

    def init_transfer(self, init_info: IPCInitInfo) -> None:
        if isinstance(init_info, ipc_vllm.VLLMIPCInitInfo):
            self._vllm = ipc_vllm.VLLMIPCReceiver(self.device, init_info, self.allow_pickled_ipc_handles)
            return
        self._control = _Control.attach(init_info.control, "init_info.control")
        self._settings = init_info

    # ---- one update_weights call ----------------------------------------------------------------

    def parse_update_info(self, update_info: dict) -> WeightUpdateInfo:
        if self._vllm is not None:
            return self._vllm.plan_update(update_info)
        return self.plan_update(self._parse(update_info))

    def _parse(self, update_info: dict) -> IPCUpdateInfo:
        """update_info parsed. A call whose tensor list is the last parsed one's (every sync of a recurring call) has
        only its other fields converted: hundreds of names, dtypes and shapes cost a conversion each, once."""
        last = self._last_parsed
        if (last is not None and type(update_info) is dict and update_info.keys() == _UPDATE_INFO_KEYS
                and update_info["names"] == last[0] and update_info["dtypes"] == last[1]
                and update_info["shapes"] == last[2]):
            rest = parse_message({key: update_info[key] for key in _CallFields.__struct_fields__}, _CallFields,
                                 "update_info")
            return replace_parsed(last[3], **{key: getattr(rest, key) for key in _CallFields.__struct_fields__})
        parsed = parse_message(update_info, IPCUpdateInfo, "update_info")
        if type(update_info) is dict and update_info.keys() == _UPDATE_INFO_KEYS:
            self._last_parsed = (update_info["names"], update_info["dtypes"], update_info["shapes"], parsed)
        return parsed

    def plan_update(self, update_info: IPCUpdateInfo) -> IPCWeightUpdate:
        control = self._require_control()
        where = "update_info"
        names, dtypes, shapes, slot = update_info.names, update_info.dtypes, update_info.shapes, update_info.slot
        if self._layout[0] is not names:  # a repeat (_parse) has the very lists of the last call: its layout too
            self._layout = (names, (tuple(names), tuple(dtypes), tuple(shapes)))
        layout = self._layout[1]
        cached = self._packs.get(slot)
        if cached is not None and cached[0][1] == update_info.buffer_size and cached[0][0] == layout:
            pack = cached[1]
        else:
            packs = packing.plan_packs([packing.nbytes_of(d, s) for d, s in zip(dtypes, shapes)], update_info.buffer_size)
            if len(packs) != 1:
                raise ValueError(
                    f"{where}.names: the tensors fill {len(packs)} buffers of {update_info.buffer_size} bytes; "
                    "a call carries one"
                )
            pack = packs[0]
            self._packs[slot] = ((layout, update_info.buffer_size), pack)
        if self.key not in update_info.buffer:
            raise ValueError(
                f"{where}.buffer: nothing for this worker's device {self.key!r} (the update has "
                f"{sorted(update_info.buffer)}); the ipc backend needs the trainer's sender and the engine worker "
                "on the same device"
            )
        where = f"{where}.buffer[{self.key!r}]"
        descriptor = update_info.buffer[self.key]
        if descriptor.slot != slot:
            raise ValueError(f"{where}.slot: {descriptor.slot}, but the call is for slot {slot}")
        if isinstance(descriptor.handle, CudaHandle) != (self.device.type == "cuda"):
            kind = "cuda" if isinstance(descriptor.handle, CudaHandle) else "shm"
            raise ValueError(f"{where}.handle.kind: {kind!r} on a {self.device.type} worker")
        if pack.nbytes > descriptor.capacity:
            raise ValueError(
                f"{where}.capacity: the pack spans bytes [0, {pack.nbytes}), beyond the buffer's {descriptor.capacity}"
            )
        mapped = self._map(descriptor, where, control)
        if layout not in mapped.views:
            if len(mapped.views) >= _MAX_VIEW_SETS:
                mapped.views.clear()
            mapped.views[layout] = (
                [packing.view_of(mapped.tensor, ps, dtypes[ps.index], shapes[ps.index]) for ps in pack.slots],
                _flat_view(mapped.tensor, pack, dtypes),
            )
        views, flat = mapped.views[layout]
        return IPCWeightUpdate(
            list(names), list(dtypes), list(shapes),
            # Fresh buffers every sync (keep_buffers False) never repeat a key, and a kept landing plan
            # would hold views of a released buffer, keeping its memory from the trainer: no key then.
            reuse_key=(slot, descriptor.gen, layout) if self._settings.keep_buffers else None,
            pack=pack, mapped=mapped, slot=slot, seq=update_info.seq, views=views, flat=flat,
        )

    def _map(self, descriptor: BufferDescriptor, where: str, control: _Control) -> _Mapped:
        """The opened buffer for `descriptor`, from the cache when this (slot, gen) was opened before."""
        mapped = self._mapped.get(descriptor.slot)
        if mapped is not None and mapped.descriptor.gen == descriptor.gen:
            if mapped.descriptor != descriptor:
                raise ValueError(
                    f"{where}: buffer (slot {descriptor.slot}, gen {descriptor.gen}) came before with another handle"
                )
            return mapped
        if mapped is not None and descriptor.gen < mapped.descriptor.gen:
            raise ValueError(f"{where}.gen: {descriptor.gen} is older than the slot's buffer {mapped.descriptor.gen}")
        if isinstance(descriptor.handle, ShmHandle):
            # Buffer names derive from the control block's, so a handle can only name this trainer's buffers.
            expected = f"{control.name.removesuffix('-ctl')}-{descriptor.slot}-{descriptor.gen}"
            if descriptor.handle.name != expected:
                raise ValueError(f"{where}.handle.name: {descriptor.handle.name!r}, expected {expected!r}")
            segment = _open_segment(descriptor.handle.name, descriptor.capacity, f"{where}.handle.name")
            tensor = torch.frombuffer(segment, dtype=torch.uint8)  # keeps the mapping alive
        else:
            try:
                tensor = _open_cuda(descriptor.handle, self.device)
            except RuntimeError as e:  # a well-formed handle that names no live export (stale, or from elsewhere)
                raise ValueError(f"{where}.handle: CUDA could not open it: {e}") from None
        if mapped is not None:  # the trainer replaced this slot's buffer (only now: a bad handle must not evict it)
            self._release(descriptor.slot)
        mapped = _Mapped(descriptor, tensor)
        self._mapped[descriptor.slot] = mapped
        control.set_opened(descriptor.slot, descriptor.gen)  # the export's reference is now ours to release
        return mapped

    def receive_weights(self, info: IPCWeightUpdate) -> Iterator[tuple[str, torch.Tensor]]:
        if isinstance(info, ipc_vllm.VLLMIPCWeightUpdate):
            yield from self._vllm.receive_weights(info)
            return
        control = self._require_control()
        control.set_taken(info.slot, info.seq)
        self._wait_ready(control, info.slot, info.seq, info.names[info.pack.slots[0].index])
        sync_trace.mark("engine: fill seen")
        buffer = info.mapped.tensor
        try:
            for pack_slot, view in zip(info.pack.slots, info.views):
                yield info.names[pack_slot.index], view
        finally:
            # The landing copies read the buffer on the current stream: done before the trainer may refill it.
            # (That stream only: the device's other work, such as an adapter's host copy of the sync before on
            # a side stream, has no part in this buffer.)
            if buffer.is_cuda:
                torch.cuda.current_stream(buffer.device).synchronize()

    def _wait_ready(self, control: _Control, slot: int, seq: int, first_name: str) -> None:
        """Returns once the trainer marked fill `seq` of `slot` complete; raises on abort, protocol error or timeout."""
        timeout_s = self._settings.timeout_s  # set with the control block
        where = f"ipc: buffer slot {slot} (pack {seq}, first tensor {first_name!r})"
        now = time.monotonic()
        deadline = now + timeout_s
        # Short sleeps: a pack takes the trainer well under a millisecond to fill on a GPU, and a long
        # back-off would add its overshoot to every sync (a call posted before its fill, as every one is,
        # usually arrives first); the engine has nothing else to do meanwhile. The shortest for the first
        # _SHORT_WAIT_S, then backing off.
        delay = 5e-5
        short_until = now + _SHORT_WAIT_S
        while True:
            if control.aborted:
                raise RuntimeError(f"{where}: the trainer abandoned the sync")
            ready = control.ready(slot)
            if ready == seq:
                return
            if ready > seq:
                raise RuntimeError(
                    f"{where}: the trainer already refilled the buffer (fill {ready}); calls out of order"
                )
            if time.monotonic() > deadline:
                message = f"{where}: not filled within timeout_s={timeout_s:g} s (trainer stalled or dead)"
                logger.warning("%s", message)
                raise TimeoutError(message)
            time.sleep(delay)
            if time.monotonic() > short_until:
                delay = min(delay * 2, 5e-4)

    # ---- lifecycle ---------------------------------------------------------------------------------

    def finish_update(self) -> None:
        if self._vllm is not None:
            self._vllm.finish_update()
        if self._settings is not None and not self._settings.keep_buffers:
            self._release_all()

    def abort_update(self) -> None:
        # A kept buffer stays mapped: the trainer reuses it, and each export may be opened only
        # once. A dead trainer's buffers go when the next trainer_init replaces this engine.
        self.finish_update()

    def shutdown(self) -> None:
        if self._vllm is not None:
            self._vllm.shutdown()
        self._release_all()
        if self._control is not None:
            self._control.close()
            self._control = None

    def _release(self, slot: int) -> None:
        """Drops the mapping of slot's buffer; CUDA: closing it gives the export's reference back."""
        self._mapped.pop(slot, None)

    def _release_all(self) -> None:
        for slot in list(self._mapped):
            self._release(slot)

    def _require_control(self) -> _Control:
        if self._control is None:
            raise RuntimeError("ipc: the transfer engine is not initialized (or already shut down)")
        return self._control


# =======================================================================================
# Trainer side
# =======================================================================================


class IPCTrainerInitInfo(TrainerInitInfo):
    """Settings of the ipc backend's trainer side: trainer_init(IPCTrainerInitInfo(...), client=...)."""

    backend: ClassVar[str] = "ipc"

    packed_buffer_size_bytes: int_in(packing.ALIGN) = 512 << 20
    """Bytes per ring buffer (tensors larger than this go through one extra buffer of their size)."""
    packed_num_buffers: int_in(1, _MAX_SLOTS - 1) = 2  # the oversize buffer takes one more slot
    """Ring buffers: one is filled while the engine copies out of the others; also the limit of calls in flight."""
    timeout_s: TimeoutS = 300.0
    """Limit of every wait on either side (an engine call, the engine waiting for a fill)."""
    keep_buffers: bool = True
    """True: buffers are exported and opened once and live until shutdown (fast syncs, device memory held
    between them). False: allocated, exported and opened for each sync and freed after it (nothing held
    between syncs, e.g. for an engine that sleeps; opening costs ~160 ms a buffer on CUDA)."""
    device: str | None = None
    """Where the buffers live (the device the engine worker uses); None: the device of the first tensor sent."""
    wire: Literal["ours", "vllm", "vllm_packed"] = "ours"
    """The update_info shape: ours (the ring of shared buffers, CPU or CUDA), or vLLM's (CUDA only, for a vLLM
    server or ours): "vllm" shares every tensor, "vllm_packed" one buffer of packed_buffer_size_bytes per call."""

    def check(self) -> None:
        if self.device is not None:
            try:
                kind = torch.device(self.device).type
            except (RuntimeError, TypeError) as e:
                raise ValueError(f".device: {self.device!r} is not a torch device ({e})") from None
            if kind not in ("cpu", "cuda"):
                raise ValueError(f".device: the ipc backend shares cuda or cpu memory, not {self.device!r}")
            if self.wire != "ours" and kind != "cuda":
                raise ValueError(f".wire: vLLM's ipc shape ({self.wire!r}) shares CUDA tensors, not {self.device!r} ones")


@dataclass
class _Buffer:
    """One buffer of the trainer's, exported once; `descriptor` is what update_info announces."""

    slot: int
    gen: int
    tensor: torch.Tensor  # uint8 [capacity], on the trainer's device
    descriptor: dict
    key: str = ""  # device_key of tensor's device, the key update_info publishes the descriptor under
    segment_name: str | None = None  # CPU
    cuda_ref: tuple[bytes, int] | None = None  # CUDA: (ref counter, offset) of the export
    # A pack's (offset, dtype, shape) per tensor -> typed views into `tensor` to copy them into:
    # a model's packs recur every sync, so the views are made once.
    views: dict[tuple, list[torch.Tensor]] = dataclasses.field(default_factory=dict)

    def views_for(self, pack: packing.Pack, metas: list[ParamMeta]) -> list[torch.Tensor]:
        key = tuple((s.offset, metas[s.index].dtype, metas[s.index].shape) for s in pack.slots)
        views = self.views.get(key)
        if views is None:
            if len(self.views) >= _MAX_VIEW_SETS:
                self.views.clear()
            views = self.views[key] = [packing.view_of(self.tensor, s, d, shape) for s, d, shape in
                                       ((s, metas[s.index].dtype, metas[s.index].shape) for s in pack.slots)]
        return views

    @property
    def capacity(self) -> int:
        return self.tensor.numel()

    @property
    def buffer_id(self) -> str:
        return f"{self.slot}.{self.gen}"


@dataclass
class _InFlight:
    """An update_weights call posted for fill `seq` of `slot`."""

    future: concurrent.futures.Future
    slot: int
    seq: int
    first_name: str


@dataclass
class _PlannedFill:
    """A one-pack sync of a source's fixed tensor list into one buffer, planned once: a fill is one multi-tensor
    copy from the list's tensors into their views, and the update_info is the same but for its seq."""

    pairs: list[tuple[str, torch.Tensor]]  # the source's list (held, so that its identity is not reused)
    pack: packing.Pack
    buffer: _Buffer
    dsts: list[torch.Tensor]  # the tensors' views into the buffer
    srcs: list[torch.Tensor]  # the list's tensors, as checked against the metadata
    specs: list[tuple[torch.dtype, torch.Size]]  # their dtypes and shapes then
    names: list[str]
    update_info: dict  # but "slot" and "seq" (_call_layout)

    def check(self) -> None:
        """Refuses, naming it, a tensor whose dtype or shape changed since the plan (its .data replaced)."""
        specs = [(t.dtype, t.shape) for t in self.srcs]
        if specs != self.specs:
            i = next(i for i, (now, then) in enumerate(zip(specs, self.specs)) if now != then)
            raise ValueError(f"source: {self.names[i]!r} is now {specs[i][0]} {list(specs[i][1])}, "
                             f"not the {self.specs[i][0]} {list(self.specs[i][1])} of the metadata")

    def fill(self, buffer: _Buffer) -> None:
        """The tensors' current values into the buffer (check() passed); complete on return."""
        with torch.no_grad():  # a source's tensors may be parameters that require grad
            torch._foreach_copy_(self.dsts, self.srcs)
        if buffer.tensor.is_cuda:  # `ready` must not be set before the device copies are done
            torch.cuda.current_stream(buffer.tensor.device).synchronize()


class _PeekedSource:
    """iter_full() with the next item visible: the buffers' device is that of the first tensor."""

    def __init__(self, items: Iterator[tuple[str, torch.Tensor]]) -> None:
        self._items = items
        self._next: tuple[str, torch.Tensor] | None = None

    def peek(self) -> tuple[str, torch.Tensor]:
        if self._next is None:
            self._next = next(self._items)
        return self._next

    def pop(self) -> tuple[str, torch.Tensor]:
        item = self.peek()
        self._next = None
        return item

    def drain(self) -> None:
        self._next = None
        for _ in self._items:
            pass


class IPCTrainerWeightTransferEngine(TrainerWeightTransferEngine[IPCTrainerInitInfo]):
    """Trainer side of "ipc": rank 0 packs into shared buffers and drives the engine; other ranks only gather."""

    backend: ClassVar[str] = "ipc"

    def __init__(self, init_info: IPCTrainerInitInfo, client, source: WeightSource | None, rank: int) -> None:
        super().__init__(init_info, client, source, rank)
        self.config: IPCTrainerInitInfo = init_info
        self._token = f"{os.getpid()}-{secrets.token_hex(6)}"
        self._control: _Control | None = None
        self._buffers: dict[int, _Buffer] = {}  # slot -> buffer
        self._device = _concrete(torch.device(init_info.device)) if init_info.device else None  # None: the source's
        self._next_gen = 1
        self._next_seq = 1
        self._next_ring = 0
        self._closed = False
        self.num_exports = 0  # buffers exported so far (each costs an export here and an open in the engine)
        self._plans: list[tuple[list[ParamMeta], tuple]] = []  # _plan's: (a source's metadata, its plan)
        self._planned_fills: list[_PlannedFill] = []  # _planned's, the last two

    # ---- set-up ----------------------------------------------------------------------------------

    @classmethod
    def _start(cls, init_info: IPCTrainerInitInfo, *, client, source) -> IPCTrainerWeightTransferEngine:
        if init_info.wire != "ours":  # vLLM's shape: its own engine (weight_transfer/ipc_vllm.py)
            return ipc_vllm.VLLMShapeIPCTrainer._start(init_info, client=client, source=source)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        engine = cls(init_info, client, source, rank)
        if rank == 0:
            engine._connect()
        return engine

    def _connect(self) -> None:
        num_workers = self._bounded("get_world_size", self.client.get_world_size)
        if num_workers != 1:
            raise ValueError(
                f"ipc: the engine has {num_workers} workers; the sender shares buffers on its own device only, "
                "so the engine must be one worker colocated with trainer rank 0"
            )
        self._control = _Control.create(f"wt-ipc-{self._token}-ctl")
        try:
            self._bounded(
                "init_weight_transfer_engine",
                self.client.init_weight_transfer_engine,
                {
                    "backend": "ipc",
                    "control": self._control.name,
                    "host": device_key(torch.device("cpu")),
                    "timeout_s": float(self.config.timeout_s),
                    "keep_buffers": self.config.keep_buffers,
                },
            )
        except BaseException:
            self._control.close()
            self._control = None
            raise

    # ---- one sync ------------------------------------------------------------------------------------

    def send_weights(self, source=None, *, weight_version: str | None = None) -> SyncStats:
        if self._closed:
            raise RuntimeError("ipc: send_weights after shutdown")
        try:
            return super().send_weights(source, weight_version=weight_version)
        finally:
            if not self.config.keep_buffers:  # the engine let them go at finish (or abort) of the update
                self._free_buffers()

    def _follow(self, source: WeightSource) -> SyncStats:
        start = time.perf_counter()
        metas = source.metadata
        if _gathers(metas):  # rank 0's pass gathers sharded tensors: every rank takes part
            for _ in source.iter_full():
                pass
        return SyncStats(backend=self.backend, num_tensors=len(metas), dense_bytes=sum(m.nbytes for m in metas),
                         seconds=time.perf_counter() - start)

    def _send(self, source: WeightSource) -> SyncStats:
        metas = source.metadata
        packs, tensor_list, dense_bytes = self._plan(metas)
        exports_before = self.num_exports
        self._sync(metas, packs, tensor_list, _PeekedSource(iter(source.iter_full())))
        return self._stats(metas, packs, dense_bytes, exports_before)

    def _send_in_one_call(self, source: WeightSource, post: Callable[[dict], Callable[[], None]]) -> SyncStats | None:
        """A sync of one pack: its apply_weight_update is posted before the fill, as _sync posts an update_weights
        call (the call's way to the engine and the engine's start overlap the copy; it waits for `ready`)."""
        metas = source.metadata
        packs, tensor_list, dense_bytes = self._plan(metas)
        if len(packs) != 1:
            return None
        (pack,) = packs
        control = self._require_control()
        exports_before = self.num_exports
        pairs = source.plain_tensors()
        items = _PeekedSource(iter(source.iter_full()))
        control.set_aborted(False)
        wait = None
        where = "before the first pack"
        try:
            # Nothing is in flight between syncs: the ring's first buffer (or the oversize one), every time, so
            # that one-call syncs export and open one buffer, not one per ring slot.
            slot = self.config.packed_num_buffers if pack.nbytes > self.config.packed_buffer_size_bytes else 0
            buffer = self._buffer(slot, pack.nbytes, self._buffer_device(items))
            planned = self._planned(pairs, pack, buffer, metas, tensor_list) if pairs is not None else None
            if planned is not None:
                # Before the post: a refused source then never reaches the engine (no call to abort), and the
                # call's way out (the client's thread encoding and sending it) does not wait on this per-tensor
                # Python for the GIL; the fill after the post is one multi-tensor copy.
                planned.check()
            update_info = self._update_info(pack, tensor_list, slot, buffer, planned)
            where = f"the pack starting at {metas[pack.slots[0].index].name!r}"
            wait = post(update_info)
            if planned is not None:
                planned.fill(buffer)
            else:
                self._fill(buffer, pack, metas, items)
            control.set_ready(slot, update_info["seq"])
            sync_trace.mark("trainer: buffer filled")
            where = "the engine's apply_weight_update"
            wait()
        except BaseException as e:
            if wait is not None:
                control.set_aborted(True)  # an engine waiting for the fill raises now instead of at its timeout
                if where != "the engine's apply_weight_update":
                    try:
                        wait()  # the call ends (failed) before the trainer may touch the buffer again
                    except Exception as late:  # the first error is the one reported; this follows from it
                        logger.info("ipc: the apply_weight_update call ended with %s", str(late))
            if _gathers(metas):
                _drain_quietly(items)
            if isinstance(e, Exception) and not isinstance(e, TimeoutError):
                raise RuntimeError(f"ipc: send_weights failed at {where}: {type(e).__name__}: {e}") from e
            raise
        return self._stats(metas, packs, dense_bytes, exports_before)

    def _stats(self, metas: list[ParamMeta], packs: list[packing.Pack], dense_bytes: int,
               exports_before: int) -> SyncStats:
        # Each byte crosses once: the trainer's copy into the shared buffer.
        stats = SyncStats(backend=self.backend, num_tensors=len(metas), bytes_sent=dense_bytes, dense_bytes=dense_bytes)
        stats.extra.update(num_packs=len(packs), buffer_ids=self.buffer_ids, num_exports=self.num_exports - exports_before)
        return stats

    def _planned(self, pairs: list[tuple[str, torch.Tensor]], pack: packing.Pack, buffer: _Buffer,
                 metas: list[ParamMeta], tensor_list: dict) -> _PlannedFill | None:
        """The planned fill of a source's fixed tensor list (WeightSource.plain_tensors) into `buffer`, checked
        against the metadata and made once per (list, pack, buffer); None for a list of tensors on several devices."""
        for planned in self._planned_fills:
            if planned.pairs is pairs and planned.pack is pack and planned.buffer is buffer:
                return planned
        srcs = []
        for meta, (name, tensor) in zip(metas, pairs, strict=True):
            if name != meta.name or tensor.dtype != meta.dtype or tensor.shape != meta.shape:
                raise ValueError(
                    f"source: iter_full yielded {name!r} {tensor.dtype} {list(tensor.shape)} where the metadata has "
                    f"{meta.name!r} {meta.dtype} {list(meta.shape)}"
                )
            srcs.append(tensor)
        if any(t.device != buffer.tensor.device for t in srcs):
            return None
        planned = _PlannedFill(pairs, pack, buffer, buffer.views_for(pack, metas), srcs,
                               [(t.dtype, t.shape) for t in srcs], [m.name for m in metas],
                               self._call_layout(pack, tensor_list, buffer))
        self._planned_fills = [planned, *self._planned_fills[:1]]  # a model's and its adapter's
        return planned

    def _update_info(self, pack: packing.Pack, tensor_list: dict, slot: int, buffer: _Buffer,
                     planned: _PlannedFill | None = None) -> dict:
        """The update_info of the pack's next fill of `slot`'s buffer (a fresh seq); a planned fill's made once."""
        seq = self._next_seq
        self._next_seq += 1
        return {**(planned.update_info if planned is not None else self._call_layout(pack, tensor_list, buffer)),
                "slot": slot, "seq": seq}

    def _call_layout(self, pack: packing.Pack, tensor_list: dict, buffer: _Buffer) -> dict:
        """An update_info's parts that stay while the pack and buffer do: the tensors, the buffer size, the buffer."""
        return {
            **{key: [values[s.index] for s in pack.slots] for key, values in tensor_list.items()},
            "buffer_size": self.config.packed_buffer_size_bytes,
            "buffer": {buffer.key: buffer.descriptor},
        }

    @property
    def buffer_ids(self) -> list[str]:
        """ "slot.generation" of every live buffer; the same ids across syncs mean the same exports, reused."""
        return [self._buffers[slot].buffer_id for slot in sorted(self._buffers)]

    def _plan(self, metas: list[ParamMeta]) -> tuple[list[packing.Pack], dict, int]:
        """The packs, the tensor list and the bytes of a source's tensors, made once per source.

        A source's metadata is one list that never changes (WeightSource.metadata is cached), so it is
        known by identity; the plan of the last two sources is kept (a model's and its adapter's)."""
        limit = self.config.packed_buffer_size_bytes
        for cached_metas, plan in self._plans:
            if cached_metas is metas:
                return plan
        packs = packing.plan_packs([m.nbytes for m in metas], limit)
        tensor_list = packing.tensor_list([m.name for m in metas], [m.dtype for m in metas], [m.shape for m in metas])
        plan = (packs, tensor_list, sum(m.nbytes for m in metas))
        self._plans = [(metas, plan), *self._plans[:1]]  # holds the list: its id is not reused meanwhile
        return plan

    def _sync(self, metas: list[ParamMeta], packs: list[packing.Pack], tensor_list: dict, items: _PeekedSource) -> None:
        """Every pack into a buffer and its update_weights call, each call answered; on a failure the
        engine's waits are stopped and its calls ended (the base class then aborts the update)."""
        control = self._require_control()
        limit = self.config.packed_buffer_size_bytes
        capacity = {  # ring buffers and the oversize buffer: as large as this sync's largest pack of each kind
            False: max((p.nbytes for p in packs if p.nbytes <= limit), default=0),
            True: max((p.nbytes for p in packs if p.nbytes > limit), default=0),
        }
        control.set_aborted(False)
        pending: dict[int, _InFlight] = {}  # slot -> the update_weights call reading it
        where = "before the first pack"
        try:
            for pack in packs:
                first_name = metas[pack.slots[0].index].name
                where = f"the pack starting at {first_name!r}"
                slot = self._claim_slot(pack.nbytes > limit, pending)
                buffer = self._buffer(slot, capacity[pack.nbytes > limit], self._buffer_device(items))
                update_info = self._update_info(pack, tensor_list, slot, buffer)
                seq = update_info["seq"]
                # Posted before the fill: the call's round trip overlaps the copy; the engine waits for `ready`.
                future = self.client.submit("update_weights", update_info)
                pending[slot] = _InFlight(future, slot, seq, first_name)
                self._fill(buffer, pack, metas, items)
                control.set_ready(slot, seq)
            where = "waiting for the engine"
            while pending:
                self._wait_call(pending.pop(next(iter(pending))))
        except BaseException as e:
            # A call posted after the engine already aborted fails with "no update in progress";
            # the failure worth reporting is the earlier call's, if one already came back failed.
            e = _earliest_engine_failure(pending) or e
            self._abandon(pending, items, metas, e)
            if isinstance(e, Exception) and not isinstance(e, TimeoutError):
                raise RuntimeError(f"ipc: send_weights failed at {where}: {type(e).__name__}: {e}") from e
            raise e

    def _claim_slot(self, oversize: bool, pending: dict[int, _InFlight]) -> int:
        """The slot for the next pack, once no call reads it and fewer than packed_num_buffers are in flight."""
        if oversize:
            slot = self.config.packed_num_buffers  # the slot after the ring
        else:
            slot = self._next_ring
            self._next_ring = (self._next_ring + 1) % self.config.packed_num_buffers
        if slot in pending:
            self._wait_call(pending.pop(slot))
        while len(pending) >= self.config.packed_num_buffers:
            self._wait_call(pending.pop(next(iter(pending))))  # the oldest call
        return slot

    def _buffer_device(self, items: _PeekedSource) -> torch.device:
        if self._device is None:  # the source's device: a peek at the first tensor
            self._device = _concrete(items.peek()[1].device)
        return self._device

    def _fill(self, buffer: _Buffer, pack: packing.Pack, metas: list[ParamMeta], items: _PeekedSource) -> None:
        """Copies the pack's tensors (pulled one at a time from the source) into `buffer`; complete on return.

        Copies go in batches (one multi-tensor copy per _FILL_BATCH_BYTES of source tensors) into views
        made once per pack: per-tensor launches and views dominated small models' syncs, and a batch
        bounds what a gathering source keeps alive."""
        views = buffer.views_for(pack, metas)
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        held = 0

        def flush() -> None:
            nonlocal held
            if srcs and all(t.device == buffer.tensor.device for t in srcs):
                torch._foreach_copy_(dsts, srcs)
            else:
                for dst, src in zip(dsts, srcs):
                    dst.copy_(src, non_blocking=True)
            dsts.clear()
            srcs.clear()
            held = 0

        for pack_slot, view in zip(pack.slots, views):
            meta = metas[pack_slot.index]
            try:
                name, tensor = items.pop()
            except Exception as e:
                raise RuntimeError(f"reading {meta.name!r} from the source failed: {type(e).__name__}: {e}") from e
            if name != meta.name or tensor.dtype != meta.dtype or tensor.shape != meta.shape:
                raise ValueError(
                    f"source: iter_full yielded {name!r} {tensor.dtype} {list(tensor.shape)} where the metadata has "
                    f"{meta.name!r} {meta.dtype} {list(meta.shape)}"
                )
            dsts.append(view)
            srcs.append(tensor)
            held += pack_slot.nbytes
            if held >= _FILL_BATCH_BYTES:
                flush()
        flush()
        if buffer.tensor.is_cuda:  # `ready` must not be set before the device copies are done
            torch.cuda.current_stream(buffer.tensor.device).synchronize()

    def _wait_call(self, call: _InFlight) -> None:
        try:
            call.future.result(timeout=self.config.timeout_s)
        except concurrent.futures.TimeoutError:
            started = self._control is not None and self._control.taken(call.slot) == call.seq
            raise TimeoutError(
                f"ipc: update_weights for the pack starting at {call.first_name!r} did not return within "
                f"timeout_s={self.config.timeout_s:g} s; the engine "
                + ("was reading it (stalled?)" if started else "never started on it (dead, or busy with another call?)")
            ) from None

    def _abandon(
        self, pending: dict[int, _InFlight], items: _PeekedSource, metas: list[ParamMeta], error: BaseException
    ) -> None:
        """After a failure on rank 0: stop the engine's waits and let its calls end (then it is told to abort)."""
        # Log strings, not exceptions: a log record would keep the traceback's frames (and their tensors) alive.
        control = self._require_control()
        control.set_aborted(True)  # an engine waiting for a fill raises now instead of at its timeout
        for call in pending.values():
            try:
                call.future.result(timeout=self.config.timeout_s)
            except Exception as e:  # the first error is the one reported; these follow from it
                logger.info("ipc: the call for the pack starting at %r ended with %s", call.first_name, str(e))
        logger.warning("ipc: sync failed (%s); the engine will be told to abort the update", str(error))
        if _gathers(metas):
            _drain_quietly(items)

    # ---- buffers ---------------------------------------------------------------------------------------

    def _buffer(self, slot: int, capacity: int, device: torch.device) -> _Buffer:
        """Slot's buffer, allocated and exported unless a live one is large enough (reuse is the point)."""
        capacity = max(capacity, packing.ALIGN)
        buffer = self._buffers.get(slot)
        if buffer is not None and buffer.capacity >= capacity and buffer.tensor.device == device:
            return buffer
        if buffer is not None:
            self._free(buffer)
        gen = self._next_gen
        self._next_gen += 1
        if device.type == "cuda":
            tensor = torch.empty(capacity, dtype=torch.uint8, device=device)
            handle, cuda_ref = _export_cuda(tensor)
            buffer = _Buffer(slot, gen, tensor, {}, cuda_ref=cuda_ref)
        else:
            name = f"wt-ipc-{self._token}-{slot}-{gen}"
            tensor = torch.frombuffer(_create_segment(name, capacity), dtype=torch.uint8)
            handle = {"kind": "shm", "name": name}
            buffer = _Buffer(slot, gen, tensor, {}, segment_name=name)
        buffer.descriptor = {"slot": slot, "gen": gen, "capacity": capacity, "handle": handle}
        buffer.key = device_key(tensor.device)
        self._buffers[slot] = buffer
        self.num_exports += 1
        return buffer

    def _free(self, buffer: _Buffer) -> None:
        """Lets a buffer go. The engine must have released it (finish/shutdown) or never opened it."""
        self._buffers.pop(buffer.slot, None)
        self._planned_fills = [p for p in self._planned_fills if p.buffer is not buffer]  # they hold its views
        control = self._control
        opened = control is not None and control.opened(buffer.slot) >= buffer.gen
        if buffer.cuda_ref is not None and not opened:
            # Never opened by the engine: give the export's reference back ourselves, or the memory stays in limbo.
            torch.UntypedStorage._release_ipc_counter(*buffer.cuda_ref, device=buffer.tensor.device)
        device = buffer.tensor.device
        buffer.tensor = torch.empty(0, dtype=torch.uint8)  # drops the mapping / the storage
        if buffer.segment_name is not None:
            _unlink_segment(buffer.segment_name)
        if device.type == "cuda":
            torch.cuda.ipc_collect()  # frees exported blocks whose last importer has closed them

    def _free_buffers(self) -> None:
        for buffer in list(self._buffers.values()):
            self._free(buffer)

    # ---- teardown ------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Rank 0: the engine drops its mappings first, then the buffers and the control block go. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.rank != 0:
            return
        if self._control is not None:
            try:
                self._bounded("shutdown_weight_transfer_engine", self.client.shutdown_weight_transfer_engine)
            except Exception as e:  # still free ours; an engine that is gone holds nothing of consequence
                logger.warning("ipc: shutdown_weight_transfer_engine failed: %s", str(e))
        self._free_buffers()
        if self._control is not None:
            self._control.close()
            self._control = None

    def _require_control(self) -> _Control:
        if self._control is None:
            raise RuntimeError("ipc: not connected (trainer_init failed, or shut down)")
        return self._control


def _earliest_engine_failure(pending: dict[int, "_InFlight"]) -> BaseException | None:
    """The error of the oldest in-flight call that already failed in the engine's transfer, if any."""
    for call in pending.values():  # insertion order: oldest first
        if call.future.done() and call.future.exception() is not None:
            error = call.future.exception()
            if "weight transfer failed" in str(error):
                return error
    return None


def _drain_quietly(items: _PeekedSource) -> None:
    """After a failure on rank 0 of a gathering source: the other ranks gather with us, so the pass is finished
    for them not to be left waiting."""
    try:
        items.drain()
    except Exception as e:  # the source itself failed; the other ranks see that too
        logger.info("ipc: draining the source after the failure: %s", str(e))


def _gathers(metas: list[ParamMeta]) -> bool:
    """Whether a full pass over a source with these tensors needs every rank (sharded tensors are gathered)."""
    return any(m.sharded for m in metas)


def _flat_view(buffer: torch.Tensor, pack: packing.Pack, dtypes: Sequence[torch.dtype]) -> torch.Tensor | None:
    """The pack's tensors as one flat tensor of their dtype, when they lie end to end from the buffer's start in one
    dtype (no alignment gap: an adapter's tensors usually do); else None."""
    if not pack.slots:
        return None
    dtype = dtypes[pack.slots[0].index]
    end = 0
    for ps in pack.slots:
        if ps.offset != end or dtypes[ps.index] != dtype:
            return None
        end += ps.nbytes
    return buffer[:end].view(dtype)


def _concrete(device: torch.device) -> torch.device:
    """cuda -> cuda:<current index>, so that devices compare equal."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


__all__ = [
    "IPCTrainerInitInfo",
    "IPCTrainerWeightTransferEngine",
    "IPCWeightTransferEngine",
    "device_key",
]
