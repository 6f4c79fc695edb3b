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
    saved by a trainer after more steps) must not hit the blocks its old weights computed. A weight sync of
    the adapter (resync) gives it a new key too, and a weight_version of its own.
    Plain Python: no torch, nothing per token.
    """

    def __init__(self, max_cpu_loras: int) -> None:
        self.max_cpu_loras = max_cpu_loras
        self._entries: OrderedDict[int, tuple[LoRARequest, int]] = OrderedDict()
        self._pinned: set[int] = set()
        self._versions: dict[int, str] = {}  # lora_int_id -> the weight_version of its synced weights
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
            self._versions.pop(victim, None)
        self._versions.pop(lora.lora_int_id, None)  # as read from its directory
        return key

    def find(self, lora_name: str, where: str = "lora_name") -> LoRARequest:
        """The loaded adapter named `lora_name`; ValueError naming `where` when none is, or several are."""
        found = [lora for lora, _ in self._entries.values() if lora.lora_name == lora_name]
        if not found:
            loaded = sorted(lora.lora_name for lora, _ in self._entries.values())
            raise ValueError(f"{where}: no adapter named {lora_name!r} is loaded (loaded: {loaded}); add_lora it first "
                             "(a PEFT adapter directory), so that its rank, target modules and scaling are known")
        if len(found) > 1:
            raise ValueError(f"{where}: {len(found)} loaded adapters are named {lora_name!r} (lora_int_ids "
                             f"{sorted(lora.lora_int_id for lora in found)}); remove_lora all but one")
        return found[0]

    def resync(self, lora_id: int, weight_version: str | None) -> int | None:
        """After a weight sync of the adapter: a new cache key (returned; None if it was removed meanwhile), its
        version (None: kept), and pinned, since its weights are in no file to read again."""
        entry = self._entries.get(lora_id)
        if entry is None:
            return None
        key = next(self._next_key)
        self._entries[lora_id] = (entry[0], key)
        self._pinned.add(lora_id)
        if weight_version is not None:
            self._versions[lora_id] = weight_version
        return key

    def weight_version(self, lora_name: str) -> str:
        """The version of the adapter named `lora_name`: its last sync's, or "default" (its directory's weights)."""
        return self._versions.get(self.find(lora_name).lora_int_id, "default")

    def synced_versions(self) -> dict[int, str] | None:
        """lora_int_id -> version of every adapter a weight sync labelled; None when there is none."""
        return dict(self._versions) if self._versions else None

    def get(self, lora_id: int) -> LoRARequest | None:
        entry = self._entries.get(lora_id)
        return entry[0] if entry is not None else None

    def remove(self, lora_id: int) -> bool:
        self._pinned.discard(lora_id)
        self._versions.pop(lora_id, None)
        return self._entries.pop(lora_id, None) is not None

    def pin(self, lora_id: int) -> None:
        """Never forgets the adapter (until remove); it stops counting against max_cpu_loras."""
        self._pinned.add(lora_id)

    def ids(self) -> list[int]:
        return sorted(self._entries)
