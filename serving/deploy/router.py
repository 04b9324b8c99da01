"""Ray Serve request router of the engine deployment: prefix-cache affinity with a load guard.

Ray Serve asks `choose_replicas` for ranks of replicas per request; it then probes the queue lengths of the first
rank's replicas and sends the request to the least busy one that has room (`max_ongoing_requests`), falling to
the next rank when none has. This router reads the request's prompt token ids (the engine deployment's
`generate` takes a list of RequestSpec; the ingress tokenised them), ranks the replicas with
serving/deploy/prefix_index.py (longest cached prefix first, least loaded first when the load is unbalanced) and
returns one replica per rank, so the probe cannot swap the preferred replica for a random one.

Loads come from Ray's replica queue-length cache (requests queued or running at the replica, refreshed by every
probe and send) and from the replicas' routing stats (`EngineReplica.record_routing_stats`: KV usage, pool
size, polled every `request_routing_stats_period_s`). After a request is sent, its blocks are recorded for the
replica; a replica that dies or leaves is forgotten (its replacement starts with an empty cache).

Each DeploymentHandle (every ingress replica) runs its own router and index: with one ingress the index sees
every request; with several, each sees its share and affinity holds per ingress (documented in
docs/deployment.md).
"""

from __future__ import annotations

import logging
import random

from ray.serve.request_router import LocalityMixin, MultiplexMixin, PendingRequest, RequestRouter, RunningReplica

from serving.deploy.prefix_index import AffinityPolicy, PrefixIndex, ReplicaLoad, block_names, rank_replicas

log = logging.getLogger(__name__)


def prompt_token_ids(pending_request: PendingRequest | None) -> list[int] | None:
    """The first RequestSpec's prompt ids of an engine `generate` call (None for other calls)."""
    if pending_request is None or not pending_request.args:
        return None
    specs = pending_request.args[0]
    if not isinstance(specs, (list, tuple)) or not specs:
        return None
    ids = getattr(specs[0], "prompt_token_ids", None)
    return list(ids) if ids is not None else None


class PrefixAffinityRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Longest cached prefix first unless the load is unbalanced, then least loaded (Ray Serve RequestRouter).

    `request_router_kwargs` are AffinityPolicy's fields.
    """

    def initialize_state(self, **policy):
        self.policy = AffinityPolicy(**policy)
        self.index = PrefixIndex(self.policy.capacity_blocks)

    def _load(self, replica: RunningReplica) -> ReplicaLoad:
        stats = replica.routing_stats or {}
        queue = self.replica_queue_len_cache.get(replica.replica_id)
        if queue is None:
            queue = int(stats.get("num_waiting", 0)) + int(stats.get("num_running", 0))
        return ReplicaLoad(queue=int(queue), kv_usage=float(stats.get("kv_usage", 0.0)))

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        tokens = prompt_token_ids(pending_request)
        by_id = {r.replica_id: r for r in candidate_replicas}
        if tokens is None:  # health checks and other methods: two random replicas, the shorter queue wins
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        names = block_names(tokens, self.policy.block_size)
        loads = {rid: self._load(r) for rid, r in by_id.items()}
        order, why = rank_replicas(self.index.match(names, by_id), loads, self.policy)
        log.debug("request of %d blocks -> %s (%s)", len(names), order[0] if order else None, why)
        return [[by_id[rid]] for rid in order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        tokens = prompt_token_ids(pending_request)
        if tokens is not None:
            self.index.insert(replica_id, block_names(tokens, self.policy.block_size))

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.remove(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        for rid in self.index.replicas:
            if rid not in live:
                self.index.remove(rid)
