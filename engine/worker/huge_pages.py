"""Host tensors on transparent huge pages, for the CPU KV cache.

The CPU attention kernel reads a request's context block by block from a cache of gigabytes, and
the block pool scatters a request's blocks over all of it. With 4 KiB pages (a block of tiny-qwen3
is one page) nearly every block read misses the TLB: on this project's 2-core Xeon a 256-row decode
attention call took 24 ms on 4 KiB pages and 12-13 ms on 2 MiB ones. Linux backs a range with huge
pages when it is advised so (MADV_HUGEPAGE) before first touch, which works under the common
`transparent_hugepage=madvise` setting; elsewhere (other systems, THP off) the memory is plain.
"""

from __future__ import annotations

import ctypes
import logging
import math
import sys

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14  # <linux/mman.h>


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype) in host memory, on huge pages where the kernel grants them.

    The tensor starts on a huge-page boundary (a view into a slightly larger buffer, which it keeps
    alive), and only the advised range is touched after the advice, by the zero fill."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    madvise = _madvise()
    if nbytes < HUGE_PAGE_BYTES or madvise is None:
        return torch.zeros(shape, dtype=dtype)
    buffer = torch.empty(nbytes + HUGE_PAGE_BYTES, dtype=torch.uint8)  # not touched yet: no pages behind it
    start = -buffer.data_ptr() % HUGE_PAGE_BYTES
    if madvise(buffer.data_ptr() + start, nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES, _MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) refused (errno %d): the KV cache is on normal pages", ctypes.get_errno())
    tensor = buffer[start : start + nbytes].view(dtype).view(shape)
    return tensor.zero_()
