"""An engine replica spanning several hosts: one jax.distributed job inside one Ray placement group.

The replica actor runs in bundle 0 of its placement group (ray_app.py sets `placement_group_bundles`, one
bundle per host, strategy STRICT_SPREAD so each bundle lands on its own node). It is process 0 of the JAX job;
it starts one HostFollower actor in each other bundle. All processes join `jax.distributed` at the replica's
node address, build the same engine (the same EngineConfig), and the followers replay process 0's runner calls
(sharding/multihost.py `lead_or_follow`) until the replica stops them.

    bundle 0 (host A): EngineReplica = process 0: scheduler, HTTP-facing generate(), LeaderRunner
    bundle 1 (host B): HostFollower  = process 1: the same compiled steps on its devices, replaying
    ...
"""

from __future__ import annotations

import logging
import os
import socket

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from serving.config import EngineConfig

log = logging.getLogger(__name__)


@ray.remote(max_concurrency=2)  # run() blocks while following; where() still answers
class HostFollower:
    """Process `process_id` of a multi-host replica: builds the engine, replays the leader's steps."""

    def __init__(self, engine_config: EngineConfig, coordinator: str, num_processes: int, process_id: int):
        self.args = (engine_config, coordinator, num_processes, process_id)

    def run(self) -> int:
        """Joins the JAX job, builds the engine, replays process 0's steps until it stops them, then leaves the
        job (jax.distributed's shutdown barrier, which process 0 enters after stopping the replay)."""
        import jax

        from serving.engine.llm import LLM
        from sharding import multihost

        config, coordinator, n, i = self.args
        multihost.initialize(coordinator, n, i)
        multihost.lead_or_follow(LLM.from_config(config).engine)
        jax.distributed.shutdown()
        return i

    def where(self) -> tuple[str, int]:
        """(Ray node id, process id) of this follower."""
        return ray.get_runtime_context().get_node_id(), os.getpid()


FOLLOWER_NAMESPACE = "pallas-serve"  # the Ray namespace of the followers' actor names (`follower_name`)
STOP_TIMEOUT_S = 30.0  # how long a stopping replica waits for its followers to leave the JAX job


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class HostGroup:
    """The followers of one multi-host replica, started from inside the replica actor."""

    def __init__(self, followers, runs, coordinator: str, num_processes: int):
        self.followers, self.runs = followers, runs
        self.coordinator, self.num_processes = coordinator, num_processes

    @classmethod
    def start(cls, engine_config: EngineConfig, bundles: list[dict[str, float]], name: str) -> HostGroup:
        """Starts a follower in each bundle after the first (this replica's), named `{name}-host{i}` in
        FOLLOWER_NAMESPACE; raises ValueError outside a placement group."""
        group = ray.util.get_current_placement_group()
        if group is None:
            raise ValueError("a replica spanning hosts needs placement_group_bundles (one bundle per host)")
        coordinator = f"{ray.util.get_node_ip_address()}:{_free_port()}"
        followers, runs = [], []
        for i, bundle in enumerate(bundles[1:], start=1):
            follower = HostFollower.options(
                name=follower_name(name, i),
                namespace=FOLLOWER_NAMESPACE,
                num_cpus=bundle.get("CPU", 0),
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i),
            ).remote(engine_config, coordinator, len(bundles), i)
            followers.append(follower)
            runs.append(follower.run.remote())
        return cls(followers, runs, coordinator, len(bundles))

    def join(self) -> None:
        """Joins the JAX job as process 0 (on the engine thread, before the engine touches a device)."""
        from sharding import multihost

        multihost.initialize(self.coordinator, self.num_processes, 0)

    def lead(self, engine) -> None:
        from sharding import multihost

        multihost.lead_or_follow(engine)

    def check(self) -> None:
        """Raises when a follower has exited or died (the replica is then unhealthy and replaced)."""
        done, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        if done:
            try:
                ray.get(done)
                reason = "they returned"
            except Exception as e:  # noqa: BLE001 - the follower's own error (a RayTaskError), shown as the reason
                reason = str(e)
            raise RuntimeError(f"{len(done)} of {len(self.runs)} follower processes of this replica stopped: {reason}")

    def stop(self, engine) -> None:
        """Ends the followers' replay (after the engine thread has stopped), leaves the JAX job with them and
        ends their actors. A group with a stopped follower skips the shutdown barrier (it would wait for the
        missing process); the placement group's removal ends what is left."""
        import jax

        from sharding import multihost

        if ray.wait(self.runs, num_returns=len(self.runs), timeout=0)[0]:
            log.warning("a follower process stopped before its replica: not waiting for it to leave the JAX job")
        else:
            multihost.stop_followers(engine)
            jax.distributed.shutdown()  # the followers' run() enters the same barrier, then returns
            _, pending = ray.wait(self.runs, num_returns=len(self.runs), timeout=STOP_TIMEOUT_S)
            log.info("%d of %d followers left the JAX job", len(self.runs) - len(pending), len(self.runs))
        for follower in self.followers:
            ray.kill(follower)


def follower_name(replica: str, process_id: int) -> str:
    """The Ray actor name of process `process_id` of replica `replica` (a Serve replica id)."""
    return f"{replica}-host{process_id}"
