"""Unit tests of the KV cache manager: prefix hits, allocation, eviction order, ref counts, stats."""

from engine.core.block_pool import hash_block_tokens
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.sampling_params import SamplingParams

BS = 4


def make_request(req_id, token_ids, **params):
    return Request(req_id, token_ids, SamplingParams(**params), eos_token_id=None)


def admit(kv, request):
    """What the scheduler does for a waiting request given the whole budget."""
    hit_blocks, num_hit = kv.get_computed_blocks(request)
    blocks = kv.allocate_slots(request, request.num_tokens - num_hit, hit_blocks, num_hit)
    assert blocks is not None
    request.num_computed_tokens = request.num_tokens
    return num_hit


def test_same_tokens_same_chain_and_shared_prefix_hits():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_request("a", list(range(14)))
    assert admit(kv, a) == 0
    assert len(a.block_hashes) == 3  # 14 tokens: 3 full blocks, the partial 4th is never hashed
    b = make_request("b", list(range(8)) + [50, 51, 52, 53, 54])
    hit_blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    assert hit_blocks.get_block_ids() == kv.get_block_ids("a")[:2]
    assert b.block_hashes[:2] == a.block_hashes[:2] and b.block_hashes[2] != a.block_hashes[2]


def chain(token_ids, extra_key=None):
    """The block hashes of token_ids, hashed from scratch."""
    hashes = []
    for i in range(len(token_ids) // BS):
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, token_ids[i * BS : (i + 1) * BS], extra_key))
    return hashes


def test_block_hashes_copied_from_the_last_chain_equal_hashing_them():
    """Requests with the same leading tokens (the n samples of a prompt) copy the last chain's hashes of those
    blocks; every request's chain equals its tokens hashed from scratch, whatever came before it."""
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    base = list(range(14))
    cases = [
        (base, None), (list(base), None),  # the same prompt again: every block copied
        (base[:9], None),  # shorter: 2 blocks
        (base + [70, 71, 72, 73, 74, 75], None),  # longer: 3 copied, 2 hashed
        (base[:8] + [50, 51, 52, 53], None),  # shares 2 blocks
        ([99] + base[1:], None),  # differs in the first block
        (base, 7), (base, 7), (base, 8),  # another extra key (adapter): nothing shared across keys
        (base[:3], None),  # no full block
        (base, None),
    ]
    for i, (token_ids, key) in enumerate(cases):
        request = make_request(str(i), token_ids)
        request.lora_cache_key = key
        kv.get_computed_blocks(request)
        assert request.block_hashes == chain(token_ids, key), (i, token_ids, key)


def test_change_in_first_block_misses_everything():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    admit(kv, make_request("a", list(range(12))))
    _, num_hit = kv.get_computed_blocks(make_request("b", [99] + list(range(1, 12))))
    assert num_hit == 0


def test_partial_block_never_cached():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    admit(kv, make_request("a", list(range(6))))
    assert len(kv.block_pool.cached) == 1
    _, num_hit = kv.get_computed_blocks(make_request("b", list(range(7))))
    assert num_hit == 4


def test_max_hit_is_num_tokens_minus_one():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    admit(kv, make_request("a", list(range(8))))
    assert len(kv.block_pool.cached) == 2
    # The whole sequence is cached, but its last token must be computed: only block 0 hits.
    assert kv.get_computed_blocks(make_request("b", list(range(8))))[1] == 4
    assert kv.get_computed_blocks(make_request("c", list(range(9))))[1] == 8


def test_no_hits_with_prompt_logprobs_or_caching_off():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    admit(kv, make_request("a", list(range(12))))
    assert kv.get_computed_blocks(make_request("b", list(range(12)), prompt_logprobs=0))[1] == 0
    off = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=False)
    admit(off, make_request("a", list(range(12))))
    assert off.block_pool.cached == {}
    assert off.get_computed_blocks(make_request("b", list(range(12))))[1] == 0


def test_blocks_registered_when_allocated_and_when_decode_fills_them():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_request("a", list(range(3)))
    admit(kv, a)
    assert kv.block_pool.cached == {}
    a.append_output_token_ids([3])  # block 0 is now full of known tokens
    assert kv.allocate_slots(a, 1).get_block_ids() == []  # fits in the block it holds
    assert len(kv.block_pool.cached) == 1
    # Registered before any forward pass ran: a request scheduled in the same step hits it.
    assert kv.get_computed_blocks(make_request("b", [0, 1, 2, 3, 9]))[1] == 4


def test_chunked_allocation_grows_block_table():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_request("a", list(range(10)))
    assert len(kv.allocate_slots(a, 5)) == 2
    a.num_computed_tokens = 5
    assert len(kv.allocate_slots(a, 5)) == 1
    assert len(kv.get_block_ids("a")) == 3
    assert len(kv.block_pool.cached) == 2


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    admit(kv, make_request("a", list(range(8))))
    b = make_request("b", list(range(100, 112)))
    assert not kv.can_allocate(b, 12)
    assert kv.allocate_slots(b, 12) is None
    assert kv.num_free_blocks == 2 and kv.get_block_ids("b") == []
    assert kv.can_allocate(b, 8)


def test_free_hit_block_counts_against_free_blocks():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_request("a", list(range(8)))
    admit(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 3
    # b hits block 0 (free, cached) and needs 2 more: 3 blocks in all, exactly enough.
    b = make_request("b", list(range(4)) + list(range(100, 106)))
    hit_blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 4
    assert kv.can_allocate(b, 6, hit_blocks, num_hit)
    assert not kv.can_allocate(b, 10, hit_blocks, num_hit)
    kv.allocate_slots(b, 6, hit_blocks, num_hit)
    hit = hit_blocks.blocks[0]
    assert hit.ref_cnt == 1 and hit.block_id not in kv.block_pool.free_queue
    assert kv.get_block_ids("b")[0] == hit.block_id and kv.num_free_blocks == 0


def test_ref_counts_with_shared_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a, b = make_request("a", list(range(9))), make_request("b", list(range(9)))
    admit(kv, a)
    assert admit(kv, b) == 8
    shared = kv.req_to_blocks["a"][:2]
    assert kv.req_to_blocks["b"][:2] == shared and all(blk.ref_cnt == 2 for blk in shared)
    kv.free(a)
    assert all(blk.ref_cnt == 1 for blk in shared)
    assert all(blk.block_id not in kv.block_pool.free_queue for blk in shared)
    kv.free(b)
    assert kv.num_free_blocks == 16 and kv.usage == 0.0


def test_eviction_order_lru_then_tail_before_head():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_request("a", list(range(12)) + [0])  # 3 full blocks cached + 1 partial
    b = make_request("b", list(range(100, 108)))  # 2 full blocks
    admit(kv, a)
    admit(kv, b)
    a_ids, b_ids = kv.get_block_ids("a"), kv.get_block_ids("b")
    kv.free(a)
    kv.free(b)
    # a was freed first (least recently used), and within a the tail goes first.
    assert list(kv.block_pool.free_queue) == a_ids[::-1] + b_ids[::-1]
    c = make_request("c", list(range(200, 208)))
    admit(kv, c)  # takes a's partial block and a's third block
    assert kv.get_block_ids("c") == [a_ids[3], a_ids[2]]
    assert kv.get_computed_blocks(make_request("d", list(range(12)) + [0]))[1] == 8  # a's head survives
    assert kv.get_computed_blocks(make_request("e", list(range(100, 109))))[1] == 8  # b intact


def test_reset_prefix_cache():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_request("a", list(range(6)))
    admit(kv, a)
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_request("b", list(range(9))))[1] == 0
    # a holds blocks computed before the reset: it never registers blocks again...
    a.append_output_token_ids([6, 7])
    kv.allocate_slots(a, 2)
    assert kv.block_pool.cached == {}
    # ...until it is freed; a fresh request caches normally.
    kv.free(a)
    admit(kv, make_request("c", list(range(9))))
    assert len(kv.block_pool.cached) == 2


def test_prefix_cache_query_and_hit_counters():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    admit(kv, make_request("a", list(range(10))))
    admit(kv, make_request("b", list(range(10))))
    assert kv.make_prefix_cache_stats() == (20, 8)
    assert kv.make_prefix_cache_stats() == (0, 0)
    assert (kv.total_prefix_cache_queries, kv.total_prefix_cache_hits) == (20, 8)  # never reset
    kv.get_computed_blocks(make_request("c", list(range(10)), prompt_logprobs=1))
    assert kv.make_prefix_cache_stats() == (0, 0)  # not a lookup at all
