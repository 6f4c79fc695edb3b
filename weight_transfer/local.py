"""The "local" backend: update_info carries the HF-named tensors themselves (in-process, over ZMQ, or base64 over HTTP).

The simplest backend and the reference for the others: no transport to set up, so any client
works (LocalWeightSyncClient with encoding "tensors", HTTPWeightSyncClient with "b64").

init_info:   {"backend": "local"}   (LocalInitInfo; update_info: LocalUpdateInfo)
update_info: {"weights": {hf_name: torch.Tensor | numpy.ndarray, ...}}
             CPU tensors and numpy arrays cross the EngineCore's ZMQ socket as zero-copy frames
             (engine/serial_utils.py), so this form works in-process and over a real engine process.
         or  {"weights": [{"name": str, "dtype": "bfloat16", "shape": [int, ...], "data_b64": str}, ...]}
             the JSON-safe form for HTTP: data_b64 is the base64 of the tensor's raw little-endian
             bytes in row-major order. Nothing is ever unpickled.
"""

from __future__ import annotations

import base64
import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import msgspec
import numpy as np
import torch

from weight_transfer.base import (
    InitInfo,
    SyncStats,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
    WeightTransferEngine,
    WeightUpdateInfo,
)
from weight_transfer.messages import Message, NonEmptyStr, NonNegInt, int_in
from weight_transfer.packing import dtype_name


class LocalInitInfo(InitInfo):
    """init_info of the local backend: nothing but "backend"."""


class B64Weight(Message):
    """One tensor in the JSON-safe form: data_b64 is the base64 of its raw little-endian row-major bytes."""

    name: NonEmptyStr
    dtype: torch.dtype
    shape: list[NonNegInt]
    data: bytes = msgspec.field(name="data_b64")  # decoded from base64 by msgspec

    def check(self) -> None:
        expected = math.prod(self.shape) * self.dtype.itemsize
        if len(self.data) != expected:
            raise ValueError(
                f".data_b64: {len(self.data)} bytes, but shape {self.shape} of {dtype_name(self.dtype)} needs {expected}"
            )


class LocalUpdateInfo(Message):
    """update_info of the local backend: the tensors themselves, by name, or in the JSON-safe form."""

    # {hf_name: torch.Tensor | numpy.ndarray}: objects of this process (or ZMQ frames), which
    # msgspec passes through as they are; _as_tensor takes them.
    weights: dict[NonEmptyStr, Any] | list[B64Weight]


@dataclass(kw_only=True)
class LocalWeightUpdate(WeightUpdateInfo):
    tensors: list[torch.Tensor]  # the call's tensors, in the order of names


class LocalWeightTransferEngine(WeightTransferEngine[LocalInitInfo, LocalUpdateInfo]):
    """Takes the tensors straight out of update_info; nothing to set up or tear down."""

    def init_transfer(self, init_info: LocalInitInfo) -> None:
        pass

    def plan_update(self, update_info: LocalUpdateInfo) -> LocalWeightUpdate:
        if isinstance(update_info.weights, dict):
            pairs = [(name, _as_tensor(name, value)) for name, value in update_info.weights.items()]
        else:
            pairs = [(w.name, _b64_tensor(w)) for w in update_info.weights]
        return LocalWeightUpdate(
            names=[n for n, _ in pairs],
            dtypes=[t.dtype for _, t in pairs],
            shapes=[tuple(t.shape) for _, t in pairs],
            tensors=[t for _, t in pairs],
        )

    def receive_weights(self, info: LocalWeightUpdate) -> Iterable[tuple[str, torch.Tensor]]:
        return zip(info.names, info.tensors)


def _as_tensor(name: str, value: Any) -> torch.Tensor:
    """A tensor of the {name: tensor} form as torch, without a copy. A dispatch on the two array types
    this process may hold, not a field check: msgspec has no type for them (they never cross JSON)."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, np.ndarray):
        try:
            with warnings.catch_warnings():  # arrays received over ZMQ are read-only; we only read them
                warnings.simplefilter("ignore", UserWarning)
                return torch.from_numpy(value)
        except TypeError as e:
            raise ValueError(f"update_info.weights[{name!r}]: numpy dtype {value.dtype} is not supported: {e}") from None
    raise ValueError(
        f"update_info.weights[{name!r}]: expected a torch.Tensor or numpy.ndarray, got {type(value).__name__}"
    )


def _b64_tensor(weight: B64Weight) -> torch.Tensor:
    """The tensor of a JSON-safe entry (its byte count was checked against its shape)."""
    flat = torch.frombuffer(bytearray(weight.data), dtype=torch.uint8) if weight.data else torch.empty(0, dtype=torch.uint8)
    return flat.view(weight.dtype).reshape(weight.shape)


# ---------------------------------------------------------------------------------------
# Trainer side: building update_info for this backend.


def encode_weights_b64(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[dict]:
    """The JSON-safe update_info["weights"] list for (hf_name, tensor) pairs (tensors may live on any device)."""
    entries = []
    for name, tensor in named_tensors:
        t = tensor.detach().contiguous().cpu()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        entries.append(
            {
                "name": name,
                "dtype": dtype_name(t.dtype),
                "shape": list(t.shape),
                "data_b64": base64.b64encode(raw).decode("ascii"),
            }
        )
    return entries


def make_update_info(named_tensors: Iterable[tuple[str, torch.Tensor]], encoding: str = "tensors") -> dict:
    """update_info for the local backend: encoding "tensors" (CPU tensors, for in-process/ZMQ) or "b64" (HTTP)."""
    if encoding == "tensors":
        return {"weights": {name: t.detach().contiguous().cpu() for name, t in named_tensors}}
    if encoding == "b64":
        return {"weights": encode_weights_b64(named_tensors)}
    raise ValueError(f"encoding: {encoding!r} is not supported; use 'tensors' or 'b64'")


class LocalTrainerInitInfo(TrainerInitInfo):
    """Trainer settings of the local backend: how tensors are encoded and how many bytes go per call."""

    backend: ClassVar[str] = "local"
    encoding: Literal["tensors", "b64"] = "tensors"  # "tensors" (in-process or ZMQ clients) or "b64" (HTTP)
    max_bytes_per_call: int_in(1) = 256 << 20


class LocalTrainerWeightTransferEngine(TrainerWeightTransferEngine[LocalTrainerInitInfo]):
    """Sends tensors inside update_info, in calls of at most max_bytes_per_call bytes (a bigger tensor goes alone)."""

    backend = "local"

    @classmethod
    def _start(cls, init_info: LocalTrainerInitInfo, *, client, source) -> "LocalTrainerWeightTransferEngine":
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if rank == 0:
            client.init_weight_transfer_engine({"backend": "local"})
        return cls(init_info, client, source, rank)

    def _send_in_one_call(self, source: WeightSource, post) -> SyncStats | None:
        """A sync that fits one call (max_bytes_per_call; an adapter's, usually): its tensors in one
        apply_weight_update, the whole update in one round trip."""
        metas = source.metadata
        if len(metas) > 1 and sum(m.nbytes for m in metas) > self.init_info.max_bytes_per_call:
            return None
        stats = SyncStats(self.backend)
        batch = [(name, tensor.detach().cpu()) for name, tensor in source.iter_full()]
        stats.num_tensors = len(batch)
        stats.bytes_sent = stats.dense_bytes = sum(t.numel() * t.element_size() for _, t in batch)
        post(make_update_info(batch, self.init_info.encoding))()
        return stats

    def _send(self, source: WeightSource) -> SyncStats:
        stats = SyncStats(self.backend)
        batch: list[tuple[str, torch.Tensor]] = []
        batch_bytes = 0
        tensors = source.iter_full()
        for meta in source.metadata:
            # Flush before gathering a tensor that would overflow the call: at most one call's bytes are held.
            if batch and batch_bytes + meta.nbytes > self.init_info.max_bytes_per_call:
                self.client.update_weights(make_update_info(batch, self.init_info.encoding))
                batch, batch_bytes = [], 0
            name, tensor = next(tensors)
            nbytes = tensor.numel() * tensor.element_size()
            batch.append((name, tensor.detach().cpu()))
            batch_bytes += nbytes
            stats.num_tensors += 1
            stats.bytes_sent += nbytes
        if batch:
            self.client.update_weights(make_update_info(batch, self.init_info.encoding))
        stats.dense_bytes = stats.bytes_sent
        return stats

    def shutdown(self) -> None:
        if self.rank == 0:
            self.client.shutdown_weight_transfer_engine()
