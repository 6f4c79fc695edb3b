"""How many bytes of a GPU the KV cache may take, and the error that says who holds the memory when it cannot fit.

gpu_memory_utilization is a share of the device for one engine (vLLM's meaning): two engines at 0.4
fit one GPU side by side. What the engine already holds when its cache is sized (its weights) counts
in its share; memory other engines, a trainer in this process or other processes hold does not
shrink the share, but the KV cache must fit in what is free now. When it cannot, the error names the
holders and the largest share that would fit, instead of a negative byte count:

    device total ──┬── free now ──────────────────────┬── held by this process ──┬── other processes
                   │   (the KV cache must fit here)   │  this engine │ the rest  │   and CUDA contexts
    share = utilization * total = engine's weights + KV cache
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceMemory:
    """One device's memory as this process sees it (torch.cuda.mem_get_info and memory_reserved)."""

    total: int
    free: int  # free on the device: what any process could still allocate
    process_reserved: int  # held by this process's caching allocator (this engine's tensors included)
    name: str = "cuda"

    @property
    def other_processes(self) -> int:
        """Held outside this process's allocator: other processes, and every process's CUDA context."""
        return max(0, self.total - self.free - self.process_reserved)


def kv_cache_budget(memory: DeviceMemory, *, engine_bytes: int, utilization: float, block_bytes: int,
                    kv_cache_memory_bytes: int | None = None) -> int:
    """Bytes for the KV cache: the engine's share (utilization * total) less what it holds (engine_bytes),
    or kv_cache_memory_bytes when given; ValueError when that is not one block of block_bytes, or more
    than is free now (the message says how much this process and the others hold, and what to change)."""
    if kv_cache_memory_bytes is not None:
        if kv_cache_memory_bytes > memory.free:
            raise ValueError(f"kv cache: kv_cache_memory_bytes={kv_cache_memory_bytes} ({_gib(kv_cache_memory_bytes)}) "
                             f"is more than the {_gib(memory.free)} free on {memory.name}: "
                             f"{_holders(memory, engine_bytes)}. Lower kv_cache_memory_bytes or free that memory.")
        return kv_cache_memory_bytes
    share = int(memory.total * utilization)
    budget = share - engine_bytes
    if budget < block_bytes:
        needed = _ceil_2(min(1.0, (engine_bytes + block_bytes) / memory.total))
        raise ValueError(
            f"kv cache: gpu_memory_utilization={utilization:g} gives this engine {_gib(share)} of {memory.name}'s "
            f"{_gib(memory.total)}, but its weights already take {_gib(engine_bytes)}, which leaves no room for one "
            f"KV block of {block_bytes / 2**20:.2f} MiB. Raise gpu_memory_utilization to at least {needed:.2f}, "
            "or size the KV cache with kv_cache_memory_bytes."
        )
    if budget > memory.free:
        fits = _floor_2((memory.free + engine_bytes) / memory.total)  # the largest share whose KV cache fits
        if int(memory.total * fits) - engine_bytes >= block_bytes:
            change = f"Lower gpu_memory_utilization to at most {fits:.2f}, or free memory"
        else:  # not even one block is free: no share fits
            change = "Free memory"
        raise ValueError(
            f"kv cache: gpu_memory_utilization={utilization:g} gives this engine {_gib(share)} of {memory.name}'s "
            f"{_gib(memory.total)}; its weights take {_gib(engine_bytes)}, so its KV cache would take {_gib(budget)}, "
            f"but only {_gib(memory.free)} is free: {_holders(memory, engine_bytes)}. {change}: shut down another "
            "engine of this process (LLM.shutdown(), RolloutWorker.shutdown() or the end of its with block, "
            "AsyncLLM.shutdown()) or what the other processes hold. kv_cache_memory_bytes sizes the KV cache directly."
        )
    return budget


def _holders(memory: DeviceMemory, engine_bytes: int) -> str:
    rest = max(0, memory.process_reserved - engine_bytes)
    return (f"this process holds {_gib(rest)} besides this engine's {_gib(engine_bytes)}, other processes and "
            f"CUDA contexts hold {_gib(memory.other_processes)}")


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def _floor_2(x: float) -> float:
    return math.floor(x * 100) / 100


def _ceil_2(x: float) -> float:
    return math.ceil(x * 100) / 100
