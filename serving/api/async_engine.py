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
    await call(fn)              -- command queue --->   fn() between steps, result back
    await run_job(work)         -- command queue --->   work.advance(engine): one chunk of prompt logprobs per
                                                        turn, between steps, under a share of the thread's time
    live_stats() (a /metrics scrape): the snapshot with queue and running counts read now, plus the submissions
    still in the command queue, so the gauges do not lag behind a long step.

One HTTP request is one `RequestStream`, fed by one or more engine requests (OpenAI's `n`, or a list of
prompts). A stream ends when all its engine requests have finished; an engine error ends it with `EngineError`.

Nothing compiles on the engine thread while serving (serving/api/engine_work.py): a request whose prompt and
output need a block-table width warm-up did not compile is parked (its submit() waits) while a background thread
compiles that width; the other requests keep running. Progress is tracked for /health: the engine is stalled when
it has work and neither a step, a chunk nor a command has completed for `stall_timeout_s`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from serving.api.engine_work import SCORING_SHARE, JobQueue, ScoringJob, WidthCompiler, compile_counter
from serving.api.streams import ACCEPTED, EngineStats, RequestSpec, RequestStream, fail_future, settle_future
from serving.api.streams import EngineError as EngineError
from serving.api.streams import EngineNotReadyError as EngineNotReadyError
from serving.api.streams import QueueFullError as QueueFullError
from serving.core.request import RequestOutput

log = logging.getLogger(__name__)


class AsyncEngine:
    """Runs an LLMEngine on its own thread and serves it to coroutines.

    Args:
      engine_factory: builds the engine on the engine thread (load + compile happen there, so the server can
        answer /health while they run). It returns an object with LLMEngine's interface.
      max_queue: most requests waiting for a slot; a submission beyond it raises QueueFullError.
      warmup: called with the engine on the engine thread before it is marked ready (compiles buckets).
      stall_timeout_s: the engine counts as stalled (`stalled_for`) after this long with work and no progress.
    """

    _names = itertools.count()

    def __init__(
        self,
        engine_factory: Callable[[], Any],
        *,
        max_queue: int = 256,
        warmup: Callable[[Any], None] | None = None,
        stall_timeout_s: float = 60.0,
    ):
        self.max_queue = max_queue
        self.stall_timeout_s = stall_timeout_s
        self._thread_name = f"engine-{next(self._names)}"
        self._jobs = JobQueue(self._settle, lambda e: EngineError(f"prompt logprobs failed: {type(e).__name__}: {e}"))
        self._credit = 0.0  # seconds of engine-thread time scoring jobs may still take while requests run
        self._chunk_cost = 0.0  # running estimate of one scoring chunk's seconds
        self._parked: list[tuple[RequestStream, tuple[RequestSpec, ...], int]] = []  # waiting for a width
        self._compiler: WidthCompiler | None = None
        self._busy = False  # the engine thread has work (read by /health)
        self._progress_at = time.monotonic()
        self.last_step_at: float | None = None
        self._compiles_at_ready = 0
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
        self._thread = threading.Thread(target=self._run, name=self._thread_name, daemon=True)
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

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the engine thread (joined off the event loop): requests still unfinished (their HTTP responses
        have ended by now) are aborted, prompt-logprob jobs cancelled, parked requests dropped."""
        self._stopping = True
        self._commands.put(("stop",))
        if self._compiler is not None:
            self._compiler.stop()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)

    @property
    def compiling(self) -> bool:  # a background compile is running (uninterruptible: exit may skip it)
        return self._compiler is not None and self._compiler.busy

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

    async def run_job(self, work: Any) -> Any:
        """Runs `work` (an object with `done`, `next_positions(engine)`, `advance(engine)` and `release(engine)`,
        such as serving/engine/scoring.py PromptLogprobs) a chunk at a time between steps; returns it when done.
        Cancelling the await cancels the work and frees what it holds. Raises what `advance` raised, or
        EngineNotReadyError when the engine is not serving."""
        if not self.ready:
            raise EngineNotReadyError(self.not_ready_reason())
        job = ScoringJob(work, self._loop.create_future())
        with self._dead_lock:
            if self._dead:
                raise EngineNotReadyError(self.not_ready_reason())
            self._commands.put(("job", job))
        try:
            return await job.future
        except asyncio.CancelledError:
            job.cancelled = True
            self._commands.put(("cancel_job", job))
            raise

    def stalled_for(self) -> float:
        """Seconds the engine thread has had work without completing a step, chunk or command (0: not stalled
        or idle)."""
        if not self._ready.is_set() or not self._busy:
            return 0.0
        return max(0.0, time.monotonic() - self._progress_at)

    stalled = property(lambda self: self.stalled_for() > self.stall_timeout_s)

    def last_step_age(self) -> float | None:
        """Seconds since the last engine step ended (None before the first)."""
        return None if self.last_step_at is None else time.monotonic() - self.last_step_at

    @property
    def compiles_while_serving(self) -> int:
        """XLA compilations on the engine thread since it became ready (none is expected)."""
        if not self._ready.is_set():
            return 0
        return compile_counter().count(self._thread_name) - self._compiles_at_ready

    num_parked = property(lambda self: len(self._parked))

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
        self._compiler = WidthCompiler(self.engine, lambda w: self._commands.put(("compiled", w)))
        self._publish_stats()
        self._compiles_at_ready = compile_counter().count(self._thread_name)
        self._progress_at = time.monotonic()
        self._ready.set()
        log.info("engine ready after %.1f s", self.load_seconds)
        try:
            self._loop_forever()
        except BaseException as e:  # noqa: BLE001 - a dead loop must not leave requests waiting forever
            log.exception("engine loop died")
            self._die(EngineError(f"the engine loop stopped: {type(e).__name__}: {e}"))

    def _loop_forever(self) -> None:
        while True:
            busy = self.engine.has_unfinished() or self._jobs.runnable
            self._busy = busy
            for cmd in self._take_commands(block=not busy):
                if cmd[0] == "stop":
                    self._stopping = True
                else:
                    self._apply(cmd)
            self._progress_at = time.monotonic()
            if self._stopping:
                self._end_all()
                self._publish_stats()
                return
            if self.engine.has_unfinished():
                t0 = time.monotonic()
                self._step()
                self.last_step_at = self._progress_at = time.monotonic()
                self._credit = min(self._credit + (self.last_step_at - t0) * SCORING_SHARE, 1.0 + self._chunk_cost)
                self._jobs.blocked = False  # blocks may have been freed
            if self._jobs:
                self._run_job_chunk()
            self._publish_stats()

    def _run_job_chunk(self) -> None:
        """One scoring chunk when the engine is otherwise idle, or once the steps since the last one have earned
        its expected cost (SCORING_SHARE of their time), so that running requests slow by at most that share."""
        contended = self.engine.has_unfinished()
        if not contended:
            self._credit = 0.0
        elif self._credit < self._chunk_cost:
            return
        t0 = time.monotonic()
        self._jobs.advance(self.engine, self._compiler.ready)
        self._progress_at = time.monotonic()
        cost = self._progress_at - t0
        self._chunk_cost = cost if not self._chunk_cost else 0.8 * self._chunk_cost + 0.2 * cost
        if contended:
            self._credit -= cost

    def _end_all(self) -> None:
        """At shutdown: aborts unfinished requests, cancels jobs and parked requests (their clients are gone)."""
        error = EngineNotReadyError("the server is shutting down")
        streams = {id(s): s for s in self._streams.values()} | {id(p[0]): p[0] for p in self._parked}
        for rid in list(self._streams):
            self.engine.abort(rid)
        self._streams.clear()
        self._parked.clear()
        self._jobs.end_all(self.engine, error)
        for stream in streams.values():
            self._post(stream, error)

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
                self._call_loop(fail_future, cmd[2], error)
            elif cmd[0] == "job":
                self._call_loop(fail_future, cmd[1].future, error)
        streams |= {id(p[0]): p[0] for p in self._parked}
        self._parked.clear()
        for job in self._jobs.jobs:
            self._call_loop(fail_future, job.future, error)
        self._jobs.jobs.clear()
        for stream in streams.values():
            self._post(stream, error)

    def _take_commands(self, block: bool) -> list[tuple]:
        cmds = []
        if block:
            cmds.append(self._commands.get())
            self._busy, self._progress_at = True, time.monotonic()  # woken: the command is work now
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
            elif cmd[0] == "job":
                self._jobs.add(cmd[1])
            elif cmd[0] == "cancel_job":
                self._jobs.finish(self.engine, cmd[1], None)
            elif cmd[0] == "compiled":
                self._jobs.blocked = False
                self._unpark()
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

    def _add(self, stream: RequestStream, specs: tuple[RequestSpec, ...], parked: bool = False) -> None:
        """Queues the specs in the engine, or parks them until their table width is compiled (submit() waits)."""
        if not parked:
            self._call_loop(self._applied, len(specs))
        if stream.cancelled:
            return
        waiting = self.engine.scheduler.num_waiting + sum(len(p[1]) for p in self._parked)
        if not parked and waiting + len(specs) > self.max_queue:
            self._post(
                stream,
                QueueFullError(f"{waiting} requests are already waiting (max_queue={self.max_queue}); retry later"),
            )
            return
        need = max(len(s.prompt_token_ids) + s.params.max_tokens for s in specs)
        if not self._compiler.ready(need):
            self._parked.append((stream, specs, need))
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
        self._post(stream, ACCEPTED)

    def _applied(self, n: int) -> None:  # on the loop, so that _num_pending has one writer
        self._num_pending -= n

    def _unpark(self) -> None:
        parked, self._parked = self._parked, []
        for stream, specs, need in parked:
            if stream.cancelled:
                continue
            if self._compiler.ready(need):
                self._add(stream, specs, parked=True)
            else:
                self._parked.append((stream, specs, need))

    def _settle(self, future: asyncio.Future, error: BaseException | None, result: Any) -> None:
        self._call_loop(settle_future, future, error, result)

    def _abort(self, stream: RequestStream) -> None:
        self._parked = [p for p in self._parked if p[0] is not stream]
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
