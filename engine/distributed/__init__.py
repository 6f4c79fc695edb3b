"""Tensor and expert parallelism's process state and collectives (engine/distributed/parallel_state.py)."""

from engine.distributed.parallel_state import (
    ExpertParallelState,
    TensorParallelState,
    all_gather,
    all_reduce,
    destroy_expert_parallel,
    destroy_tensor_parallel,
    ep_all_gather,
    ep_all_reduce,
    get_ep,
    get_tp,
    init_expert_parallel,
    init_tensor_parallel,
)

__all__ = [
    "ExpertParallelState",
    "TensorParallelState",
    "all_gather",
    "all_reduce",
    "destroy_expert_parallel",
    "destroy_tensor_parallel",
    "ep_all_gather",
    "ep_all_reduce",
    "get_ep",
    "get_tp",
    "init_expert_parallel",
    "init_tensor_parallel",
]
