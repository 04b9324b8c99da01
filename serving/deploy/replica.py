"""One engine replica of the Ray Serve application: an LLMEngine on the devices Ray gave this actor.

The replica wraps the engine in the same AsyncEngine as the single-host server (serving/api/async_engine.py: one
thread owns the engine; coroutines submit and stream), and answers the ingress through four methods:

    describe()          -> FrontInfo: the tokenizer, model config and limits (the ingress validates and tokenises)
    generate(specs)     -> async stream of messages, for one HTTP request's engine requests:
                           ("accepted", replica id) | ("refused", kind, message)   first, always
                           ("output", RequestOutput) ...                            as the engine steps
                           ("failed", message)                                      an engine error ends it
                           ("stats", ReplicaStats)                                  last, after the outputs
    score(token_ids)    -> logits of one sequence (echo + logprobs)
    record_routing_stats / record_autoscaling_stats / check_health   called by Ray Serve

A replica spanning several hosts (`host_bundles`) is process 0 of a jax.distributed job: it starts one
follower actor per other host in its placement group's bundles (serving/deploy/multihost.py), and its engine's
runner calls are replayed there (sharding/multihost.py).

Scale-down drains: Ray stops routing to the replica, waits up to `graceful_shutdown_timeout_s` for its ongoing
requests, then calls `__del__`, which lets unfinished requests end and stops the engine thread (and followers).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from ray import serve

from serving.api.async_engine import (
    AsyncEngine,
    EngineError,
    EngineNotReadyError,
    EngineStats,
    QueueFullError,
    RequestSpec,
)
from serving.config import EngineConfig

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class FrontInfo:
    """What the ingress needs of the model to validate and tokenise without loading it."""

    tokenizer: Any
    config: Any  # model.config.ModelConfig (vocab_size, eos ids)
    max_model_len: int
    kv_capacity_tokens: int | None
    block_size: int


@dataclasses.dataclass(frozen=True)
class ReplicaStats:
    """A replica's counters and load, sent after every request (the ingress's per-replica /metrics)."""

    replica: str
    requests: int
    prefix_hit_tokens: int
    prefix_queried_tokens: int
    kv_blocks_used: int
    kv_blocks_total: int
    engine: EngineStats

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


def replica_id() -> str:
    """This Ray Serve replica's id (the `x-pallas-replica` header's value)."""
    return serve.get_replica_context().replica_id.unique_id


class EngineReplica:
    """A Ray Serve deployment class (ray_app.py wraps it in `serve.deployment`).

    Args:
      engine_config: the engine's options (the same EngineConfig the single-host server builds from its flags).
      max_queue: most requests waiting in this replica's engine; beyond it `generate` refuses with "queue_full".
      host_bundles: the placement group's bundles when one engine spans several hosts (one per host; the first
        is this actor's): followers start in the others. None: one process.
    """

    async def __init__(
        self, engine_config: EngineConfig, max_queue: int = 256, host_bundles: list[dict[str, float]] | None = None
    ):
        self.id = replica_id()
        self.config = engine_config
        self.requests = 0
        self._llm = None
        self._group = None
        if host_bundles is not None and len(host_bundles) > 1:
            from serving.deploy.multihost import HostGroup

            self._group = HostGroup.start(engine_config, host_bundles, f"pallas-serve-{self.id}")
        self.engine = AsyncEngine(self._build, max_queue=max_queue)
        self.engine.start()
        if not await asyncio.to_thread(self._wait_ready):
            raise RuntimeError(f"replica {self.id}: {self.engine.not_ready_reason()}")
        log.info("replica %s ready after %.1f s", self.id, self.engine.load_seconds or 0.0)

    def _wait_ready(self) -> bool:
        """Blocks until the engine serves (True) or failed (False); with followers, raises as soon as one stops
        (say its host cannot read the model) rather than leaving process 0 waiting for it in jax.distributed."""
        while not self.engine.wait_ready(timeout=1.0):
            if self.engine.load_error is not None or not self.engine.is_alive:
                return False
            if self._group is not None:
                self._group.check()
        return True

    def _build(self):  # on the engine thread
        from serving.engine.llm import LLM

        if self._group is not None:
            self._group.join()
        llm = LLM.from_config(self.config)
        engine = llm.engine
        if self._group is not None:
            self._group.lead(engine)
        if self.config.warmup:
            engine.generate([None], [[0, 1, 2]], max_tokens=2, temperature=0.0)
        self._llm = llm
        return engine

    # Ray Serve hooks ----------------------------------------------------------------------------------------

    def check_health(self) -> None:
        """Raises while the engine is not serving (Ray then replaces the replica)."""
        if not self.engine.ready:
            raise RuntimeError(f"replica {self.id}: {self.engine.not_ready_reason()}")
        if self._group is not None:
            self._group.check()

    def record_routing_stats(self) -> dict[str, float]:
        s = self.engine.stats
        total = s.kv_blocks_used + s.kv_blocks_free
        return {
            "num_waiting": s.num_waiting,
            "num_running": s.num_running,
            "kv_usage": s.kv_blocks_used / total if total else 0.0,
        }

    def record_autoscaling_stats(self) -> dict[str, float]:
        return {"kv_usage": self.record_routing_stats()["kv_usage"]}

    async def __del__(self):
        await self.engine.shutdown()
        if self._group is not None and self._llm is not None:
            self._group.stop(self._llm.engine)

    # Methods the ingress calls ------------------------------------------------------------------------------

    def describe(self) -> FrontInfo:
        llm = self._llm
        kv = getattr(getattr(llm.engine, "scheduler", None), "kv", None)
        return FrontInfo(
            tokenizer=llm.tokenizer,
            config=llm.config,
            max_model_len=llm.max_model_len,
            kv_capacity_tokens=None if kv is None else kv.num_usable_blocks * kv.block_size,
            block_size=self.config.block_size,
        )

    async def score(self, token_ids: list[int]):
        llm = self._llm
        return await self.engine.call(lambda: llm.score(token_ids))

    async def generate(self, specs: list[RequestSpec]):
        try:
            stream = await self.engine.submit(specs)
        except QueueFullError as e:
            yield ("refused", "queue_full", str(e))
            return
        except EngineNotReadyError as e:
            yield ("refused", "not_ready", str(e))
            return
        except ValueError as e:
            yield ("refused", "invalid", str(e))
            return
        self.requests += 1
        yield ("accepted", self.id)
        try:
            async for out in stream:
                yield ("output", out)
        except EngineError as e:
            yield ("failed", str(e))
            return
        finally:  # also when the ingress cancels (client gone): free the KV blocks
            self.engine.abort(stream)
        yield ("stats", await self.stats())

    async def stats(self) -> ReplicaStats:
        s = self.engine.stats
        try:
            sched = await self.engine.call(lambda: self._llm.engine.scheduler.stats())
            hits, queried = sched.prefix_hit_tokens, sched.prefix_queried_tokens
        except (EngineNotReadyError, AttributeError):
            hits = queried = 0
        return ReplicaStats(
            replica=self.id,
            requests=self.requests,
            prefix_hit_tokens=hits,
            prefix_queried_tokens=queried,
            kv_blocks_used=s.kv_blocks_used,
            kv_blocks_total=s.kv_blocks_used + s.kv_blocks_free,
            engine=s,
        )
