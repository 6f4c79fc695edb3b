"""Tensor parallelism's process state and collectives (engine/distributed/parallel_state.py)."""

from engine.distributed.parallel_state import (
    TensorParallelState,
    all_gather,
    all_reduce,
    destroy_tensor_parallel,
    get_tp,
    init_tensor_parallel,
)

__all__ = [
    "TensorParallelState",
    "all_gather",
    "all_reduce",
    "destroy_tensor_parallel",
    "get_tp",
    "init_tensor_parallel",
]
