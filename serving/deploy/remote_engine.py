"""The ingress's engine bridge: AsyncEngine's interface over the engine replicas of a Ray Serve deployment.

The single-host app (serving/api) talks to an AsyncEngine: `submit(specs) -> RequestStream`, `abort(stream)`,
`call(fn)`, `live_stats()`. RemoteEngine keeps that interface, so the same routes, validation, errors and
streaming serve the Ray deployment, but each submission becomes one streaming call to the engine deployment
(serving/deploy/replica.py `generate`), routed by serving/deploy/router.py:

    submit(specs) --- handle.generate(specs) ---> replica: ("accepted", id) | ("refused", kind, message)
    RemoteStream  <--- ("output", RequestOutput) ... ("stats", ReplicaStats) --- pumped by one task per stream
    abort(stream) --- cancels the call ---------> replica aborts its engine requests (KV blocks freed)

Failover: when the replica dies (its actor is gone or unreachable) before the client has seen any output (a
streamed request's first token; a whole-response request's end, `RequestSpec.streamed` False: its outputs are held
here until the replica has sent them all), the request is sent again and the router picks another replica
(`attempts` in all); a stream whose outputs have reached the client ends with EngineError naming the replica (an
OpenAI error event), so no request is lost silently. A refusal because a replica is loading or
draining is retried the same way; queue-full and invalid requests are not.

The replica that accepted a request is written into the request's `ReplicaSlot` (a context variable the ingress
sets per HTTP request), which the `x-pallas-replica` header reads; ReplicaBook keeps each replica's latest
stats for /metrics.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError

from serving.api.async_engine import (
    EngineError,
    EngineNotReadyError,
    EngineStats,
    QueueFullError,
    RequestSpec,
    RequestStream,
)

log = logging.getLogger(__name__)

REPLICA_GONE = (RayActorError, ActorUnavailableError)


@dataclasses.dataclass
class ReplicaSlot:
    """The replica serving the current HTTP request (None until one accepted it)."""

    replica: str | None = None


CURRENT_SLOT: contextvars.ContextVar[ReplicaSlot | None] = contextvars.ContextVar("pallas_replica_slot", default=None)


class RemoteStream(RequestStream):
    """A RequestStream fed by a replica's messages instead of the local engine thread."""

    replica: str | None = None
    task: asyncio.Task | None = None

    def deliver(self, item: Any) -> None:
        """Queues one RequestOutput (or the exception that ends the stream)."""
        self._put(item)


class ReplicaBook:
    """Per replica: requests the ingress sent it, and the stats it last reported."""

    def __init__(self):
        self.requests: dict[str, int] = {}
        self.stats: dict[str, Any] = {}  # replica id -> ReplicaStats
        self.seen: dict[str, float] = {}

    def count(self, replica: str) -> None:
        self.requests[replica] = self.requests.get(replica, 0) + 1
        self.seen[replica] = time.monotonic()

    def update(self, stats) -> None:
        self.stats[stats.replica] = stats
        self.seen[stats.replica] = time.monotonic()

    def total(self) -> EngineStats:
        """The replicas' engine stats summed (hit rate: over all their prompt tokens)."""
        out = EngineStats()
        hits = queried = 0
        for s in self.stats.values():
            e = s.engine
            out = dataclasses.replace(
                out,
                num_waiting=out.num_waiting + e.num_waiting,
                num_running=out.num_running + e.num_running,
                kv_blocks_used=out.kv_blocks_used + e.kv_blocks_used,
                kv_blocks_free=out.kv_blocks_free + e.kv_blocks_free,
                kv_blocks_cached=out.kv_blocks_cached + e.kv_blocks_cached,
                num_preemptions=out.num_preemptions + e.num_preemptions,
                num_steps=out.num_steps + e.num_steps,
                num_step_failures=out.num_step_failures + e.num_step_failures,
            )
            hits, queried = hits + s.prefix_hit_tokens, queried + s.prefix_queried_tokens
        return dataclasses.replace(out, prefix_hit_rate=hits / queried if queried else 0.0)


class RemoteEngine:
    """AsyncEngine's interface over a Ray Serve engine deployment.

    Args:
      engine_factory: called once on a worker thread at start; returns nothing of use here (create_app's loader,
        which builds the ingress's FrontLLM from a replica's description).
      max_queue: the most sequences one request may ask for (the replicas enforce their own queues).
      handle: DeploymentHandle of the engine deployment.
      attempts: replicas tried per request before giving up (failover).
    """

    def __init__(self, engine_factory: Callable[[], Any], *, max_queue: int = 256, handle, attempts: int = 3):
        self.max_queue = max_queue
        self.handle = handle
        self.attempts = attempts
        self.book = ReplicaBook()
        self._factory = engine_factory
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = False
        self._stopping = False
        self._num_pending = 0
        self.load_error: BaseException | None = None  # stays None: loading is retried (see _load)
        self._last_error: BaseException | None = None
        self.load_seconds: float | None = None
        self.engine = None

    # Lifecycle --------------------------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._loader = self._loop.create_task(self._load())

    async def _load(self) -> None:
        """Describes the model through a replica; retried while no replica can answer (they may still be
        starting, or failing and being replaced), the last error shown by /health meanwhile."""
        t0 = time.perf_counter()
        while not self._stopping:
            try:
                self.engine = await asyncio.to_thread(self._factory)
            except Exception as e:  # noqa: BLE001 - reported through /health and every request until it works
                log.warning("the engine deployment could not be described yet: %s", e)
                self._last_error = e
                await asyncio.sleep(2.0)
                continue
            self.load_seconds = time.perf_counter() - t0
            self._ready = True
            return

    @property
    def ready(self) -> bool:
        return self._ready and not self._stopping

    @property
    def is_alive(self) -> bool:
        return not self._stopping

    @property
    def stats(self) -> EngineStats:
        return self.book.total()

    async def shutdown(self, timeout: float = 30.0) -> None:
        self._stopping = True

    def not_ready_reason(self) -> str:
        if self._stopping:
            return "the server is shutting down"
        if self._last_error is not None:
            return f"the engine replicas could not be reached yet: {self._last_error}"
        return "the engine replicas are still loading"

    def live_stats(self) -> EngineStats:
        s = self.book.total()
        return dataclasses.replace(s, num_waiting=s.num_waiting + self._num_pending)

    # Requests ---------------------------------------------------------------------------------------------

    async def submit(self, specs: Sequence[RequestSpec]) -> RemoteStream:
        """Sends the specs to a replica and returns their stream once one accepted them (see the module doc).

        Raises:
          EngineNotReadyError: no replica took the request in `attempts` tries, or the ingress is stopping.
          QueueFullError: the chosen replica's queue is full.
          ValueError: the replica's engine refused a request (the message says why).
        """
        if not self.ready:
            raise EngineNotReadyError(self.not_ready_reason())
        stream = RemoteStream([s.request_id for s in specs])
        self._num_pending += len(specs)
        try:
            gen, stream.replica = await self._open(list(specs))
        finally:
            self._num_pending -= len(specs)
        slot = CURRENT_SLOT.get()
        if slot is not None:
            slot.replica = stream.replica
        stream.task = self._loop.create_task(self._pump(stream, list(specs), gen))
        return stream

    async def _open(self, specs: list[RequestSpec], tried: int = 0):
        """(response generator, replica id) of the first replica that accepts the specs."""
        last = None
        for _ in range(tried, self.attempts):
            gen = self.handle.options(stream=True).generate.remote(specs)
            try:
                msg = await gen.__anext__()
            except REPLICA_GONE as e:
                last = e
                log.warning("replica gone before accepting %s; retrying: %s", specs[0].request_id, e)
                continue
            except StopAsyncIteration:
                last = "the replica ended the call without an answer"
                continue
            except asyncio.CancelledError:
                gen.cancel()
                raise
            except Exception as e:  # noqa: BLE001 - a replica-side bug: this request fails with a message
                raise EngineError(f"the engine replica failed: {type(e).__name__}: {e}") from e
            if msg[0] == "accepted":
                self.book.count(msg[1])
                return gen, msg[1]
            _, why, text = msg
            if why == "queue_full":
                raise QueueFullError(text)
            if why == "invalid":
                raise ValueError(text)
            last = text  # loading or draining: another replica may take it
        raise EngineNotReadyError(f"no engine replica took the request after {self.attempts} attempts: {last}")

    async def _pump(self, stream: RemoteStream, specs: list[RequestSpec], gen) -> None:
        """Feeds the stream from the replica's messages. A replica that dies before the client has seen any output
        (a streamed request's first token; a whole-response request's end: its outputs are held until then) is
        replaced by another one, `attempts` replicas in all."""
        streamed = any(s.streamed for s in specs)
        held: list = []  # a whole-response request's outputs, delivered once its replica has sent them all
        delivered, tried = False, 1
        try:
            while True:
                try:
                    async for msg in gen:
                        if msg[0] == "output" and streamed:
                            delivered = True
                            stream.deliver(msg[1])
                        elif msg[0] == "output":
                            held.append(msg[1])
                        elif msg[0] == "failed":
                            stream.deliver(EngineError(msg[1]))
                            return
                        elif msg[0] == "stats":
                            self.book.update(msg[1])
                    for out in held:
                        stream.deliver(out)
                    if not stream.finished:
                        stream.deliver(EngineError(f"replica {stream.replica} ended the stream early"))
                    return
                except REPLICA_GONE as e:
                    if delivered or tried >= self.attempts or stream.cancelled:
                        stream.deliver(
                            EngineError(f"the engine replica {stream.replica} stopped while serving this request: {e}")
                        )
                        return
                    log.warning("replica %s gone before the client saw output; retrying elsewhere", stream.replica)
                    held.clear()
                    try:
                        gen, stream.replica = await self._open(specs, tried)
                    except (EngineNotReadyError, EngineError, QueueFullError, ValueError) as e2:
                        stream.deliver(EngineError(str(e2)))
                        return
                    tried += 1
                    slot = CURRENT_SLOT.get()  # this task runs in the submitting request's context
                    if slot is not None:
                        slot.replica = stream.replica
        except asyncio.CancelledError:
            gen.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - a replica-side error must end this stream, not hang it
            log.exception("stream from replica %s failed", stream.replica)
            stream.deliver(EngineError(f"internal error: {type(e).__name__}: {e}"))

    def abort(self, stream: RemoteStream) -> None:
        """Cancels the replica call of an unfinished stream (the replica aborts its requests)."""
        if stream.finished or stream.cancelled:
            return
        stream.cancelled = True
        if stream.task is not None:
            stream.task.cancel()

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Runs fn() (which calls a replica through the handle, e.g. FrontLLM.score) on a worker thread."""
        if not self.ready:
            raise EngineNotReadyError(self.not_ready_reason())
        return await asyncio.to_thread(fn)
