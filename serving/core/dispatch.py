"""Data-parallel dispatch: which engine replica takes a new request, and the aggregate view of the replicas'
schedulers that the server's stats read. Pure Python (no JAX): serving/engine/data_parallel.py owns the replicas.

    add_request --> least_loaded(unfinished requests per replica) --> replica i; owners[request_id] = i
    abort / pop_finished --> owners[request_id]

Load is the count of a replica's unfinished requests (waiting + running), as vLLM's data-parallel coordinator
counts them: a replica with a long queue takes nothing until the others catch up. Ties go to the lowest index, so
a batch submitted at once is dealt out round-robin and dispatch is deterministic (the same batch always lands
the same way).
"""

from __future__ import annotations

import dataclasses
from collections import ChainMap
from collections.abc import Sequence

from serving.core.scheduler_output import SchedulerStats


def least_loaded(loads: Sequence[int]) -> int:
    """Index of the smallest load (the first one on a tie).

    Raises:
        ValueError: no replicas.
    """
    if not loads:
        raise ValueError("least_loaded: no replicas")
    return min(range(len(loads)), key=lambda i: (loads[i], i))


class ReplicaRouter:
    """Request id -> the replica that owns it, for requests from dispatch to pop_finished."""

    def __init__(self, num_replicas: int):
        if num_replicas < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {num_replicas}")
        self.num_replicas = num_replicas
        self.owners: dict[str, int] = {}

    def assign(self, request_id: str, loads: Sequence[int]) -> int:
        """Picks the least-loaded replica for a new request; raises ValueError for an id already owned."""
        if len(loads) != self.num_replicas:
            raise ValueError(f"{len(loads)} loads for {self.num_replicas} replicas")
        if request_id in self.owners:
            raise ValueError(f"duplicate request_id {request_id!r}")
        self.owners[request_id] = index = least_loaded(loads)
        return index

    def owner(self, request_id: str) -> int | None:
        return self.owners.get(request_id)

    def release(self, request_id: str) -> int | None:
        """Forgets a request (popped or aborted); its former owner, or None when unknown."""
        return self.owners.pop(request_id, None)


class SchedulersView:
    """The read-only face of several schedulers that the server reads (counts, running rows, requests, stats)."""

    def __init__(self, schedulers: Sequence):
        self.schedulers = list(schedulers)

    @property
    def num_waiting(self) -> int:
        return sum(s.num_waiting for s in self.schedulers)

    @property
    def num_running(self) -> int:
        return sum(s.num_running for s in self.schedulers)

    @property
    def running(self) -> list:
        return [r for s in self.schedulers for r in s.running]

    @property
    def requests(self) -> ChainMap:
        return ChainMap(*(s.requests for s in self.schedulers))

    @property
    def prefix_hit_tokens(self) -> int:
        return sum(s.prefix_hit_tokens for s in self.schedulers)

    def has_unfinished(self) -> bool:
        return any(s.has_unfinished() for s in self.schedulers)

    def stats(self) -> SchedulerStats:
        """Every counter summed over the replicas (so prefix_hit_rate is the pooled rate)."""
        each = [s.stats() for s in self.schedulers]
        return SchedulerStats(**{f.name: sum(getattr(x, f.name) for x in each) for f in dataclasses.fields(each[0])})
