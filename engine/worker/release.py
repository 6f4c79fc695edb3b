"""Giving a shut-down worker's memory back at once: its modules' tensors emptied in place, then the device's caches."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def release_module_tensors(module: nn.Module) -> None:
    """Frees the storage of every parameter, buffer and plain tensor attribute of `module` and its submodules.

    In place, so it holds however many references to the module or its Parameter objects remain (a
    frontend the caller still has, a weight loader, a transfer engine bound to the model, a cycle only
    the collector would free): parameters keep their identity with an empty tensor of their dtype on
    their device (as sleep level 2 does), buffers become empty tensors, and tensors a module keeps as
    plain attributes (a layer's KV cache, the routing a MoE block captured) become None. The module
    computes nothing afterwards.
    """
    for param in module.parameters():  # shared (tied) parameters once
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    for sub in module.modules():
        for name, buffer in sub.named_buffers(recurse=False):
            if buffer is not None:
                setattr(sub, name, torch.empty(0, dtype=buffer.dtype, device=buffer.device))
        for name, value in list(vars(sub).items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                setattr(sub, name, None)


def release_device_caches(device: torch.device) -> None:
    """Hands what the caching allocator holds unused back to the device, once nothing queued can still read it.

    cuBLAS keeps a workspace per (handle, stream) in the allocator, counted in memory_allocated(), for as
    long as the process lives; it is made again at the next matmul, so clearing it costs that one
    allocation (the same call clears every stream's, which a trainer in this process simply re-makes).
    A no-op off CUDA.
    """
    if device.type != "cuda":
        return
    torch.cuda.synchronize(device)
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # private, present since torch 2.1
    if clear_workspaces is not None:
        clear_workspaces()
    torch.cuda.empty_cache()
