"""BlockPool: the KV cache blocks, their reference counts, the LRU free queue and the prefix-cache map."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence


class KVCacheBlock:
    """One block of `block_size` token slots in every layer's KV cache.

    Invariant: ref_cnt == 0 <=> the block is in the pool's free queue. A free block may
    still carry a block_hash: its KV stays valid for prefix hits until it is reused.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}, cached={self.block_hash is not None})"


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int], extra_key: int | None = None) -> int:
    """The prefix-hash chain: a full block's hash covers its tokens and, through the
    parent's hash, every token before it. 128-bit blake2b, stable across processes.

    extra_key: what else the block's KV depends on (the LoRA adapter that computed it, as a
    non-negative int); None: the tokens alone. Every block of a chain carries it, so two
    adapters never share a block even where their chains would otherwise meet."""
    h = hashlib.blake2b(digest_size=16)
    # A tag byte keeps "no parent" apart from every possible parent value.
    h.update(b"\x00" if parent_hash is None else b"\x01" + parent_hash.to_bytes(16, "little"))
    # And another keeps "no extra key" apart from every key (the token bytes that follow have a fixed width).
    h.update(b"\x00" if extra_key is None else b"\x01" + extra_key.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


class BlockPool:
    """Owns every block. All block ids 0..num_blocks-1 are usable: there is no reserved
    null block (a runner that pads needs its own padding slot or a -1 slot id).

    Free queue, oldest first: blocks freed long ago are evicted (reused) before recently
    freed ones, so a recently finished prefix survives the longest.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # block_id -> block, in eviction order (front = evicted first).
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        # block hash -> the block holding that prefix's KV (in use or free).
        self.cached: dict[int, KVCacheBlock] = {}
        # Every block carrying a block_hash (a superset of cached's values: duplicates carry one too),
        # so a reset touches those, not all blocks (a GPU pool has tens of thousands).
        self.hashed: set[KVCacheBlock] = set()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (free cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Takes the `num_blocks` oldest free blocks (ref_cnt 1), evicting their cached KV."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, only {self.num_free_blocks} free")
        blocks = []
        for _ in range(num_blocks):
            _, block = self.free_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Takes a reference on prefix-hit blocks; a free one leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drops a reference; blocks reaching 0 join the back of the free queue in the
        order given, so the caller passes them in the order they should be evicted."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, block
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def cache_full_blocks(
        self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[int], num_cached_blocks: int, num_full_blocks: int
    ) -> None:
        """Registers blocks[num_cached_blocks:num_full_blocks] under their chain hashes."""
        if not self.enable_caching:
            return
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None:  # a prefix hit: already registered
                continue
            block.block_hash = block_hashes[i]
            self.hashed.add(block)
            # If another block already holds this prefix (both computed it at once), keep
            # the first; this one still carries its hash so eviction stays consistent.
            self.cached.setdefault(block.block_hash, block)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix (e.g. after a weight update); blocks stay allocated."""
        for block in self.hashed:
            block.block_hash = None
        self.hashed.clear()
        self.cached.clear()

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None
            self.hashed.discard(block)
