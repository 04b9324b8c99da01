"""Autoscaling policy of the engine deployment: Ray's queue-length rule, raised when the KV pools fill up.

Ray Serve's default policy scales on ongoing requests (queued + running) per replica against
`target_ongoing_requests`, with its up/down delays. An LLM replica can be saturated with a short queue when long
sequences fill its KV pool (new requests then wait or preempt others), so this policy also reads the replicas'
`kv_usage` (EngineReplica.record_autoscaling_stats) and asks for ceil(current * mean usage / target) replicas
when the mean usage is past `kv_usage_target`. The result stays within Ray's min/max bounds.
"""

from __future__ import annotations

import math

from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy


class QueueAndKVPolicy:
    """Ray Serve class-callable autoscaling policy (policy_kwargs: kv_usage_target)."""

    def __init__(self, kv_usage_target: float = 0.85):
        self.kv_usage_target = kv_usage_target

    def __call__(self, ctx):
        wanted, state = replica_queue_length_autoscaling_policy(ctx)
        usage = list((ctx.aggregated_metrics or {}).get("kv_usage", {}).values())
        if usage and ctx.current_num_replicas:
            mean = sum(usage) / len(usage)
            if mean > self.kv_usage_target:
                wanted = max(wanted, math.ceil(ctx.current_num_replicas * mean / self.kv_usage_target))
        low, high = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
        return min(max(int(wanted), low), high), state
