"""This process's place in its engine's tensor-parallel group, and the collectives model layers use.

A worker process calls init_tensor_parallel(...) once, before it builds the model; layers read
get_tp() while they are constructed (to size their shards) and call all_reduce / all_gather in
forward. With one rank (the default, and what an engine without tensor parallelism has) every
collective returns its input unchanged and torch.distributed is never touched.

The group is torch.distributed's default group: gloo on CPU, NCCL on CUDA. One engine's
workers form it; a trainer's process group is a different world (its own init_method).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

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
