"""What flows between the HTTP handlers and the engine thread (serving/api/async_engine.py): request specs,
the per-request output stream, the engine's stats snapshot and the errors a submission can raise."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from serving.core.request import RequestOutput, SamplingParams


class QueueFullError(Exception):
    """More requests are waiting than `max_queue`; the client should retry later."""


class EngineNotReadyError(Exception):
    """The model is still loading or compiling (or the engine is shutting down)."""


class EngineError(RuntimeError):
    """The engine failed while serving a request; the message says why."""


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    """One engine request: token ids, sampling parameters and an id unique among unfinished requests."""

    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    prompt: str | None = None
    # Whether the client reads outputs as they come (SSE). A whole-response request shows nothing until it ends, so
    # a replicated deployment (serving/deploy) may restart it on another replica if its replica dies mid-way.
    streamed: bool = True


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """Scheduler snapshot taken by the engine thread after each step (read by /metrics without locking)."""

    num_waiting: int = 0
    num_running: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    kv_blocks_cached: int = 0
    prefix_hit_rate: float = 0.0
    num_preemptions: int = 0
    num_steps: int = 0
    num_step_failures: int = 0
    speculative: dict = dataclasses.field(default_factory=dict)  # method -> SpecDecoder.metrics() totals
    router_tokens: Any = None  # MoE: tokens routed per layer and expert [L, E] (ModelRunner.router_load), or None


ACCEPTED = object()  # First item of a stream whose requests the engine took.


class RequestStream:
    """Outputs of one HTTP request's engine requests, in the order the engine produced them.

    Attributes:
      request_ids: the engine request ids this stream carries.
      arrival: time.perf_counter() when the stream was created.
      first_token_at: request id -> time its first token arrived.
      finished_at: request id -> time it finished.
      num_output_tokens: request id -> tokens generated so far.
    """

    def __init__(self, request_ids: Sequence[str]):
        self.request_ids = tuple(request_ids)
        self.arrival = time.perf_counter()
        self.first_token_at: dict[str, float] = {}
        self.finished_at: dict[str, float] = {}
        self.num_output_tokens: dict[str, int] = {rid: 0 for rid in self.request_ids}
        self.cancelled = False  # set from the loop; read by the engine thread (a benign bool race)
        self._queue: asyncio.Queue = asyncio.Queue()

    @property
    def finished(self) -> bool:
        return len(self.finished_at) == len(self.request_ids)

    def _put(self, item: Any) -> None:
        self._queue.put_nowait(item)

    async def wait_accepted(self) -> None:
        """Returns once the engine has queued the requests; raises what it refused them with."""
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        assert item is ACCEPTED, item

    async def next_output(self) -> RequestOutput | None:
        """The next output, or None once every request has finished. Raises EngineError on failure."""
        if self.finished:
            return None
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished_at.update({r: time.perf_counter() for r in self.request_ids if r not in self.finished_at})
            raise item
        now = time.perf_counter()
        if item.new_token_ids:
            self.first_token_at.setdefault(item.request_id, now)
            self.num_output_tokens[item.request_id] += len(item.new_token_ids)
        if item.finished:
            self.finished_at[item.request_id] = now
        return item

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        out = await self.next_output()
        if out is None:
            raise StopAsyncIteration
        return out


def fail_future(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


def set_future(future: asyncio.Future, result: Any) -> None:
    if not future.done():
        future.set_result(result)


def settle_future(future: asyncio.Future, error: BaseException | None, result: Any) -> None:
    fail_future(future, error) if error is not None else set_future(future, result)
