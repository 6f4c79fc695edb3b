"""GPU kernels (Triton), each beside a plain-torch reference of the same signature, and the one selection point.

The implementation is chosen once, at import: Triton when CUDA and Triton are both present,
else the references. A call on CPU tensors never runs a Triton kernel; `override_kernels(False)`
forces the references (tests compare the two on the same inputs). Two CPU-side exceptions, each
beside its reference too: paged attention on CPU runs a C kernel (cpu_attention.py, chosen in
engine/attention/layer.py), and half-precision CPU linears run at bucketed row counts (cpu_linear.py).
The decode path's kernels overlap one another's start and end on Hopper (pdl.py).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


def _triton_usable() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


_TRITON_ENABLED: bool = _triton_usable()


def triton_enabled() -> bool:
    """Whether CUDA tensors go to the Triton kernels (decided once; see override_kernels)."""
    return _TRITON_ENABLED


def use_triton(t: torch.Tensor) -> bool:
    """The per-call rule: Triton for CUDA tensors when enabled, the reference otherwise."""
    return _TRITON_ENABLED and t.is_cuda


@contextmanager
def override_kernels(enabled: bool) -> Iterator[None]:
    """Temporarily switches the Triton kernels on or off (for tests)."""
    global _TRITON_ENABLED
    previous = _TRITON_ENABLED
    _TRITON_ENABLED = enabled and _triton_usable()
    try:
        yield
    finally:
        _TRITON_ENABLED = previous


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive ints (triton.cdiv, without needing Triton)."""
    return -(-a // b)
