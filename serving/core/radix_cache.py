"""Radix-tree prefix cache over token ids at block granularity (RadixAttention; pure Python, no JAX).

Each edge of the tree holds whole blocks: `block_size * k` token ids and the k KV block ids that store them, so
a root-to-node path spells a token prefix whose length is a multiple of block_size, and its blocks are exactly
the KV a request with that prefix needs. Children are keyed by their first block's tokens:

    root ─[a b | c d]─ n1 ─[e f]─ n2          block_size = 2; n1 holds blocks (7, 3), n2 holds (9,)
                        └─[x y | z w]─ n3      n3 holds (4, 5)

Partial blocks are never cached: a block is shareable only once all its tokens are known and computed.

Ownership: the cache holds one block-manager reference to each cached block (`insert` increfs, eviction frees).
A request that reuses cached blocks takes its own references and `lock`s the deepest node it uses; a lock
counts on that node and all its ancestors, and locked nodes are never evicted. So a block in an unlocked node
is normally held only by the cache, and evicting it returns it to the free queue.

Eviction is LRU and leaf-first: only unlocked leaves are evictable, kept in a heap keyed by last access time
(lazy deletion: stale entries are skipped when popped), so `evict` never scans the tree. `evict(n)` frees only
what is needed: it trims blocks from the tail of the least recently used leaf when the whole leaf is more than
the remainder, and drops leaves otherwise (after which their parent may become an evictable leaf).

Namespaces (e.g. a model or LoRA adapter name) get separate roots, so they never share blocks.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Hashable, Sequence

from serving.core.block_manager import BlockManager


class RadixNode:
    """A tree node: the edge from its parent (tokens and blocks), children, locks, last access."""

    __slots__ = (
        "uid",
        "parent",
        "children",
        "token_ids",
        "block_ids",
        "lock_ref",
        "last_access",
        "in_heap_at",
        "removed",
    )

    def __init__(
        self, uid: int, parent: RadixNode | None, token_ids: tuple[int, ...], block_ids: list[int], last_access: int
    ):
        self.uid = uid
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.token_ids = token_ids  # [len(block_ids) * block_size]
        self.block_ids = block_ids
        self.lock_ref = 0  # Locks held on this node or any descendant.
        self.last_access = last_access
        self.in_heap_at: int | None = None  # last_access of this node's newest heap entry, if any.
        self.removed = False

    @property
    def is_root(self) -> bool:
        return self.parent is None


@dataclasses.dataclass(frozen=True)
class PrefixMatch:
    """Result of `RadixCache.match_prefix`.

    Attributes:
        node: deepest matched node (a root when nothing matched); pass to `lock` / `unlock`.
        block_ids: cached blocks covering the matched tokens, in order.
        num_tokens: matched tokens (len(block_ids) * block_size).
    """

    node: RadixNode
    block_ids: list[int]
    num_tokens: int


@dataclasses.dataclass(frozen=True)
class InsertResult:
    """Result of `RadixCache.insert`.

    Attributes:
        node: the node whose path is exactly the inserted prefix.
        block_ids: the cache's blocks for that prefix. Where the cache already had a block for a position, this
            is the cache's block, not the caller's; the caller may switch to it and free its duplicate.
        num_new_blocks: caller blocks newly referenced by the cache.
    """

    node: RadixNode
    block_ids: list[int]
    num_new_blocks: int


class RadixCache:
    """Block-granular radix prefix cache holding block-manager references to the blocks it caches."""

    def __init__(self, block_manager: BlockManager, block_size: int):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_manager = block_manager
        self.block_size = block_size
        self._uids = itertools.count()
        self._clock = 0
        self._roots: dict[Hashable, RadixNode] = {}
        self._heap: list[tuple[int, int, RadixNode]] = []  # (last_access, uid, node) of evictable leaves.
        self._num_nodes = 0
        self.num_cached_blocks = 0
        self._num_locked_blocks = 0

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks in unlocked nodes (an upper bound on what `evict` can free)."""
        return self.num_cached_blocks - self._num_locked_blocks

    def root(self, namespace: Hashable = None) -> RadixNode:
        node = self._roots.get(namespace)
        if node is None:
            node = self._roots[namespace] = RadixNode(next(self._uids), None, (), [], self._clock)
        return node

    def match_prefix(self, token_ids: Sequence[int], namespace: Hashable = None) -> PrefixMatch:
        """Finds the longest cached prefix of `token_ids` made of full blocks.

        A match ending inside an edge splits that edge, so the returned node covers exactly the matched blocks.
        Every node on the path is marked as just used. (Hit counters are the KVManager's.)
        """
        bs = self.block_size
        now = self._tick()
        node = self.root(namespace)
        blocks: list[int] = []
        pos = 0
        while pos + bs <= len(token_ids):
            child = node.children.get(tuple(token_ids[pos : pos + bs]))
            if child is None:
                break
            k = self._common_blocks(child, token_ids, pos, len(token_ids))
            partial = k < len(child.block_ids)
            if partial:
                child = self._split(child, k)
            blocks.extend(child.block_ids)
            pos += k * bs
            node = child
            self._touch(node, now)
            if partial:
                break
        return PrefixMatch(node, blocks, pos)

    def insert(self, token_ids: Sequence[int], block_ids: Sequence[int], namespace: Hashable = None) -> InsertResult:
        """Caches the prefix `token_ids[:len(block_ids) * block_size]` stored in `block_ids`.

        Positions already cached keep the cache's block; the rest become a new leaf referencing the caller's
        blocks (incref). The caller keeps its own references either way.
        """
        bs = self.block_size
        n_tokens = len(block_ids) * bs
        if len(token_ids) < n_tokens:
            raise ValueError(f"{len(block_ids)} blocks need {n_tokens} tokens, got {len(token_ids)}")
        now = self._tick()
        node = self.root(namespace)
        path_blocks: list[int] = []
        pos = 0
        while pos < n_tokens:
            child = node.children.get(tuple(token_ids[pos : pos + bs]))
            if child is None:
                new_blocks = list(block_ids[pos // bs :])
                child = self._add_leaf(node, tuple(token_ids[pos:n_tokens]), new_blocks, now)
                path_blocks.extend(new_blocks)
                return InsertResult(child, path_blocks, len(new_blocks))
            k = self._common_blocks(child, token_ids, pos, n_tokens)
            if k < len(child.block_ids):
                child = self._split(child, k)
            path_blocks.extend(child.block_ids)
            pos += k * bs
            node = child
            self._touch(node, now)
        return InsertResult(node, path_blocks, 0)

    def lock(self, node: RadixNode) -> None:
        """Protects `node` and its ancestors from eviction until a matching `unlock`."""
        if node.removed:
            raise ValueError(f"lock of evicted node {node.uid}")
        while not node.is_root:
            if node.lock_ref == 0:
                self._num_locked_blocks += len(node.block_ids)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        """Releases one `lock` of `node`."""
        while not node.is_root:
            if node.lock_ref <= 0:
                raise ValueError(f"unlock of unlocked node {node.uid}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._num_locked_blocks -= len(node.block_ids)
                self._push_if_evictable(node)
            node = node.parent

    def evict(self, num_blocks: int) -> int:
        """Frees cached blocks, least recently used leaves first, until `num_blocks` returned to the pool.

        Returns:
            Blocks returned to the block manager's free queue (less than asked when not enough is evictable).
        """
        freed = 0
        while freed < num_blocks and self._heap:
            last_access, _, node = heapq.heappop(self._heap)
            if node.in_heap_at == last_access:
                node.in_heap_at = None
            if not self._evictable(node) or node.last_access != last_access:
                continue
            take = min(num_blocks - freed, len(node.block_ids))
            if take < len(node.block_ids):
                victims = node.block_ids[-take:]
                node.block_ids = node.block_ids[:-take]
                node.token_ids = node.token_ids[: len(node.block_ids) * self.block_size]
                self._push_if_evictable(node)
            else:
                victims = node.block_ids
                self._remove_leaf(node)
            self.num_cached_blocks -= len(victims)
            freed += self.block_manager.free(victims)
        return freed

    def clear(self) -> int:
        """Evicts everything unlocked; returns blocks freed."""
        return self.evict(self.num_cached_blocks)

    def check_invariants(self) -> None:
        """Asserts the tree's structure and its accounting against the block manager."""
        seen: set[int] = set()
        total = locked = nodes = 0
        bs = self.block_size
        for root in self._roots.values():
            stack = [root]
            while stack:
                node = stack.pop()
                nodes += 1
                assert len(node.token_ids) == len(node.block_ids) * bs, f"node {node.uid}: edge length mismatch"
                assert node.is_root or node.block_ids, f"node {node.uid}: empty non-root edge"
                assert not node.removed, f"node {node.uid} removed but still linked"
                child_locks = 0
                for key, child in node.children.items():
                    assert child.parent is node and key == child.token_ids[:bs], f"node {child.uid}: bad link"
                    child_locks += child.lock_ref
                    stack.append(child)
                assert node.is_root or node.lock_ref >= child_locks, f"node {node.uid}: lock below children's"
                for b in node.block_ids:
                    assert b not in seen, f"block {b} cached twice"
                    assert self.block_manager.refcount(b) >= 1, f"cached block {b} has no reference"
                    seen.add(b)
                total += len(node.block_ids)
                locked += len(node.block_ids) if node.lock_ref > 0 else 0
                if self._evictable(node):
                    assert node.in_heap_at == node.last_access, f"evictable leaf {node.uid} not in the heap"
        assert total == self.num_cached_blocks, f"cached count {self.num_cached_blocks} != {total}"
        assert locked == self._num_locked_blocks, f"locked count {self._num_locked_blocks} != {locked}"
        assert nodes == self._num_nodes + len(self._roots), "node count drifted"

    def num_locks(self) -> int:
        """Outstanding `lock`s on non-root nodes (each counts once on its top-level ancestor)."""
        return sum(child.lock_ref for root in self._roots.values() for child in root.children.values())

    def cached_block_ids(self) -> list[int]:
        """Every cached block (for tests and accounting checks)."""
        out = []
        for root in self._roots.values():
            stack = [root]
            while stack:
                node = stack.pop()
                out.extend(node.block_ids)
                stack.extend(node.children.values())
        return out

    def cached_prefixes(self) -> list[tuple[Hashable, tuple[int, ...], list[int]]]:
        """(namespace, path tokens, path blocks) for every non-root node: the prefix it spells and the blocks
        that hold its KV (for tests that check cached KV against its tokens)."""
        out = []
        for namespace, root in self._roots.items():
            stack = [(root, (), [])]
            while stack:
                node, tokens, blocks = stack.pop()
                for child in node.children.values():
                    path = (tokens + child.token_ids, blocks + child.block_ids)
                    out.append((namespace, *path))
                    stack.append((child, *path))
        return out

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _common_blocks(self, child: RadixNode, token_ids: Sequence[int], pos: int, end: int) -> int:
        """Whole blocks shared by child's edge and token_ids[pos:end] (>= 1: the first block is the dict key)."""
        bs = self.block_size
        k = 1
        while (
            k < len(child.block_ids)
            and pos + (k + 1) * bs <= end
            and tuple(token_ids[pos + k * bs : pos + (k + 1) * bs]) == child.token_ids[k * bs : (k + 1) * bs]
        ):
            k += 1
        return k

    def _split(self, child: RadixNode, k: int) -> RadixNode:
        """Cuts child's edge after k blocks; returns the new upper node (child keeps the lower part)."""
        bs = self.block_size
        upper = RadixNode(
            next(self._uids), child.parent, child.token_ids[: k * bs], child.block_ids[:k], child.last_access
        )
        upper.lock_ref = child.lock_ref  # Every lock through child passes through upper.
        child.parent.children[child.token_ids[:bs]] = upper
        child.token_ids = child.token_ids[k * bs :]
        child.block_ids = child.block_ids[k:]
        child.parent = upper
        upper.children[child.token_ids[:bs]] = child
        self._num_nodes += 1
        return upper

    def _add_leaf(self, parent: RadixNode, token_ids: tuple[int, ...], block_ids: list[int], now: int) -> RadixNode:
        self.block_manager.incref(block_ids)
        leaf = RadixNode(next(self._uids), parent, token_ids, block_ids, now)
        parent.children[token_ids[: self.block_size]] = leaf
        self._num_nodes += 1
        self.num_cached_blocks += len(block_ids)
        self._push_if_evictable(leaf)
        return leaf

    def _remove_leaf(self, node: RadixNode) -> None:
        parent = node.parent
        del parent.children[node.token_ids[: self.block_size]]
        node.removed = True
        node.parent = None
        self._num_nodes -= 1
        self._push_if_evictable(parent)

    def _touch(self, node: RadixNode, now: int) -> None:
        node.last_access = now
        self._push_if_evictable(node)

    def _evictable(self, node: RadixNode) -> bool:
        return not node.is_root and not node.removed and not node.children and node.lock_ref == 0

    def _push_if_evictable(self, node: RadixNode) -> None:
        if self._evictable(node) and node.in_heap_at != node.last_access:
            node.in_heap_at = node.last_access
            heapq.heappush(self._heap, (node.last_access, node.uid, node))
            self._maybe_compact_heap()

    def _maybe_compact_heap(self) -> None:
        """Drops stale entries once they outnumber live nodes (amortised; bounds the heap's size)."""
        if len(self._heap) <= 2 * self._num_nodes + 64:
            return
        live = []
        for entry in self._heap:
            last_access, _, node = entry
            if self._evictable(node) and last_access == node.last_access:
                live.append(entry)
            elif node.in_heap_at == last_access:
                node.in_heap_at = None  # Its only current entry is gone: it must be pushed again when evictable.
        heapq.heapify(live)
        self._heap = live
