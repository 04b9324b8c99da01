"""DeployConfig: how the engine is replicated on Ray Serve (no Ray, no JAX; the flags in serving/deploy/flags.py)."""

from __future__ import annotations

import dataclasses

from serving.deploy.prefix_index import AffinityPolicy

ROUTERS = ("prefix", "pow2")


@dataclasses.dataclass(frozen=True)
class DeployConfig:
    """Replicas, routing, scaling and failover of a Ray Serve deployment of the engine.

    Attributes:
      replicas: engine replicas at start (the fixed count without autoscaling).
      min_replicas / max_replicas: autoscaling bounds (None: `replicas`); scaling is on when max > min.
      target_ongoing_requests: requests (queued + running) per replica the autoscaler aims at.
      kv_usage_target: mean KV usage past which the autoscaler adds replicas whatever the queues say.
      router: "prefix" (serving/deploy/router.py) or "pow2" (Ray's default power-of-two-choices router).
      affinity: the prefix router's policy (its block_size is the engine's).
      replica_cpus / replica_gpus: resources of one replica's process (per host when it spans several).
      hosts_per_replica: hosts one engine spans (a placement group of that many bundles, one per node).
      max_ongoing_requests: most requests Ray sends one replica at once (the rest wait at the router).
      attempts: replicas tried per request when one dies before answering (failover).
      health_check_period_s: how often Ray asks each replica whether its engine still serves.
      drain_timeout_s: how long a replica leaving (scale-down, update) may take to finish its requests.
      address: Ray cluster to join ("auto": the one `ray start` runs here); None starts a local one.
      ingress_cpus: CPUs reserved for the ingress replica.
    """

    replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float = 8.0
    kv_usage_target: float = 0.85
    router: str = "prefix"
    affinity: AffinityPolicy = dataclasses.field(default_factory=AffinityPolicy)
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    hosts_per_replica: int = 1
    max_ongoing_requests: int = 128
    attempts: int = 3
    health_check_period_s: float = 5.0
    drain_timeout_s: float = 30.0
    address: str | None = None
    ingress_cpus: float = 0.0

    def __post_init__(self):
        low, high = self.min_replicas or self.replicas, self.max_replicas or self.replicas
        checks = (
            (self.replicas >= 1, f"replicas must be >= 1, got {self.replicas}"),
            (1 <= low <= self.replicas <= high, f"need 1 <= min {low} <= replicas {self.replicas} <= max {high}"),
            (self.router in ROUTERS, f"router must be one of {ROUTERS}, got {self.router!r}"),
            (self.target_ongoing_requests > 0, f"target_ongoing_requests must be > 0: {self.target_ongoing_requests}"),
            (0 < self.kv_usage_target <= 1, f"kv_usage_target must be in (0, 1], got {self.kv_usage_target}"),
            (min(self.replica_cpus, self.replica_gpus, self.ingress_cpus) >= 0, "replica / ingress resources < 0"),
            (self.hosts_per_replica >= 1, f"hosts_per_replica must be >= 1, got {self.hosts_per_replica}"),
            (self.max_ongoing_requests >= 1, f"max_ongoing_requests must be >= 1: {self.max_ongoing_requests}"),
            (self.attempts >= 1, f"attempts must be >= 1, got {self.attempts}"),
            (self.health_check_period_s > 0, f"health_check_period_s must be > 0: {self.health_check_period_s}"),
            (self.drain_timeout_s >= 0, f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}"),
        )
        for ok, message in checks:
            if not ok:
                raise ValueError(f"ray deployment: {message}")

    @property
    def autoscaling(self) -> bool:
        return (self.max_replicas or self.replicas) > (self.min_replicas or self.replicas)

    def host_bundles(self) -> list[dict[str, float]]:
        """One placement-group bundle per host of a replica."""
        bundle = {"CPU": self.replica_cpus} | ({"GPU": self.replica_gpus} if self.replica_gpus else {})
        return [dict(bundle) for _ in range(self.hosts_per_replica)]
