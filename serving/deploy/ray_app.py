"""The Ray Serve application of the engine: one OpenAI ingress in front of N engine replicas.

    HTTP -> Ray Serve proxy -> "ingress" (serving/deploy/ingress.py: serving/api's app, tokenises, validates)
                                  | DeploymentHandle, routed by PrefixAffinityRouter (or Ray's power of two)
                                  v
                              "engine" x N (serving/deploy/replica.py: one LLMEngine each, on its devices;
                                            a replica spanning hosts is a placement group of one bundle per host)

Started by `python -m serving.server --ray_replicas N [engine and server flags]` (`serve_forever`) or by Ray's
CLI with the same flags in one string:

    serve run serving.deploy.serve_cli:app_builder flags="--max_model_len 1024 --ray_replicas 2"

Autoscaling (`DeployConfig.autoscaling`) uses serving/deploy/autoscale.py; health checks call
EngineReplica.check_health; a replica leaving drains for `drain_timeout_s` (Ray's graceful shutdown).
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading

from ray import serve
from ray.serve.config import AutoscalingPolicy, HTTPOptions, RequestRouterConfig

from serving.config import EngineConfig, ServerConfig
from serving.deploy.autoscale import QueueAndKVPolicy
from serving.deploy.config import DeployConfig
from serving.deploy.ingress import Ingress
from serving.deploy.replica import EngineReplica
from serving.deploy.router import PrefixAffinityRouter

log = logging.getLogger(__name__)

APP_NAME = "pallas-serve"
ROUTING_STATS_PERIOD_S = 1.0


def engine_options(deploy: DeployConfig) -> dict:
    """serve.deployment options of the engine deployment."""
    options = dict(
        name="engine",
        max_ongoing_requests=deploy.max_ongoing_requests,
        health_check_period_s=deploy.health_check_period_s,
        health_check_timeout_s=max(30.0, 2 * deploy.health_check_period_s),
        graceful_shutdown_timeout_s=deploy.drain_timeout_s,
        graceful_shutdown_wait_loop_s=1.0,
    )
    if deploy.router == "prefix":
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=PrefixAffinityRouter,
            request_router_kwargs=dataclasses.asdict(deploy.affinity),
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
            request_routing_stats_timeout_s=10.0,
        )
    if deploy.autoscaling:
        options["autoscaling_config"] = {
            "min_replicas": deploy.min_replicas or deploy.replicas,
            "initial_replicas": deploy.replicas,
            "max_replicas": deploy.max_replicas or deploy.replicas,
            "target_ongoing_requests": deploy.target_ongoing_requests,
            "upscale_delay_s": 5.0,
            "downscale_delay_s": 30.0,
            "policy": AutoscalingPolicy(
                policy_function=QueueAndKVPolicy, policy_kwargs={"kv_usage_target": deploy.kv_usage_target}
            ),
        }
    else:
        options["num_replicas"] = deploy.replicas
    if deploy.hosts_per_replica > 1:
        options["placement_group_bundles"] = deploy.host_bundles()
        options["placement_group_strategy"] = "STRICT_SPREAD"
    options["ray_actor_options"] = {"num_cpus": deploy.replica_cpus, "num_gpus": deploy.replica_gpus}
    return options


def build_app(engine_config: EngineConfig, server: ServerConfig, deploy: DeployConfig):
    """The bound Ray Serve application (serve.run it, or return it from an app builder)."""
    engine = serve.deployment(EngineReplica, **engine_options(deploy))
    ingress = serve.deployment(
        Ingress, name="ingress", num_replicas=1, ray_actor_options={"num_cpus": deploy.ingress_cpus}
    )
    bundles = deploy.host_bundles() if deploy.hosts_per_replica > 1 else None
    model_name = server.served_model_name or engine_config.model.display_name
    return ingress.bind(engine.bind(engine_config, server.max_queue, bundles), server, model_name, deploy.attempts)


def start(engine_config: EngineConfig, server: ServerConfig, deploy: DeployConfig, *, blocking: bool = False):
    """Joins (or starts) the Ray cluster, starts Serve's HTTP proxy on server.host:port and deploys the app;
    returns the ingress handle once every replica is up."""
    import ray

    if not ray.is_initialized():
        ray.init(address=deploy.address, include_dashboard=False, logging_level=logging.WARNING)
    serve.start(http_options=HTTPOptions(host=server.host, port=server.port))
    return serve.run(build_app(engine_config, server, deploy), name=APP_NAME, route_prefix="/", blocking=blocking)


def serve_forever(engine_config: EngineConfig, server: ServerConfig, deploy: DeployConfig) -> int:
    """`python -m serving.server --ray_replicas N`: deploys, serves until SIGTERM / SIGINT, then shuts Serve down
    (replicas drain for deploy.drain_timeout_s)."""
    import ray

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        start(engine_config, server, deploy)
        log.info("serving %d engine replica(s) on http://%s:%d", deploy.replicas, server.host, server.port)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
