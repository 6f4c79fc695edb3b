"""WorkerSleeper: gives a worker's weights and KV cache memory back for sleep(level) and restores it on wake_up(tags).

    level 1  weights -> pinned host memory (on CPU they already live there and stay put);
             KV cache tensors dropped
    level 2  weights discarded, KV cache tensors dropped; buffers such as the rotary cos/sin
             caches are kept

wake_up("weights") copies the host copies back (level 1). After level 2 the weights' values are gone:
wake_up zero-fills them and the target model's WeightUpdater marks every weight unwritten (the
engine refuses to generate until a weight update has written them all), unless reload_weights asks
for the checkpoint to be read again from disk. wake_up("kv_cache")
brings the KV tensors back with the shapes (so the number of blocks) they had, zero-filled: their old
contents are gone, so the caller must reset its prefix cache.

Two ways to free the memory:
- Fixed addresses (CUDA with VMM, CacheConfig.sleep_fixed_addresses): the weights live packed in one
  SleepableRegion and the KV cache in another (engine/worker/device_memory.py), placed there by
  pack_weights and allocate_kv_cache when the worker starts. Sleep copies the weight region to one
  pinned host buffer (made at start-up with ModelConfig.enable_sleep_mode, else at the first
  sleep(1); then reused) in a single copy and unmaps both regions; wake_up maps them again at the
  same addresses and copies back. Tensors, Parameters and the CUDA graphs that recorded their
  addresses stay valid: nothing is captured again, and the same batch runs the same kernels on the
  same addresses as before the sleep.
- Otherwise (CPU, no VMM, or weights moved out of the region since, e.g. by elastic EP): each
  parameter's storage is swapped (`param.data`), the KV tensors dropped, the regions (if any) closed,
  and the CUDA graphs dropped at sleep and captured again once weights and KV cache are both back.
Either way parameters keep their identity, so weight loaders, tied embeddings and anything else
holding the Parameter objects keep working.
"""

from __future__ import annotations

import logging
import time
import weakref

import torch

from engine.models.loader import iterate_safetensors
from engine.worker.device_memory import (
    SleepableRegion,
    move_parameters_into,
    nbytes,
    packed_size,
    region_views,
    shapes_size,
    vmm_available,
)
from engine.worker.huge_pages import host_zeros

logger = logging.getLogger(__name__)


def pack_weights(model: torch.nn.Module, device: torch.device, enabled: bool) -> SleepableRegion | None:
    """Moves every parameter of `model` into one fixed-address region (None, and nothing moved, off CUDA,
    without VMM or when not enabled). Called before anything records a weight's address (graphs, receivers)."""
    if not enabled or not vmm_available(device):
        return None
    params = list(model.parameters())  # shared (tied) parameters once
    region = SleepableRegion(packed_size([nbytes(p) for p in params]), device)
    move_parameters_into(region, params)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # the copies' old storage goes back to the device before the KV cache is sized
    return region


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled KV tensor; on the host, on huge pages (engine/worker/huge_pages.py)."""
    if torch.device(device).type == "cpu":
        return host_zeros(tuple(shape), dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def allocate_kv_cache(shapes: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device,
                      weight_region: SleepableRegion | None) -> tuple[list[torch.Tensor], SleepableRegion | None]:
    """Zero-filled KV tensors of `shapes`: in one fixed-address region when the weights have one, else plain."""
    if weight_region is None:
        return [_zeros(shape, dtype, device) for shape, dtype in shapes], None
    region = SleepableRegion(shapes_size(shapes), device)
    region.tensor.zero_()
    return region_views(region, shapes), region


class WorkerSleeper:
    def __init__(self, worker) -> None:
        # The worker keeps its sleeper: a strong reference back would be a cycle that keeps the worker's
        # model and KV cache alive until the collector runs.
        self._worker = weakref.ref(worker)
        self.asleep: set[str] = set()  # "weights" and/or "kv_cache"
        self.level = 0
        self.fixed = False  # this sleep kept the addresses (the regions are unmapped, graphs kept)
        self.host_buffer: torch.Tensor | None = None  # fixed addresses, level 1: pinned, reused every sleep
        self.copy_stream: torch.cuda.Stream | None = None  # fixed addresses: wake_up's weight copy
        self.host_weights: dict[str, torch.Tensor] | None = None  # otherwise, level 1 on GPU
        self.discarded_weights: dict[str, tuple[torch.Size, torch.dtype]] | None = None  # otherwise, level 2
        self.kv_shapes: list[tuple[torch.Size, torch.dtype]] | None = None

    @property
    def worker(self):
        return self._worker()

    @property
    def device(self) -> torch.device:
        return self.worker.device

    def _params(self) -> list[tuple[str, torch.nn.Parameter]]:
        return list(self.worker.model.named_parameters())  # shared (tied) parameters once

    def _weight_bytes(self) -> int:
        return packed_size([nbytes(p) for _, p in self._params()])

    def _can_keep_addresses(self) -> bool:
        worker = self.worker
        weights, kv = worker.weight_region, worker.kv_region
        return (weights is not None and kv is not None
                and all(weights.holds(p) for _, p in self._params())
                and all(layer.kv_cache is not None and kv.holds(layer.kv_cache) for layer in worker.attn_layers))

    # ---- sleep ---------------------------------------------------------------------------------

    def sleep(self, level: int) -> None:
        if level == 0 or self.asleep:
            return
        start = time.perf_counter()
        self.fixed = self._can_keep_addresses()
        if self.fixed:
            self._sleep_in_place(level)
        else:
            self._sleep_by_swapping(level)
        self.level = level
        self.asleep = {"weights", "kv_cache"}
        self._release_device_memory()
        logger.info("Worker: asleep at level %d (%.3f s%s)", level, time.perf_counter() - start,
                    ", addresses kept" if self.fixed else "")

    def release_kv_cache(self) -> None:
        """Frees the KV cache alone, the weights staying resident (vLLM's release_kv_cache_memory);
        wake_up(["kv_cache"]) brings it back zero-filled, with its shapes."""
        if self.asleep:
            raise RuntimeError("release_kv_cache_memory() requires all executor memory to be resident")
        worker = self.worker
        self.fixed = self._can_keep_addresses()
        if self.fixed:
            worker.synchronize()  # nothing queued may still read the pages unmapped here
            worker.kv_region.release()
        else:
            worker.drop_cuda_graphs()  # they point at the KV tensors dropped here
            self.kv_shapes = [(layer.kv_cache.shape, layer.kv_cache.dtype) for layer in worker.attn_layers]
            for layer in worker.attn_layers:
                layer.kv_cache = None
        self.asleep = {"kv_cache"}
        self._release_device_memory()

    def allocate_host_buffer(self) -> int:
        """Fixed addresses: makes sure the pinned host buffer sleep(1) copies the weight region into exists
        (pinning takes ~0.65 s/GB, so ModelConfig.enable_sleep_mode calls this at start-up); returns the
        bytes to copy, 0 (nothing allocated) without a weight region."""
        if self.worker.weight_region is None:
            return 0
        num_bytes = self._weight_bytes()
        if self.host_buffer is None or self.host_buffer.numel() < num_bytes:
            self.host_buffer = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
        return num_bytes

    @torch.no_grad()
    def _sleep_in_place(self, level: int) -> None:
        worker = self.worker
        worker.synchronize()  # nothing queued may still read the memory unmapped below
        weights = worker.weight_region
        if level == 1:
            num_bytes = self.allocate_host_buffer()
            self.host_buffer[:num_bytes].copy_(weights.tensor[:num_bytes], non_blocking=True)
        worker.kv_region.release()  # while the weights are copied out: the copy does not read it
        if level == 1:
            worker.synchronize()  # the copy must land before the weights' pages go
        weights.release()

    def _sleep_by_swapping(self, level: int) -> None:
        worker = self.worker
        worker.drop_cuda_graphs()  # they point at the memory freed below (a draft model's weights stay)
        if level == 1 and self.device.type != "cpu":
            self._offload_weights()
        elif level == 2:
            self._discard_weights()
        self.kv_shapes = []
        for layer in worker.attn_layers:
            self.kv_shapes.append((layer.kv_cache.shape, layer.kv_cache.dtype))
            layer.kv_cache = None
        worker.close_regions()  # nothing points into them any more (a weight moved out made this path run)

    @torch.no_grad()
    def _offload_weights(self) -> None:
        host = {}
        for name, param in self._params():
            copy = torch.empty(param.shape, dtype=param.dtype, device="cpu", pin_memory=True)
            copy.copy_(param.data, non_blocking=True)
            host[name] = copy
        torch.cuda.synchronize(self.device)  # the copies must land before the device memory goes
        for _, param in self._params():
            param.data = torch.empty(0, dtype=param.dtype, device=self.device)
        self.host_weights = host

    def _discard_weights(self) -> None:
        params = self._params()
        self.discarded_weights = {name: (param.shape, param.dtype) for name, param in params}
        for _, param in params:
            param.data = torch.empty(0, dtype=param.dtype, device=self.device)

    def _release_device_memory(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # hand the freed blocks back, so another process can use them

    def release(self) -> None:
        """The worker shuts down: the host copies of sleeping weights go (pinned memory), nothing wakes up."""
        self.host_buffer = self.host_weights = self.discarded_weights = self.kv_shapes = self.copy_stream = None
        self.asleep = set()

    # ---- wake-up -------------------------------------------------------------------------------

    def wake_up(self, tags: list[str], reload_weights: bool = False) -> None:
        """Weights before KV cache; without fixed addresses, graphs are captured again once both are back.
        reload_weights: after level 2, read the checkpoint into the weights (else they stay unwritten)."""
        start = time.perf_counter()
        woke = set(tags) & self.asleep
        # Fixed addresses: the weights' copy is queued first, so that mapping the KV cache's pages (host work)
        # and zeroing them (on the SMs) run while the copy engine moves the weights.
        if "weights" in woke:
            self._restore_weights(reload_weights)
        if "kv_cache" in woke:
            self._restore_kv_cache()
        self.asleep -= woke
        if woke and not self.asleep and not self.fixed:
            self.worker.capture_cuda_graphs()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if woke:
            logger.info("Worker: woke up %s (%.3f s)", sorted(woke), time.perf_counter() - start)

    @torch.no_grad()
    def _restore_weights(self, reload_weights: bool) -> None:
        if self.fixed:
            region = self.worker.weight_region
            region.restore()
            if self.level == 1:  # on a side stream: the copy engine moves the weights while the SMs zero the KV cache
                num_bytes = self._weight_bytes()
                current = torch.cuda.current_stream(self.device)
                if self.copy_stream is None:
                    self.copy_stream = torch.cuda.Stream(self.device)
                self.copy_stream.wait_stream(current)
                with torch.cuda.stream(self.copy_stream):
                    region.tensor[:num_bytes].copy_(self.host_buffer[:num_bytes], non_blocking=True)
                # wake_up ends with a device-wide synchronize: no step reads the weights before they landed
            else:
                region.tensor.zero_()  # defined contents until the checkpoint's or the trainer's land
                self._refill_discarded(reload_weights)
            return
        params = self._params()
        if self.host_weights is not None:
            for name, param in params:
                param.data = self.host_weights[name].to(self.device, non_blocking=True)
            torch.cuda.synchronize(self.device)  # before the pinned copies may be reused
            self.host_weights = None
        elif self.discarded_weights is not None:
            for name, param in params:
                shape, dtype = self.discarded_weights[name]
                param.data = torch.zeros(shape, dtype=dtype, device=self.device)
            self.discarded_weights = None
            self._refill_discarded(reload_weights)

    def _refill_discarded(self, reload_weights: bool) -> None:
        """After level 2: the checkpoint read again (reload_weights), or every weight marked unwritten."""
        worker = self.worker
        if not reload_weights:
            worker.weight_updaters.target.discard()
            return
        model_dir = worker.config.model.model
        loaded = worker.model.load_weights(iterate_safetensors(model_dir))
        missing = sorted({name for name, _ in self._params()} - loaded)
        if missing:
            raise RuntimeError(f"wake_up: checkpoint {model_dir} is missing parameters: {missing}")
        worker.weight_updaters.target.unwritten = set()

    def _restore_kv_cache(self) -> None:
        worker = self.worker
        if self.fixed:
            worker.kv_region.restore()
            worker.kv_region.tensor.zero_()  # never-written slots hold finite values, as at start-up
            return
        for layer, (shape, dtype) in zip(worker.attn_layers, self.kv_shapes, strict=True):
            layer.kv_cache = _zeros(shape, dtype, self.device)
        self.kv_shapes = None
