"""The Ray Serve flags of `python -m serving.server` (serving/server.py imports this module to define them).

python -m serving.server --ray_replicas 2                     # 2 engine replicas on a local Ray cluster
python -m serving.server --ray_replicas 2 --ray_max_replicas 4 --ray_address auto   # autoscaling, on `ray start`
"""

from __future__ import annotations

from absl import flags

from serving.deploy.config import ROUTERS, DeployConfig
from serving.deploy.prefix_index import AffinityPolicy

FLAGS = flags.FLAGS
_D, _A = DeployConfig(), AffinityPolicy()

flags.DEFINE_integer("ray_replicas", 0, "serve through Ray Serve with this many engine replicas (0: one engine here)")
flags.DEFINE_integer("ray_min_replicas", None, "autoscaling: fewest replicas (default: --ray_replicas)")
flags.DEFINE_integer("ray_max_replicas", None, "autoscaling: most replicas (default: --ray_replicas: no scaling)")
flags.DEFINE_float("ray_target_ongoing_requests", _D.target_ongoing_requests, "autoscaling: requests per replica")
flags.DEFINE_float("ray_kv_usage_target", _D.kv_usage_target, "autoscaling: mean KV usage that adds replicas")
flags.DEFINE_enum("ray_router", _D.router, list(ROUTERS), "prefix: cache-affinity router; pow2: Ray's default")
flags.DEFINE_integer("ray_affinity_queue_gap", _A.max_queue_gap, "prefix router: queue gap that overrides affinity")
flags.DEFINE_float("ray_affinity_kv_limit", _A.kv_usage_limit, "prefix router: KV usage that overrides affinity")
flags.DEFINE_float("ray_replica_cpus", _D.replica_cpus, "CPUs per replica (per host of a multi-host replica)")
flags.DEFINE_float("ray_replica_gpus", _D.replica_gpus, "GPUs per replica (per host of a multi-host replica)")
flags.DEFINE_integer("ray_hosts_per_replica", _D.hosts_per_replica, "hosts one engine replica spans")
flags.DEFINE_integer("ray_max_ongoing_requests", _D.max_ongoing_requests, "most requests in flight per replica")
flags.DEFINE_integer("ray_failover_attempts", _D.attempts, "replicas tried per request when one dies")
flags.DEFINE_string("ray_address", _D.address, "Ray cluster to join ('auto' after `ray start`); default: start one")


def deploy_config_from_flags(block_size: int, drain_timeout_s: float) -> DeployConfig | None:
    """DeployConfig from the flags (None without --ray_replicas); the router's block size is the engine's.
    Raises ValueError when invalid."""
    if FLAGS.ray_replicas == 0:
        return None
    return DeployConfig(
        replicas=FLAGS.ray_replicas,
        min_replicas=FLAGS.ray_min_replicas,
        max_replicas=FLAGS.ray_max_replicas,
        target_ongoing_requests=FLAGS.ray_target_ongoing_requests,
        kv_usage_target=FLAGS.ray_kv_usage_target,
        router=FLAGS.ray_router,
        affinity=AffinityPolicy(
            block_size=block_size,
            max_queue_gap=FLAGS.ray_affinity_queue_gap,
            kv_usage_limit=FLAGS.ray_affinity_kv_limit,
        ),
        replica_cpus=FLAGS.ray_replica_cpus,
        replica_gpus=FLAGS.ray_replica_gpus,
        hosts_per_replica=FLAGS.ray_hosts_per_replica,
        max_ongoing_requests=FLAGS.ray_max_ongoing_requests,
        attempts=FLAGS.ray_failover_attempts,
        drain_timeout_s=drain_timeout_s,
        address=FLAGS.ray_address,
    )
