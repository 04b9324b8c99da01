"""BlockManager: tiny pools, exact block ids."""

import pytest

from serving.core.block_manager import NULL_BLOCK, BlockManager, NoFreeBlocksError


def test_null_block_reserved_and_fifo_allocation():
    bm = BlockManager(5)
    assert bm.num_usable_blocks == 4 and bm.num_free == 4 and bm.num_used == 0
    assert bm.allocate(2) == [1, 2]
    assert bm.allocate(2) == [3, 4]
    assert NULL_BLOCK == 0 and bm.refcount(0) == 0
    assert bm.num_free == 0 and bm.num_used == 4
    bm.check_invariants()


def test_free_returns_to_tail_of_queue():
    bm = BlockManager(5)
    a = bm.allocate(3)  # [1, 2, 3]; free queue [4]
    assert bm.free([a[1], a[0]]) == 2  # queue [4, 2, 1]
    assert bm.allocate(3) == [4, 2, 1]
    bm.check_invariants()


def test_allocate_too_many_takes_nothing():
    bm = BlockManager(3)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(3)
    assert bm.num_free == 2 and bm.can_allocate(2) and not bm.can_allocate(3)
    with pytest.raises(ValueError):
        bm.allocate(-1)


def test_refcounts_share_and_release():
    bm = BlockManager(4)
    (b,) = bm.allocate(1)
    bm.incref([b])
    bm.incref([b])
    assert bm.refcount(b) == 3
    assert bm.free([b]) == 0 and bm.free([b]) == 0
    assert bm.num_used == 1
    assert bm.free([b]) == 1
    assert bm.num_used == 0 and bm.refcount(b) == 0
    bm.check_invariants()


def test_double_free_and_bad_ids_raise():
    bm = BlockManager(4)
    (b,) = bm.allocate(1)
    bm.free([b])
    with pytest.raises(ValueError, match="double free"):
        bm.free([b])
    with pytest.raises(ValueError, match="invalid block id"):
        bm.free([0])
    with pytest.raises(ValueError, match="invalid block id"):
        bm.incref([4])
    with pytest.raises(ValueError, match="incref of free block"):
        bm.incref([b])
    bm.check_invariants()


def test_copy_on_write_private_block_is_kept():
    bm = BlockManager(4)
    (b,) = bm.allocate(1)
    cow = bm.copy_on_write(b)
    assert cow.block_id == b and cow.copied_from is None and cow.pair is None
    assert bm.num_used == 1


def test_copy_on_write_shared_block_gets_a_copy():
    bm = BlockManager(4)
    (b,) = bm.allocate(1)  # 1
    bm.incref([b])  # Shared by two writers.
    cow = bm.copy_on_write(b)
    assert cow.block_id == 2 and cow.copied_from == 1 and cow.pair == (1, 2)
    assert bm.refcount(1) == 1 and bm.refcount(2) == 1
    # The other holder now owns block 1 alone: its write needs no copy.
    assert bm.copy_on_write(1).pair is None
    bm.check_invariants()


def test_copy_on_write_without_free_block_raises():
    bm = BlockManager(2)
    (b,) = bm.allocate(1)
    bm.incref([b])
    with pytest.raises(NoFreeBlocksError):
        bm.copy_on_write(b)
    assert bm.refcount(b) == 2


def test_check_invariants_catches_corruption():
    bm = BlockManager(4)
    bm.allocate(1)
    bm._free.append(1)  # A referenced block in the free queue.
    with pytest.raises(AssertionError):
        bm.check_invariants()


def test_too_small_pool_rejected():
    with pytest.raises(ValueError):
        BlockManager(1)
