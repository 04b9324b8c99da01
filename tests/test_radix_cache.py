"""RadixCache: block-granular matching, splits, locks, LRU leaf-first eviction, namespaces (block_size 2)."""

import pytest

from serving.core.block_manager import BlockManager
from serving.core.radix_cache import RadixCache

BS = 2


def make(num_blocks=16):
    bm = BlockManager(num_blocks)
    return bm, RadixCache(bm, BS)


def cache_seq(bm, cache, tokens, namespace=None):
    """Simulates a finished request: allocates its blocks, inserts them, drops the request's references."""
    blocks = bm.allocate(len(tokens) // BS)
    result = cache.insert(tokens, blocks, namespace)
    bm.free(blocks)
    cache.check_invariants()
    bm.check_invariants()
    return result


def test_empty_cache_misses():
    bm, cache = make()
    m = cache.match_prefix([1, 2, 3, 4])
    assert m.block_ids == [] and m.num_tokens == 0 and m.node.is_root


def test_match_at_every_depth():
    bm, cache = make()
    r = cache_seq(bm, cache, [1, 2, 3, 4, 5, 6, 7, 8])
    assert r.block_ids == [1, 2, 3, 4] and r.num_new_blocks == 4
    assert cache.num_cached_blocks == 4 and bm.num_used == 4
    assert all(bm.refcount(b) == 1 for b in (1, 2, 3, 4))  # Held by the cache alone.
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).block_ids == [1, 2, 3, 4]
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9, 10]).block_ids == [1, 2, 3, 4]
    assert cache.match_prefix([1, 2, 3, 4, 5]).block_ids == [1, 2]  # Trailing partial block never matches.
    assert cache.match_prefix([1, 2, 3, 9]).block_ids == [1]  # Diverges inside the second block.
    assert cache.match_prefix([1]).block_ids == []
    assert cache.match_prefix([2, 1]).block_ids == []
    m = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert m.block_ids == [1, 2, 3] and m.num_tokens == 6
    cache.check_invariants()


def test_match_splits_edge_so_the_node_is_exact():
    bm, cache = make()
    cache_seq(bm, cache, [1, 2, 3, 4, 5, 6])
    m = cache.match_prefix([1, 2, 3, 4, 9, 9])
    assert m.block_ids == [1, 2] and m.node.block_ids == [1, 2]
    (child,) = m.node.children.values()
    assert child.block_ids == [3] and child.token_ids == (5, 6)
    cache.check_invariants()


def test_insert_diverging_sequence_splits_and_reuses_cached_blocks():
    bm, cache = make()
    cache_seq(bm, cache, [1, 2, 3, 4, 5, 6, 7, 8])  # Blocks 1..4.
    r = cache_seq(bm, cache, [1, 2, 3, 4, 9, 9, 9, 9])  # Caller blocks 5..8; the first two duplicate 1, 2.
    assert r.block_ids == [1, 2, 7, 8] and r.num_new_blocks == 2
    assert r.node.block_ids == [7, 8] and r.node.parent.block_ids == [1, 2]
    assert cache.num_cached_blocks == 6
    assert bm.refcount(5) == 0 and bm.refcount(6) == 0  # Duplicates went back to the pool.
    assert cache.match_prefix([1, 2, 3, 4, 9, 9, 9, 9]).block_ids == [1, 2, 7, 8]
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).block_ids == [1, 2, 3, 4]
    # Re-inserting a cached prefix adds nothing and ends at an existing node.
    again = cache_seq(bm, cache, [1, 2, 3, 4])
    assert again.num_new_blocks == 0 and again.block_ids == [1, 2] and again.node is r.node.parent


def test_insert_needs_enough_tokens():
    bm, cache = make()
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], bm.allocate(2))


def test_lock_protects_node_and_ancestors():
    bm, cache = make()
    cache_seq(bm, cache, [1, 2, 3, 4, 5, 6])  # Blocks 1, 2, 3.
    cache_seq(bm, cache, [1, 2, 7, 7])  # Block 5 under the split node [1].
    m = cache.match_prefix([1, 2, 3, 4])  # Splits [2, 3] into [2] + [3]; node holds block 2.
    assert m.block_ids == [1, 2]
    cache.lock(m.node)
    assert cache.num_evictable_blocks == 2  # Blocks 3 and 5.
    assert cache.evict(10) == 2
    assert sorted(cache.cached_block_ids()) == [1, 2]
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).block_ids == [1, 2]
    cache.check_invariants()
    cache.unlock(m.node)
    with pytest.raises(ValueError, match="unlock of unlocked"):
        cache.unlock(m.node)
    assert cache.num_evictable_blocks == 2
    assert cache.evict(10) == 2 and cache.num_cached_blocks == 0 and bm.num_free == 15
    with pytest.raises(ValueError, match="evicted"):
        cache.lock(m.node)
    cache.check_invariants()
    bm.check_invariants()


def test_lru_leaf_first_eviction_order():
    bm, cache = make()
    cache_seq(bm, cache, [1, 1, 2, 2])  # Blocks 1, 2.
    cache_seq(bm, cache, [1, 1, 3, 3])  # Block 4 (3 was the duplicate of 1, freed).
    cache_seq(bm, cache, [1, 1, 4, 4])  # Block 6.
    assert cache.match_prefix([1, 1, 2, 2]).block_ids == [1, 2]  # Leaf 2 is now the most recent.
    assert cache.match_prefix([1, 1, 3, 3]).block_ids == [1, 4]  # Leaf 4 newer still; leaf 6 is the LRU.
    order = []
    for _ in range(4):
        before = set(cache.cached_block_ids())
        assert cache.evict(1) == 1
        (gone,) = before - set(cache.cached_block_ids())
        order.append(gone)
        cache.check_invariants()
    # Leaves go in LRU order; the shared parent (block 1) only once it has become a leaf.
    assert order == [6, 2, 4, 1]
    assert cache.evict(1) == 0


def test_evict_frees_only_what_is_needed():
    bm, cache = make()
    cache_seq(bm, cache, [1, 2, 3, 4, 5, 6, 7, 8])  # One leaf with blocks 1..4.
    assert cache.evict(1) == 1
    assert cache.cached_block_ids() == [1, 2, 3] and bm.num_free == 12
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).block_ids == [1, 2, 3]
    assert cache.evict(2) == 2
    assert cache.match_prefix([1, 2, 3, 4]).block_ids == [1]
    assert cache.clear() == 1 and cache.num_cached_blocks == 0 and bm.num_free == 15
    cache.check_invariants()


def test_evict_skips_blocks_still_held_elsewhere():
    bm, cache = make(4)  # Blocks 1..3.
    cache_seq(bm, cache, [1, 1])  # Block 1, cache only.
    shared = bm.allocate(1)  # Block 2, also held by a "request" that never locked it.
    cache.insert([2, 2], shared)
    assert bm.refcount(2) == 2
    cache.match_prefix([1, 1])  # Block 2's leaf is now the LRU one.
    assert cache.evict(1) == 1  # Dropping block 2 frees nothing, so block 1 goes too.
    assert cache.num_cached_blocks == 0 and bm.refcount(2) == 1 and bm.num_free == 2
    cache.check_invariants()
    bm.check_invariants()


def test_namespaces_never_share():
    bm, cache = make()
    cache_seq(bm, cache, [1, 2, 3, 4], namespace="model-a")
    assert cache.match_prefix([1, 2, 3, 4], "model-b").block_ids == []
    assert cache.match_prefix([1, 2, 3, 4]).block_ids == []
    r = cache_seq(bm, cache, [1, 2, 3, 4], namespace="model-b")
    assert r.num_new_blocks == 2 and r.block_ids == [3, 4]
    assert cache.match_prefix([1, 2, 3, 4], "model-a").block_ids == [1, 2]
    assert cache.match_prefix([1, 2, 3, 4], "model-b").block_ids == [3, 4]
    assert cache.clear() == 4
    cache.check_invariants()


def test_cached_prefixes_spell_paths():
    bm, cache = make()
    cache_seq(bm, cache, [1, 2, 3, 4])
    cache_seq(bm, cache, [1, 2, 5, 6], "ns")
    cache_seq(bm, cache, [1, 2, 7, 8])  # Splits [1 2 | 3 4] into [1 2] -> [3 4], [7 8].
    assert sorted(cache.cached_prefixes(), key=repr) == sorted(
        [
            (None, (1, 2), [1]),
            (None, (1, 2, 3, 4), [1, 2]),
            (None, (1, 2, 7, 8), [1, 6]),
            ("ns", (1, 2, 5, 6), [3, 4]),
        ],
        key=repr,
    )


def test_heap_stays_bounded_under_repeated_hits():
    bm, cache = make()
    cache_seq(bm, cache, [1, 2, 3, 4])
    for _ in range(1000):
        cache.match_prefix([1, 2, 3, 4])
    assert len(cache._heap) <= 2 * cache._num_nodes + 65
    cache.check_invariants()
    assert cache.clear() == 2


def test_locked_then_touched_node_is_evictable_after_unlock():
    bm, cache = make()
    cache_seq(bm, cache, [1, 2])
    m = cache.match_prefix([1, 2])
    cache.lock(m.node)
    for _ in range(300):  # Heap compactions while the node is locked must not lose it.
        cache.match_prefix([1, 2])
    cache.unlock(m.node)
    cache.check_invariants()
    assert cache.evict(1) == 1
