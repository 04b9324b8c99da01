"""The prefix-affinity routing policy, free of Ray: an approximate per-replica prefix index and the ranking rule.

The router cannot see the replicas' radix caches, so it keeps its own approximation (as SGLang's router does):
every prompt it sends to a replica is cut into KV blocks of `block_size` tokens, each full block named by a
chained hash (block i's name covers blocks 0..i, like vLLM's block hashes), and the names are remembered for
that replica, least recently used first out once `capacity_blocks` is exceeded (a replica's pool is finite; so
is its cache). A prompt's match on a replica is the number of its leading blocks whose names that replica holds:

    tokens   | b0 | b1 | b2 | b3 | partial |
    names      h0   h1   h2   h3             h_i = hash((h_{i-1}, tokens of b_i))
    replica A  h0   h1                       match 2 blocks
    replica B  h0   h1   h2   h3             match 4 blocks -> B, unless B is overloaded

`rank_replicas` turns matches and loads into an order of preference: the longest match first, unless the
load is unbalanced (the best match's queue exceeds the shortest queue by more than `max_queue_gap`, or its KV
usage is past `kv_usage_limit`), then the least loaded first. A match shorter than `min_match_blocks` counts as
no match (a shared chat template's first block is on every replica).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class AffinityPolicy:
    """How the router trades cache affinity against load.

    Attributes:
      block_size: tokens per KV block of the replicas (their cache matches whole blocks only).
      capacity_blocks: blocks remembered per replica (about its KV pool's size).
      max_queue_gap: the best match is skipped when its queue is longer than the shortest by more than this.
      kv_usage_limit: the best match is skipped when this fraction of its KV blocks is in use.
      min_match_blocks: shorter matches count as none.
    """

    block_size: int = 16
    capacity_blocks: int = 4096
    max_queue_gap: int = 4
    kv_usage_limit: float = 0.95
    min_match_blocks: int = 2

    def __post_init__(self):
        for name in ("block_size", "capacity_blocks", "min_match_blocks"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"AffinityPolicy.{name} must be a positive int, got {getattr(self, name)!r}")
        if not isinstance(self.max_queue_gap, int) or self.max_queue_gap < 0:
            raise ValueError(f"AffinityPolicy.max_queue_gap must be an int >= 0, got {self.max_queue_gap!r}")
        if not 0.0 < self.kv_usage_limit <= 1.0:
            raise ValueError(f"AffinityPolicy.kv_usage_limit must be in (0, 1], got {self.kv_usage_limit!r}")


@dataclasses.dataclass(frozen=True)
class ReplicaLoad:
    """What the router knows of a replica's load: requests queued or running there, and KV blocks in use."""

    queue: int = 0
    kv_usage: float = 0.0


def block_names(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the prompt's full blocks (a partial last block is never cached, so never named)."""
    names, prev = [], 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = hash((prev, tuple(token_ids[start : start + block_size])))
        names.append(prev)
    return names


class PrefixIndex:
    """Per replica, the block names it was sent recently (LRU, at most `capacity_blocks` each)."""

    def __init__(self, capacity_blocks: int):
        self.capacity_blocks = capacity_blocks
        self._blocks: dict[Hashable, OrderedDict[int, None]] = {}

    @property
    def replicas(self) -> list[Hashable]:
        return list(self._blocks)

    def num_blocks(self, replica: Hashable) -> int:
        return len(self._blocks.get(replica, ()))

    def match(self, names: Sequence[int], replicas: Iterable[Hashable]) -> dict[Hashable, int]:
        """Leading blocks of `names` each replica holds."""
        out = {}
        for r in replicas:
            held, n = self._blocks.get(r, {}), 0
            while n < len(names) and names[n] in held:
                n += 1
            out[r] = n
        return out

    def insert(self, replica: Hashable, names: Sequence[int]) -> None:
        """Records that `replica` now caches these blocks (most recently used), evicting its oldest beyond capacity."""
        held = self._blocks.setdefault(replica, OrderedDict())
        for name in names:
            held[name] = None
            held.move_to_end(name)
        while len(held) > self.capacity_blocks:
            held.popitem(last=False)

    def remove(self, replica: Hashable) -> None:
        """Forgets a replica (gone, or replaced: a new replica starts with an empty cache)."""
        self._blocks.pop(replica, None)


def least_loaded(loads: Mapping[Hashable, ReplicaLoad]) -> list[Hashable]:
    """Replicas by queue, then KV usage."""
    return sorted(loads, key=lambda r: (loads[r].queue, loads[r].kv_usage))


def rank_replicas(
    matches: Mapping[Hashable, int], loads: Mapping[Hashable, ReplicaLoad], policy: AffinityPolicy
) -> tuple[list[Hashable], str]:
    """Replicas in order of preference, and why: "affinity" (longest match first), "no_match" or "imbalanced"
    (least loaded first). Every replica of `loads` appears once."""
    order = least_loaded(loads)
    if not order:
        return [], "no_match"
    best = max(order, key=lambda r: matches.get(r, 0))  # ties: the least loaded of them (max keeps the first)
    if matches.get(best, 0) < policy.min_match_blocks:
        return order, "no_match"
    shortest = loads[order[0]].queue
    if loads[best].queue - shortest > policy.max_queue_gap or loads[best].kv_usage >= policy.kv_usage_limit:
        return order, "imbalanced"
    return [best] + [r for r in order if r != best], "affinity"
