"""AsyncEngine: the single-threaded LLMEngine behind an asyncio server.

The engine is not thread-safe, so one thread owns it: it builds it (load + compile), applies submitted commands
between steps and runs `step()` while anything is unfinished. The event loop never touches the engine.

    event loop (HTTP handlers)                          engine thread
    --------------------------                          -------------
    stream = await submit(specs) -- command queue --->  add_request (or refuse: QueueFull / ValueError)
    abort(stream)               -- command queue --->   engine.abort(ids): KV blocks freed
    async for out in stream     <-- loop.call_soon_threadsafe(deliver, outputs of one step) --
                                                        step() -> RequestOutputs
                                                        stats() snapshot after every step
    await call(fn)              -- command queue --->   fn() between steps (prompt scoring), result back
    live_stats() (a /metrics scrape): the snapshot with queue and running counts read now, plus the submissions
    still in the command queue, so the gauges do not lag behind a long step.

One HTTP request is one `RequestStream`, fed by one or more engine requests (OpenAI's `n`, or a list of
prompts). A stream ends when all its engine requests have finished; an engine error ends it with `EngineError`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from serving.core.request import RequestOutput, SamplingParams

log = logging.getLogger(__name__)


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


_ACCEPTED = object()  # First item of a stream whose requests the engine took.


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
        assert item is _ACCEPTED, item

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


class AsyncEngine:
    """Runs an LLMEngine on its own thread and serves it to coroutines.

    Args:
      engine_factory: builds the engine on the engine thread (load + compile happen there, so the server can
        answer /health while they run). It returns an object with LLMEngine's interface.
      max_queue: most requests waiting for a slot; a submission beyond it raises QueueFullError.
      warmup: called with the engine on the engine thread before it is marked ready (compiles buckets).
    """

    def __init__(
        self, engine_factory: Callable[[], Any], *, max_queue: int = 256, warmup: Callable[[Any], None] | None = None
    ):
        self.max_queue = max_queue
        self._factory = engine_factory
        self._warmup = warmup
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # Engine thread only: request id -> stream.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stopping = False
        self._dead = False
        self._dead_lock = threading.Lock()
        self.engine = None
        self.load_error: BaseException | None = None
        self.stats = EngineStats()
        self.load_seconds: float | None = None
        self._num_pending = 0  # engine requests submitted but not yet applied by the engine thread

    # Lifecycle (event loop) ----------------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Starts the engine thread; outputs are delivered on `loop` (default: the running loop)."""
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and not self._stopping and self.is_alive

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Blocks (a plain thread, not the loop) until the engine is ready or failed to load."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready.wait(0.2):
            if self.load_error is not None or not self.is_alive:
                return False
            if deadline is not None and time.monotonic() > deadline:
                return False
        return True

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Lets unfinished requests end, then stops the engine thread (joined off the event loop)."""
        self._stopping = True
        self._commands.put(("stop",))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)

    # Requests (event loop) -----------------------------------------------------------------------------------

    async def submit(self, specs: Sequence[RequestSpec]) -> RequestStream:
        """Queues engine requests as one stream.

        Raises:
          EngineNotReadyError: the model is not loaded yet, failed to load, or the server is stopping.
          QueueFullError: more than max_queue requests would be waiting.
          ValueError: the engine refused a request (the message says why); none of `specs` stays queued.
        """
        if not self.ready:
            raise EngineNotReadyError(self.not_ready_reason())
        stream = RequestStream([s.request_id for s in specs])
        with self._dead_lock:  # so that _die either sees this command or submit sees _dead
            if self._dead:
                raise EngineNotReadyError(self.not_ready_reason())
            self._num_pending += len(specs)
            self._commands.put(("add", stream, tuple(specs)))
        try:
            await stream.wait_accepted()
        except asyncio.CancelledError:
            self.abort(stream)
            raise
        return stream

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Runs fn() on the engine thread between steps (so it never races a step on the device) and returns
        its result; raises what fn raised, or EngineNotReadyError when the engine is not serving."""
        if not self.ready:
            raise EngineNotReadyError(self.not_ready_reason())
        future = self._loop.create_future()
        self._commands.put(("call", fn, future))
        return await future

    def live_stats(self) -> EngineStats:
        """The last snapshot with the waiting and running counts read now (ints the engine thread updates; a
        scrape may see them one command apart) plus the submissions not yet applied."""
        s, engine = self.stats, self.engine
        if engine is None or not self._ready.is_set():
            return s
        try:
            waiting, running = engine.scheduler.num_waiting, len(engine.scheduler.running)
        except (AttributeError, RuntimeError):  # a fake engine, or a container resized while read
            waiting, running = s.num_waiting, s.num_running
        return dataclasses.replace(s, num_waiting=waiting + self._num_pending, num_running=running)

    def abort(self, stream: RequestStream) -> None:
        """Ends the stream's unfinished requests and frees their KV blocks (safe to call more than once)."""
        if stream.finished or stream.cancelled:
            return
        stream.cancelled = True
        self._commands.put(("abort", stream))

    def not_ready_reason(self) -> str:
        if self.load_error is not None:
            return f"the model failed to load: {self.load_error}"
        if self._dead:
            return "the engine loop has stopped after an internal error"
        if self._stopping:
            return "the server is shutting down"
        if not self._ready.is_set():
            return "the model is still loading"
        return "the engine loop has stopped"

    # Engine thread -------------------------------------------------------------------------------------------

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            self.engine = self._factory()
            if self._warmup is not None:
                self._warmup(self.engine)
        except ValueError as e:  # a configuration the model or the devices refuse: its message says which
            log.error("engine failed to load: %s", e)
            self.load_error = e
            return
        except Exception as e:  # noqa: BLE001 - reported through /health and every request
            log.exception("engine failed to load")
            self.load_error = e
            return
        self.load_seconds = time.perf_counter() - t0
        self._publish_stats()
        self._ready.set()
        log.info("engine ready after %.1f s", self.load_seconds)
        try:
            self._loop_forever()
        except BaseException as e:  # noqa: BLE001 - a dead loop must not leave requests waiting forever
            log.exception("engine loop died")
            self._die(EngineError(f"the engine loop stopped: {type(e).__name__}: {e}"))

    def _loop_forever(self) -> None:
        while True:
            busy = self.engine.has_unfinished()
            for cmd in self._take_commands(block=not busy):
                if cmd[0] == "stop":
                    self._stopping = True
                else:
                    self._apply(cmd)
            if self.engine.has_unfinished():
                self._step()
            elif self._stopping and self._commands.empty():
                self._publish_stats()
                return
            self._publish_stats()

    def _die(self, error: EngineError) -> None:
        """Fails every stream, in flight or still queued as a command (submit refuses new ones from now on)."""
        self._stopping = True
        streams = {id(s): s for s in self._streams.values()}
        self._streams.clear()
        with self._dead_lock:
            self._dead = True
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                streams[id(cmd[1])] = cmd[1]
            elif cmd[0] == "call":
                self._call_loop(_fail_future, cmd[2], error)
        for stream in streams.values():
            self._post(stream, error)

    def _take_commands(self, block: bool) -> list[tuple]:
        cmds = []
        if block:
            cmds.append(self._commands.get())
        while True:
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                return cmds

    def _apply(self, cmd: tuple) -> None:
        try:
            if cmd[0] == "add":
                self._add(cmd[1], cmd[2])
            elif cmd[0] == "abort":
                self._abort(cmd[1])
            elif cmd[0] == "call":
                self._call(cmd[1], cmd[2])
        except Exception as e:  # noqa: BLE001 - a bug here must fail one request, not the engine thread
            log.exception("engine command %s failed", cmd[0])
            self._deliver_error(cmd[1], EngineError(f"internal error: {type(e).__name__}: {e}"))

    def _call(self, fn: Callable[[], Any], future: asyncio.Future) -> None:
        try:
            result, error = fn(), None
        except Exception as e:  # noqa: BLE001 - handed to the awaiting coroutine
            result, error = None, e

        def settle():
            if not future.done():
                future.set_exception(error) if error is not None else future.set_result(result)

        self._call_loop(settle)

    def _add(self, stream: RequestStream, specs: tuple[RequestSpec, ...]) -> None:
        self._call_loop(self._applied, len(specs))
        if stream.cancelled:
            return
        waiting = self.engine.scheduler.num_waiting
        if waiting + len(specs) > self.max_queue:
            self._post(
                stream,
                QueueFullError(f"{waiting} requests are already waiting (max_queue={self.max_queue}); retry later"),
            )
            return
        added = []
        try:
            for s in specs:
                self.engine.add_request(s.prompt_token_ids, s.params, s.request_id, s.prompt)
                added.append(s.request_id)
        except ValueError as e:
            for rid in added:
                self.engine.abort(rid)
            self._post(stream, ValueError(str(e)))
            return
        for rid in added:
            self._streams[rid] = stream
        self._post(stream, _ACCEPTED)

    def _applied(self, n: int) -> None:  # on the loop, so that _num_pending has one writer
        self._num_pending -= n

    def _abort(self, stream: RequestStream) -> None:
        for rid in stream.request_ids:
            if self._streams.get(rid) is stream:
                self.engine.abort(rid)
                del self._streams[rid]

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - fail the requests, keep serving
            log.exception("engine step failed")
            self._fail_all(EngineError(f"engine step failed: {type(e).__name__}: {e}"))
            return
        batch: dict[int, tuple[RequestStream, list[RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self.engine.pop_finished(out.request_id)
                self._streams.pop(out.request_id, None)
            if stream is not None:
                batch.setdefault(id(stream), (stream, []))[1].append(out)
        if batch:
            self._call_loop(_deliver, list(batch.values()))

    def _fail_all(self, error: EngineError) -> None:
        """Ends every in-flight request with `error` and clears the scheduler so no step retries them."""
        self.stats = dataclasses.replace(self.stats, num_step_failures=self.stats.num_step_failures + 1)
        streams = {id(s): s for s in self._streams.values()}
        for rid in list(self._streams) + list(self.engine.scheduler.requests):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - keep failing the others
                log.exception("abort of %s after a failed step also failed", rid)
        self._streams.clear()
        for stream in streams.values():
            self._post(stream, error)

    def _deliver_error(self, stream: Any, error: EngineError) -> None:
        if isinstance(stream, RequestStream):
            self._abort(stream)
            self._post(stream, error)

    def _post(self, stream: RequestStream, item: Any) -> None:
        self._call_loop(stream._put, item)

    def _call_loop(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # The event loop is closed: nobody is listening any more.
            log.warning("event loop closed; dropping engine output")

    def _publish_stats(self) -> None:
        s = self.engine.scheduler.stats()
        self.stats = EngineStats(
            num_waiting=s.num_waiting,
            num_running=s.num_running,
            kv_blocks_used=s.num_used_blocks,
            kv_blocks_free=s.num_free_blocks,
            kv_blocks_cached=s.num_cached_blocks,
            prefix_hit_rate=s.prefix_hit_rate,
            num_preemptions=s.num_preemptions,
            num_steps=self.engine.num_steps,
            num_step_failures=self.stats.num_step_failures,
            speculative=spec.metrics() if (spec := getattr(self.engine, "spec", None)) is not None else {},
            router_tokens=_router_load(self.engine),
        )


def _router_load(engine):
    """MoE router statistics of an LLMEngine (its runner's) or a DataParallelEngine (summed over the replicas)."""
    if hasattr(engine, "runner"):
        return engine.runner.router_load()
    return engine.router_load() if hasattr(engine, "router_load") else None


def _deliver(batch: list[tuple[RequestStream, list[RequestOutput]]]) -> None:
    for stream, outs in batch:
        for out in outs:
            stream._put(out)


def _fail_future(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
