"""vLLM 0.33's shape of the "ipc" backend: our engine side reads it, our trainer side can write it.

vLLM's trainer shares CUDA tensors with torch's own CUDA IPC (torch.multiprocessing.reductions):
for each tensor (or, packed, for one uint8 buffer per call) it sends the argument tuple of
rebuild_cuda_tensor, keyed by the uuid of the GPU it lives on, and keeps the tensors alive until
the update is finished.

    init_info:    {"packed": bool}                                     (vLLM's IPCWeightTransferInitInfo)
    update_info:  {"names": [...], "dtype_names": [...], "shapes": [[...], ...],
                   "ipc_handles": [{uuid: args}, ...]    unpacked: one per tensor
                                | {uuid: args}           packed: the buffer holding the call's tensors
                   "ipc_handles_pickled": "<base64>",    instead of ipc_handles: the same, pickled (HTTP)
                   "tensor_sizes": [bytes, ...]}         packed: each tensor's bytes, back to back
    args:         (tensor_cls, size, stride, tensor_offset, storage_cls, dtype, device index, handle,
                   storage_size_bytes, storage_offset_bytes, requires_grad, ref_counter_handle,
                   ref_counter_offset, event_handle, event_sync_required)

ipc_handles itself is Python objects (classes, bytes, torch.Size), so it only travels in-process or
over Ray; over HTTP vLLM pickles it (our trainer always does). Nothing here unpickles unless the operator opted in
(WeightTransferConfig.weight_transfer_allow_pickled_ipc_handles, vLLM's switch being
VLLM_ALLOW_INSECURE_SERIALIZATION=1); without it ipc_handles_pickled is a ValueError (HTTP 400)
naming the field and the flag. With it the pickle goes through safe_pickle with PICKLE_ALLOWED:
the globals an args tuple holds (torch.Tensor and nn.Parameter, torch.Size, the two storage classes,
the dtypes), of which only torch.Size may be called, by a stand-in that takes a short tuple of ints;
the classes come back as inert names and only become classes after the whole tuple is checked
(no BUILD, INST, OBJ or NEWOBJ opcode is admitted either, so nothing else is made or changed)
(check_args). rebuild_cuda_tensor itself is never in the pickle: we call it, on checked args,
with this worker's device index in slot 6 (as vLLM does), when the tensors are received.

Which dict entry a worker uses is its GPU's uuid, str(torch.cuda.get_device_properties(i).uuid),
the same key vLLM's worker looks up. Our own ipc shape (weight_transfer/ipc.py: shared memory on CPU,
a ring of exported buffers, a control block) stays the default; this shape is for vLLM's trainers
(engine side) and for vLLM servers (trainer side, IPCTrainerInitInfo(wire="vllm")).
"""

from __future__ import annotations

import base64
import binascii
import math
import pickle
import pickletools
import reprlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

import msgspec
import torch

from weight_transfer import packing
from weight_transfer.base import SyncStats, TrainerInitInfo, TrainerWeightTransferEngine, WeightSource, WeightUpdateInfo
from weight_transfer.messages import INT64_MAX, Message, NonEmptyStr, NonNegInt, parse_message

FLAG = "--weight-transfer-allow-pickled-ipc-handles"  # WeightTransferConfig.weight_transfer_allow_pickled_ipc_handles
_MAX_PICKLED_CHARS = 64 << 20  # base64 of a few hundred thousand handles
_MAX_PICKLE_BYTES = _MAX_PICKLED_CHARS // 4 * 3
_MAX_BYTES = 4096  # a CUDA IPC handle is 64 bytes, a ref-counter handle a short file name
_MAX_DIMS = 64  # torch's limit on a tensor's dimensions
_NUM_ARGS = 15  # rebuild_cuda_tensor's parameters

# init_info keys of vLLM's shape (IPCWeightTransferInitInfo has just `packed`; "backend" is ours)
VLLM_INIT_KEYS = frozenset({"backend", "packed"})


def is_vllm_init_info(init_info: Any) -> bool:
    """Whether an ipc init_info is vLLM's shape ({"packed": bool}, or {}) rather than ours (a control block)."""
    return isinstance(init_info, dict) and set(init_info) <= VLLM_INIT_KEYS


# =======================================================================================
# The allow-list: what a pickled args tuple may name
# =======================================================================================


@dataclass(frozen=True)
class _Name:
    """What a pickled class comes back as: its name only (not callable, so no pickle opcode can run it)."""

    module: str
    qualname: str


_TENSOR_CLASSES = {_Name("torch", "Tensor"): torch.Tensor, _Name("torch.nn.parameter", "Parameter"): torch.nn.Parameter}
_STORAGE_CLASSES = {_Name("torch.storage", "TypedStorage"): torch.storage.TypedStorage,
                    _Name("torch.storage", "UntypedStorage"): torch.UntypedStorage}
# Every dtype under the name it pickles as (torch.float32 -> the global torch.float32).
_DTYPES = {packing.dtype_name(d): d for d in (getattr(torch, n) for n in dir(torch)) if isinstance(d, torch.dtype)}


def _size(dims: Any = ()) -> torch.Size:
    """The stand-in for torch.Size, the one callable a pickle may call: a short tuple of ints, nothing else."""
    if type(dims) is not tuple or len(dims) > _MAX_DIMS or not all(
            type(d) is int and 0 <= d <= INT64_MAX for d in dims):
        raise ValueError(f"torch.Size takes up to {_MAX_DIMS} non-negative ints, not {_shown(dims)}")
    return torch.Size(dims)


PICKLE_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch", "Size"): _size,
    **{(n.module, n.qualname): n for n in (*_TENSOR_CLASSES, *_STORAGE_CLASSES)},
    **{("torch", name): dtype for name, dtype in _DTYPES.items()},
}
"""(module, qualname) -> what safe_pickle hands back for it: everything a pickled ipc_handles may name."""


# =======================================================================================
# Messages
# =======================================================================================


class VLLMIPCInitInfo(Message):
    """vLLM's ipc init_info: whether the trainer packs each call's tensors into one buffer."""

    backend: str | None = None  # ours: set when the client names the backend, absent from vLLM's
    packed: bool = False


class VLLMIPCUpdateInfo(Message):
    """vLLM's ipc update_info (IPCWeightTransferUpdateInfo); ipc_handles is checked by check_handles."""

    names: list[NonEmptyStr]
    dtype_names: list[torch.dtype]
    shapes: list[tuple[NonNegInt, ...]]
    ipc_handles: Any = None  # Python objects (in-process callers); their checks are check_handles'
    ipc_handles_pickled: Annotated[str, msgspec.Meta(max_length=_MAX_PICKLED_CHARS)] | None = None
    tensor_sizes: list[NonNegInt] | None = None

    def check(self) -> None:
        if self.ipc_handles_pickled is not None and self.ipc_handles is not None:
            raise ValueError(".ipc_handles_pickled: give ipc_handles or ipc_handles_pickled, not both")
        if self.ipc_handles_pickled is None and self.ipc_handles is None:
            raise ValueError(".ipc_handles: missing (vLLM's ipc shape needs ipc_handles or ipc_handles_pickled)")
        for field in ("dtype_names", "shapes"):
            if len(getattr(self, field)) != len(self.names):
                raise ValueError(f".{field}: {len(getattr(self, field))} entries for {len(self.names)} names")
        if self.tensor_sizes is not None and len(self.tensor_sizes) != len(self.names):
            raise ValueError(f".tensor_sizes: {len(self.tensor_sizes)} entries for {len(self.names)} names")


@dataclass(frozen=True)
class RebuildArgs:
    """A checked args tuple of rebuild_cuda_tensor: the real classes in place of their names."""

    args: tuple  # the 15 arguments, slot 6 (the device index) as the sender wrote it

    @property
    def dtype(self) -> torch.dtype:
        return self.args[5]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.args[1])

    def on(self, device_index: int) -> tuple:
        """The arguments with this worker's device index in slot 6 (the sender's numbering may differ)."""
        return self.args[:6] + (device_index,) + self.args[7:]


def decode_pickled(text: str, allowed: bool, where: str = "update_info.ipc_handles_pickled") -> Any:
    """ipc_handles from vLLM's base64 pickle, only if the operator allowed it, through the allow-list."""
    if not allowed:
        raise ValueError(
            f"{where}: refusing to unpickle what a client sent; vLLM's pickled ipc handles are read only "
            f"when the engine is started with {FLAG} (weight_transfer_allow_pickled_ipc_handles; vLLM's "
            "switch is VLLM_ALLOW_INSECURE_SERIALIZATION=1)"
        )
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{where}: not valid base64") from None
    _check_opcodes(raw, where)
    from weight_transfer import safe_pickle  # (imported when a pickle is read: the rest of ipc needs none)

    return safe_pickle.loads(raw, PICKLE_ALLOWED, what=where, max_bytes=_MAX_PICKLE_BYTES)


# The opcodes of a pickled ipc_handles (lists, dicts, tuples, ints, bytes, strings, globals, torch.Size(...)):
# no BUILD, INST, OBJ or NEWOBJ, so no object is made or changed except by the stand-ins PICKLE_ALLOWED hands back.
_DATA_OPCODES = frozenset({
    "PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK", "DUP", "NONE", "NEWTRUE", "NEWFALSE",
    "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4",
    "STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8",
    "BINBYTES", "SHORT_BINBYTES", "BINBYTES8",
    "EMPTY_LIST", "APPEND", "APPENDS", "LIST", "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3",
    "EMPTY_DICT", "DICT", "SETITEM", "SETITEMS",
    "GET", "BINGET", "LONG_BINGET", "PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE",
    "GLOBAL", "STACK_GLOBAL", "REDUCE",
})


def _check_opcodes(raw: bytes, where: str) -> None:
    if len(raw) > _MAX_PICKLE_BYTES:
        raise ValueError(f"{where}: pickle of {len(raw)} bytes is over the {_MAX_PICKLE_BYTES}-byte limit")
    refused = None
    try:
        for opcode, _arg, pos in pickletools.genops(raw):
            if opcode.name not in _DATA_OPCODES:
                refused = f"{opcode.name} at byte {pos}"
                break
    except Exception as e:  # a truncated or garbled stream
        raise ValueError(f"{where}: not a readable pickle ({type(e).__name__}: {e})") from None
    if refused is not None:
        raise ValueError(f"{where}: refused pickle opcode {refused} (ipc handles are plain data)")


def check_args(args: Any, where: str) -> RebuildArgs:
    """One rebuild_cuda_tensor args tuple, every slot's type and range checked; ValueError naming the slot."""
    if type(args) not in (tuple, list) or len(args) != _NUM_ARGS:
        raise ValueError(f"{where}: expected rebuild_cuda_tensor's {_NUM_ARGS} arguments, got {_shown(args)}")
    (tensor_cls, size, stride, tensor_offset, storage_cls, dtype, device, handle, storage_size, storage_offset,
     requires_grad, ref_counter, ref_counter_offset, event, event_sync) = args
    tensor_cls = _class(tensor_cls, _TENSOR_CLASSES, f"{where}[0] (tensor class)")
    storage_cls = _class(storage_cls, _STORAGE_CLASSES, f"{where}[4] (storage class)")
    size = _ints(size, f"{where}[1] (size)")
    stride = _ints(stride, f"{where}[2] (stride)")
    for i, value in ((3, tensor_offset), (6, device), (8, storage_size), (9, storage_offset), (12, ref_counter_offset)):
        if type(value) is not int or not 0 <= value <= INT64_MAX:
            raise ValueError(f"{where}[{i}]: expected a non-negative int, got {_shown(value)}")
    if type(dtype) is not torch.dtype:
        raise ValueError(f"{where}[5] (dtype): expected a torch dtype, got {_shown(dtype)}")
    for i, value, optional in ((7, handle, False), (11, ref_counter, False), (13, event, True)):
        if not (type(value) is bytes and 0 < len(value) <= _MAX_BYTES or optional and value is None
                or optional and value == b""):
            raise ValueError(f"{where}[{i}]: expected a CUDA IPC handle (1 to {_MAX_BYTES} bytes), got {_shown(value)}")
    for i, value in ((10, requires_grad), (14, event_sync)):
        if type(value) is not bool:
            raise ValueError(f"{where}[{i}]: expected a bool, got {_shown(value)}")
    if len(stride) != len(size):
        raise ValueError(f"{where}[2] (stride): {len(stride)} strides for {len(size)} dimensions")
    expected = 1
    for dim, (n, s) in reversed(list(enumerate(zip(size, stride)))):
        if n != 1 and s != expected:  # contiguous, as vLLM sends them (a size-1 dimension's stride is free)
            raise ValueError(f"{where}[2] (stride): {list(stride)} is not contiguous for size {list(size)}")
        expected *= n
    extent = (tensor_offset + math.prod(size)) * dtype.itemsize
    if math.prod(size) and extent > storage_size:
        raise ValueError(f"{where}[8] (storage_size_bytes): the tensor reaches byte {extent}, "
                         f"beyond the storage's {storage_size}")
    return RebuildArgs((tensor_cls, torch.Size(size), tuple(stride), tensor_offset, storage_cls, dtype, device, handle,
                        storage_size, storage_offset, requires_grad, ref_counter, ref_counter_offset, event,
                        event_sync))


def _class(value: Any, known: dict[_Name, type], where: str) -> type:
    if isinstance(value, _Name) and value in known:
        return known[value]
    if isinstance(value, type) and value in known.values():  # a Python caller's ipc_handles: the class itself
        return value
    raise ValueError(f"{where}: expected one of {sorted(c.__name__ for c in known.values())}, got {_shown(value)}")


def _ints(value: Any, where: str) -> tuple[int, ...]:
    if type(value) not in (tuple, list, torch.Size) or len(value) > _MAX_DIMS or not all(
            type(v) is int and 0 <= v <= INT64_MAX for v in value):
        raise ValueError(f"{where}: expected up to {_MAX_DIMS} non-negative ints, got {_shown(value)}")
    return tuple(value)


def _by_gpu(entry: Any, where: str) -> dict[str, RebuildArgs]:
    """One {gpu uuid: args} entry of ipc_handles, every GPU's args checked (also those of other workers)."""
    if type(entry) is not dict or not entry:
        raise ValueError(f"{where}: expected a dict of GPU uuid -> rebuild args, got {_shown(entry)}")
    checked = {}
    for uuid, args in entry.items():
        if type(uuid) is not str or not 0 < len(uuid) <= 128:
            raise ValueError(f"{where} (a key): expected a GPU uuid string, got {_shown(uuid)}")
        checked[uuid] = check_args(args, f"{where}[{uuid!r}]")
    return checked


def check_handles(info: VLLMIPCUpdateInfo, handles: Any, packed: bool) -> list[dict[str, RebuildArgs]]:
    """ipc_handles checked against the call (one per tensor, or packed one buffer for all); ValueError naming
    the field."""
    where = "update_info.ipc_handles"
    if packed:
        if info.tensor_sizes is None:
            raise ValueError("update_info.tensor_sizes: missing (the trainer's init_info said packed)")
        buffer = _by_gpu(handles, where)
        tensors = zip(info.names, info.dtype_names, info.shapes, info.tensor_sizes)
        for i, (name, dtype, shape, nbytes) in enumerate(tensors):
            if nbytes != packing.nbytes_of(dtype, shape):
                raise ValueError(f"update_info.tensor_sizes[{i}]: {nbytes} bytes, but {name!r} "
                                 f"({packing.dtype_name(dtype)} {list(shape)}) has {packing.nbytes_of(dtype, shape)}")
        for uuid, args in buffer.items():
            if args.dtype != torch.uint8 or len(args.shape) != 1:
                raise ValueError(f"{where}[{uuid!r}]: a packed buffer is 1-D uint8, "
                                 f"not {args.dtype} {list(args.shape)}")
            if sum(info.tensor_sizes) > args.shape[0]:
                raise ValueError(f"update_info.tensor_sizes: {sum(info.tensor_sizes)} bytes in all, beyond the "
                                 f"buffer's {args.shape[0]}")
        return [buffer]
    if type(handles) is not list:
        raise ValueError(f"{where}: expected a list (one entry per tensor; init_info said not packed), "
                         f"got {_shown(handles)}")
    if len(handles) != len(info.names):
        raise ValueError(f"{where}: {len(handles)} entries for {len(info.names)} names")
    checked = []
    for i, (entry, name, dtype, shape) in enumerate(zip(handles, info.names, info.dtype_names, info.shapes)):
        by_gpu = _by_gpu(entry, f"{where}[{i}]")
        for uuid, args in by_gpu.items():
            if args.dtype != dtype or args.shape != tuple(shape):
                raise ValueError(f"{where}[{i}][{uuid!r}]: a {args.dtype} {list(args.shape)} tensor for {name!r}, "
                                 f"announced as {packing.dtype_name(dtype)} {list(shape)}")
        checked.append(by_gpu)
    return checked


# =======================================================================================
# Engine side: behind ipc.IPCWeightTransferEngine when init_info is vLLM's shape
# =======================================================================================


def gpu_uuid(device_index: int) -> str:
    """The key vLLM's ipc_handles use for a GPU: its uuid as torch prints it."""
    return str(torch.cuda.get_device_properties(device_index).uuid)


@dataclass(kw_only=True)
class VLLMIPCWeightUpdate(WeightUpdateInfo):
    rebuilds: list[RebuildArgs]  # unpacked: one per tensor; packed: the buffer's
    tensor_sizes: list[int] | None  # packed: each tensor's bytes in the buffer


class VLLMIPCReceiver:
    """Receives vLLM-shaped calls on one CUDA worker; a packed buffer is opened once per update (as vLLM does)."""

    def __init__(self, device: torch.device, init_info: VLLMIPCInitInfo, allow_pickled: bool) -> None:
        self.device = device
        self.packed = init_info.packed
        self.allow_pickled = allow_pickled
        self._buffer: tuple[tuple, torch.Tensor] | None = None  # packed: (args, the opened buffer) of this update

    def plan_update(self, update_info: Any) -> VLLMIPCWeightUpdate:
        info = parse_message(update_info, VLLMIPCUpdateInfo, "update_info")
        handles = info.ipc_handles
        if info.ipc_handles_pickled is not None:
            handles = decode_pickled(info.ipc_handles_pickled, self.allow_pickled)
        checked = check_handles(info, handles, self.packed)
        if self.device.type != "cuda":
            raise ValueError(
                f"update_info.ipc_handles: vLLM's ipc shape shares CUDA tensors, and this worker runs on "
                f"{self.device.type} (on CPU the ipc backend takes its own shape: shared memory)"
            )
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        uuid = gpu_uuid(index)
        missing = [i for i, by_gpu in enumerate(checked) if uuid not in by_gpu]
        if missing:
            raise ValueError(f"update_info.ipc_handles[{missing[0]}]: nothing for this worker's GPU {uuid!r} "
                             f"(it has {sorted(checked[missing[0]])}); the trainer must share on this GPU")
        return VLLMIPCWeightUpdate(
            list(info.names), list(info.dtype_names), [tuple(s) for s in info.shapes],
            rebuilds=[by_gpu[uuid] for by_gpu in checked], tensor_sizes=info.tensor_sizes,
        )

    def receive_weights(self, info: VLLMIPCWeightUpdate) -> Iterator[tuple[str, torch.Tensor]]:
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        if info.tensor_sizes is None:
            for i, (name, rebuild) in enumerate(zip(info.names, info.rebuilds)):
                yield name, _rebuild(rebuild.on(index), f"update_info.ipc_handles[{i}]")
            return
        buffer = self._open_buffer(info.rebuilds[0].on(index))
        offset = 0
        for name, dtype, shape, nbytes in zip(info.names, info.dtypes, info.shapes, info.tensor_sizes):
            part = buffer[offset:offset + nbytes]
            if offset % dtype.itemsize:  # vLLM packs back to back: a view of this dtype needs aligned bytes
                part = part.clone()
            yield name, part.view(dtype).view(shape)
            offset += nbytes

    def _open_buffer(self, args: tuple) -> torch.Tensor:
        """The packed buffer: vLLM's trainer sends the same export with every call of an update, opened once
        (each export gives one reference to release, and closing it per call would release it repeatedly)."""
        if self._buffer is None or self._buffer[0] != args:
            self._buffer = None  # the previous export's mapping closes: its one reference goes back
            self._buffer = (args, _rebuild(args, "update_info.ipc_handles"))
        return self._buffer[1]

    def finish_update(self) -> None:
        self._buffer = None

    def shutdown(self) -> None:
        self._buffer = None


def _rebuild(args: tuple, where: str) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    try:
        return rebuild_cuda_tensor(*args)
    except RuntimeError as e:  # a well-formed handle naming no live export (stale, or another process's)
        raise ValueError(f"{where}: CUDA could not open it: {e}") from None


# =======================================================================================
# Trainer side: the update_info a vLLM server reads (ours, for IPCTrainerInitInfo(wire="vllm"))
# =======================================================================================


def share(tensor: torch.Tensor) -> tuple:
    """rebuild_cuda_tensor's args for a CUDA tensor (torch's reduce_tensor); keep the tensor alive until finish."""
    from torch.multiprocessing.reductions import reduce_tensor

    if not tensor.is_cuda:
        raise ValueError(f"vLLM's ipc shape shares CUDA tensors, not {tensor.device.type} ones")
    _rebuild_fn, args = reduce_tensor(tensor)
    return args


def init_info_of(packed: bool) -> dict:
    """vLLM's ipc init_info exactly (no "backend": a vLLM server picks it from its --weight-transfer-config)."""
    return {"packed": packed}


def update_info(names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]], ipc_handles: Any,
                tensor_sizes: list[int] | None = None, *, pickled: bool) -> dict:
    """vLLM's update_info for one call; pickled (base64, as vLLM's HTTP client sends it) or the objects themselves."""
    info: dict[str, Any] = {
        "names": list(names),
        "dtype_names": [packing.dtype_name(d) for d in dtypes],
        "shapes": [list(s) for s in shapes],
    }
    if pickled:
        info["ipc_handles_pickled"] = base64.b64encode(pickle.dumps(ipc_handles)).decode("ascii")
    else:
        info["ipc_handles"] = ipc_handles
    if tensor_sizes is not None:
        info["tensor_sizes"] = list(tensor_sizes)
    return info


class VLLMShapeIPCTrainer(TrainerWeightTransferEngine[TrainerInitInfo]):
    """Our ipc trainer speaking vLLM's shape (IPCTrainerInitInfo wire "vllm" or "vllm_packed"), made by
    IPCTrainerWeightTransferEngine.trainer_init: rank 0 shares CUDA tensors on its GPU, the others only
    take part in a gathering source's pass.

    Unpacked: one update_weights call with every tensor's handle; the tensors stay referenced until
    the update is finished. Packed: one buffer of packed_buffer_size_bytes, exported once per sync,
    filled back to back with as many tensors as fit, one call per fill (the next fill only after the
    call returned); tensor_sizes says where each tensor ends. The handles always go pickled
    (ipc_handles_pickled): the one form every transport carries (JSON over HTTP, msgpack to an engine
    process, Ray), and the one a vLLM server reads over HTTP (with VLLM_ALLOW_INSECURE_SERIALIZATION=1;
    ours with --weight-transfer-allow-pickled-ipc-handles).
    """

    backend: ClassVar[str] = "ipc"

    def __init__(self, init_info: Any, client, source: WeightSource | None, rank: int) -> None:
        super().__init__(init_info, client, source, rank)
        self.packed = init_info.wire == "vllm_packed"
        self.buffer_size = init_info.packed_buffer_size_bytes
        self._held: list[torch.Tensor] = []

    @classmethod
    def _start(cls, init_info: Any, *, client, source) -> VLLMShapeIPCTrainer:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        engine = cls(init_info, client, source, rank)
        if rank == 0:
            engine._bounded("init_weight_transfer_engine", client.init_weight_transfer_engine,
                            init_info_of(engine.packed))
        return engine

    def _send(self, source: WeightSource) -> SyncStats:
        metas = source.metadata
        held: list[torch.Tensor] = []  # what the engine maps: alive until finish_weight_update returned
        try:
            num_calls = self._send_packed(source, held) if self.packed else self._send_unpacked(source, held)
        except ValueError as e:
            raise ValueError(f"ipc (vLLM's shape): {e}") from None
        self._held = held  # dropped in send_weights, after finish
        dense = sum(m.nbytes for m in metas)
        stats = SyncStats(backend=self.backend, num_tensors=len(metas), bytes_sent=dense, dense_bytes=dense)
        stats.extra.update(num_calls=num_calls, wire="vllm_packed" if self.packed else "vllm")
        return stats

    def send_weights(self, source=None, *, weight_version: str | None = None) -> SyncStats:
        try:
            return super().send_weights(source, weight_version=weight_version)
        finally:
            self._held = []
            if torch.cuda.is_available():
                torch.cuda.ipc_collect()  # exported blocks the engine closed go back to the allocator

    def _follow(self, source: WeightSource) -> SyncStats:
        for _ in source.iter_full():
            pass
        return SyncStats(self.backend)

    def _send_unpacked(self, source: WeightSource, held: list[torch.Tensor]) -> int:
        names, dtypes, shapes, handles = [], [], [], []
        for name, tensor in source.iter_full():
            weight = tensor.detach().contiguous()
            args = share(weight)
            held.append(weight)
            names.append(name)
            dtypes.append(weight.dtype)
            shapes.append(list(weight.shape))
            handles.append({gpu_uuid(weight.device.index): args})
        self._bounded("update_weights", self.client.update_weights,
                      update_info(names, dtypes, shapes, handles, pickled=True))
        return 1

    def _send_packed(self, source: WeightSource, held: list[torch.Tensor]) -> int:
        buffer: torch.Tensor | None = None
        handle: dict | None = None
        chunk: list[tuple[str, torch.Tensor]] = []
        used = 0
        num_calls = 0

        def flush() -> None:
            nonlocal used, num_calls
            offset = 0
            for _name, tensor in chunk:
                flat = packing.as_bytes(tensor)
                buffer[offset:offset + flat.numel()].copy_(flat)
                offset += flat.numel()
            torch.cuda.current_stream(buffer.device).synchronize()  # the engine reads it from another process
            info = update_info([n for n, _ in chunk], [t.dtype for _, t in chunk], [list(t.shape) for _, t in chunk],
                               handle, [packing.nbytes_of(t.dtype, t.shape) for _, t in chunk], pickled=True)
            self._bounded("update_weights", self.client.update_weights, info)  # returned: the buffer may be refilled
            chunk.clear()
            used = 0
            num_calls += 1

        for name, tensor in source.iter_full():
            if not tensor.is_cuda:
                raise ValueError(f"{name!r}: vLLM's ipc shape shares CUDA tensors, not {tensor.device.type} ones")
            nbytes = packing.nbytes_of(tensor.dtype, tensor.shape)
            if nbytes > self.buffer_size:
                raise ValueError(f"{name!r} has {nbytes} bytes, more than packed_buffer_size_bytes={self.buffer_size}")
            if buffer is None:
                buffer = torch.empty(self.buffer_size, dtype=torch.uint8, device=tensor.device)
                handle = {gpu_uuid(buffer.device.index): share(buffer)}
                held.append(buffer)
            if used + nbytes > self.buffer_size:
                flush()
            # A view of the tensor's bytes (the source's copy, kept only until this chunk is sent).
            chunk.append((name, tensor.detach().contiguous()))
            used += nbytes
        if chunk:
            flush()
        return num_calls


# A value in an error message: bounded in length and depth whatever a client nested (reprlib stops early).
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict = 3, 6, 16, 4
_REPR.maxstring, _REPR.maxother, _REPR.maxlong = 60, 60, 40


def _shown(value: Any) -> str:
    if isinstance(value, _Name):
        return f"{value.module}.{value.qualname}"
    text = _REPR.repr(value)
    return text if len(text) <= 200 else text[:197] + "..."
