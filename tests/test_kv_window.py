"""KVManager with a sliding window on every layer (Mistral-style): blocks no later query can see are given back
and their table entries become the null page; prefix caching stops at the first freed block. Tiny pools
(block_size 4) so block ids are exact: the free queue hands out 1, 2, 3, ..."""

import pytest

from serving.core.kv_manager import KVManager
from serving.core.request import Request

BS = 4


def req(rid, n):
    return Request(rid, list(range(100, 100 + n)))


def compute(kv, r, n):
    assert kv.allocate(r, n)
    r.num_computed_tokens += n


def test_blocks_outside_the_window_are_freed_exactly():
    kv = KVManager(9, BS, enable_prefix_caching=False, window=6)
    r = req("a", 13)
    compute(kv, r, 13)  # positions 0..12 in blocks 1..4; nothing freed before the first allocation sees 13
    assert r.block_ids == [1, 2, 3, 4] and kv.num_free_blocks == 4
    r.append_output(7)
    compute(kv, r, 1)  # the query at 13 sees keys > 7: blocks 1 (0..3) and 2 (4..7) are dead
    assert r.block_ids == [0, 0, 3, 4] and kv.num_free_blocks == 6
    kv.check_invariants([r])
    r.append_output(8)
    compute(kv, r, 1)  # position 14 sees keys > 8: block 3 (8..11) still holds keys 9..11
    assert r.block_ids == [0, 0, 3, 4]
    assert kv.slot_mapping(r, 12, 3) == [4 * BS + 0, 4 * BS + 1, 4 * BS + 2]
    kv.release(r)
    assert r.block_ids == [] and kv.num_free_blocks == 8
    kv.check_invariants([])


def test_window_boundary_keeps_the_block_of_the_first_visible_key():
    kv = KVManager(9, BS, enable_prefix_caching=False, window=8)
    r = req("a", 16)
    compute(kv, r, 8)
    compute(kv, r, 8)  # at num_computed 8 the next query (8) sees keys > 0: key 1..3 of block 1 -> kept
    assert r.block_ids == [1, 2, 3, 4]
    r.append_output(1)
    compute(kv, r, 1)  # query 16 sees keys > 8: blocks 1 and 2 (0..7) dead, block 3 (8..11) holds 9..11
    assert r.block_ids == [0, 0, 3, 4, 5]


def test_no_window_frees_nothing():
    kv = KVManager(9, BS, enable_prefix_caching=False)
    r = req("a", 30)
    compute(kv, r, 30)
    r.append_output(1)
    compute(kv, r, 1)
    assert 0 not in r.block_ids and kv.free_outside_window(r) == 0


def test_prefix_cache_stops_at_the_first_freed_block():
    kv = KVManager(12, BS, enable_prefix_caching=True, window=5)
    r = req("a", 8)
    compute(kv, r, 8)
    kv.cache_computed(r)  # blocks 1, 2 (positions 0..7) enter the cache
    assert kv.num_cached_blocks == 2
    for t in range(6):
        r.append_output(t)
        compute(kv, r, 1)
        kv.cache_computed(r)
    # The last allocation (at 13: the query sees keys > 8) dropped this request's blocks 1, 2 (the cache keeps its
    # own reference); block 3 (8..11) is kept, and nothing past the first null page enters the cache.
    assert r.block_ids[:2] == [0, 0] and kv.num_cached_blocks == 2
    kv.check_invariants([r])
    kv.release(r)
    kv.check_invariants([])


def test_bad_window():
    with pytest.raises(ValueError, match="window"):
        KVManager(9, BS, window=0)
