"""Does a step's dispatch return before the device has run it? Host milliseconds per call of a jitted step.

    PYTHONPATH=. python benchmarks/dispatch_probe.py --calls 30          # any backend; meant for the GPU

A stand-in step (a chain of bf16 matmuls of `--layers` x `--width` weights: ~3 ms on an H100 by default, plus a write into a large "KV pool"
buffer) is called `--calls` times back to back without waiting, then once synchronised. Per variant, the median host
milliseconds per call and the device milliseconds per call (the whole run's wall time / calls):

    plain        jax.jit, device-resident inputs
    donate       the pool donated and replaced by the output (the engine's KV pool)
    numpy_in     small per-step inputs (tokens, positions, a [S, W] table) passed as numpy arrays
    compiled     the donate + numpy_in step through .lower().compile() (the engine's executables)
    many_args    as compiled, plus 300 weight arrays passed per call (the engine passes its parameters)
    fetch_prev   as compiled, and after each call the previous call's small output copied to the host (the engine's
                 one-step loop: dispatch N + 1, then read N)

If a variant's host ms per call is close to its device ms, its dispatch waits for the device: the host then cannot
overlap its own work with the step. Prints one JSON line per variant and writes them to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def _step(weights, pool, tokens, positions, tables):
    x = jnp.take(weights[0], tokens % weights[0].shape[0], axis=0)
    for w in weights[1:]:
        x = jnp.tanh(x @ w)
    row = (positions + tables[:, 0]) % pool.shape[0]
    pool = pool.at[row].set(x.astype(pool.dtype))
    return jnp.argmax(x, axis=-1).astype(jnp.int32), pool


def _timed(call, calls: int, fetch_prev: bool) -> dict:
    host, prev = [], None
    jax.block_until_ready(call())  # compiled and warm
    t_start = time.perf_counter()
    for _ in range(calls):
        t0 = time.perf_counter()
        out = call()
        host.append(time.perf_counter() - t0)
        if fetch_prev and prev is not None:
            np.asarray(prev)
        prev = out
    jax.block_until_ready(prev)
    wall = time.perf_counter() - t_start
    return dict(host_ms=round(statistics.median(host) * 1e3, 3), device_ms=round(wall / calls * 1e3, 3))


def probe(a) -> list[dict]:
    key = jax.random.key(0)
    d, rows = a.width, a.rows
    n_layers = max(1, a.layers)
    weights = [jax.random.normal(key, (d, d), jnp.bfloat16) * d**-0.5 for _ in range(n_layers)]
    pool = jnp.zeros((a.pool_rows, d), jnp.bfloat16)
    tok_np = np.arange(rows, dtype=np.int32)
    pos_np = np.arange(rows, dtype=np.int32)
    tab_np = np.zeros((rows, 64), np.int32)
    tok, pos, tab = jnp.asarray(tok_np), jnp.asarray(pos_np), jnp.asarray(tab_np)
    extra = [jnp.ones((256, 256), jnp.bfloat16) for _ in range(300)]
    state = {"pool": pool}

    plain = jax.jit(_step)
    donate = jax.jit(_step, donate_argnums=(1,))
    compiled = donate.lower(weights, pool, tok_np, pos_np, tab_np).compile()

    def with_extra(weights, extra, pool, tokens, positions, tables):
        return _step(weights, pool, tokens, positions, tables)

    many = jax.jit(with_extra, donate_argnums=(2,)).lower(weights, extra, pool, tok_np, pos_np, tab_np).compile()

    def run(fn, *args, extra_args=()):
        def call():
            out, state["pool"] = fn(weights, *extra_args, state["pool"], *args)
            return out

        return call

    variants = {
        "plain": (run(plain, tok, pos, tab), False),
        "donate": (run(donate, tok, pos, tab), False),
        "numpy_in": (run(donate, tok_np, pos_np, tab_np), False),
        "compiled": (run(compiled, tok_np, pos_np, tab_np), False),
        "many_args": (run(many, tok_np, pos_np, tab_np, extra_args=(extra,)), False),
        "fetch_prev": (run(compiled, tok_np, pos_np, tab_np), True),
    }
    rows_out = []
    for name, (call, fetch_prev) in variants.items():
        r = dict(bench="dispatch_probe", device=jax.devices()[0].device_kind, variant=name, calls=a.calls)
        r.update(_timed(call, a.calls, fetch_prev))
        rows_out.append(r)
    return rows_out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--width", type=int, default=8192, help="matmul width")
    p.add_argument("--rows", type=int, default=64, help="rows per step (the batch)")
    p.add_argument("--layers", type=int, default=64, help="matmuls per step")
    p.add_argument("--pool_rows", type=int, default=262144, help="rows of the donated pool (x width bf16)")
    p.add_argument("--out", default="dispatch_probe.jsonl")
    a = p.parse_args(argv)
    with open(a.out, "a") as f:
        for row in probe(a):
            print(json.dumps(row), flush=True)
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
