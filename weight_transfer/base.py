"""Weight sync interfaces: the trainer's WeightSource and TrainerWeightTransferEngine, the engine's WeightTransferEngine.

A backend moves HF-named tensors from a trainer into every engine worker. On the trainer a
WeightSource says what there is (metadata) and yields the tensors; a
TrainerWeightTransferEngine moves them and alone talks to the engine through a client
(weight_transfer/clients.py). On the engine a WeightTransferEngine receives them. The worker
(engine/worker/weight_update.py) drives it through one lifecycle:

    bind_worker, bind_model                      once, when the transfer engine is created
    parse_init_info -> rendezvous               once, when the transfer engine is created
    init_transfer                               once, in a background thread (see rendezvous)
    start_update                                 once per weight update
    parse_update_info -> receive_weights         once per update_weights call (any number)
    finish_update or abort_update                once per weight update
    shutdown                                     when the transfer engine goes away

parse_update_info returns the names, dtypes and shapes the call will deliver, so the worker
can reject a bad update before a single byte moves; receive_weights then yields the tensors.
Backends never touch model parameters: the worker validates everything a call delivered and
only then lands it through the model's weight loaders.

Each backend declares its messages once, as msgspec Structs (weight_transfer/messages.py):
WeightTransferEngine[InitT, UpdateT] parses init_info into InitT and update_info into UpdateT,
and TrainerWeightTransferEngine[TrainerInitT] a trainer's settings into TrainerInitT, all
through parse_message; a backend only adds the checks against its own state and the transfer.
"""

from __future__ import annotations

import functools
import importlib
import logging
import math
import re
import time
import typing
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar, Generic, TypeVar

import torch
from torch import nn

from weight_transfer import sync_trace

# INT64_MAX and MAX_TIMEOUT_S bound every message; callers that bound their own inputs (HTTP bodies) import them here.
from weight_transfer.messages import INT64_MAX, MAX_TIMEOUT_S, Message, parse_message  # noqa: F401

logger = logging.getLogger(__name__)

InitT = TypeVar("InitT", bound=Message)
UpdateT = TypeVar("UpdateT", bound=Message)


@dataclass(frozen=True)
class Rendezvous:
    """Whom a backend's init_transfer waits on and for how long; the worker acts on it.

    init_transfer runs in a background thread, so that the engine keeps serving while it waits;
    the worker gives up on it after timeout_s (plus a short grace: the backend's own bounded
    waits report first) with PeerTimeoutError naming `peer`. When `host` is set, init_transfer
    connects out to it, and the worker checks it against the engine's weight_transfer_allowed_hosts
    before init_transfer starts (ValueError naming `where`).
    """

    timeout_s: float
    peer: str = "the trainer"  # for messages, e.g. "the trainer's TCPStore at 10.0.0.1:29500"
    host: str | None = None  # the address init_transfer connects to; None: it connects nowhere
    where: str = "init_info.master_address"  # the init_info field that gave `host`


class InitInfo(Message, kw_only=True):
    """Base of an engine-side init_info: the "backend" key names the backend, which the worker dispatched on."""

    backend: str | None = None


@dataclass
class WeightUpdateInfo:
    """What one update_weights call will deliver: per tensor its HF name, dtype and shape (same order).

    A backend subclasses it for what its receive_weights needs besides (a packing plan, a call id).
    """

    names: list[str]
    dtypes: list[torch.dtype]
    shapes: list[tuple[int, ...]]
    # views_stable_per_call backends: equal keys promise that receive_weights yields the very same
    # tensor views again (same buffer, same tensors), so the worker may reuse what it built for them.
    reuse_key: Hashable | None = None
    # Optional: consecutive runs of tensors (their counts, summing to len(names)) whose views all stay
    # valid until the first tensor of the next run is pulled (e.g. nccl's packs), so the worker may
    # check and land each run together instead of tensor by tensor.
    group_sizes: list[int] | None = None
    # Optional: the call's tensors end to end in order with no gap, of one dtype, as one flat tensor whose
    # consecutive ranges are the views receive_weights yields (valid as they are, once the first is pulled),
    # so the worker may land the whole call in one copy (e.g. ipc's pack).
    flat: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not (len(self.names) == len(self.dtypes) == len(self.shapes)):
            raise ValueError(
                f"update_info: {len(self.names)} names, {len(self.dtypes)} dtypes and "
                f"{len(self.shapes)} shapes; they must have the same length"
            )


DEFAULT_INIT_TIMEOUT_S = 60.0  # Rendezvous.timeout_s of a backend whose init waits on no peer


class WeightTransferEngine(ABC, Generic[InitT, UpdateT]):
    """Engine side of one transfer backend, owned by a worker for the device it serves.

    A backend subclasses WeightTransferEngine[ItsInitInfo, ItsUpdateInfo] (two Message types, see
    InitInfo): init_info_type and update_info_type are taken from there.
    """

    init_info_type: ClassVar[type[Message]]
    update_info_type: ClassVar[type[Message]]

    # True when every tensor receive_weights yields stays valid until the update_weights call
    # returns (one buffer per call, refilled only after the call): the worker may then collect a
    # call's tensors and land them together, one finite check and one multi-tensor copy.
    views_stable_per_call: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        declared = _declared_types(cls, WeightTransferEngine)
        if declared is not None:
            cls.init_info_type, cls.update_info_type = declared

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # This worker's place in its engine (tensor parallelism): set by bind_worker before init_transfer.
        self.worker_rank, self.workers_per_engine = 0, 1
        # WeightTransferConfig.weight_transfer_allow_pickled_ipc_handles, set by the worker before init_transfer:
        # whether vLLM's pickled ipc handles may be read (only the ipc backend has any).
        self.allow_pickled_ipc_handles = False
        # WeightTransferConfig.weight_transfer_allowed_hosts (engine.allowed_hosts.AllowedHosts), set by the
        # worker before init_transfer, for an address a backend learns only while it connects (nccl: the
        # NCCL bootstrap address inside the unique id read from the trainer's store). None: no check.
        self.allowed_hosts = None

    def bind_worker(self, worker_rank: int, workers_per_engine: int) -> None:
        """Called once, before init_transfer, with this worker's rank among its engine's workers and
        their number (the tensor-parallel rank and size). Every worker receives the full tensors;
        a backend whose transport has one rank per worker (nccl) joins at its own rank."""
        if not (isinstance(workers_per_engine, int) and workers_per_engine >= 1
                and isinstance(worker_rank, int) and 0 <= worker_rank < workers_per_engine):
            raise ValueError(f"worker_rank {worker_rank!r} is not in [0, workers_per_engine {workers_per_engine!r})")
        self.worker_rank, self.workers_per_engine = worker_rank, workers_per_engine

    def bind_model(self, model: nn.Module) -> None:
        """Called once, before init_transfer, with the model this worker serves. A backend may plan
        against its weight loaders (sharded_rdt records which slices this worker consumes); it never
        changes the model."""

    def parse_init_info(self, init_info: dict) -> InitT:
        """init_info (as a client sent it) as this backend's init message; ValueError naming a bad field."""
        info = parse_message(init_info, self.init_info_type, "init_info")
        self.check_init_info(info)
        return info

    def check_init_info(self, init_info: InitT) -> None:
        """Checks a parsed init_info against this worker (its device, its rank); ValueError naming the field."""

    def rendezvous(self, init_info: InitT) -> Rendezvous:
        """Whom init_transfer(init_info) waits on, for how long, and where it connects (see Rendezvous).

        A backend whose engine side connects out to an address given in init_info must name it
        here (host), so that the address is checked before any connection is attempted."""
        return Rendezvous(timeout_s=DEFAULT_INIT_TIMEOUT_S)

    @abstractmethod
    def init_transfer(self, init_info: InitT) -> None:
        """Sets the transport up (join a process group, open a handle, ...) with parsed init info.

        Runs in a background thread of the worker (never concurrently with another call on this
        object), bounded by rendezvous(init_info).timeout_s; when that passes first, the object is
        abandoned and shut down once init_transfer returns."""

    def start_update(self) -> None:
        """Called once before the update_weights calls of one update."""

    def parse_update_info(self, update_info: dict) -> WeightUpdateInfo:
        """update_info (as a client sent it) parsed and planned; ValueError naming a bad field. Moves no weights."""
        return self.plan_update(parse_message(update_info, self.update_info_type, "update_info"))

    @abstractmethod
    def plan_update(self, update_info: UpdateT) -> WeightUpdateInfo:
        """What the parsed call will deliver, checked against this worker's state (its transport, its
        buffers); ValueError naming a bad field. Moves no weights."""

    @abstractmethod
    def receive_weights(self, info: WeightUpdateInfo) -> Iterable[tuple[str, "torch.Tensor | SparseWeightPatch"]]:
        """Yields the (hf_name, tensor or patch) pairs that `info` announced, in order.

        The worker lands each pair before it asks for the next, so a backend may yield views
        into a receive buffer and reuse that buffer once the generator resumes. A transport
        failure (peer gone, timeout) raises from here; the worker then restores the weights
        it held at start_update.
        """

    def finish_update(self) -> None:
        """Called once after the last update_weights call of one update."""

    def abort_update(self) -> None:
        """Called instead of finish_update when the update is abandoned (transfer failed, or aborted by the trainer)."""

    def shutdown(self) -> None:
        """Releases the transport; the object is not used afterwards."""


# ---------------------------------------------------------------------------------------
# Registry: name -> "module:Class", imported on first use so that a backend's dependencies
# (NCCL, Ray, NIXL) load only when someone asks for that backend.

_ENGINE_BACKENDS: dict[str, str | type[WeightTransferEngine]] = {
    "local": "weight_transfer.local:LocalWeightTransferEngine",
    "nccl": "weight_transfer.nccl:NCCLWeightTransferEngine",
    "sparse_nccl": "weight_transfer.sparse_nccl:SparseNCCLWeightTransferEngine",
    "ipc": "weight_transfer.ipc:IPCWeightTransferEngine",
    "sharded_rdt": "weight_transfer.sharded_rdt:ShardedRDTWeightTransferEngine",
}


def register_engine_backend(name: str, target: str | type[WeightTransferEngine]) -> None:
    """Registers (or replaces) backend `name` as a class or a lazy "module:Class" path."""
    _register(_ENGINE_BACKENDS, name, target)


def known_engine_backends() -> list[str]:
    return sorted(_ENGINE_BACKENDS)


def get_engine_backend(name: str) -> type[WeightTransferEngine]:
    """The WeightTransferEngine class registered as `name`; ValueError listing the known ones if none is."""
    return _resolve(_ENGINE_BACKENDS, name, WeightTransferEngine, "weight transfer backend")


def _register(registry: dict, name: str, target) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError("backend name must be a non-empty string")
    if isinstance(target, str) and ":" not in target:
        raise ValueError(f"backend {name!r}: target {target!r} must look like 'package.module:ClassName'")
    registry[name] = target


def _resolve(registry: dict, name: str, base: type, kind: str) -> type:
    """registry[name] as a class, importing a lazy "module:Class" entry on first use."""
    target = registry.get(name) if isinstance(name, str) else None
    if target is None:
        raise ValueError(f"backend: unknown {kind} {name!r}; known: {sorted(registry)}")
    if isinstance(target, str):
        module_name, _, class_name = target.partition(":")
        cls = getattr(importlib.import_module(module_name), class_name)
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise TypeError(f"backend {name!r}: {target} is not a {base.__name__} subclass")
        registry[name] = target = cls
    return target


# =======================================================================================
# Trainer side
# =======================================================================================


@dataclass(frozen=True)
class Replicate:
    """A mesh axis along which every coordinate holds the whole extent (vLLM's weight_transfer.base.Replicate)."""


@dataclass(frozen=True)
class Shard:
    """A mesh axis that splits tensor dimension `dim` as torch.chunk does (vLLM's weight_transfer.base.Shard)."""

    dim: int


Placement = Replicate | Shard


@dataclass(frozen=True)
class ParamMeta:
    """One tensor of a trainer model as the engine will receive it (full, unsharded).

    Same constructor as vLLM's ParamMeta, so a WeightSource written for vLLM's base works here:
    `owners` None means every trainer rank holds it; `mesh_shape` (row-major, over `owners`;
    default `(len(owners),)`) and `placements` (one Replicate or Shard per mesh axis; all
    Replicate is stored as None) describe a sharded layout. Our own sources also give
    placements as strings (a DTensor's placements, e.g. "Shard(dim=0)"); () and None both mean
    a plain tensor.
    """

    name: str  # HF name, e.g. "model.layers.0.self_attn.q_proj.weight"
    dtype: torch.dtype
    shape: tuple[int, ...]  # the full tensor's shape
    owners: tuple[int, ...] | None = field(default=None, kw_only=True)  # trainer ranks holding a piece; None: all
    mesh_shape: tuple[int, ...] | None = field(default=None, kw_only=True)
    placements: tuple[Placement | str, ...] | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        where = f"ParamMeta {self.name!r}"
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"{where}: dtype must be a torch.dtype, got {type(self.dtype).__name__}")
        placements = tuple(self.placements) if self.placements is not None else None
        if self.owners is None:
            if self.mesh_shape is not None or (placements and not all(isinstance(p, str) for p in placements)):
                raise ValueError(f"{where}: mesh_shape or Shard/Replicate placements need owners")
            object.__setattr__(self, "placements", placements)
            return
        owners = tuple(self.owners)
        if not owners or len(set(owners)) != len(owners) or any(
            isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in owners
        ):
            raise ValueError(f"{where}: owners must be distinct non-negative ranks, got {self.owners!r}")
        mesh = (len(owners),) if self.mesh_shape is None else tuple(self.mesh_shape)
        if any(d <= 0 for d in mesh) or math.prod(mesh) != len(owners):
            raise ValueError(f"{where}: mesh_shape {mesh} does not cover its {len(owners)} owners")
        if placements is not None and not all(isinstance(p, str) for p in placements):
            if len(placements) != len(mesh):
                raise ValueError(f"{where}: {len(placements)} placements for a {len(mesh)}-D mesh")
            for p in placements:
                if isinstance(p, Shard):
                    if not 0 <= p.dim < len(self.shape):
                        raise ValueError(f"{where}: Shard(dim={p.dim}) of a {len(self.shape)}-D tensor")
                elif not isinstance(p, Replicate):
                    raise TypeError(f"{where}: placement {p!r} is neither Replicate nor Shard")
            if all(isinstance(p, Replicate) for p in placements):
                placements = None
        object.__setattr__(self, "owners", owners)
        object.__setattr__(self, "mesh_shape", mesh)
        object.__setattr__(self, "placements", placements)

    def owned_by(self, rank: int) -> bool:
        return self.owners is None or rank in self.owners

    @property
    def sharded(self) -> bool:
        """More than one owner, or a sharded layout: iter_full gathers (a collective) for it."""
        return bool(self.placements) or (self.owners is not None and len(self.owners) > 1)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class SparseWeightPatch:
    """Changed coordinates of one tensor: tensor.view(-1)[indices] = values, everything else unchanged."""

    name: str
    indices: torch.Tensor  # int32 [nnz], flat (row-major) positions, unique
    values: torch.Tensor  # [nnz], the tensor's dtype
    full_shape: tuple[int, ...]

    def validate(self, dtype: torch.dtype | None = None) -> None:
        """Raises ValueError naming the patch when it is malformed (never touches a weight)."""
        where = f"sparse patch {self.name!r}"
        numel = 1
        for d in self.full_shape:
            numel *= d
        if self.indices.dtype != torch.int32 or self.indices.dim() != 1:
            raise ValueError(f"{where}: indices must be a flat int32 tensor, got {self.indices.dtype} {list(self.indices.shape)}")
        if self.values.dim() != 1 or self.values.shape[0] != self.indices.shape[0]:
            raise ValueError(f"{where}: {self.indices.shape[0]} indices but values of shape {list(self.values.shape)}")
        if not self.values.dtype.is_floating_point:
            raise ValueError(f"{where}: values dtype {self.values.dtype} is not a floating-point dtype")
        if dtype is not None and self.values.dtype != dtype:
            raise ValueError(f"{where}: values dtype {self.values.dtype} differs from the tensor's {dtype}")
        if self.indices.numel():
            if int(self.indices.min()) < 0 or int(self.indices.max()) >= numel:
                raise ValueError(f"{where}: indices out of range [0, {numel})")
            if torch.unique(self.indices).numel() != self.indices.numel():
                raise ValueError(f"{where}: indices are not unique")
            if not bool(torch.isfinite(self.values).all()):
                raise ValueError(f"{where}: values contain NaN or inf")


class WeightSource(ABC):
    """What a trainer rank can send: metadata (identical on every rank) and fresh passes over the tensors.

    Written either our way (`_metadata()`, cached into `metadata`) or vLLM's (`metadata` itself a
    functools.cached_property): a subclass of vLLM's WeightSource works here unchanged once it
    imports this one. iter_local is optional (vLLM's sources may have only iter_full); a backend
    that needs it says so.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        metadata = cls.__dict__.get("metadata")
        if metadata is not None and not isinstance(metadata, cached_property):
            raise TypeError(
                f"{cls.__name__}.metadata must be a functools.cached_property (engines read it repeatedly; "
                "it must not change), or define _metadata() instead"
            )

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        return self._metadata()

    def _metadata(self) -> list[ParamMeta]:
        """The tensors, in the order every pass yields them (or override `metadata`)."""
        raise NotImplementedError(f"{type(self).__name__}: define metadata (a cached_property) or _metadata()")

    def owned_names(self, rank: int) -> list[str]:
        """The names `rank` iterates, in metadata order."""
        return [m.name for m in self.metadata if m.owned_by(rank)]

    def implements_iter_full(self) -> bool:
        return type(self).iter_full is not WeightSource.iter_full

    def implements_iter_local(self) -> bool:
        return type(self).iter_local is not WeightSource.iter_local

    @abstractmethod
    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) in metadata order. Sharded sources gather while iterating, so
        every rank must run the same pass; memory stays bounded to one full tensor."""

    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, this rank's local piece) in metadata order; no communication."""
        raise NotImplementedError(f"{type(self).__name__} does not implement iter_local")

    def plain_tensors(self) -> list[tuple[str, torch.Tensor]] | None:
        """What iter_full yields, as one list that is the same object on every call while the source holds the
        same tensors (their values change in place: a training step's), when each is a plain tensor yielded as
        it is (no gather, no cast); None otherwise, and always for a subclass that yields otherwise (its own
        iter_full). A sender may then plan a recurring sync once (ipc). The tensors may be parameters that require
        grad: read them under torch.no_grad()."""
        return None


_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


def layerwise_groups(names: Iterable[str]) -> list[list[str]]:
    """Names grouped by decoder layer, in first-seen order; names outside any layer form one group each side.

    Tensors before the first layer (embeddings) make the first group, those after the last
    (final norm, lm_head) the last one; a layer's tensors stay together so a consumer can
    load a layer as soon as its group arrives.
    """
    before: list[str] = []
    after: list[str] = []
    layers: dict[str, list[str]] = {}
    for name in names:
        m = _LAYER.match(name)
        if m:
            layers.setdefault(m.group(1), []).append(name)
        elif layers:
            after.append(name)
        else:
            before.append(name)
    return [g for g in [before, *layers.values(), after] if g]


def _placements(param: torch.Tensor) -> tuple[str, ...]:
    return tuple(repr(p) for p in param.placements) if _is_dtensor(param) else ()


def _is_dtensor(t: torch.Tensor) -> bool:
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(t, dtensor)


@functools.cache
def _dtensor_type() -> type | None:
    """torch's DTensor class, imported once (a sync asks this of every tensor); None: torch without distributed."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return DTensor


class ModuleSource(WeightSource):
    """A torch module (plain, or FSDP2 `fully_shard`ed with DTensor parameters) as a WeightSource.

    Names are the module's state_dict names (HF naming for an HF model), buffers excluded;
    `dtype` casts each tensor as it is yielded (e.g. float32 master weights -> bfloat16 engine);
    `names` filters (None: every parameter). Tied parameters appear once, under their first name.
    """

    def __init__(self, module: nn.Module, *, dtype: torch.dtype | None = None, names: Iterable[str] | None = None) -> None:
        self.module = module
        self.dtype = dtype
        self._names = set(names) if names is not None else None

    def _params(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p) for n, p in self.module.named_parameters() if self._names is None or n in self._names]

    def _metadata(self) -> list[ParamMeta]:
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        metas = []
        for name, p in self._params():
            # A plain tensor: every rank holds it (owners None); a DTensor: the ranks of the group.
            owners = tuple(range(world)) if _is_dtensor(p) else None
            metas.append(ParamMeta(name, self.dtype or p.dtype, tuple(p.shape), owners=owners,
                                   placements=_placements(p)))
        return metas

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        return t.to(self.dtype) if self.dtype is not None and t.dtype != self.dtype else t

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, p in self._params():
            yield name, self._cast(p.full_tensor() if _is_dtensor(p) else p)

    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, p in self._params():
            yield name, self._cast(p.to_local() if _is_dtensor(p) else p)


class StateDictSource(WeightSource):
    """{name: tensor} (or (name, tensor) pairs) as a WeightSource on one rank; for tests and scripts."""

    def __init__(self, tensors, *, dtype: torch.dtype | None = None) -> None:
        items = tensors.items() if hasattr(tensors, "items") else tensors
        self.tensors = [(n, t.detach() if dtype is None else t.detach().to(dtype)) for n, t in items]
        self._plain: bool | None = None

    def _metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.tensors]

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(list(self.tensors))

    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.iter_full()

    def plain_tensors(self) -> list[tuple[str, torch.Tensor]] | None:
        if self._plain is None:  # decided once: the list and its tensors' kinds do not change
            self._plain = (type(self).iter_full is StateDictSource.iter_full
                           and not any(_is_dtensor(t) for _, t in self.tensors))
        return self.tensors if self._plain else None


def as_source(source: "WeightSource | nn.Module | dict") -> WeightSource:
    if isinstance(source, WeightSource):
        return source
    if isinstance(source, nn.Module):
        return ModuleSource(source)
    if isinstance(source, dict):
        return StateDictSource(source)
    raise ValueError(f"source: expected a WeightSource, an nn.Module or a {{name: tensor}} dict, got {type(source).__name__}")


@dataclass
class SyncStats:
    """What one send_weights() did (filled on rank 0; other ranks report their own bytes)."""

    backend: str
    num_tensors: int = 0
    bytes_sent: int = 0  # payload bytes that crossed the transport
    dense_bytes: int = 0  # what a dense sync of the same tensors would have sent
    seconds: float = 0.0
    weight_version: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def gb_per_s(self) -> float:
        return self.dense_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


TrainerInitT = TypeVar("TrainerInitT", bound="TrainerInitInfo")


class TrainerInitInfo(Message):
    """Base of a backend's trainer-side settings: checked when built (NCCLTrainerInitInfo(...)) or parsed
    from their dict form; `backend` names the backend they are for."""

    where: ClassVar[str] = "init_info"
    backend: ClassVar[str]


class TrainerWeightTransferEngine(ABC, Generic[TrainerInitT]):
    """Trainer side of one backend. Every trainer rank constructs it and calls send_weights()
    and shutdown(); rank 0 is the sender and the only rank that talks to the client.

    A backend subclasses TrainerWeightTransferEngine[ItsTrainerInitInfo] and implements _start and
    _send; send_weights runs the engine's update lifecycle around _send once for all of them.
    """

    backend: ClassVar[str]
    init_info_type: ClassVar[type[TrainerInitInfo]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        declared = _declared_types(cls, TrainerWeightTransferEngine)
        if declared is not None:
            (cls.init_info_type,) = declared

    def __init__(self, init_info: TrainerInitT, client, source: WeightSource | None, rank: int) -> None:
        self.init_info = init_info
        self.client = client
        self.source = as_source(source) if source is not None else None
        self.rank = rank
        # The longest any client call may take (whatever the client's own timeout); None: the client's
        # own timeout alone (the local backend, whose calls carry the tensors and wait on nothing else).
        self.timeout_s: float | None = getattr(init_info, "timeout_s", None)

    @classmethod
    def parse_init_info(cls, init_info: Any) -> TrainerInitT:
        """init_info as this backend's settings: an init_info_type itself, or its dict form (with or
        without "backend"); ValueError naming a bad field."""
        if isinstance(init_info, cls.init_info_type):
            return init_info
        if not isinstance(init_info, Mapping):
            raise ValueError(
                f"init_info: expected a {cls.init_info_type.__name__} or its dict form, got {type(init_info).__name__}"
            )
        fields = dict(init_info)
        backend = fields.pop("backend", cls.backend)
        if backend != cls.backend:
            raise ValueError(f"init_info.backend: expected {cls.backend!r}, got {backend!r}")
        return parse_message(fields, cls.init_info_type, "init_info")

    @classmethod
    def trainer_init(cls, init_info: Any, *, client, source: "WeightSource | nn.Module | None" = None) -> "TrainerWeightTransferEngine":
        """Sets the transport up on this rank and (rank 0) asks the engine to join it through `client`."""
        return cls._start(cls.parse_init_info(init_info), client=client, source=source)

    @classmethod
    @abstractmethod
    def _start(cls, init_info: TrainerInitT, *, client, source) -> "TrainerWeightTransferEngine":
        """trainer_init with parsed settings."""

    def send_weights(self, source: "WeightSource | nn.Module | None" = None, *, weight_version: str | None = None) -> SyncStats:
        """One full sync: start_weight_update, every tensor of the source, finish_weight_update.

        Returns when the engine serves the new weights (under weight_version when given). On
        any failure the engine keeps its previous weights and this raises naming the cause.

        A source with a `lora_name` (weight_transfer.lora.AdapterSource) holds one LoRA adapter's tensors:
        the sync goes to that adapter of the engine (client.for_lora), through this same transport, and
        weight_version becomes the adapter's version; the base model's weights and version stay.

        A sync that fits one update_weights call (an adapter's, usually) is one engine call instead of three
        (apply_weight_update), when the backend supports it (_send_in_one_call); same guarantees.
        """
        src = self._source(source)
        if self.rank == 0:
            lora_name = getattr(src, "lora_name", None)
            if lora_name is None:
                return self._update(src, weight_version)
            # Every backend reaches the engine through self.client alone, so aiming it for this sync aims
            # all of its update_weights calls (including ones it posts from background threads meanwhile).
            client, self.client = self.client, self.client.for_lora(lora_name)
            try:
                return self._update(src, weight_version)
            finally:
                self.client = client
        stats = self._follow(src)
        stats.weight_version = weight_version
        return stats

    def _update(self, source: WeightSource, weight_version: str | None) -> SyncStats:
        """One update as the engine sees it, on the sender: apply_weight_update when the backend sends the
        sync in one call, else start_weight_update, _send, finish_weight_update. On any failure the update
        is abandoned (_abandon_update) and the failure raised."""
        started = self._begin_update()
        stats = self._update_in_one_call(source, weight_version, started)
        if stats is not None:
            return stats
        return self._update_in_phases(lambda: self._send(source), weight_version, started)

    def _begin_update(self) -> float:
        """The sender's first steps of every update (its start time, marked for sync_trace, and _before_update);
        returns the start time."""
        started = time.perf_counter()
        sync_trace.mark(sync_trace.SYNC_STARTED)
        self._before_update()
        return started

    def _update_in_one_call(self, source: WeightSource, weight_version: str | None, started: float) -> SyncStats | None:
        """apply_weight_update around _send_in_one_call; None when the backend does not send this sync in one call,
        or the client is not a WeightSyncClient (anything with the lifecycle's methods runs the three calls)."""
        if not callable(getattr(self.client, "submit", None)):
            return None
        waiting: list[float] = []  # when the sender began waiting for the one call (once posted, it may hold an update)

        def post(update_info: Any) -> Callable[[], None]:
            sync_trace.mark("trainer: call posted")
            future = self.client.submit("apply_weight_update", update_info, weight_version)
            waiting.append(0.0)

            def wait() -> None:
                waiting[0] = time.perf_counter()
                sync_trace.mark("trainer: waiting for the answer")
                if self.timeout_s is None:
                    future.result()
                else:
                    answer_of(future, self.timeout_s, "apply_weight_update")
                sync_trace.mark("trainer: answer received")

            return wait

        try:
            stats = self._send_in_one_call(source, post)
        except BaseException:
            # A refused or failed call ended the engine's update itself; a timed-out one may still hold it.
            self._abandon_update(bool(waiting))
            raise
        if stats is not None:
            stats.weight_version = weight_version
            stats.seconds = time.perf_counter() - started
            # What the sender did until it waited (the engine's call running meanwhile), and the wait for the call:
            # the rest of its start, landing and finish in the engine, and the answer's way back.
            stats.extra["phases_s"] = {"send": waiting[0] - started, "apply": started + stats.seconds - waiting[0]}
        return stats

    def _update_in_phases(self, send: Callable[[], SyncStats], weight_version: str | None, started: float) -> SyncStats:
        """start_weight_update, send(), finish_weight_update (after _begin_update, at `started`); on a failure
        _abandon_update and raise."""
        begun = False
        try:
            self._bounded("start_weight_update", self.client.start_weight_update)
            begun = True
            sending = time.perf_counter()
            stats = send()
            finishing = time.perf_counter()
            self._bounded("finish_weight_update", self.client.finish_weight_update, weight_version)
        except BaseException:
            self._abandon_update(begun)
            raise
        stats.weight_version = weight_version
        stats.seconds = time.perf_counter() - started
        # Where a sync's time goes, as the sender sees it (a small sync is mostly its calls' round trips).
        stats.extra["phases_s"] = {"start": sending - started, "send": finishing - sending,
                                   "finish": started + stats.seconds - finishing}
        return stats

    def _before_update(self) -> None:
        """Runs on the sender before start_weight_update (nccl: joins a fresh group after a failed sync)."""

    def _abandon_update(self, begun: bool) -> None:
        """After the sender's update failed: once it had begun, the engine is told to restore its weights.

        Not before: a start_weight_update that failed (say, another update is in progress) began nothing
        of ours to abort. A backend with more to undo on a failure (sharded_rdt: its producers) adds it here."""
        if not begun:
            return
        try:
            self._bounded("abort_weight_update", self.client.abort_weight_update)
        except Exception as e:  # e.g. the engine already ended the update itself, or it is gone
            # A string, not the exception: a kept log record would hold its traceback's frames (and tensors).
            logger.info("%s: abort_weight_update after a failed sync: %s", self.backend, str(e))

    def _send_in_one_call(self, source: WeightSource,
                          post: Callable[[Any], Callable[[], None]]) -> SyncStats | None:
        """The sender's part of a sync that fits one update_weights call, with no update started: post(update_info)
        once sends the engine's apply_weight_update (start, landing and finish) in the background and returns
        wait(), which returns once the call has (or raises its failure); meanwhile the backend moves the tensors
        as its update_weights call would need them. On a failure after post it stops the engine's wait for the
        data and waits for the call before it raises. None, having done nothing, when the sync does not fit one
        call or the backend has no such path: the three-phase update runs instead."""
        return None

    @abstractmethod
    def _send(self, source: WeightSource) -> SyncStats:
        """The sender's part of a sync, between start_weight_update and finish_weight_update: moves every
        tensor of `source` to the engine (its update_weights calls included). On a failure it leaves the
        transport ready for the next sync (or marked for a fresh one) and raises."""

    def _follow(self, source: WeightSource) -> SyncStats:
        """A non-sender rank's part of a sync: the same pass over the source, since a sharded
        source gathers collectively and every rank must take part; nothing is sent."""
        for _ in source.iter_full():
            pass
        return SyncStats(self.backend)

    def _bounded(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args), a client call, answered within timeout_s (a plain call when timeout_s is None)."""
        if self.timeout_s is None:
            return fn(*args)
        # Imported here: clients.py (the trainer's side) is not needed by the engine, which imports this module.
        from weight_transfer.clients import call_in_background

        return answer_of(call_in_background(fn, *args), self.timeout_s, what)

    def shutdown(self) -> None:
        """Tears the transport down on this rank (rank 0 also tells the engine)."""

    def _source(self, source) -> WeightSource:
        if source is not None:
            return as_source(source)
        if self.source is None:
            raise ValueError("send_weights: no source; pass one here or to trainer_init")
        return self.source


def answer_of(future: Future, timeout_s: float, what: str) -> Any:
    """The result of a client call running in the background, or TimeoutError naming it after timeout_s."""
    try:
        return future.result(timeout=timeout_s)
    except TimeoutError:
        if future.done():  # the call itself raised a TimeoutError
            raise
        raise TimeoutError(f"{what}: the engine did not answer within timeout_s={timeout_s:g}") from None


def _declared_types(cls: type, generic_base: type) -> tuple[type, ...] | None:
    """The message types `cls` names by subclassing generic_base[...] itself (None: it names none)."""
    for base in cls.__dict__.get("__orig_bases__", ()):
        if typing.get_origin(base) is generic_base:
            args = typing.get_args(base)
            if all(isinstance(a, type) for a in args):  # not still generic (TypeVars)
                return args
    return None


_TRAINER_BACKENDS: dict[str, str | type[TrainerWeightTransferEngine]] = {
    "local": "weight_transfer.local:LocalTrainerWeightTransferEngine",
    "nccl": "weight_transfer.nccl:NCCLTrainerWeightTransferEngine",
    "sparse_nccl": "weight_transfer.sparse_nccl:SparseNCCLTrainerWeightTransferEngine",
    "ipc": "weight_transfer.ipc:IPCTrainerWeightTransferEngine",
    "sharded_rdt": "weight_transfer.sharded_rdt:ShardedRDTTrainerWeightTransferEngine",
}


def register_trainer_backend(name: str, target: str | type[TrainerWeightTransferEngine]) -> None:
    """Registers (or replaces) trainer backend `name` as a class or a lazy "module:Class" path."""
    _register(_TRAINER_BACKENDS, name, target)


def get_trainer_backend(name: str) -> type[TrainerWeightTransferEngine]:
    return _resolve(_TRAINER_BACKENDS, name, TrainerWeightTransferEngine, "trainer weight transfer backend")


def backend_of(init_info: Any) -> str:
    """The backend name of a trainer init info: its `backend` class attribute or dict key."""
    name = init_info.get("backend") if isinstance(init_info, dict) else getattr(init_info, "backend", None)
    if not isinstance(name, str):
        raise ValueError(f"init_info: cannot tell the backend of {init_info!r} (expected a backend init info or a dict with 'backend')")
    return name


def trainer_init(init_info: Any, *, client, source: "WeightSource | nn.Module | None" = None) -> TrainerWeightTransferEngine:
    """Dispatches on init_info's backend: e.g. trainer_init(NCCLTrainerInitInfo(...), client=HTTPWeightSyncClient(url))."""
    return get_trainer_backend(backend_of(init_info)).trainer_init(init_info, client=client, source=source)
