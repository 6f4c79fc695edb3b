"""The sharded_rdt producer: a Ray actor per trainer rank that holds layer groups in NIXL-registered slots for engines.

Protocol (all engine -> producer traffic is one-sided; the producer never needs to know its
consumers in advance):

    status  int64 [1 + num_slots], registered with NIXL:
            status[0]      id of the last sync the trainer aborted (-1: none)
            status[1 + s]  tag of the group slot s holds: sync_id * 2**24 + group (-1: empty)
    slots   num_slots uint8 buffers of slot_bytes, registered with NIXL

The trainer calls publish(sync_id, group, slot, payload): the producer waits until the slot is
free, copies the packed group in, then writes its tag (data first, tag last: an engine that
READs the tag knows the bytes behind it are complete). An engine polls the status words,
READs the packs of a ready group, and then sends the NIXL notification "ack:<sync>:<group>".
A slot is free again once every consumer of the sync has acked the group it holds, so the
producer never holds more than num_slots groups: that is the trainer's memory bound.
"""

from __future__ import annotations

import base64
import threading
import time
import uuid
import warnings

import numpy as np
import torch

GROUP_BITS = 24  # a tag is sync_id << GROUP_BITS | group
GROUP_LIMIT = 1 << GROUP_BITS
EMPTY = -1


def tag_of(sync_id: int, group: int) -> int:
    return (sync_id << GROUP_BITS) | group


def nixl_api():
    """NIXL's Python API from the build for torch's CUDA major version (nixl_cu12 or nixl_cu13), else the other one.

    The builds bundle UCX linked against one CUDA runtime: on a CUDA 13 machine the cu12 build
    cannot load UCX's CUDA transports, and UCX then takes device memory for host memory.
    """
    import importlib

    major = (torch.version.cuda or "12").split(".")[0]
    for name in dict.fromkeys([f"nixl_cu{major}", "nixl_cu12", "nixl_cu13"]):
        try:
            return importlib.import_module(f"{name}._api")
        except ImportError:
            continue
    raise ImportError("NIXL is not installed (pip install nixl: the nixl_cu12 or nixl_cu13 build)")


def make_agent(name: str, backend: str):
    """A NIXL agent with one backend (e.g. UCX) and its progress thread; RuntimeError if the backend is missing."""
    api = nixl_api()
    nixl_agent, nixl_agent_config = api.nixl_agent, api.nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(backends=[backend]))
    if backend not in agent.backends:
        raise RuntimeError(f"NIXL backend {backend!r} is not available here; plugins: {agent.get_plugin_list()}")
    return agent


def mem_type_of(device: torch.device) -> tuple[str, int]:
    """NIXL memory type and device id of tensors on `device`."""
    return ("VRAM", device.index or 0) if device.type == "cuda" else ("DRAM", 0)


class RDTProducer:
    """One trainer rank's slots. Thread-safe: Ray runs it with several concurrent calls (publish, abort, stats)."""

    def __init__(self, rank: int, num_slots: int, timeout_s: float, nixl_backend: str = "UCX", device: str = "cpu"):
        self.rank = rank
        self.num_slots = num_slots
        self.timeout_s = timeout_s
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)
        self.agent = make_agent(f"rdt-producer-{rank}-{uuid.uuid4().hex[:12]}", nixl_backend)
        self._lock = threading.Lock()  # guards the agent (not thread-safe) and the sync state below
        self.status = torch.full((1 + num_slots,), EMPTY, dtype=torch.int64)  # always host memory: polled often
        self._status_reg = self.agent.register_memory(self.status)
        self.slots: list[torch.Tensor] = []
        self._slots_reg = None
        self.slot_bytes = 0
        self.sync_id: int | None = None
        self.num_consumers = 0
        self._held: dict[int, int] = {}  # slot -> group it holds, published and not yet acked by every consumer
        self._acks: dict[int, set[str]] = {}  # group -> consumers (NIXL agent names) that acked it this sync
        self.max_groups_held = 0  # high-water mark of len(_held) over this actor's life
        self.groups_published = 0
        self.bytes_published = 0

    # ---- calls from the trainer ----------------------------------------------------------------

    def ready(self) -> str:
        return self.agent.name

    def begin_sync(self, sync_id: int, num_consumers: int, slot_bytes: int) -> dict:
        """Starts sync `sync_id` for `num_consumers` engine workers; returns the JSON-safe descriptor engines need."""
        with self._lock:
            self._held.clear()  # an unfinished earlier sync is abandoned (the trainer aborted it)
            self._acks.clear()
            self.agent.get_new_notifs()  # drop stale acks
            if slot_bytes > self.slot_bytes:
                self._allocate(slot_bytes)
            self.sync_id, self.num_consumers = sync_id, num_consumers
            return self._descriptor()

    def publish(self, sync_id: int, group: int, slot: int, payload: np.ndarray | torch.Tensor) -> None:
        """Copies a packed group (uint8; a Ray actor gets a numpy array, a producer in the trainer's process a
        tensor on its slots' device) into `slot` once the slot is free; TimeoutError after timeout_s without
        progress."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"publish: slot {slot} is not one of the {self.num_slots} slots")
        self._wait(sync_id, lambda: slot not in self._held, f"slot {slot} to be free for group {group}")
        if payload.nbytes > self.slot_bytes:  # known once the sync has begun
            raise ValueError(f"publish: group {group} has {payload.nbytes} bytes; slots hold {self.slot_bytes}")
        data = self.slots[slot][: payload.nbytes]
        if isinstance(payload, np.ndarray):
            with warnings.catch_warnings():  # Ray hands over a read-only array; it is only read
                warnings.simplefilter("ignore", UserWarning)
                payload = torch.from_numpy(payload)
        data.copy_(payload)
        if data.is_cuda:
            torch.cuda.synchronize(data.device)  # the bytes must be in place before the tag says so
        with self._lock:
            if self.sync_id != sync_id:
                raise RuntimeError(f"publish: sync {sync_id} was aborted or replaced")
            self.status[1 + slot] = tag_of(sync_id, group)
            self._held[slot] = group
            self._acks.setdefault(group, set())
            self.max_groups_held = max(self.max_groups_held, len(self._held))
            self.groups_published += 1
            self.bytes_published += payload.nbytes

    def wait_drained(self, sync_id: int) -> None:
        """Returns once every published group of the sync was acked by every consumer."""
        self._wait(sync_id, lambda: not self._held, "every consumer to finish reading")

    def abort(self, sync_id: int) -> None:
        """Marks sync `sync_id` aborted: polling engines see it at once; the slots are released."""
        with self._lock:
            self.status[0] = sync_id
            if self.sync_id == sync_id:
                self._held.clear()
                self.sync_id = None

    def stats(self) -> dict:
        with self._lock:
            return {
                "max_groups_held": self.max_groups_held,
                "groups_held": len(self._held),
                "groups_published": self.groups_published,
                "bytes_published": self.bytes_published,
                "num_slots": self.num_slots,
                "slot_bytes": self.slot_bytes,
                "agent_name": self.agent.name,
            }

    def close(self) -> None:
        """Deregisters the slots and the status words (a producer in the trainer process; an actor just dies).

        Any sync in progress is marked aborted first, so engines polling it stop. Idempotent."""
        with self._lock:
            if self.agent is None:
                return
            if self.sync_id is not None:
                self.status[0] = self.sync_id  # the abort word, as abort() writes it
                self._held.clear()
                self.sync_id = None
            if self._slots_reg is not None:
                self.agent.deregister_memory(self._slots_reg)
            self.agent.deregister_memory(self._status_reg)
            self._slots_reg = self._status_reg = None
            self.slots = []
            self.agent = None

    # ---- internals -----------------------------------------------------------------------------

    def _allocate(self, slot_bytes: int) -> None:
        if self._slots_reg is not None:
            self.agent.deregister_memory(self._slots_reg)
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=self.device) for _ in range(self.num_slots)]
        self._slots_reg = self.agent.register_memory(self.slots)
        self.slot_bytes = slot_bytes
        self.status[1:] = EMPTY

    def _descriptor(self) -> dict:
        mem_type, device_id = mem_type_of(self.device)
        return {
            "rank": self.rank,
            "agent_name": self.agent.name,
            "agent_metadata_b64": base64.b64encode(self.agent.get_agent_metadata()).decode("ascii"),
            "mem_type": mem_type,
            "device_id": device_id,
            "slots": [[s.data_ptr(), s.numel()] for s in self.slots],
            "status": [self.status.data_ptr(), self.status.numel() * 8],
        }

    def _poll_acks(self) -> None:
        """Counts new acks (lock held); frees every slot whose group all consumers have read."""
        for consumer, messages in self.agent.get_new_notifs().items():
            for message in messages:
                kind, _, rest = bytes(message).decode(errors="replace").partition(":")
                sync, _, group = rest.partition(":")
                if kind == "ack" and sync.isdigit() and group.isdigit() and int(sync) == self.sync_id:
                    self._acks.setdefault(int(group), set()).add(consumer)
        for slot, group in list(self._held.items()):
            if len(self._acks.get(group, ())) >= self.num_consumers:
                del self._held[slot]

    def _wait(self, sync_id: int, done, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        pause = 1e-4
        waiting: dict = {}
        while True:
            with self._lock:
                if int(self.status[0]) == sync_id:
                    raise RuntimeError(f"sharded_rdt producer {self.rank}: sync {sync_id} was aborted")
                if self.sync_id == sync_id:  # else: not begun yet (rank 0 begins every rank's sync)
                    self._poll_acks()
                    if done():
                        return
                waiting = {g: sorted(self._acks.get(g, ())) for g in self._held.values()}
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"sharded_rdt producer {self.rank}: waited {self.timeout_s} s for {what} (sync {sync_id}); "
                    f"groups still held and the consumers that acked them: {waiting} "
                    f"(expected {self.num_consumers} consumers)"
                )
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)
