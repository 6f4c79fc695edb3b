"""Unit tests of the block pool: the hash chain, LRU free queue, ref counts and the cache map."""

from engine.core.block_pool import BlockPool, hash_block_tokens


def chain(token_ids, block_size):
    hashes, parent = [], None
    for i in range(len(token_ids) // block_size):
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes


def test_hash_chain_is_deterministic_and_covers_the_prefix():
    tokens = list(range(16))
    assert chain(tokens, 4) == chain(list(tokens), 4)
    changed = [99] + tokens[1:]
    # A change in block 0 changes every later hash, although later blocks' tokens match.
    assert all(a != b for a, b in zip(chain(tokens, 4), chain(changed, 4)))
    # Same tokens under a different parent (or no parent) hash differently.
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(0, [1, 2])
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [2, 1])
    assert isinstance(hash_block_tokens(None, []), int)


def test_get_new_blocks_takes_oldest_free_and_free_appends_in_order():
    pool = BlockPool(4, enable_caching=True)
    assert pool.num_free_blocks == 4 and pool.usage == 0.0
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.usage == 0.75
    pool.free_blocks([blocks[2], blocks[0]])
    # Free queue now: 3 (never used), 2, 0.
    assert list(pool.free_queue) == [3, 2, 0]
    assert [b.block_id for b in pool.get_new_blocks(2)] == [3, 2]


def test_too_many_blocks_raises():
    pool = BlockPool(2, enable_caching=True)
    try:
        pool.get_new_blocks(3)
    except ValueError:
        pass
    else:
        raise AssertionError("expected ValueError")
    assert pool.num_free_blocks == 2


def test_cached_block_survives_free_until_reused():
    pool = BlockPool(2, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1, 2])
    pool.cache_full_blocks([block], [h], 0, 1)
    assert pool.get_cached_block(h) is block
    pool.free_blocks([block])
    assert pool.get_cached_block(h) is block  # free but still cached
    pool.get_new_blocks(1)  # takes block 1 (older in the queue), block 0 survives
    assert pool.get_cached_block(h) is block
    pool.get_new_blocks(1)  # now block 0 is reused: evicted from the cache map
    assert pool.get_cached_block(h) is None and block.block_hash is None


def test_touch_removes_free_block_from_queue_and_counts_refs():
    pool = BlockPool(3, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    assert block.block_id in pool.free_queue
    pool.touch([block])
    assert block.ref_cnt == 1 and block.block_id not in pool.free_queue
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.block_id not in pool.free_queue
    pool.free_blocks([block])
    assert block.block_id in pool.free_queue and pool.num_free_blocks == 3


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(3, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [5])
    pool.cache_full_blocks([a], [h], 0, 1)
    pool.cache_full_blocks([b], [h], 0, 1)
    assert pool.get_cached_block(h) is a
    pool.free_blocks([b])
    pool.get_new_blocks(2)  # reuses 2 and b; evicting b must not drop a's entry
    assert pool.get_cached_block(h) is a


def test_reset_prefix_cache_and_caching_off():
    pool = BlockPool(2, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    hashes = chain([1, 2, 3, 4], 2)
    pool.cache_full_blocks(blocks, hashes, 0, 2)
    pool.reset_prefix_cache()
    assert pool.cached == {} and all(b.block_hash is None for b in blocks)

    # A duplicate of a cached prefix carries its hash too, free or not: the reset clears it as well,
    # and an evicted block leaves the set of hashed blocks the reset walks.
    pool = BlockPool(4, enable_caching=True)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_full_blocks([a], hashes[:1], 0, 1)
    pool.cache_full_blocks([b, c], hashes[:2], 0, 2)  # b duplicates a's prefix
    pool.free_blocks([b, c])
    assert pool.hashed == {a, b, c}
    pool.get_new_blocks(2)  # the oldest free blocks: the never-used one, then b (evicted)
    assert pool.hashed == {a, c} and b.block_hash is None
    pool.reset_prefix_cache()
    assert pool.cached == {} and pool.hashed == set() and a.block_hash is None and c.block_hash is None

    off = BlockPool(2, enable_caching=False)
    blocks = off.get_new_blocks(2)
    off.cache_full_blocks(blocks, hashes, 0, 2)
    assert off.get_cached_block(hashes[0]) is None and off.cached == {}
