"""Work the server's engine thread does besides `engine.step()`, bounded so that no request stalls the others.

    WidthCompiler    executables for block-table widths warm-up left out (a CPU host compiles only the narrowest
                     at start-up): compiled on a background thread while requests that fit the compiled widths
                     keep running; a request that needs a missing width waits for it (AsyncEngine parks it)
    ScoringJob       prompt logprobs (serving/engine/scoring.py PromptLogprobs), advanced one chunk at a time
                     between engine steps under a fair share of the engine thread's time
    CompileCounter   compilations that ran on an engine thread (from JAX's monitoring events): none is expected
                     once the server is ready, and /metrics shows the count

Only the engine thread touches the engine; the compiler thread only lowers and compiles (through the runner's
`warmup`, whose abstract arguments are shapes, so a concurrently donated KV buffer does not matter) and then
wakes the engine thread with a command.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

# Share of the engine thread's time that prompt-logprob chunks may take while requests are running: a neighbour's
# latency grows by at most this factor's worth (1.5x at 0.5); with nothing running they take all of it.
SCORING_SHARE = 0.5


class CompileCounter:
    """Counts XLA compilations per thread name (JAX reports each backend compile in the thread that ran it)."""

    _EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()
        self.listening = False
        self.listen()

    def listen(self) -> None:
        """Registers with JAX once it is imported (an engine that compiles has imported it; the Ray Serve ingress
        never does, and importing it here would cost seconds)."""
        if not self.listening and "jax" in sys.modules:
            sys.modules["jax"].monitoring.register_event_duration_secs_listener(self._on_event)
            self.listening = True

    def _on_event(self, event: str, duration: float, **kw) -> None:
        if event == self._EVENT:
            name = threading.current_thread().name
            with self._lock:
                self.counts[name] = self.counts.get(name, 0) + 1
            if name.startswith("engine-"):
                log.debug("compiled %s on %s in %.2f s", kw.get("fun_name"), name, duration)

    def count(self, thread_name: str) -> int:
        return self.counts.get(thread_name, 0)


_COUNTER: CompileCounter | None = None
_COUNTER_LOCK = threading.Lock()


def compile_counter() -> CompileCounter:
    """The process's one counter (listeners cannot be removed one by one, so one is registered)."""
    global _COUNTER
    with _COUNTER_LOCK:
        if _COUNTER is None:
            _COUNTER = CompileCounter()
        _COUNTER.listen()
        return _COUNTER


class WidthCompiler:
    """Which block-table widths have every step executable, and a background thread compiling the others.

    Args:
      engine: an LLMEngine (engines without a runner, such as data-parallel or test engines, count as fully
        compiled: nothing is parked for them).
      wake: called (on the compiler thread) after each width is compiled; the engine thread's command queue.
    """

    def __init__(self, engine, wake: Callable[[int], None]):
        runner = getattr(engine, "runner", None)
        self._runner = runner if runner is not None and hasattr(runner, "has_executable") else None
        self._wake = wake
        self._thread: threading.Thread | None = None
        self._wanted: set[int] = set()
        self._stopped = False
        self._lock = threading.Lock()
        self.failed: dict[int, str] = {}
        if self._runner is None:
            self.ready_widths, self._steps = set(), ()
            return
        self._steps = _loop_lengths(runner, engine.config.decode_steps)
        self.ready_widths = {w for w in self._runner.width_buckets if self._complete(w)}

    def _complete(self, w: int) -> bool:
        return all(self._runner.has_executable(key) for key, _, _ in self._runner.warmup_plan(self._steps, (w,)))

    def width(self, num_positions: int) -> int | None:
        """The table width a sequence of num_positions positions needs (None without a runner)."""
        if self._runner is None:
            return None
        blocks = -(-max(1, num_positions) // self._runner.block_size)
        return next((w for w in self._runner.width_buckets if w >= blocks), self._runner.width_buckets[-1])

    def ready(self, num_positions: int) -> bool:
        """Whether every step a sequence of up to num_positions positions can take is compiled (its block table
        grows chunk by chunk, through every narrower width); if not, asks for the missing widths."""
        w = self.width(num_positions)
        if w is None:
            return True
        missing = [x for x in self._runner.width_buckets if x <= w and x not in self.ready_widths | set(self.failed)]
        for x in missing:
            self._request(x)
        return not missing

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        """Compiles no further width (one being compiled cannot be interrupted: see `busy`)."""
        with self._lock:
            self._stopped = True
            self._wanted.clear()

    def _request(self, w: int) -> None:
        with self._lock:
            if self._stopped:
                return
            self._wanted.add(w)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="compile-widths", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                todo = sorted(self._wanted - self.ready_widths)
                if not todo or self._stopped:
                    self._thread = None
                    return
            w = todo[0]
            try:
                n = self._runner.warmup(self._steps, widths=(w,), threads=1)
                log.info("compiled table width %d in the background (%d executables in all)", w, n)
            except Exception as e:  # noqa: BLE001 - the parked requests run anyway (compiling inline)
                log.exception("background compile of table width %d failed", w)
                self.failed[w] = f"{type(e).__name__}: {e}"
            with self._lock:
                self.ready_widths.add(w)
                self._wanted.discard(w)
            self._wake(w)


def _loop_lengths(runner, decode_steps: int) -> tuple[int, ...]:
    """The decode-loop length warm-up compiled for the narrowest width (none, or the config's decode_steps), so
    a width is compiled in the background as warm-up would have compiled it."""
    key = ("loop", decode_steps, runner.decode_buckets[0], runner.width_buckets[0])
    return (decode_steps,) if runner.has_executable(key) else ()


@dataclasses.dataclass(eq=False)
class ScoringJob:
    """One prompt's logprobs in flight: the engine-side work (PromptLogprobs) and the future awaiting it."""

    work: object
    future: asyncio.Future
    cancelled: bool = False


class JobQueue:
    """The engine thread's scoring jobs, advanced one chunk per call, round robin.

    Args:
      settle: settle(future, error, result), called on the engine thread; it must hand the outcome to the event
        loop (AsyncEngine posts it with call_soon_threadsafe).
      make_error: turns an unexpected exception of `advance` into the error the handler sees (a ValueError, such
        as a prompt the pool cannot hold, is passed on as it is).
    """

    def __init__(self, settle: Callable[[asyncio.Future, BaseException | None, Any], None], make_error):
        self.jobs: list[ScoringJob] = []
        self.blocked = False  # no job could advance at the last try (no blocks, or a width not compiled yet)
        self._settle, self._make_error = settle, make_error

    def __bool__(self) -> bool:
        return bool(self.jobs)

    @property
    def runnable(self) -> bool:
        return bool(self.jobs) and not self.blocked

    def add(self, job: ScoringJob) -> None:
        self.jobs.append(job)
        self.blocked = False

    def advance(self, engine, ready: Callable[[int], bool]) -> None:
        """One chunk of the first job that can take one; `ready(num_positions)`: whether its shapes are compiled."""
        for _ in range(len(self.jobs)):
            job = self.jobs.pop(0)
            work = job.work
            if job.cancelled:
                self.finish(engine, job, None)
                continue
            if not ready(work.next_positions(engine)):
                self.jobs.append(job)
                continue
            try:
                moved = work.advance(engine)
            except Exception as e:  # noqa: BLE001 - handed to the awaiting handler
                if not isinstance(e, ValueError):
                    log.exception("prompt logprobs failed")
                    e = self._make_error(e)
                self.finish(engine, job, e)
                return
            if work.done:
                self.finish(engine, job, None, result=work)
                return
            self.jobs.append(job)
            if moved:
                return
        self.blocked = True

    def finish(self, engine, job: ScoringJob, error: BaseException | None, result: Any = None) -> None:
        """Frees what the job holds and settles its future (a cancelled job's: nobody awaits it)."""
        if job in self.jobs:
            self.jobs.remove(job)
        try:
            job.work.release(engine)
        except Exception:  # noqa: BLE001 - keep serving
            log.exception("releasing a prompt-logprob job failed")
        if not job.cancelled:
            self._settle(job.future, error, result)

    def end_all(self, engine, error: BaseException) -> None:
        for job in list(self.jobs):
            self.finish(engine, job, error)
