"""Host <-> device copies that never make the host wait for the device's queued work (pinned staging).

A copy from pageable host memory to a GPU waits for everything queued on the stream first;
with a step in flight (async scheduling) that is the whole previous step. Staged through
pinned memory and issued non-blocking, the copy is queued like a kernel instead.
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device`, copied without blocking the host (no copy on CPU)."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """Starts copying a device tensor to pinned host memory; read it only after an event recorded
    behind the copy has passed. A CPU tensor is returned as it is."""
    if not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
