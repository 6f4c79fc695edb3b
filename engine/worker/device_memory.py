"""SleepableRegion: device memory whose pages can be given back and mapped again at the same addresses (CUDA VMM).

Sleep mode frees the weights and the KV cache and brings them back. Freed with the caching allocator,
they come back elsewhere, and every CUDA graph (which recorded their addresses) has to be captured
again. A region instead reserves a range of device virtual addresses once and backs it with physical
memory that release() gives back to the device and restore() maps again, at the same addresses:

    reserve VA  ──  create + map + set access  ──  [tensors live here]  ──  unmap + release  ──  (asleep)
                        ^                                                                          |
                        └─────────────────────────── restore() ────────────────────────────────────┘

A tensor over the region (`tensor`, uint8) and every view of it keep their data pointers across a
release, so the weights' Parameters and the KV cache tensors, and the graphs reading them, stay valid;
only reading or writing them while released is an illegal-address fault, which the sleeper prevents
(nothing runs while asleep). The contents after restore() are undefined: the caller copies the weights
back or zero-fills the KV cache.

The driver calls go through cuda-bindings (cuda.bindings.driver, NVIDIA's Python bindings of the CUDA
driver API); without them, or without VMM support on the device, vmm_available() is False and the
sleeper frees memory through the caching allocator as before.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

_ALIGN = 256  # bytes between tensors packed into a region: every kernel's vectorised loads stay aligned


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    return driver


def _check(result: tuple, call: str) -> Any:
    """cuda-bindings return (CUresult, *values); raise on an error, else the value(s)."""
    err, *values = result
    if int(err) != 0:
        raise RuntimeError(f"CUDA VMM: {call} failed with {err!r}")
    return values[0] if len(values) == 1 else tuple(values) if values else None


def vmm_available(device: torch.device) -> bool:
    """True when regions can be made on `device`: CUDA, cuda-bindings importable, and the device supports VMM."""
    if device.type != "cuda":
        return False
    cu = _driver()
    if cu is None:
        return False
    try:
        _make_context_current(cu, device)
        attr = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
        return bool(_check(cu.cuDeviceGetAttribute(attr, _index(device)), "cuDeviceGetAttribute"))
    except RuntimeError as e:
        logger.info("CUDA VMM unavailable on %s (%s): sleep mode frees through the caching allocator", device, e)
        return False


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _make_context_current(cu, device: torch.device) -> None:
    """The driver calls need the device's primary context current in this thread (torch's runtime uses the same one)."""
    torch.cuda.set_device(device)
    torch.cuda.init()
    ctx = _check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if ctx is None or int(ctx) == 0:
        ctx = _check(cu.cuDevicePrimaryCtxRetain(_index(device)), "cuDevicePrimaryCtxRetain")
        _check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


class _DeviceArray:
    """Lends a raw device range to torch.as_tensor (the CUDA array interface); the region owns the memory."""

    def __init__(self, ptr: int, num_bytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (num_bytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


class SleepableRegion:
    """`num_bytes` (rounded up to the allocation granularity) of device memory at a fixed virtual address."""

    def __init__(self, num_bytes: int, device: torch.device) -> None:
        cu = _driver()
        if cu is None:
            raise RuntimeError("SleepableRegion needs cuda-bindings (pip install cuda-bindings)")
        self._cu = cu
        self.device = device
        _make_context_current(cu, device)
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = _index(device)
        self._prop = prop
        granularity = _check(cu.cuMemGetAllocationGranularity(
            prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED), "cuMemGetAllocationGranularity")
        self.size = max(granularity, -(-num_bytes // granularity) * granularity)
        self._va = _check(cu.cuMemAddressReserve(self.size, granularity, 0, 0), "cuMemAddressReserve")
        self._handle = None
        self.restore()
        self.tensor = torch.as_tensor(_DeviceArray(int(self._va), self.size), device=device)  # uint8 [size]

    @property
    def mapped(self) -> bool:
        return self._handle is not None

    @property
    def ptr(self) -> int:
        return int(self._va)

    def holds(self, tensor: torch.Tensor) -> bool:
        """True if `tensor`'s bytes lie inside this region."""
        start = tensor.data_ptr()
        return self.ptr <= start and start + tensor.numel() * tensor.element_size() <= self.ptr + self.size

    def restore(self) -> None:
        """Backs the addresses with physical memory again (contents undefined). A no-op when mapped."""
        if self._handle is not None:
            return
        cu = self._cu
        _make_context_current(cu, self.device)
        handle = _check(cu.cuMemCreate(self.size, self._prop, 0), "cuMemCreate")
        try:
            _check(cu.cuMemMap(self._va, self.size, 0, handle, 0), "cuMemMap")
            access = cu.CUmemAccessDesc()
            access.location = self._prop.location
            access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            _check(cu.cuMemSetAccess(self._va, self.size, [access], 1), "cuMemSetAccess")
        except RuntimeError:
            cu.cuMemUnmap(self._va, self.size)
            cu.cuMemRelease(handle)
            raise
        self._handle = handle

    def release(self) -> None:
        """Gives the physical memory back to the device; the addresses stay reserved. The caller has made
        sure nothing queued still reads the region (synchronize first). A no-op when released."""
        if self._handle is None:
            return
        cu = self._cu
        _make_context_current(cu, self.device)
        _check(cu.cuMemUnmap(self._va, self.size), "cuMemUnmap")
        _check(cu.cuMemRelease(self._handle), "cuMemRelease")
        self._handle = None

    def close(self) -> None:
        """Releases the memory and the addresses; tensors over the region must not be used afterwards."""
        if self._va is None:
            return
        self.release()
        _check(self._cu.cuMemAddressFree(self._va, self.size), "cuMemAddressFree")
        self._va = None
        self.tensor = None


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def packed_size(sizes: list[int]) -> int:
    """Bytes a region needs to hold tensors of `sizes` bytes one after another, each at a multiple of _ALIGN."""
    offset = 0
    for size in sizes:
        offset = _aligned(offset) + size
    return offset


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


@torch.no_grad()
def move_parameters_into(region: SleepableRegion, params: list[torch.nn.Parameter]) -> None:
    """Copies each parameter into the region (in order, aligned) and points its data there. Parameters keep
    their identity (only `.data` changes), so loaders, tied weights and optimizers holding them keep working."""
    offset = 0
    for param in params:
        offset = _aligned(offset)
        num_bytes = nbytes(param)
        view = region.tensor[offset:offset + num_bytes].view(param.dtype).view(param.shape)
        view.copy_(param.data)
        param.data = view
        offset += num_bytes


def _shape_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def shapes_size(shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> int:
    """Bytes a region needs for region_views(shapes)."""
    return packed_size([_shape_bytes(shape, dtype) for shape, dtype in shapes])


def region_views(region: SleepableRegion, shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """Tensors of the given shapes and dtypes laid one after another (aligned) over the region."""
    views, offset = [], 0
    for shape, dtype in shapes:
        offset = _aligned(offset)
        num_bytes = _shape_bytes(shape, dtype)
        views.append(region.tensor[offset:offset + num_bytes].view(dtype).view(shape))
        offset += num_bytes
    return views
