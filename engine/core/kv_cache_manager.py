"""KVCacheManager: which blocks each request holds, prefix-cache lookups, and check-then-act allocation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.core.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from engine.core.request import Request


@dataclass(frozen=True)
class KVCacheBlocks:
    """An opaque allocation result: callers only read its block ids."""

    blocks: tuple[KVCacheBlock, ...] = ()

    def get_block_ids(self) -> list[int]:
        if not self.blocks:  # most decode steps take no block
            return []
        return [b.block_id for b in self.blocks]

    def __len__(self) -> int:
        return len(self.blocks)


_NO_BLOCKS = KVCacheBlocks()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Maps req_id -> its blocks (block i holds token positions [i*block_size, (i+1)*block_size)).

    A block enters the prefix cache once it is full of known tokens, at the allocation
    that makes it full: within one forward pass every layer writes the KV of all scheduled
    tokens before attention reads any, so even a request scheduled later in the same step
    may hit it.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # req_id -> how many of its leading blocks are registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        # Requests holding blocks across a reset_prefix_cache(): their KV may predate a
        # weight update, so they never register blocks again (until freed and recomputed).
        self.uncacheable_req_ids: set[str] = set()
        self.num_queries = 0  # prefix-cache tokens looked up since make_prefix_cache_stats()
        self.num_hits = 0  # of which found in the cache
        self.total_prefix_cache_queries = 0  # the same two counts since start, never reset
        self.total_prefix_cache_hits = 0
        # The chain last hashed for a request from its first block: (extra key, its tokens, their block hashes).
        # The n samples of one prompt arrive one after another with the same tokens, so each after the first
        # copies the hashes of the blocks whose tokens equal these instead of hashing them again.
        self._last_chain: tuple[int | None, list[int], list[int]] = (None, [], [])

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest cached prefix of full blocks, as (blocks, num_tokens). At most
        num_tokens - 1 tokens hit, so the last token is always computed (it yields the logits)."""
        params = request.sampling_params
        if not self.enable_caching or params.prompt_logprobs is not None or params.return_routed_experts:
            # Prompt logprobs need the logits of every prompt position, routed experts the routing of
            # every position (a cached block keeps KV, not routing): nothing may be skipped.
            return _NO_BLOCKS, 0
        self._update_block_hashes(request, request.num_tokens)
        max_num_hit_blocks = (request.num_tokens - 1) // self.block_size
        hit_blocks = []
        for block_hash in request.block_hashes[:max_num_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:  # the chain breaks: nothing after a miss can be reused
                break
            hit_blocks.append(block)
        num_hit_tokens = len(hit_blocks) * self.block_size
        self.num_queries += request.num_tokens
        self.num_hits += num_hit_tokens
        self.total_prefix_cache_queries += request.num_tokens
        self.total_prefix_cache_hits += num_hit_tokens
        return KVCacheBlocks(tuple(hit_blocks)), num_hit_tokens

    def can_allocate(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_new_computed_tokens: int = 0,
    ) -> bool:
        return self._num_blocks_needed(request, num_new_tokens, new_computed_blocks, num_new_computed_tokens) is not None

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_new_computed_tokens: int = 0,
        num_lookahead_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Gives `request` blocks for num_computed_tokens + num_new_computed_tokens +
        num_new_tokens tokens, plus num_lookahead_tokens slots after them (a draft model's KV;
        they never enter the prefix cache), taking the prefix-hit blocks first. Returns the
        blocks appended this call, or None (and changes nothing) when too few blocks are free."""
        num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        req_blocks = self.req_to_blocks.get(request.request_id)
        num_slots = num_tokens + num_lookahead_tokens
        if new_computed_blocks is None and req_blocks is not None and len(req_blocks) * self.block_size >= num_slots:
            # The common decode step: its tokens fit in the blocks it holds, so nothing is taken
            # (the general path below would take zero blocks and return an empty result too). A block
            # to register is rare (one step in block_size): _cache_full_blocks' cheapest test first.
            num_full_blocks = min(num_tokens, len(request.all_token_ids)) // self.block_size
            if self.enable_caching and num_full_blocks > self.num_cached_blocks.get(request.request_id, 0):
                self._cache_full_blocks(request, req_blocks, num_tokens)
            return _NO_BLOCKS
        num_new_blocks = self._num_blocks_needed(request, num_new_tokens + num_lookahead_tokens, new_computed_blocks,
                                                 num_new_computed_tokens)
        if num_new_blocks is None:
            return None
        hit_blocks = new_computed_blocks.blocks if new_computed_blocks is not None else ()
        if req_blocks is None:
            req_blocks = self.req_to_blocks[request.request_id] = []
        # Touch hits before taking new blocks so a free hit block cannot be evicted here.
        self.block_pool.touch(hit_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(hit_blocks)
        req_blocks.extend(new_blocks)
        self._cache_full_blocks(request, req_blocks, num_tokens)
        return KVCacheBlocks(tuple(hit_blocks) + tuple(new_blocks))

    def _cache_full_blocks(self, request: Request, req_blocks: list[KVCacheBlock], num_tokens: int) -> None:
        """Registers the request's blocks that are full of known tokens once its first
        num_tokens tokens are computed."""
        if not self.enable_caching or request.request_id in self.uncacheable_req_ids:
            return
        num_cached = self.num_cached_blocks.get(request.request_id, 0)
        num_full_blocks = min(num_tokens, len(request.all_token_ids)) // self.block_size
        if num_full_blocks > num_cached:
            self._update_block_hashes(request, num_full_blocks * self.block_size)
            self.block_pool.cache_full_blocks(req_blocks, request.block_hashes, num_cached, num_full_blocks)
            self.num_cached_blocks[request.request_id] = num_full_blocks

    def free(self, request: Request) -> None:
        """Returns the request's blocks, tail first: when they are evicted later, the
        tail of a sequence goes before its head (the head is the likeliest shared prefix)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.block_pool.free_blocks(reversed(blocks))
        self.num_cached_blocks.pop(request.request_id, None)
        self.uncacheable_req_ids.discard(request.request_id)

    def get_block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(req_id, ())]

    def make_prefix_cache_stats(self) -> tuple[int, int]:
        """(queries, hits) in tokens since the previous call."""
        stats = (self.num_queries, self.num_hits)
        self.num_queries = self.num_hits = 0
        return stats

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix. Always succeeds: requests holding blocks keep them
        (their KV stays in use) but stop registering new ones, so after a weight update
        no block computed even partly with old weights is ever hit again."""
        self.block_pool.reset_prefix_cache()
        self.uncacheable_req_ids.update(self.req_to_blocks)
        return True

    def _num_blocks_needed(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: KVCacheBlocks | None,
        num_new_computed_tokens: int,
    ) -> int | None:
        """Fresh blocks to take, or None when the pool cannot supply them."""
        num_hit_blocks = len(new_computed_blocks) if new_computed_blocks is not None else 0
        num_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_held = len(self.req_to_blocks.get(request.request_id, ()))
        num_new_blocks = max(0, _cdiv(num_tokens, self.block_size) - num_held - num_hit_blocks)
        # A hit on a free block takes it out of the free queue too.
        num_free_hits = sum(1 for b in new_computed_blocks.blocks if b.ref_cnt == 0) if num_hit_blocks else 0
        if num_new_blocks + num_free_hits > self.block_pool.num_free_blocks:
            return None
        return num_new_blocks

    def _update_block_hashes(self, request: Request, num_tokens: int) -> None:
        """Extends request.block_hashes to cover the full blocks among its first num_tokens tokens."""
        hashes: list[int] = request.block_hashes
        token_ids: Sequence[int] = request.all_token_ids
        bs = self.block_size
        extra_key = request.lora_cache_key
        num_blocks = num_tokens // bs
        first_hash = not hashes
        if first_hash and num_blocks:
            hashes += self._copied_chain(token_ids, num_blocks, extra_key)
        num_copied = len(hashes) if first_hash else num_blocks
        for i in range(len(hashes), num_blocks):
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, token_ids[i * bs : (i + 1) * bs], extra_key))
        if num_copied < num_blocks:  # hashed a chain of its own from the first block: the next samples match it
            self._last_chain = (extra_key, token_ids[: num_blocks * bs], hashes[:num_blocks])

    def _copied_chain(self, token_ids: Sequence[int], num_blocks: int, extra_key: int | None) -> list[int]:
        """The hashes of the leading blocks (at most num_blocks) whose tokens equal the last chain's: a
        block's hash is a function of its tokens, the tokens before it and the extra key alone."""
        last_key, last_tokens, last_hashes = self._last_chain
        if last_key != extra_key:
            return []
        bs = self.block_size
        num_blocks = min(num_blocks, len(last_hashes))
        if token_ids[: num_blocks * bs] == last_tokens[: num_blocks * bs]:  # the n samples of one prompt
            return last_hashes[:num_blocks]
        num_equal = 0
        while num_equal < num_blocks and (token_ids[num_equal * bs : (num_equal + 1) * bs]
                                          == last_tokens[num_equal * bs : (num_equal + 1) * bs]):
            num_equal += 1
        return last_hashes[:num_equal]
