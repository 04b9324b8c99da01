"""Fixed-size KV block pool with reference counts (pure Python, no JAX).

The device KV cache is `[Hkv, num_pages, page_size, hd]` per layer; a block id here is a page index there and
`block_size == page_size`. Token position p of a sequence lives at slot
`block_table[p // block_size] * block_size + p % block_size`.

Block 0 is the null page: it is never allocated, never freed and never cached. The runner pads block tables
(rows past a sequence's last block, padding rows of a batch) with 0, so garbage written through padding lands
in a page nobody reads. Usable ids are 1 .. num_blocks - 1.

Ownership is a reference count per block: a running request holds one reference to every block in its table,
and the radix prefix cache holds one reference to every block it caches. A block with refcount 0 sits in the
free queue (FIFO, a deque of ids); `allocate` pops from the head, `free` appends at the tail. A writer that must
modify a block shared with someone else (refcount > 1) calls `copy_on_write`, which gives it a private copy
and reports the (src, dst) pair; the runner copies page src to page dst on device before the step's writes.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable

NULL_BLOCK = 0


class NoFreeBlocksError(RuntimeError):
    """Raised when more blocks are requested than are free."""


@dataclasses.dataclass(frozen=True)
class CopyOnWrite:
    """Result of `BlockManager.copy_on_write`.

    Attributes:
        block_id: the block the writer must use from now on.
        copied_from: the shared block it replaces when a copy was made, else None; the runner copies page
            copied_from -> block_id.
    """

    block_id: int
    copied_from: int | None = None

    @property
    def pair(self) -> tuple[int, int] | None:
        """(src, dst) for the device copy, or None."""
        return None if self.copied_from is None else (self.copied_from, self.block_id)


class BlockManager:
    """Reference-counted pool of `num_blocks` KV blocks, block 0 reserved as the null page."""

    def __init__(self, num_blocks: int):
        """Args:
        num_blocks: pages in the device pool, including the null page (so at least 2).
        """
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the reserved null page), got {num_blocks}")
        self.num_blocks = num_blocks
        self._refcounts = [0] * num_blocks  # [num_blocks]
        self._free: collections.deque[int] = collections.deque(range(1, num_blocks))

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can ever be allocated (all but the null page)."""
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks with at least one reference."""
        return self.num_usable_blocks - len(self._free)

    def refcount(self, block_id: int) -> int:
        return self._refcounts[block_id]

    def can_allocate(self, num: int) -> bool:
        return num <= len(self._free)

    def allocate(self, num: int) -> list[int]:
        """Takes `num` blocks from the head of the free queue, each with refcount 1.

        Raises:
            NoFreeBlocksError: when fewer than `num` are free (nothing is taken then).
        """
        if num < 0:
            raise ValueError(f"cannot allocate {num} blocks")
        if num > len(self._free):
            raise NoFreeBlocksError(f"asked for {num} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(num)]
        for b in blocks:
            self._refcounts[b] = 1
        return blocks

    def incref(self, block_ids: Iterable[int]) -> None:
        """Adds a reference to blocks already in use (sharing them)."""
        for b in block_ids:
            self._check_id(b)
            if self._refcounts[b] == 0:
                raise ValueError(f"incref of free block {b}")
            self._refcounts[b] += 1

    def free(self, block_ids: Iterable[int]) -> int:
        """Drops one reference from each block; blocks reaching 0 go to the tail of the free queue.

        Returns:
            How many blocks were returned to the free queue.

        Raises:
            ValueError: on the null page, an out-of-range id, or a block that is already free (double free).
        """
        released = 0
        for b in block_ids:
            self._check_id(b)
            if self._refcounts[b] == 0:
                raise ValueError(f"double free of block {b}")
            self._refcounts[b] -= 1
            if self._refcounts[b] == 0:
                self._free.append(b)
                released += 1
        return released

    def copy_on_write(self, block_id: int) -> CopyOnWrite:
        """Makes `block_id` safe for the caller to write.

        If the caller is the only holder it keeps the block. Otherwise it drops its reference to the shared block
        and gets a fresh one (refcount 1); the caller must copy the page on device (`CopyOnWrite.pair`).

        Raises:
            NoFreeBlocksError: when a copy is needed and no block is free.
        """
        self._check_id(block_id)
        if self._refcounts[block_id] == 0:
            raise ValueError(f"copy_on_write of free block {block_id}")
        if self._refcounts[block_id] == 1:
            return CopyOnWrite(block_id)
        (new_block,) = self.allocate(1)
        self._refcounts[block_id] -= 1  # Still >= 1: the other holders keep it.
        return CopyOnWrite(new_block, copied_from=block_id)

    def check_invariants(self) -> None:
        """Asserts: the null page is never referenced or free; every other block is either free (refcount 0, in
        the free queue exactly once) or referenced (refcount > 0, not in the queue)."""
        assert self._refcounts[NULL_BLOCK] == 0, "null block was referenced"
        free_set = set(self._free)
        assert len(free_set) == len(self._free), "a block is in the free queue twice"
        assert NULL_BLOCK not in free_set, "null block is in the free queue"
        for b in range(1, self.num_blocks):
            rc = self._refcounts[b]
            assert rc >= 0, f"block {b} has refcount {rc}"
            assert (rc == 0) == (b in free_set), f"block {b}: refcount {rc} but in free queue: {b in free_set}"

    def _check_id(self, block_id: int) -> None:
        if not 0 < block_id < self.num_blocks:
            raise ValueError(f"invalid block id {block_id} (usable ids are 1..{self.num_blocks - 1})")
