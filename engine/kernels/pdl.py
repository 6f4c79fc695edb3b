"""Programmatic dependent launch (Hopper and later): a decode kernel starts while the one before it drains.

A kernel launched with `launch_pdl=True` may be scheduled as soon as every program of the kernel
before it has called gdc_launch_dependents (or exited); it must then call gdc_wait before it reads
anything an earlier kernel wrote, which returns once that kernel has finished and its memory is
visible. Because every PDL kernel here waits in every program before it can finish, the order is
kept transitively: kernel C that reads what A wrote two launches earlier still sees it, since B
finished only after A had. Only what no kernel of the step writes (weights) may be read before the
wait: the small-M linear loads its first weight tile there, so the memory latency overlaps the
previous kernel's tail. Kernels not launched with PDL (cuBLAS, torch ops) serialize as usual, and
griddepcontrol.wait returns at once when there is nothing to wait for.

    kernel[grid](..., **pdl_args())     and in the kernel (a `PDL: tl.constexpr` parameter):  wait_inputs(PDL)
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


@functools.cache
def pdl() -> bool:
    """Whether PDL is on: a GPU of compute capability 9.0+ and a Triton with the gdc intrinsics;
    ROLLOUT_PDL=0 turns it off. Asked at launch time, never at import (which must not initialise
    CUDA before a fork)."""
    if os.environ.get("ROLLOUT_PDL", "1") == "0" or triton is None or not _HAS_GDC or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability()[0] >= 9


def pdl_args() -> dict:
    """The launch's keyword arguments: the kernel's PDL constexpr, and launch_pdl when on (only then, so
    launchers that do not know the option, Triton's interpreter among them, never see it)."""
    return {"PDL": True, "launch_pdl": True} if pdl() else {"PDL": False}


if triton is not None:
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

        _HAS_GDC = True
    except ImportError:
        _HAS_GDC = False

    @triton.jit
    def wait_inputs(PDL: tl.constexpr):
        """Waits for the kernel before (its writes visible), then lets the next kernel be scheduled."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
else:
    _HAS_GDC = False
