"""KVManager alone: allocation, copy-on-write, prefix lookup / insertion and counters, slot map, provisional
tokens and rollback. Tiny pools (block_size 4) so block ids are exact: the free queue hands out 1, 2, 3, ..."""

import random

import pytest

from serving.core.kv_manager import KVManager
from serving.core.request import Request

BS = 4


def make(num_blocks=9, caching=True):
    return KVManager(num_blocks, BS, enable_prefix_caching=caching)


def req(rid, prompt, outputs=()):
    if isinstance(prompt, int):
        prompt = list(range(100, 100 + prompt))
    r = Request(rid, prompt)
    for t in outputs:
        r.append_output(t)
    return r


def compute(kv, r, n):
    """Allocates n positions and marks them computed, as one scheduler step would."""
    alloc = kv.allocate(r, n)
    assert alloc
    r.num_computed_tokens += n
    return alloc


def test_allocate_exact_ids_fast_path_and_failure_takes_nothing():
    kv = make(num_blocks=5, caching=False)  # 4 usable blocks.
    a, b = req("a", 6), req("b", 9)
    alloc = compute(kv, a, 6)
    assert a.block_ids == [1, 2] and alloc.num_new_blocks == 2 and alloc.cow_pairs == ()
    assert kv.allocate(a, 1) and kv.allocate(a, 1).num_new_blocks == 0  # Position 6 is in block 2 already.
    assert kv.can_allocate(b, 8) and not kv.can_allocate(b, 9)
    assert not kv.allocate(b, 9) and b.block_ids == [] and kv.num_free_blocks == 2
    compute(kv, b, 8)
    assert b.block_ids == [3, 4] and kv.num_free_blocks == 0
    kv.check_invariants([a, b])
    kv.release(a)
    kv.release(b)
    assert a.block_ids == b.block_ids == [] and kv.num_free_blocks == 4
    kv.check_invariants([])


def test_slot_mapping():
    kv = make(caching=False)
    r = req("r", 10)
    compute(kv, r, 10)
    r.block_ids = [3, 1, 2]  # An arbitrary table: slot = block_table[pos // bs] * bs + pos % bs.
    assert kv.slot_mapping(r, 2, 7) == [14, 15, 4, 5, 6, 7, 8]
    assert kv.slot_mapping(r, 11, 1) == [11]
    assert kv.slot_mapping(r, 0, 0) == []
    with pytest.raises(ValueError, match="not covered"):
        kv.slot_mapping(r, 10, 3)


def test_prefix_insert_lookup_and_one_set_of_counters():
    kv = make()
    a = req("a", 10)
    assert kv.lookup_prefix(a).num_tokens == 0
    kv.record_admission(a)
    compute(kv, a, 10)
    kv.cache_computed(a)  # Full blocks 1, 2 (positions 0-7) go to the cache; a's lock moves to their node.
    assert kv.cache.cached_block_ids() == [1, 2] and kv.block_manager.refcount(1) == 2
    kv.check_invariants([a])
    b = req("b", list(range(100, 109)) + [55])
    hit = kv.lookup_prefix(b)
    assert (hit.num_tokens, hit.num_blocks, b.block_ids, b.num_computed_tokens) == (8, 2, [1, 2], 8)
    kv.record_admission(b)
    assert b.num_cached_tokens == 8 and kv.block_manager.refcount(1) == 3
    assert (kv.prefix_queried_tokens, kv.prefix_hit_tokens) == (20, 8) and kv.prefix_hit_rate == pytest.approx(0.4)
    b.num_preemptions = 1  # A re-admission after preemption is not counted again.
    kv.record_admission(b)
    assert (kv.prefix_queried_tokens, kv.prefix_hit_tokens) == (20, 8)
    assert kv.cache.match_prefix([100, 101, 102, 103]).block_ids == [1]  # The cache itself counts nothing.
    assert (kv.prefix_queried_tokens, kv.prefix_hit_tokens) == (20, 8)
    compute(kv, b, 2)
    assert b.block_ids == [1, 2, 4]  # a holds 1, 2, 3.
    for r in (a, b):
        kv.release(r)
    kv.check_invariants([])
    assert kv.num_used_blocks == kv.num_cached_blocks == 2  # Only the cache holds blocks 1, 2.
    with pytest.raises(ValueError, match="already holds blocks"):
        kv.lookup_prefix(Request("c", [1], block_ids=[1]))


def test_lookup_never_covers_the_last_token_and_release_undoes_it():
    kv = make()
    a = req("a", 8)
    compute(kv, a, 8)
    kv.release(a)  # Caches blocks 1, 2.
    c = req("c", 8)  # Exactly the cached tokens: the last one must be computed, so one block is reused.
    assert kv.lookup_prefix(c).num_tokens == 4 and c.block_ids == [1]
    kv.check_invariants([c])
    kv.release(c)  # Undo an admission that did not happen.
    kv.check_invariants([])
    assert kv.cache.num_locks() == 0 and kv.block_manager.refcount(1) == 1


def test_concurrent_duplicate_prefill_switches_to_the_cached_block():
    kv = make()
    a, b = req("a", 9), req("b", 9)
    compute(kv, a, 9)
    compute(kv, b, 9)  # Same prompt computed twice: a in [1, 2, 3], b in [4, 5, 6].
    kv.cache_computed(a)
    kv.cache_computed(b)
    assert b.block_ids == [1, 2, 6] and kv.block_manager.refcount(1) == 3  # b's duplicates 4, 5 are freed.
    assert kv.num_free_blocks == 4
    kv.check_invariants([a, b])


def test_copy_on_write_of_a_shared_block():
    kv = make()
    a = req("a", 8)
    compute(kv, a, 8)
    kv.cache_computed(a)  # Blocks 1, 2 shared by a and the cache.
    a.num_computed_tokens = 6  # Rewrite positions 6, 7 (in shared block 2) and 8 (a new block).
    alloc = kv.allocate(a, 3)
    assert alloc.cow_pairs == ((2, 3),) and alloc.num_new_blocks == 2
    assert a.block_ids == [1, 3, 4] and kv.block_manager.refcount(2) == 1  # Only the cache holds 2 now.
    kv.block_manager.check_invariants()  # (Not kv's own check: a rewound below its cached blocks on purpose.)
    assert kv.cache.cached_block_ids() == [1, 2] and kv.block_manager.refcount(1) == 2


def test_allocation_evicts_the_prefix_cache_only_when_short():
    kv = make(num_blocks=5)  # 4 usable.
    a = req("a", 12)
    compute(kv, a, 12)
    kv.release(a)  # Blocks 1-3 cached, block 4 free.
    b = req("b", list(range(300, 308)))
    assert kv.can_allocate(b, 8)
    compute(kv, b, 8)
    assert b.block_ids == [4, 3] and kv.cache.cached_block_ids() == [1, 2]  # The LRU leaf's tail went first.
    c = req("c", list(range(500, 513)))
    assert not kv.can_allocate(c, 13) and not kv.allocate(c, 13) and c.block_ids == []
    kv.check_invariants([b])


def test_provisional_append_and_rollback_exact_blocks():
    kv = make(caching=False)
    r = req("r", 4, outputs=[7])  # Prompt computed in block 1, token 7 at position 4 still to compute.
    compute(kv, r, 4)
    alloc = kv.append_provisional(r, 5)  # Positions 4 (token 7) .. 9 (drafts): blocks 2, 3.
    assert alloc and r.block_ids == [1, 2, 3] and kv.num_provisional(r) == 5
    with pytest.raises(ValueError, match="already has provisional"):
        kv.append_provisional(r, 1)
    with pytest.raises(ValueError, match=r"num_rejected must be in \[0, 5\]"):
        kv.rollback(r, 6)
    assert kv.rollback(r, 4) == 1  # 1 draft accepted: positions 4, 5 stay valid, block 3 goes back.
    r.num_computed_tokens = 6
    assert r.block_ids == [1, 2] and kv.num_provisional(r) == 0 and kv.num_free_blocks == 6
    with pytest.raises(ValueError, match="no provisional tokens"):
        kv.rollback(r, 0)
    kv.check_invariants([r])
    r.append_output(20)
    r.append_output(30)
    assert kv.append_provisional(r, 2).num_new_blocks == 1  # Positions 6 (token 30), 7, 8: one more block.
    assert r.block_ids == [1, 2, 4]  # The free queue is [4, ..., 8, 3]: the rolled-back block went to its tail.
    assert kv.rollback(r, 0) == 0 and r.block_ids == [1, 2, 4]  # All accepted: nothing to give back.


def test_provisional_fails_without_blocks_and_takes_nothing():
    kv = make(num_blocks=3, caching=False)  # 2 usable.
    r = req("r", 4, outputs=[7])
    compute(kv, r, 4)
    assert not kv.append_provisional(r, 5) and r.block_ids == [1] and kv.num_provisional(r) == 0
    assert kv.append_provisional(r, 3) and r.block_ids == [1, 2]
    kv.release(r)  # Release drops provisional positions too.
    assert kv.num_provisional(r) == 0 and kv.num_free_blocks == 2
    kv.check_invariants([])


@pytest.mark.parametrize("caching", [False, True])
def test_many_rejections_leave_every_block_free(caching):
    rng = random.Random(caching)
    kv = make(num_blocks=48, caching=caching)
    reqs = [req(f"r{i}", rng.randint(1, 9)) for i in range(3)]
    for r in reqs:
        kv.lookup_prefix(r)
        compute(kv, r, r.num_tokens - r.num_computed_tokens)
        r.append_output(rng.randint(3, 9))
    rejected = 0
    for _ in range(300):
        r = rng.choice(reqs)
        k = rng.randint(0, 6)
        if not kv.append_provisional(r, k):
            assert kv.num_provisional(r) == 0
            continue
        drafts = [rng.randint(3, 9) for _ in range(k)]
        accepted = rng.randint(0, k)
        kv.rollback(r, k - accepted)
        rejected += k - accepted
        r.num_computed_tokens += accepted + 1
        for t in drafts[:accepted] + [rng.randint(3, 9)]:
            r.append_output(t)
        assert len(r.block_ids) == kv.blocks_for(r.num_computed_tokens)  # Nothing past the accepted positions.
        assert all(kv.block_manager.refcount(b) >= 1 for b in r.block_ids)
        kv.cache_computed(r)
        kv.check_invariants(reqs)
        if r.num_tokens > 40:  # Finish and start over, so the cache sees many sequences.
            kv.release(r)
            reqs[reqs.index(r)] = fresh = req(f"n{rng.random()}", rng.randint(1, 9))
            kv.lookup_prefix(fresh)
            compute(kv, fresh, fresh.num_tokens - fresh.num_computed_tokens)
            fresh.append_output(3)
            kv.check_invariants(reqs)
    assert rejected > 100
    for r in reqs:
        kv.release(r)
    if caching:
        kv.cache.clear()
    kv.check_invariants([])
    assert kv.num_free_blocks == kv.num_usable_blocks
