"""KV-block bookkeeping for the scheduler: block tables, copy-on-write, the prefix cache, provisional tokens.

Pure Python, no JAX. The scheduler decides which tokens of which requests run in a step; the KVManager decides
where their KV lives. It owns the BlockManager (reference-counted pages) and the RadixCache (shared prefixes),
and is the only code that changes a request's `block_ids`:

    lookup_prefix(req)            admission: take the cached blocks of all but the last token (references + lock)
    can_allocate / allocate       make the table cover the next n positions, private where they are written
    append_provisional(req, k)    the same for the known tokens plus k draft tokens (speculative verification)
    rollback(req, num_rejected)   give back the blocks only rejected drafts needed
    cache_computed(req)           share the request's computed full blocks through the prefix cache
    release(req)                  finish / preempt: cache, unlock, drop every reference

A request's table and the positions it covers:

    position   0 ............. num_computed-1 | num_computed ...... end-1
    KV         written, valid (committed)      | written this step (end = num_computed + n)
    blocks     [ b0 | b1 | ... | b(j-1) ]  with j = ceil(end / block_size)
    tree       the first `num_tree_blocks` blocks are also in the prefix cache (full, committed)

A provisional (draft) position is written like any other, but stays outside `num_computed_tokens` until the
verifier accepts it. After verification the scheduler sets `num_computed_tokens` to the accepted length and
calls `rollback`, which frees the blocks past it:

    block_size 4, num_computed = start = 6, the last token t0 and 4 drafts (append_provisional(req, 4)):
    position   4   5   6   7  | 8   9   10  11
    token      .   .   t0  d1 | d2  d3  d4  -        end = 11
    block      b1             | b2 (taken for the drafts)
    d1 accepted, d2 rejected (rollback(req, 3)): num_computed = 8, ceil(8 / 4) = 2 blocks kept, b2 freed

Only committed blocks ever enter the prefix cache (`cache_computed` inserts the full blocks below
num_computed_tokens), so a block holding a rejected draft's KV is never shared. Its garbage KV is overwritten
when the position is computed again.

Copy-on-write: a block with refcount > 1 is copied before a write into it (the (src, dst) pair goes to the
runner). The scheduler's own flows write only past the shared prefix (prefix hits and cached blocks end on a
block boundary), so copies are rare; the manager handles them anyway.

Sliding windows (`window`, when EVERY layer attends to the last `window` keys only, as in Mistral-style
configs; a model with any global layer, like Gemma 3, keeps the whole context): a block none of whose positions
any later query can see is given back at the next `allocate`, and its table entry becomes the null page, which
the paged kernels never read (they start at the window):

    window 6, block_size 4, num_computed 13: the next query sits at >= 13 and sees keys > 13 - 6 = 7
    position   0..3  4..7 | 8..11  12..
    blocks     b0    b1   | b2     b3          b0, b1 hold only keys <= 7: freed, table [0, 0, b2, b3]

Only the leading blocks that are still held (before the first freed one) can enter the prefix cache afterwards.

Prefix counters (one set): `prefix_queried_tokens` / `prefix_hit_tokens` count a request's prompt and its hit
at its first admission only (`record_admission`), so retries and recomputation after preemption do not count.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable

from serving.core.block_manager import NULL_BLOCK, BlockManager
from serving.core.radix_cache import RadixCache, RadixNode
from serving.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class Allocation:
    """Result of `allocate` / `append_provisional`; truthy when it succeeded.

    Attributes:
        ok: whether the request's blocks now cover the positions (when False nothing was taken).
        cow_pairs: (src, dst) pages the runner copies before the step's KV writes.
        num_new_blocks: blocks taken from the pool (copies included).
    """

    ok: bool
    cow_pairs: tuple[tuple[int, int], ...] = ()
    num_new_blocks: int = 0

    def __bool__(self) -> bool:
        return self.ok


@dataclasses.dataclass(frozen=True)
class PrefixHit:
    """Result of `lookup_prefix`: leading tokens (and blocks) whose KV came from the prefix cache."""

    num_tokens: int
    num_blocks: int


_FAILED, _DONE = Allocation(False), Allocation(True)


class KVManager:
    """Block tables of running requests over one block pool and one optional prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, window: int | None = None):
        """Args:
        num_blocks: KV pages in the device pool, including the null page 0.
        block_size: tokens per page.
        enable_prefix_caching: reuse KV of shared prefixes through a radix cache.
        window: the sliding window of every layer (ModelConfig.kv_window), or None when some layer sees the whole
            context; blocks outside it are given back.
        """
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if window is not None and window < 1:
            raise ValueError(f"window must be None or >= 1, got {window}")
        self.block_size = block_size
        self.window = window
        self._num_freed: dict[str, int] = {}  # request_id -> leading table entries given back (window)
        self.block_manager = BlockManager(num_blocks)
        self.cache = RadixCache(self.block_manager, block_size) if enable_prefix_caching else None
        self._lock_node: dict[str, RadixNode] = {}  # Deepest cache node a request uses, locked.
        self._num_tree_blocks: dict[str, int] = {}  # Leading blocks of a request that are in the cache.
        self._provisional: dict[str, tuple[int, int]] = {}  # request_id -> (end position, provisional tokens).
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    # ------------------------------------------------------------------------------------------------ sizes

    @property
    def num_usable_blocks(self) -> int:
        return self.block_manager.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.block_manager.num_used

    @property
    def num_cached_blocks(self) -> int:
        return self.cache.num_cached_blocks if self.cache else 0

    @property
    def num_evictable_blocks(self) -> int:
        return self.cache.num_evictable_blocks if self.cache else 0

    def blocks_for(self, num_positions: int) -> int:
        """Blocks a table needs to cover positions 0 .. num_positions - 1."""
        return cdiv(num_positions, self.block_size)

    # -------------------------------------------------------------------------------------------- admission

    def lookup_prefix(self, req: Request) -> PrefixHit:
        """Takes the cached prefix of all but the last token (at least the last token is computed, so that its
        logits exist) for a request holding no blocks: references its blocks, locks its node and sets
        `num_computed_tokens` to the hit. Undo with `release`."""
        if req.block_ids:
            raise ValueError(f"lookup_prefix: {req.request_id!r} already holds blocks")
        if self.cache is None:
            return PrefixHit(0, 0)
        match = self.cache.match_prefix(req.all_token_ids[: req.num_tokens - 1], req.cache_namespace)
        self.cache.lock(match.node)
        self.block_manager.incref(match.block_ids)
        req.block_ids = list(match.block_ids)
        req.num_computed_tokens = match.num_tokens
        self._lock_node[req.request_id] = match.node
        self._num_tree_blocks[req.request_id] = len(match.block_ids)
        return PrefixHit(match.num_tokens, len(match.block_ids))

    def record_admission(self, req: Request) -> None:
        """Counts a request's prompt and prefix hit at its first admission; sets `num_cached_tokens`."""
        if req.num_preemptions == 0:
            req.num_cached_tokens = req.num_computed_tokens
            self.prefix_queried_tokens += req.num_prompt_tokens
            self.prefix_hit_tokens += req.num_computed_tokens

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0

    # ----------------------------------------------------------------------------------------------- blocks

    def _needs(self, req: Request, n: int) -> tuple[int, list[int]]:
        """(new blocks, indices of shared blocks written) for positions num_computed .. num_computed + n - 1."""
        bm, bs = self.block_manager, self.block_size
        start, end = req.num_computed_tokens, req.num_computed_tokens + n
        num_new = max(0, cdiv(end, bs) - len(req.block_ids))
        written = range(start // bs, min(len(req.block_ids), cdiv(end, bs)))
        return num_new, [i for i in written if bm.refcount(req.block_ids[i]) > 1]

    def can_allocate(self, req: Request, n: int) -> bool:
        """Whether `allocate(req, n)` can succeed now (free blocks plus what the prefix cache could evict)."""
        num_new, shared = self._needs(req, n)
        return num_new + len(shared) <= self.block_manager.num_free + self.num_evictable_blocks

    def allocate(self, req: Request, n: int) -> Allocation:
        """Makes req's blocks cover positions < num_computed_tokens + n and private where those are written.

        Evicts from the prefix cache when the free queue is short. Fails, taking nothing, when even the evictable
        cache cannot cover the shortfall (or, rarely, when evicted blocks turned out to be shared).
        """
        bm, bs = self.block_manager, self.block_size
        start = req.num_computed_tokens
        if self.window is not None:
            self.free_outside_window(req)
        if n == 1 and start // bs < len(req.block_ids) and bm.refcount(req.block_ids[start // bs]) == 1:
            return _DONE  # Decode fast path: the token goes into a private block already held.
        num_new, shared = self._needs(req, n)
        need = num_new + len(shared)
        if need > bm.num_free:
            if need > bm.num_free + self.num_evictable_blocks:
                return _FAILED
            self.cache.evict(need - bm.num_free)
            if need > bm.num_free:
                return _FAILED
        pairs = []
        for i in shared:
            cow = bm.copy_on_write(req.block_ids[i])
            req.block_ids[i] = cow.block_id
            pairs.append(cow.pair)
        req.block_ids.extend(bm.allocate(num_new))
        return Allocation(True, tuple(pairs), need)

    def free_outside_window(self, req: Request) -> int:
        """Gives back req's leading blocks that no query at or after `num_computed_tokens` can see (see the module
        docstring); their table entries become the null page. Returns the blocks freed (0 without a window)."""
        if self.window is None:
            return 0
        # The next query sits at position >= num_computed and sees keys > num_computed - window.
        dead = min(max(0, req.num_computed_tokens - self.window + 1) // self.block_size, len(req.block_ids))
        done = self._num_freed.get(req.request_id, 0)
        if dead <= done:
            return 0
        freed = [b for b in req.block_ids[done:dead] if b != NULL_BLOCK]
        req.block_ids[done:dead] = [NULL_BLOCK] * (dead - done)
        self._num_freed[req.request_id] = dead
        return self.block_manager.free(freed)

    def append_provisional(self, req: Request, k: int) -> Allocation:
        """Allocates for the request's known tokens not yet computed plus `k` provisional (draft) tokens after
        them, and remembers the k positions for `rollback`. Fails, taking nothing, like `allocate`."""
        if k < 0:
            raise ValueError(f"append_provisional: k must be >= 0, got {k}")
        if req.request_id in self._provisional:
            raise ValueError(f"append_provisional: {req.request_id!r} already has provisional tokens")
        n = req.num_tokens - req.num_computed_tokens + k
        alloc = self.allocate(req, n)
        if alloc:
            self._provisional[req.request_id] = (req.num_computed_tokens + n, k)
        return alloc

    def rollback(self, req: Request, num_rejected: int) -> int:
        """Drops the last `num_rejected` provisional positions of `append_provisional` and frees the blocks that
        only they needed. The caller sets `num_computed_tokens` (at most the positions kept).

        Returns:
            Blocks returned to the free queue.
        """
        if req.request_id not in self._provisional:
            raise ValueError(f"rollback: {req.request_id!r} has no provisional tokens")
        end, k = self._provisional[req.request_id]
        if not 0 <= num_rejected <= k:
            raise ValueError(f"rollback: num_rejected must be in [0, {k}], got {num_rejected}")
        del self._provisional[req.request_id]
        keep = max(self.blocks_for(end - num_rejected), self._num_tree_blocks.get(req.request_id, 0))
        extra = req.block_ids[keep:]
        del req.block_ids[keep:]
        return self.block_manager.free(extra)

    def num_provisional(self, req: Request) -> int:
        """Provisional tokens appended and not yet rolled back."""
        return self._provisional.get(req.request_id, (0, 0))[1]

    def slot_mapping(self, req: Request, start: int, n: int) -> list[int]:
        """Cache slots of positions start .. start + n - 1: block_table[pos // bs] * bs + pos % bs.

        Raises:
            ValueError: when the table does not cover the positions.
        """
        bs, table = self.block_size, req.block_ids
        if start < 0 or n < 0 or cdiv(start + n, bs) > len(table):
            raise ValueError(f"slot_mapping: positions {start}..{start + n - 1} not covered by {len(table)} blocks")
        return [table[p // bs] * bs + p % bs for p in range(start, start + n)]

    # ------------------------------------------------------------------------------------------ prefix cache

    def cache_computed(self, req: Request) -> None:
        """Inserts req's committed full blocks into the prefix cache; where the cache already held a block for
        the same tokens, req switches to it and frees its duplicate. Moves req's lock to the new deepest node."""
        if self.cache is None:
            return
        k = req.num_computed_tokens // self.block_size
        if self._num_freed.get(req.request_id, 0):  # only blocks before the first freed one form a prefix
            k = min(k, req.block_ids.index(NULL_BLOCK))
        if k <= self._num_tree_blocks.get(req.request_id, 0):
            return
        result = self.cache.insert(req.all_token_ids[: k * self.block_size], req.block_ids[:k], req.cache_namespace)
        for i, cached in enumerate(result.block_ids):
            if req.block_ids[i] != cached:
                self.block_manager.incref([cached])
                self.block_manager.free([req.block_ids[i]])
                req.block_ids[i] = cached
        self.cache.lock(result.node)
        old = self._lock_node.get(req.request_id)
        if old is not None:
            self.cache.unlock(old)
        self._lock_node[req.request_id] = result.node
        self._num_tree_blocks[req.request_id] = k

    def release(self, req: Request) -> None:
        """Caches req's committed full blocks, unlocks its cache node and drops all its block references (and
        provisional positions). `num_computed_tokens` is left to the caller."""
        self.cache_computed(req)
        node = self._lock_node.pop(req.request_id, None)
        if node is not None:
            self.cache.unlock(node)
        self._num_tree_blocks.pop(req.request_id, None)
        self._provisional.pop(req.request_id, None)
        self._num_freed.pop(req.request_id, None)
        self.block_manager.free([b for b in req.block_ids if b != NULL_BLOCK])
        req.block_ids = []

    # ----------------------------------------------------------------------------------------------- checks

    def check_invariants(self, holders: Iterable[Request]) -> None:
        """Asserts that the references of `holders` (every request holding blocks) and of the cache account for
        every block's refcount, and that locks and provisional positions belong to holders."""
        self.block_manager.check_invariants()
        holders = list(holders)
        ids = {r.request_id for r in holders}
        expected = collections.Counter()
        for req in holders:
            assert self.blocks_for(req.num_computed_tokens) <= len(req.block_ids), req.request_id
            assert self._num_tree_blocks.get(req.request_id, 0) <= req.num_computed_tokens // self.block_size
            expected.update(req.block_ids)
        assert set(self._provisional) <= ids, f"provisional tokens of {set(self._provisional) - ids}"
        for req in holders:
            end = self._provisional.get(req.request_id, (0, 0))[0]
            assert self.blocks_for(end) <= len(req.block_ids), f"{req.request_id}: provisional past its blocks"
        assert set(self._lock_node) <= ids, f"locks of {set(self._lock_node) - ids}"
        if self.cache is not None:
            self.cache.check_invariants()
            expected.update(self.cache.cached_block_ids())
            locks = sum(not node.is_root for node in self._lock_node.values())
            assert locks == self.cache.num_locks(), f"{locks} request locks, the cache counts {self.cache.num_locks()}"
        for b in range(1, self.block_manager.num_blocks):
            assert self.block_manager.refcount(b) == expected[b], (
                f"block {b}: refcount {self.block_manager.refcount(b)}, holders {expected[b]}"
            )
