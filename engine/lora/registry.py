"""LoRARegistry: the EngineCore's record of the adapters its workers validated, and each one's prefix-cache key."""

from __future__ import annotations

import itertools
from collections import OrderedDict

from engine.lora.request import LoRARequest


class LoRARegistry:
    """lora_int_id -> (its LoRARequest, its cache key), least recently used first, at most max_cpu_loras
    unpinned entries (the workers' host caches have the same bound, so forgetting one here costs only a
    re-validation from disk the next time a request names it).

    The cache key goes into every prefix-cache block hash of the adapter's requests. It is a new number
    for each load, never the user's id: an id removed and loaded again from changed files (an adapter
    saved by a trainer after more steps) must not hit the blocks its old weights computed.
    Plain Python: no torch, nothing per token.
    """

    def __init__(self, max_cpu_loras: int) -> None:
        self.max_cpu_loras = max_cpu_loras
        self._entries: OrderedDict[int, tuple[LoRARequest, int]] = OrderedDict()
        self._pinned: set[int] = set()
        self._next_key = itertools.count()

    def cache_key(self, lora: LoRARequest) -> int | None:
        """The adapter's cache key when it is loaded (marking it just used); None when it is not.
        ValueError when its id is loaded as another adapter."""
        entry = self._entries.get(lora.lora_int_id)
        if entry is None:
            return None
        known = entry[0]
        if known != lora:
            raise ValueError(
                f"lora_int_id {lora.lora_int_id} is already loaded as {known.lora_name!r} from {known.lora_path!r}; "
                f"remove_lora({lora.lora_int_id}) first to load {lora.lora_name!r} from {lora.lora_path!r} under it")
        self._entries.move_to_end(lora.lora_int_id)
        return entry[1]

    def add(self, lora: LoRARequest) -> int:
        """Records a newly validated adapter; returns its cache key."""
        key = next(self._next_key)
        self._entries[lora.lora_int_id] = (lora, key)
        unpinned = [i for i in self._entries if i not in self._pinned]  # oldest use first
        for victim in unpinned[: max(0, len(unpinned) - self.max_cpu_loras)]:
            del self._entries[victim]
        return key

    def get(self, lora_id: int) -> LoRARequest | None:
        entry = self._entries.get(lora_id)
        return entry[0] if entry is not None else None

    def remove(self, lora_id: int) -> bool:
        self._pinned.discard(lora_id)
        return self._entries.pop(lora_id, None) is not None

    def pin(self, lora_id: int) -> None:
        """Never forgets the adapter (until remove); it stops counting against max_cpu_loras."""
        self._pinned.add(lora_id)

    def ids(self) -> list[int]:
        return sorted(self._entries)
