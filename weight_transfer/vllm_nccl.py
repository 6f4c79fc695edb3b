"""vLLM's NCCL rendezvous, both ends: the unique id in the trainer's TCPStore, or in base64, and a raw NCCL group.

vLLM's trainer (StatelessProcessGroup + PyNcclCommunicator) serves a TCPStore at
master_address:master_port from its rank 0, mints an ncclUniqueId there, and publishes it with
the group's first broadcast_obj: key UNIQUE_ID_KEY ("broadcast_from/0/0"), value a pickle of
vLLM's ctypes struct `vllm.distributed.device_communicators.pynccl_wrapper.ncclUniqueId`
(128 bytes; ctypes pickles it as `_ctypes._unpickle(ncclUniqueId, ({}, <bytes>))`). Every rank
then calls ncclCommInitRank(world_size, id, rank) and one all_reduce of a one-element float32
zero tensor (the warm-up every peer must match). A torch-free trainer may instead hand the id
over as `nccl_unique_id_b64` (standard base64, not URL-safe).

The engine reads nothing of that store but the one key, and unpickles it through
safe_pickle with exactly those two globals allowed, both substituted by our own callables:
the result is the 128 bytes, never a vLLM object (vLLM need not be installed). The reverse,
unique_id_pickle, writes the bytes a vLLM worker's plain pickle.loads turns into its struct.

VllmNcclGroup is a WeightSyncGroup look-alike (broadcast -> work, bounded wait, abort, close)
over libnccl through ctypes, so process_group.send_items / receive_items run on it unchanged.
CUDA only; the GPU-to-GPU run against vLLM's trainer is issue #27.
"""

from __future__ import annotations

import base64
import binascii
import ctypes
import datetime
import glob
import os
import time
from typing import Any

import torch

from weight_transfer import safe_pickle
from weight_transfer.process_group import Check, WeightSyncTransportError

UNIQUE_ID_KEY = "broadcast_from/0/0"  # StatelessProcessGroup.broadcast_obj(src=0), its first call
UNIQUE_ID_BYTES = 128  # sizeof(ncclUniqueId)
VLLM_UNIQUE_ID_CLASS = ("vllm.distributed.device_communicators.pynccl_wrapper", "ncclUniqueId")
MAX_UNIQUE_ID_PICKLE_BYTES = 4096  # the real one is ~200 bytes


# ---- the unique id on the wire --------------------------------------------------------------------


def decode_unique_id_b64(text: str) -> bytes:
    """vLLM's nccl_unique_id_b64: standard base64 of exactly 128 bytes; ValueError otherwise."""
    if not isinstance(text, str) or not text:
        raise ValueError("expected a non-empty base64 string")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("not valid standard base64 (URL-safe base64 is not accepted)") from None
    if len(raw) != UNIQUE_ID_BYTES:
        raise ValueError(f"must decode to {UNIQUE_ID_BYTES} bytes (an ncclUniqueId), got {len(raw)}")
    return raw


def encode_unique_id_b64(unique_id: bytes) -> str:
    _check_id(unique_id)
    return base64.b64encode(unique_id).decode("ascii")


def _check_id(unique_id: Any) -> bytes:
    if not isinstance(unique_id, (bytes, bytearray)) or len(unique_id) != UNIQUE_ID_BYTES:
        size = len(unique_id) if isinstance(unique_id, (bytes, bytearray)) else type(unique_id).__name__
        raise ValueError(f"an NCCL unique id is {UNIQUE_ID_BYTES} bytes, got {size}")
    return bytes(unique_id)


class _UniqueIdClass:
    """Stands in for vLLM's ncclUniqueId class while unpickling (never instantiated)."""


def _unpickle_unique_id(cls: Any, state: Any) -> bytes:
    """Stands in for ctypes' _unpickle: accepts only (ncclUniqueId, ({}, <128 bytes>))."""
    what = "the trainer's NCCL unique id (TCPStore key broadcast_from/0/0)"
    if cls is not _UniqueIdClass:
        raise ValueError(f"{what}: a ctypes object of another type than ncclUniqueId")
    if not (isinstance(state, tuple) and len(state) == 2 and state[0] == {} and isinstance(state[1], bytes)):
        raise ValueError(f"{what}: not the state of an ncclUniqueId struct")
    try:
        return _check_id(state[1])
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None


_UNIQUE_ID_GLOBALS = {("_ctypes", "_unpickle"): _unpickle_unique_id, VLLM_UNIQUE_ID_CLASS: _UniqueIdClass}


def unique_id_from_pickle(data: bytes) -> bytes:
    """The 128 id bytes of vLLM's pickled ncclUniqueId; ValueError for anything else (nothing else runs)."""
    what = "the trainer's NCCL unique id (TCPStore key broadcast_from/0/0)"
    value = safe_pickle.loads(data, _UNIQUE_ID_GLOBALS, what=what, max_bytes=MAX_UNIQUE_ID_PICKLE_BYTES)
    if not isinstance(value, bytes):
        raise ValueError(f"{what}: expected a pickled ncclUniqueId, got a pickled {type(value).__name__}")
    return value


def unique_id_pickle(unique_id: bytes) -> bytes:
    """What vLLM's trainer puts under UNIQUE_ID_KEY for this id: pickle.loads in a vLLM worker gives its
    ncclUniqueId struct. Written opcode by opcode (protocol 3), as pickling needs vLLM's class importable."""
    raw = _check_id(unique_id)
    module, name = VLLM_UNIQUE_ID_CLASS
    return b"".join([
        b"\x80\x03",  # PROTO 3
        b"c_ctypes\n_unpickle\n",  # GLOBAL
        b"c" + module.encode() + b"\n" + name.encode() + b"\n",  # GLOBAL
        b"}",  # EMPTY_DICT: the struct's __dict__
        b"C" + bytes([len(raw)]) + raw,  # SHORT_BINBYTES: its 128 bytes
        b"\x86",  # TUPLE2: (dict, bytes)
        b"\x86",  # TUPLE2: (class, state)
        b"R",  # REDUCE
        b".",  # STOP
    ])


def unique_id_address(unique_id: bytes) -> str | None:
    """The IP address NCCL's other ranks connect to for this id (rank 0's bootstrap socket), or None.

    An ncclUniqueId is NCCL's bootstrap handle: a 64-bit magic, then the root's socket address
    (struct sockaddr_in / sockaddr_in6: family in host order, port and address in network
    order). None when the family is neither AF_INET nor AF_INET6 (a layout this does not know).
    """
    import ipaddress
    import socket

    raw = _check_id(unique_id)
    family = int.from_bytes(raw[8:10], "little")
    if family == socket.AF_INET:
        return str(ipaddress.IPv4Address(raw[12:16]))
    if family == socket.AF_INET6:
        return str(ipaddress.IPv6Address(raw[16:32]))
    return None


def check_unique_id_address(unique_id: bytes, allowed_hosts, where: str) -> None:
    """The id's bootstrap address against the engine's weight_transfer_allowed_hosts (ValueError naming
    `where`): joining NCCL connects there, whatever master_address said. An id whose address cannot be
    read passes only when every host is allowed."""
    if allowed_hosts is None:
        return
    address = unique_id_address(unique_id)
    if address is None:
        if not allowed_hosts.any_host:
            raise ValueError(f"{where}: cannot read the NCCL unique id's bootstrap address to check it against "
                             "weight_transfer_allowed_hosts (allow '*' to skip the check)")
        return
    allowed_hosts.check(address, f"{where} (the NCCL bootstrap address it carries)")


def read_unique_id(store, timeout_s: float) -> bytes:
    """Waits (at most timeout_s) for vLLM's trainer to publish its unique id in its store, and reads it."""
    try:
        store.wait([UNIQUE_ID_KEY], datetime.timedelta(seconds=timeout_s))
        data = store.get(UNIQUE_ID_KEY)
    except RuntimeError as e:  # DistStoreError (a timeout) derives from it
        raise TimeoutError(
            f"the trainer's TCPStore has no NCCL unique id ({UNIQUE_ID_KEY}) within timeout_s={timeout_s:g}: "
            f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}"
        ) from e
    return unique_id_from_pickle(data)


# ---- libnccl through ctypes --------------------------------------------------------------------------

_NCCL_DTYPES = {
    torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6, torch.float32: 7,
    torch.float64: 8, torch.bfloat16: 9, torch.bool: 1,
}
_NCCL_SUM = 0
_NCCL_SUCCESS, _NCCL_IN_PROGRESS = 0, 7


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]


def _library_candidates() -> list[str]:
    paths = []
    if os.environ.get("ROLLOUT_NCCL_LIBRARY"):
        paths.append(os.environ["ROLLOUT_NCCL_LIBRARY"])
    try:  # the wheel torch depends on (nvidia-nccl-cu12)
        import nvidia.nccl

        for root in nvidia.nccl.__path__:
            paths += sorted(glob.glob(os.path.join(root, "lib", "libnccl.so*")))
    except ImportError:
        pass
    paths += ["libnccl.so.2", "librccl.so.1"]
    return paths


_lib: ctypes.CDLL | None = None


def _nccl() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        errors = []
        for path in _library_candidates():
            try:
                lib = ctypes.CDLL(path)
                break
            except OSError as e:
                errors.append(f"{path}: {e}")
        else:
            raise RuntimeError(f"cannot load the NCCL library (set ROLLOUT_NCCL_LIBRARY): {'; '.join(errors)}")
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(_UniqueId)]
        lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, _UniqueId, ctypes.c_int]
        lib.ncclBroadcast.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                      ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        lib.ncclAllReduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                      ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        lib.ncclCommAbort.argtypes = [ctypes.c_void_p]
        lib.ncclCommDestroy.argtypes = [ctypes.c_void_p]
        lib.ncclCommGetAsyncError.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
        _lib = lib
    return _lib


def _check(result: int, what: str) -> None:
    if result not in (_NCCL_SUCCESS, _NCCL_IN_PROGRESS):
        message = _nccl().ncclGetErrorString(result)
        raise WeightSyncTransportError(f"{what}: NCCL error {result} ({message.decode(errors='replace')})")


def get_unique_id() -> bytes:
    """A fresh ncclUniqueId (what vLLM's trainer rank 0 mints)."""
    uid = _UniqueId()
    _check(_nccl().ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
    return bytes(bytearray(uid.internal))


class _Work:
    """A broadcast in flight: an event recorded after it on the group's stream (and the tensor it uses)."""

    def __init__(self, event: torch.cuda.Event, tensor: torch.Tensor) -> None:
        self.event, self.tensor = event, tensor

    def is_completed(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)


class VllmNcclGroup:
    """This rank's NCCL communicator of vLLM's weight-transfer group, with WeightSyncGroup's interface."""

    def __init__(self, unique_id: bytes, *, rank: int, world_size: int, device: torch.device,
                 timeout_s: float) -> None:
        if device.type != "cuda":
            raise ValueError(f"device: vLLM's NCCL rendezvous runs on CUDA, not {device.type}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is out of range for world_size {world_size}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.rank, self.world_size, self.device, self.timeout_s = rank, world_size, device, timeout_s
        self.aborted = False
        self._in_flight: list[_Work] = []
        uid = _UniqueId()
        ctypes.memmove(ctypes.addressof(uid.internal), _check_id(unique_id), UNIQUE_ID_BYTES)
        self.comm = ctypes.c_void_p()
        with torch.cuda.device(device):
            self.stream = torch.cuda.Stream(device)
            # Blocks until every rank joined (NCCL's own bootstrap over the id's address).
            _check(_nccl().ncclCommInitRank(ctypes.byref(self.comm), world_size, uid, rank), "ncclCommInitRank")
            warmup = torch.zeros(1, dtype=torch.float32, device=device)  # vLLM's warm-up: every peer issues it
            self._collective("ncclAllReduce", warmup, warmup, _NCCL_SUM)
            self.wait(self._last, "the NCCL warm-up all_reduce")

    def _collective(self, op: str, send: torch.Tensor, recv: torch.Tensor, arg: int) -> _Work:
        dtype = _NCCL_DTYPES.get(recv.dtype)
        count = recv.numel()
        if dtype is None:  # any other dtype travels as its bytes
            count = recv.numel() * recv.element_size()
            send, recv, dtype = send.view(torch.uint8), recv.view(torch.uint8), 1
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the tensor's producer first
        # ncclBroadcast(send, recv, count, dtype, root, comm, stream); ncclAllReduce(..., op, comm, stream).
        result = getattr(_nccl(), op)(send.data_ptr(), recv.data_ptr(), count, dtype, arg, self.comm,
                                      self.stream.cuda_stream)
        _check(result, op)
        event = torch.cuda.Event()
        event.record(self.stream)
        self._last = _Work(event, recv)
        self._in_flight.append(self._last)
        return self._last

    def broadcast(self, tensor: torch.Tensor) -> _Work:
        """Starts a broadcast of `tensor` (contiguous, on self.device) from rank 0; returns its work handle."""
        if self.aborted:
            raise WeightSyncTransportError("the weight-sync group was aborted after a failed transfer")
        with torch.cuda.device(self.device):
            return self._collective("ncclBroadcast", tensor, tensor, 0)

    def wait(self, work: _Work, what: str, check: Check | None = None) -> None:
        deadline = time.monotonic() + self.timeout_s
        pause = 1e-4
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: nothing within timeout_s={self.timeout_s:g} (peer stalled or gone?)")
            error = ctypes.c_int(0)
            _check(_nccl().ncclCommGetAsyncError(self.comm, ctypes.byref(error)), "ncclCommGetAsyncError")
            _check(error.value, what)
            if check is not None:
                check()
            time.sleep(pause)
            pause = min(pause * 2, 0.002)
        work.wait()
        self._in_flight = [w for w in self._in_flight if w is not work]

    def abort(self) -> None:
        """Gives up on the communicator (collectives in flight never finish): ncclCommAbort."""
        if self.aborted:
            return
        self.aborted = True
        if self.comm:
            _nccl().ncclCommAbort(self.comm)
            self.comm = ctypes.c_void_p()
        self._in_flight = []

    def close(self) -> None:
        if not self.aborted and self.comm:
            torch.cuda.synchronize(self.device)
            _nccl().ncclCommDestroy(self.comm)
            self.comm = ctypes.c_void_p()
        self.aborted = True
        self._in_flight = []
