"""One timing rule for every benchmark: median seconds per call over `reps` batches of `iters` back-to-back calls,
after an untimed first call (compile + warm-up)."""

from __future__ import annotations

import statistics
import time

import jax


def median_seconds(fn, *args, iters: int = 10, reps: int = 5) -> float:
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / iters)
    return statistics.median(samples)
