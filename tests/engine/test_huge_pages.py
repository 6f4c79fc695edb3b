"""The CPU KV cache's host memory: zero-filled, huge-page aligned and advised onto huge pages on Linux."""

from __future__ import annotations

import sys

import pytest
import torch

from engine.worker.huge_pages import HUGE_PAGE_BYTES, host_zeros


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding address, from /proc/self/smaps."""
    flags, inside = None, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                flags = line.split()[1:]
    assert flags is not None, f"no mapping holds {address:#x}"
    return flags


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_large_tensors_are_zero_and_start_on_a_huge_page(dtype):
    t = host_zeros((3, 1000, 700), dtype)
    assert t.shape == (3, 1000, 700) and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE_BYTES == 0
    assert not t.any()
    t[-1, -1, -1] = 1  # the whole range is writable: the view covers exactly the tensor's bytes
    assert t.sum().item() == 1


def test_small_tensors_are_plain_zeros():
    t = host_zeros((4, 16), torch.float32)
    assert torch.equal(t, torch.zeros(4, 16))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_HUGEPAGE is Linux's")
def test_the_range_is_advised_for_huge_pages():
    t = host_zeros((8 * HUGE_PAGE_BYTES,), torch.uint8)
    assert "hg" in _vm_flags(t.data_ptr() + HUGE_PAGE_BYTES)  # hg: MADV_HUGEPAGE advised (proc(5))
