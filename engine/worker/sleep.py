"""WorkerSleeper: gives a worker's weights and KV cache memory back for sleep(level) and restores it on wake_up(tags).

    level 1  weights -> pinned host memory (on CPU they already live there and stay put);
             KV cache tensors dropped
    level 2  weights discarded (storage released), KV cache tensors dropped; buffers such as
             the rotary cos/sin caches are kept

wake_up("weights") copies the host copies back (level 1) or re-allocates every parameter and
re-loads it from the checkpoint directory (level 2): a trainer's weight update may follow, or
not, and either way the weights are right. wake_up("kv_cache") allocates the KV tensors again,
with the shapes (so the number of blocks) they had, zero-filled: their old contents are gone,
so the caller must reset its prefix cache.

Parameters keep their identity (only `param.data` is swapped), so weight loaders, tied
embeddings and anything else holding the Parameter objects keep working. CUDA graphs record
the addresses of weights and KV tensors: they are dropped at sleep and captured again once
both are back.
"""

from __future__ import annotations

import logging
import time
import weakref

import torch

from engine.models.loader import iterate_safetensors

logger = logging.getLogger(__name__)


class WorkerSleeper:
    def __init__(self, worker) -> None:
        # The worker keeps its sleeper: a strong reference back would be a cycle that keeps the worker's
        # model and KV cache alive until the collector runs.
        self._worker = weakref.ref(worker)
        self.asleep: set[str] = set()  # "weights" and/or "kv_cache"
        self.host_weights: dict[str, torch.Tensor] | None = None  # level 1 on GPU
        self.discarded_weights: dict[str, tuple[torch.Size, torch.dtype]] | None = None  # level 2
        self.kv_shapes: list[tuple[torch.Size, torch.dtype]] | None = None

    @property
    def worker(self):
        return self._worker()

    @property
    def device(self) -> torch.device:
        return self.worker.device

    def _params(self) -> list[tuple[str, torch.nn.Parameter]]:
        return list(self.worker.model.named_parameters())  # shared (tied) parameters once

    # ---- sleep ---------------------------------------------------------------------------------

    def sleep(self, level: int) -> None:
        if level == 0 or self.asleep:
            return
        start = time.perf_counter()
        self.worker.drop_cuda_graphs()  # they point at the memory freed below (a draft model's weights stay)
        if level == 1 and self.device.type != "cpu":
            self._offload_weights()
        elif level == 2:
            self._discard_weights()
        self.kv_shapes = []
        for layer in self.worker.attn_layers:
            self.kv_shapes.append((layer.kv_cache.shape, layer.kv_cache.dtype))
            layer.kv_cache = None
        self.asleep = {"weights", "kv_cache"}
        self._release_device_memory()
        logger.info("Worker: asleep at level %d (%.2f s)", level, time.perf_counter() - start)

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
        self.host_weights = self.discarded_weights = self.kv_shapes = None
        self.asleep = set()

    # ---- wake-up -------------------------------------------------------------------------------

    def wake_up(self, tags: list[str]) -> None:
        """Weights before KV cache; graphs are captured again once both are back."""
        start = time.perf_counter()
        woke = set(tags) & self.asleep
        if "weights" in woke:
            self._restore_weights()
        if "kv_cache" in woke:
            self._allocate_kv_cache()
        self.asleep -= woke
        if woke and not self.asleep:
            self.worker.capture_cuda_graphs()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if woke:
            logger.info("Worker: woke up %s (%.2f s)", sorted(woke), time.perf_counter() - start)

    @torch.no_grad()
    def _restore_weights(self) -> None:
        params = self._params()
        if self.host_weights is not None:
            for name, param in params:
                param.data = self.host_weights[name].to(self.device, non_blocking=True)
            torch.cuda.synchronize(self.device)  # before the pinned copies may be reused
            self.host_weights = None
        elif self.discarded_weights is not None:
            for name, param in params:
                shape, dtype = self.discarded_weights[name]
                param.data = torch.empty(shape, dtype=dtype, device=self.device)
            model_dir = self.worker.config.model.model
            loaded = self.worker.model.load_weights(iterate_safetensors(model_dir))
            missing = sorted(set(self.discarded_weights) - loaded)
            if missing:
                raise RuntimeError(f"wake_up: checkpoint {model_dir} is missing parameters: {missing}")
            self.discarded_weights = None

    def _allocate_kv_cache(self) -> None:
        for layer, (shape, dtype) in zip(self.worker.attn_layers, self.kv_shapes, strict=True):
            layer.kv_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.kv_shapes = None
