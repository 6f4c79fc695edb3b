"""The weight-sync process group (trainer rank 0 + every engine worker, not the default group) and its broadcasts.

Trainers use the default group for FSDP, so weight sync builds its own: a TCPStore served by
the trainer's rank 0 at master_address:master_port, and on it a ProcessGroupGloo (CPU tensors)
or ProcessGroupNCCL (CUDA tensors) of rank 0 (the sender) and the engine workers (ranks
1..world_size-1). The store doubles as a side channel for small control keys: an engine
worker says it joined, that it has posted the receives of an update call, and the trainer
says it gave up on a call.

send_items / receive_items move a list of tensors (WireSpec: dtype and shape) from rank 0 to
every other rank, packed into rotating buffers (packing.plan_nccl_packs: vLLM's layout) or one broadcast each.

Every blocking wait here is bounded by timeout_s and raises TimeoutError, or
WeightSyncTransportError when the transport itself fails (a peer's connection closed). A
group that failed a transfer is aborted on the spot and never used again: its peers may
have collectives in flight that would pair with the next transfer's, and gloo kills a
process whose receive meets a send of another size.
"""

from __future__ import annotations

import datetime
import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from weight_transfer.packing import Pack, copy_into, plan_nccl_packs, view_or_copy

logger = logging.getLogger(__name__)

# How often a wait runs its `check` (a store round trip on the engine, a Future poll on the trainer).
CHECK_INTERVAL_S = 0.05
# Polls of a work handle back off from 0.1 ms to this, so a finished transfer is noticed within ~2 ms.
_MAX_POLL_SLEEP_S = 0.002


# A callable a wait runs now and then; it raises to give up (the peer reported a failure).
Check = Callable[[], None]


class WeightSyncTransportError(RuntimeError):
    """A collective of the weight-sync group failed (typically: a peer died and its connection closed)."""


def first_line(error: BaseException) -> str:
    """An error's message without the C++ stack trace torch appends to some."""
    return str(error).strip().split("\n", 1)[0]


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def local_address_towards(address: str) -> str:
    """This host's IP address on the route to `address` (no packet is sent): what peers can reach us at."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((address, 9))
            return s.getsockname()[0]
    except OSError:  # no route (e.g. no network at all): loopback is all there is
        return "127.0.0.1"


def host_store(address: str, port: int, timeout_s: float) -> dist.TCPStore:
    """The store server, on the trainer's rank 0; port 0 picks a free port (read it back from .port)."""
    try:
        return dist.TCPStore(address, port, None, True, _timedelta(timeout_s), wait_for_workers=False)
    except (RuntimeError, OSError) as e:
        raise WeightSyncTransportError(
            f"master_port: cannot serve a TCPStore at {address}:{port}: {first_line(e)}"
        ) from e


def host_port(address: str, port: int) -> str:
    """"10.0.0.1:29500", "[::1]:29500": a peer as messages name it."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def connect_store(address: str, port: int, timeout_s: float, world_size: int | None = None) -> dist.TCPStore:
    """A client of the trainer's store (engine side); TimeoutError naming the peer after timeout_s.

    world_size: given, the client counts itself in as one of the store's workers, which a store
    served with a world size (vLLM's StatelessProcessGroup) waits for before its rank 0 goes on.

    torch's own timeout does not cover every wait: against a listener that accepts and never
    answers, the TCPStore client's handshake waits forever. So the connect runs in a daemon
    thread and this waits at most timeout_s for it; a store it makes after that is dropped
    (closing its connection), and a thread that stays stuck ends with the listener's socket.
    """
    peer = host_port(address, port)
    done = threading.Event()
    outcome: list = []

    def connect() -> None:
        try:
            outcome.append(dist.TCPStore(address, port, world_size, False, _timedelta(timeout_s)))
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            outcome.append(e)
        done.set()

    threading.Thread(target=connect, name=f"tcpstore-connect-{peer}", daemon=True).start()
    if not done.wait(timeout_s):  # a store made later is freed with the thread: nothing else holds it
        raise TimeoutError(f"no answer from the trainer's TCPStore at {peer} within timeout_s={timeout_s:g}")
    result = outcome[0]
    if isinstance(result, (RuntimeError, OSError)):
        raise TimeoutError(
            f"could not reach the trainer's TCPStore at {peer} within timeout_s={timeout_s:g}: {first_line(result)}"
        ) from result
    if isinstance(result, BaseException):
        raise result
    return result


def wait_for_keys(
    store: dist.Store, keys: Sequence[str], timeout_s: float, what: str, check: Check | None = None
) -> None:
    """Waits until every key exists in the store, running `check` (which may raise) meanwhile."""
    deadline = time.monotonic() + timeout_s
    pause = 1e-4  # backs off to CHECK_INTERVAL_S / 5: a key that appears soon (the usual case) costs no 10 ms nap
    while not store.check(list(keys)):
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not done within timeout_s={timeout_s:g}")
        time.sleep(pause)
        pause = min(pause * 2, CHECK_INTERVAL_S / 5)


class StoreKeys:
    """Names of the control keys of one group generation (a re-joined group starts a new generation)."""

    def __init__(self, generation: int) -> None:
        self.prefix = f"wsync/{generation}/"

    def joined(self, rank: int) -> str:
        return f"{self.prefix}joined/{rank}"

    def ready(self, call_id: int, rank: int) -> str:
        return f"{self.prefix}ready/{call_id}/{rank}"

    def abort(self, call_id: int) -> str:
        return f"{self.prefix}abort/{call_id}"

    @property
    def group(self) -> str:
        return f"{self.prefix}pg/"


# Aborted gloo groups whose collectives are still in flight. Destroying a gloo group waits for
# them (up to its timeout, holding the caller), so they are kept here until they finish.
_retired: list[tuple[object, list]] = []


def _retire(pg, works: list) -> None:
    _retired[:] = [(g, w) for g, w in _retired if not all(x.is_completed() for x in w)]
    if any(not w.is_completed() for w in works):
        _retired.append((pg, works))


class WeightSyncGroup:
    """One member's handle on the group: broadcasts from rank 0 and bounded waits on them."""

    def __init__(
        self, store: dist.Store, *, prefix: str, rank: int, world_size: int, device: torch.device,
        timeout_s: float, address: str,
    ) -> None:
        self.rank, self.world_size, self.device, self.timeout_s = rank, world_size, device, timeout_s
        self.aborted = False
        self._in_flight: list = []  # works issued and not yet waited for
        prefixed = dist.PrefixStore(prefix, store)
        try:
            if device.type == "cuda":
                self.pg = _nccl_group(prefixed, rank, world_size, timeout_s)
            elif device.type == "cpu":
                self.pg = _gloo_group(prefixed, rank, world_size, timeout_s, address)
            else:
                raise ValueError(f"device: weight sync runs on cpu (gloo) or cuda (nccl), not {device.type}")
        except (RuntimeError, dist.DistError) as e:  # DistStoreError: a peer never showed up
            raise TimeoutError(
                f"weight-sync group (store at {address}): rank {rank} of {world_size} could not connect to every "
                f"peer within timeout_s={timeout_s:g}: {first_line(e)}"
            ) from e

    def broadcast(self, tensor: torch.Tensor):
        """Starts a broadcast of `tensor` (on self.device, contiguous) from rank 0; returns its work handle."""
        if self.aborted:
            raise WeightSyncTransportError("the weight-sync group was aborted after a failed transfer")
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                work = self.pg.broadcast(tensor, 0)
        else:
            work = self.pg.broadcast(tensor, 0)
        self._in_flight.append(work)
        return work

    def wait(self, work, what: str, check: Check | None = None) -> None:
        """Waits for a broadcast, at most timeout_s, running `check` (which may raise) every CHECK_INTERVAL_S."""
        deadline = time.monotonic() + self.timeout_s
        next_check = 0.0
        pause = 1e-4
        while not work.is_completed():
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"{what}: nothing within timeout_s={self.timeout_s:g} (peer stalled or gone?)")
            if check is not None and now >= next_check:
                check()
                next_check = now + CHECK_INTERVAL_S
            time.sleep(pause)
            pause = min(pause * 2, _MAX_POLL_SLEEP_S)
        try:
            # Raises the transport's error; on CUDA it also orders the current stream after the broadcast.
            work.wait()
        except RuntimeError as e:
            raise WeightSyncTransportError(f"{what}: {first_line(e)}") from e
        finally:
            self._in_flight = [w for w in self._in_flight if w is not work]

    def abort(self) -> None:
        """Gives up on the group after a failed transfer: collectives in flight are abandoned, never resumed."""
        if self.aborted:
            return
        self.aborted = True
        if self.device.type == "cuda":
            # NCCL collectives in flight would never finish, and the watchdog would end the process.
            self.pg.abort()
        _retire(self.pg, self._in_flight)
        self._in_flight = []

    def close(self) -> None:
        """Releases the group; collectives still in flight (after a failure) finish in the background."""
        self.abort()
        self.pg = None


def _gloo_group(store: dist.Store, rank: int, world_size: int, timeout_s: float, address: str):
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = _timedelta(timeout_s)
    # Gloo listens on the interface that reaches the store's host, which peers can reach back.
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address_towards(address))]
    return dist.ProcessGroupGloo(store, rank, world_size, opts)


def _nccl_group(store: dist.Store, rank: int, world_size: int, timeout_s: float):
    if not dist.is_nccl_available():
        raise ValueError("device: CUDA weight sync needs NCCL, which this torch build lacks")
    opts = dist.ProcessGroupNCCL.Options()
    # Our own waits give up at timeout_s and abort the group; NCCL's watchdog (which would end
    # the process) is set later, so that it never fires first.
    opts._timeout = _timedelta(2 * timeout_s + 60)
    return dist.ProcessGroupNCCL(store, rank, world_size, opts)


@dataclass(frozen=True)
class TransferSettings:
    """How tensors travel; identical on both sides, so both compute the same packing plan."""

    packed: bool = True
    buffer_size: int = 1 << 30  # bytes per pack buffer
    num_buffers: int = 2  # buffers in rotation (packed) / broadcasts in flight (unpacked)


# =======================================================================================
# Transport: a list of (dtype, shape) items, broadcast from rank 0, packed or one by one
# =======================================================================================


@dataclass(frozen=True)
class WireSpec:
    """One tensor on the wire; `label` (usually the HF name) is for error messages."""

    label: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class _BufferRing:
    """settings.num_buffers pack buffers, allocated on first use and sized to the largest usual pack.

    Pack k uses buffer k % num_buffers. vLLM's layout (packing.plan_nccl_packs) lets a pack run
    past buffer_size by its last tensor; packs up to twice buffer_size share the ring, a larger
    one (an oversized tensor) gets a buffer of its own for its time in flight.
    """

    def __init__(self, plan: list[Pack], settings: TransferSettings, device: torch.device) -> None:
        self.settings, self.device = settings, device
        self.limit = 2 * settings.buffer_size
        self.size = max((p.nbytes for p in plan if p.nbytes <= self.limit), default=0)
        self.buffers: list[torch.Tensor | None] = [None] * settings.num_buffers

    def buffer_for(self, k: int, pack: Pack) -> torch.Tensor:
        if pack.nbytes > self.limit:
            return torch.empty(pack.nbytes, dtype=torch.uint8, device=self.device)
        i = k % self.settings.num_buffers
        if self.buffers[i] is None:
            self.buffers[i] = torch.empty(self.size, dtype=torch.uint8, device=self.device)
        return self.buffers[i]


def _pack_what(verb: str, k: int, plan: list[Pack], specs: Sequence[WireSpec]) -> str:
    """E.g. "receiving pack 3 of 9 (model.layers.0.mlp.up_proj.weight .. model.layers.1.self_attn.q_proj.weight)"."""
    first, last = specs[plan[k].slots[0].index].label, specs[plan[k].slots[-1].index].label
    return f"{verb} pack {k + 1} of {len(plan)} ({first if first == last else f'{first} .. {last}'})"


def _checked(spec: WireSpec, tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
        raise ValueError(
            f"{spec.label}: the source yielded {str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}, "
            f"its metadata says {str(spec.dtype).removeprefix('torch.')} {list(spec.shape)}"
        )
    return tensor.detach()


def _next_tensor(tensors: Iterator[torch.Tensor], spec: WireSpec) -> torch.Tensor:
    try:
        return _checked(spec, next(tensors))
    except StopIteration:
        raise ValueError(f"{spec.label}: the source ended before this tensor (metadata lists more)") from None


def send_items(
    group: WeightSyncGroup, specs: Sequence[WireSpec], tensors: Iterator[torch.Tensor],
    settings: TransferSettings, check: Check | None = None,
) -> int:
    """Broadcasts the tensors (in spec order) from rank 0; returns the bytes put on the wire."""
    if settings.packed:
        return _send_packed(group, specs, tensors, settings, check)
    num = settings.num_buffers
    in_flight: list = [None] * num
    sent = 0
    for k, spec in enumerate(specs):
        if in_flight[k % num] is not None:  # at most num_buffers broadcasts in flight
            group.wait(in_flight[k % num], f"sending {specs[k - num].label}", check)
        tensor = _next_tensor(tensors, spec).to(group.device).contiguous()
        in_flight[k % num] = group.broadcast(tensor) if spec.nbytes else None
        sent += spec.nbytes
    for k in range(len(specs) - num, len(specs)):
        if k >= 0 and in_flight[k % num] is not None:
            group.wait(in_flight[k % num], f"sending {specs[k].label}", check)
    return sent


def _send_packed(
    group: WeightSyncGroup, specs: Sequence[WireSpec], tensors: Iterator[torch.Tensor],
    settings: TransferSettings, check: Check | None,
) -> int:
    plan = plan_nccl_packs([s.nbytes for s in specs], settings.buffer_size)
    ring = _BufferRing(plan, settings, group.device)
    num = settings.num_buffers
    in_flight: list = [None] * num  # in_flight[i]: the broadcast that still reads buffer i
    sent = 0
    for k, pack in enumerate(plan):
        if in_flight[k % num] is not None:  # pack k - num must be out before its buffer is refilled
            group.wait(in_flight[k % num], _pack_what("sending", k - num, plan, specs), check)
        buffer = ring.buffer_for(k, pack)
        for slot in pack.slots:
            copy_into(buffer, slot, _next_tensor(tensors, specs[slot.index]))
        in_flight[k % num] = group.broadcast(buffer[: pack.nbytes]) if pack.nbytes else None
        sent += pack.nbytes
    for k in range(len(plan) - num, len(plan)):
        if k >= 0 and in_flight[k % num] is not None:
            group.wait(in_flight[k % num], _pack_what("sending", k, plan, specs), check)
    return sent


def receive_items(
    group: WeightSyncGroup, specs: Sequence[WireSpec], settings: TransferSettings, check: Check | None = None
) -> Iterator[torch.Tensor]:
    """Yields the broadcast tensors in spec order. Packed: views into a pack buffer, valid until the next pull."""
    if settings.packed:
        yield from _receive_packed(group, specs, settings, check)
        return
    num = settings.num_buffers
    posted: dict[int, tuple[Any, torch.Tensor]] = {}

    def post(k: int) -> None:
        tensor = torch.empty(specs[k].shape, dtype=specs[k].dtype, device=group.device)
        posted[k] = (group.broadcast(tensor) if specs[k].nbytes else None, tensor)

    for k in range(min(num, len(specs))):
        post(k)
    for k, spec in enumerate(specs):
        work, tensor = posted.pop(k)
        if work is not None:
            group.wait(work, f"receiving {spec.label}", check)
        if k + num < len(specs):
            post(k + num)
        yield tensor


def _receive_packed(
    group: WeightSyncGroup, specs: Sequence[WireSpec], settings: TransferSettings, check: Check | None
) -> Iterator[torch.Tensor]:
    plan = plan_nccl_packs([s.nbytes for s in specs], settings.buffer_size)
    ring = _BufferRing(plan, settings, group.device)
    num = settings.num_buffers
    posted: dict[int, tuple[Any, torch.Tensor]] = {}

    def post(k: int) -> None:
        buffer = ring.buffer_for(k, plan[k])
        posted[k] = (group.broadcast(buffer[: plan[k].nbytes]) if plan[k].nbytes else None, buffer)

    for k in range(min(num, len(plan))):
        post(k)
    for k, pack in enumerate(plan):
        work, buffer = posted.pop(k)
        if work is not None:
            group.wait(work, _pack_what("receiving", k, plan, specs), check)
        for slot in pack.slots:
            spec = specs[slot.index]
            yield view_or_copy(buffer, slot, spec.dtype, spec.shape)
        # The consumer asked for the next tensor, so it is done with every view of pack k
        # (the worker lands a tensor before it pulls the next): the buffer takes pack k + num.
        if k + num < len(plan):
            post(k + num)
