"""This process's place in its engine's tensor-parallel group and in its expert-parallel group, and the collectives layers use.

A worker process calls init_tensor_parallel(...) once, before it builds the model; layers read
get_tp() while they are constructed (to size their shards) and call all_reduce / all_gather in
forward. With one rank (the default, and what an engine without tensor parallelism has) every
collective returns its input unchanged and torch.distributed is never touched.

The group is torch.distributed's default group: gloo on CPU, NCCL on CUDA. One engine's
workers form it; a trainer's process group is a different world (its own init_method).

Expert parallelism (EP) is a second, independent group: one worker of each engine of a
data-parallel group (MoE models run with tensor_parallel_size 1), EP rank = the engine's
data_parallel_rank. It is a standalone process group built on its own TCPStore, never the
default group, so it lives beside a tensor-parallel (or a trainer's) default group and can be
destroyed and built again with another size (elastic EP). A worker calls
init_expert_parallel(...) before it builds the model; MoE layers read get_ep() to pick their
experts and call ep_all_gather / ep_all_reduce in forward (identity at EP size 1).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from urllib.parse import urlparse

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelState:
    rank: int = 0
    size: int = 1

    @property
    def is_first(self) -> bool:
        """The rank whose results the executor returns (rank 0)."""
        return self.rank == 0


_STATE = TensorParallelState()


def get_tp() -> TensorParallelState:
    return _STATE


def init_tensor_parallel(
    size: int, rank: int, init_method: str | None = None, backend: str | None = None, timeout_s: float = 600.0
) -> TensorParallelState:
    """Joins this engine's tensor-parallel group (size 1: records the state, touches nothing).

    init_method: a torch.distributed URL every rank of the group shares ("tcp://127.0.0.1:PORT");
    backend: "gloo" or "nccl" (None: nccl when CUDA is set up in this process, else gloo).
    """
    global _STATE
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, got {size!r}")
    if not isinstance(rank, int) or not 0 <= rank < size:
        raise ValueError(f"tensor-parallel rank {rank!r} is out of range [0, {size})")
    if size > 1:
        if init_method is None:
            raise ValueError("init_tensor_parallel: an init_method is needed for more than one rank")
        if dist.is_initialized():
            raise RuntimeError("init_tensor_parallel: torch.distributed is already initialized in this process")
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() and torch.cuda.is_initialized() else "gloo"
        dist.init_process_group(
            backend, init_method=init_method, world_size=size, rank=rank,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    _STATE = TensorParallelState(rank=rank, size=size)
    return _STATE


def destroy_tensor_parallel() -> None:
    global _STATE
    if _STATE.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _STATE = TensorParallelState()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of x over the group (in place when there is more than one rank; x itself at size 1)."""
    if _STATE.size == 1:
        return x
    dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's x, concatenated along dim in rank order (x itself at size 1)."""
    if _STATE.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_STATE.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


# ---------------------------------------------------------------------------------------
# Expert parallelism: a standalone group (own TCPStore) over one worker per data-parallel engine.


@dataclass(frozen=True)
class ExpertParallelState:
    rank: int = 0
    size: int = 1
    group: object | None = None  # the c10d ProcessGroup (gloo or NCCL) when size > 1, else None

    def __iter__(self):  # rank, size, group = get_ep()
        return iter((self.rank, self.size, self.group))


_EP = ExpertParallelState()
_EP_STORE: object | None = None  # the TCPStore the group was built on (rank 0 hosts it): kept alive with the group


def get_ep() -> ExpertParallelState:
    """This process's expert-parallel (rank, size, group); (0, 1, None) when it has none."""
    return _EP


def _parse_tcp(init_method: str) -> tuple[str, int]:
    url = urlparse(init_method)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise ValueError(f"init_expert_parallel: init_method must be 'tcp://HOST:PORT', got {init_method!r}")
    return url.hostname, url.port


def init_expert_parallel(
    size: int, rank: int, init_method: str | None = None, backend: str | None = None, timeout_s: float = 600.0
) -> ExpertParallelState:
    """Joins the expert-parallel group (size 1: records the state, touches nothing).

    init_method: "tcp://HOST:PORT" every rank shares; rank 0 hosts the group's TCPStore on that
    port (the data-parallel group uses data_parallel_master_port + 1). backend: "gloo" or "nccl"
    (None: nccl when CUDA is set up in this process, else gloo). Blocks until all `size` ranks
    joined (or timeout_s). Raises RuntimeError if this process is in an EP group already: call
    destroy_expert_parallel() first (re-initialization with a new size, rank or port is fine).
    """
    global _EP, _EP_STORE
    if type(size) is not int or size < 1:
        raise ValueError(f"expert-parallel size must be a positive int, got {size!r}")
    if type(rank) is not int or not 0 <= rank < size:
        raise ValueError(f"expert-parallel rank {rank!r} is out of range [0, {size})")
    if _EP.size > 1:
        raise RuntimeError("init_expert_parallel: this process is in an expert-parallel group already; "
                           "destroy_expert_parallel() first")
    if size == 1:
        _EP = ExpertParallelState()
        return _EP
    if init_method is None:
        raise ValueError("init_expert_parallel: an init_method is needed for more than one rank")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.is_initialized() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"init_expert_parallel: backend must be gloo or nccl, got {backend!r}")
    host, port = _parse_tcp(init_method)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size=size, is_master=rank == 0, timeout=timeout, wait_for_workers=True)
    prefixed = dist.PrefixStore("expert_parallel", store)
    if backend == "gloo":
        group = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
    else:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(prefixed, rank, size, options)
    _EP, _EP_STORE = ExpertParallelState(rank=rank, size=size, group=group), store
    return _EP


def destroy_expert_parallel() -> None:
    """Leaves the expert-parallel group (a no-op without one); init_expert_parallel may be called again after."""
    global _EP, _EP_STORE
    group = _EP.group
    _EP, _EP_STORE = ExpertParallelState(), None
    if group is not None:
        try:
            group.shutdown()  # frees the communicator now, not when the object happens to be collected
        except (AttributeError, RuntimeError):
            pass


def ep_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of x over the expert-parallel group (in place when there is more than one rank; x itself at size 1)."""
    if _EP.size == 1:
        return x
    _EP.group.allreduce([x]).wait()
    return x


def ep_all_gather(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Every EP rank's x (all of the same shape), concatenated along dim in rank order (x itself at size 1)."""
    if _EP.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_EP.size)]
    _EP.group.allgather([parts], [x]).wait()
    return torch.cat(parts, dim=dim)
