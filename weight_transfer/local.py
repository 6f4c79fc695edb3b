"""The "local" backend: update_info carries the HF-named tensors themselves (in-process, over ZMQ, or base64 over HTTP).

The simplest backend and the reference for the others: no transport to set up, so any client
works (LocalWeightSyncClient with encoding "tensors", HTTPWeightSyncClient with "b64").

init_info:   {"backend": "local"}
update_info: {"weights": {hf_name: torch.Tensor | numpy.ndarray, ...}}
             CPU tensors and numpy arrays cross the EngineCore's ZMQ socket as zero-copy frames
             (engine/serial_utils.py), so this form works in-process and over a real engine process.
         or  {"weights": [{"name": str, "dtype": "bfloat16", "shape": [int, ...], "data_b64": str}, ...]}
             the JSON-safe form for HTTP: data_b64 is the base64 of the tensor's raw little-endian
             bytes in row-major order. Nothing is ever unpickled.
"""

from __future__ import annotations

import base64
import binascii
import math
import time
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from weight_transfer.base import SyncStats, TrainerWeightTransferEngine, WeightTransferEngine, WeightUpdateInfo

_B64_FIELDS = ("name", "dtype", "shape", "data_b64")


class LocalWeightTransferEngine(WeightTransferEngine):
    """Takes the tensors straight out of update_info; nothing to set up or tear down."""

    def parse_init_info(self, init_info: dict) -> dict:
        unknown = sorted(set(init_info) - {"backend"})
        if unknown:
            raise ValueError(f"init_info: unknown field(s) {unknown} for backend 'local'")
        return dict(init_info)

    def init_transfer(self, init_info: dict) -> None:
        pass

    def parse_update_info(self, update_info: dict) -> WeightUpdateInfo:
        if not isinstance(update_info, Mapping):
            raise ValueError(f"update_info: expected a dict, got {type(update_info).__name__}")
        unknown = sorted(set(update_info) - {"weights"})
        if unknown:
            raise ValueError(f"update_info: unknown field(s) {unknown}; the local backend takes only 'weights'")
        if "weights" not in update_info:
            raise ValueError("update_info.weights: missing")
        weights = update_info["weights"]
        if isinstance(weights, Mapping):
            pairs = [(name, _as_tensor(name, value)) for name, value in weights.items()]
        elif isinstance(weights, (list, tuple)):
            pairs = [_decode_b64_entry(i, entry) for i, entry in enumerate(weights)]
        else:
            raise ValueError(
                "update_info.weights: expected {name: tensor} or a list of "
                f"{{name, dtype, shape, data_b64}} entries, got {type(weights).__name__}"
            )
        for name, _ in pairs:
            if not isinstance(name, str) or not name:
                raise ValueError(f"update_info.weights: tensor names must be non-empty strings, got {name!r}")
        return WeightUpdateInfo(
            names=[n for n, _ in pairs],
            dtypes=[t.dtype for _, t in pairs],
            shapes=[tuple(t.shape) for _, t in pairs],
            extra={"tensors": [t for _, t in pairs]},
        )

    def receive_weights(self, info: WeightUpdateInfo) -> Iterable[tuple[str, torch.Tensor]]:
        return zip(info.names, info.extra["tensors"])


def _as_tensor(name: str, value) -> torch.Tensor:
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


def _torch_dtype(name: str, where: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{where}.dtype: {name!r} is not a torch dtype name (e.g. 'float32', 'bfloat16')")
    return dtype


def _decode_b64_entry(index: int, entry) -> tuple[str, torch.Tensor]:
    where = f"update_info.weights[{index}]"
    if not isinstance(entry, Mapping):
        raise ValueError(f"{where}: expected a dict with fields {list(_B64_FIELDS)}, got {type(entry).__name__}")
    missing = [f for f in _B64_FIELDS if f not in entry]
    unknown = sorted(set(entry) - set(_B64_FIELDS))
    if missing or unknown:
        raise ValueError(f"{where}: missing field(s) {missing}, unknown field(s) {unknown}")
    name = entry["name"]
    where = f"update_info.weights[{index}] ({name!r})"
    dtype = _torch_dtype(entry["dtype"], where)
    shape = entry["shape"]
    if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ValueError(f"{where}.shape: expected a list of non-negative ints, got {shape!r}")
    try:
        raw = base64.b64decode(entry["data_b64"], validate=True)
    except (binascii.Error, TypeError, ValueError) as e:
        raise ValueError(f"{where}.data_b64: not valid base64: {e}") from None
    itemsize = dtype.itemsize
    expected = math.prod(shape) * itemsize
    if len(raw) != expected:
        raise ValueError(
            f"{where}.data_b64: {len(raw)} bytes, but shape {list(shape)} of {entry['dtype']} needs {expected}"
        )
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return name, flat.view(dtype).reshape(shape)


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
                "dtype": str(t.dtype).removeprefix("torch."),
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


@dataclass(frozen=True)
class LocalTrainerInitInfo:
    """Trainer settings of the local backend: how tensors are encoded and how many bytes go per call."""

    backend: ClassVar[str] = "local"
    encoding: str = "tensors"  # "tensors" (in-process or ZMQ clients) or "b64" (HTTP)
    max_bytes_per_call: int = 256 << 20

    def __post_init__(self) -> None:
        if self.encoding not in ("tensors", "b64"):
            raise ValueError(f"encoding: {self.encoding!r} is not supported; use 'tensors' or 'b64'")
        if self.max_bytes_per_call < 1:
            raise ValueError(f"max_bytes_per_call: must be >= 1, got {self.max_bytes_per_call}")


class LocalTrainerWeightTransferEngine(TrainerWeightTransferEngine):
    """Sends tensors inside update_info, in calls of at most max_bytes_per_call bytes (a bigger tensor goes alone)."""

    backend = "local"

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None) -> "LocalTrainerWeightTransferEngine":
        if isinstance(init_info, dict):
            init_info = LocalTrainerInitInfo(**{k: v for k, v in init_info.items() if k != "backend"})
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if rank == 0:
            client.init_weight_transfer_engine({"backend": "local"})
        return cls(init_info, client, source, rank)

    def send_weights(self, source=None, *, weight_version: str | None = None) -> SyncStats:
        source = self._source(source)
        stats = SyncStats(self.backend, weight_version=weight_version)
        start = time.perf_counter()
        sender = self.rank == 0
        if sender:
            self.client.start_weight_update()
        try:
            batch: list[tuple[str, torch.Tensor]] = []
            batch_bytes = 0
            tensors = source.iter_full()  # every rank iterates: a sharded source gathers here
            for meta in source.metadata:
                # Flush before gathering a tensor that would overflow the call: at most one call's bytes are held.
                if sender and batch and batch_bytes + meta.nbytes > self.init_info.max_bytes_per_call:
                    self.client.update_weights(make_update_info(batch, self.init_info.encoding))
                    batch, batch_bytes = [], 0
                name, tensor = next(tensors)
                if not sender:
                    continue
                nbytes = tensor.numel() * tensor.element_size()
                batch.append((name, tensor.detach().cpu()))
                batch_bytes += nbytes
                stats.num_tensors += 1
                stats.bytes_sent += nbytes
            if sender and batch:
                self.client.update_weights(make_update_info(batch, self.init_info.encoding))
        except BaseException:
            if sender:
                _abort_quietly(self.client)
            raise
        if sender:
            self.client.finish_weight_update(weight_version)
        stats.dense_bytes = stats.bytes_sent
        stats.seconds = time.perf_counter() - start
        return stats

    def shutdown(self) -> None:
        if self.rank == 0:
            self.client.shutdown_weight_transfer_engine()


def _abort_quietly(client) -> None:
    """Tells the engine to drop a half-done update; the original error is the one worth raising."""
    try:
        client.abort_weight_update()
    except Exception:  # the engine may be the thing that failed
        pass
