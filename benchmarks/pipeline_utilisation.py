"""Pipeline-parallel utilisation: busy stage-ticks counted inside the compiled pipeline vs m / (m + p - 1).

For each (stages p, microbatches m) one PipelinedLayers step (model/pipeline.py) runs a batch on forced CPU
devices; its per-stage busy counters are read back and

    measured utilisation = sum over stages of busy ticks / (p * (m + p - 1) ticks)

is set beside the GPipe formula. The wall time per step is reported too, beside the unsplit layers' time on one
device and the ideal GPipe time (unsplit x (m + p - 1) / (m p)): on CPU "devices" that share a few host cores it
shows the cost of the schedule, not the overlap a real multi-accelerator pipeline gets (`bash benchmarks/gpu.sh
parallel` measures that on GPUs). `max_abs_diff` compares the pipelined output with the unsplit layers'
(--stages 1 on one GPU: the device kernels on the microbatch split, a correctness run).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 PYTHONPATH=. .venv/bin/python \
        benchmarks/pipeline_utilisation.py --out benchmarks/results/pipeline_utilisation_cpu.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.timing import median_seconds
from model.config import ModelConfig
from model.kv import PagedMeta, init_paged_cache
from model.layers import rope_inv_freq
from model.pipeline import PipelinedLayers, init_stage_cache
from model.transformer import random_model
from sharding.mesh import ParallelConfig, make_mesh


def batch(kind: str, rows: int, tokens: int, block: int) -> tuple[np.ndarray, PagedMeta, int]:
    """(positions [T], PagedMeta, pages in the pool) of a decode batch (one token per row at position 39) or a
    ragged prefill batch (`tokens` spread evenly over `rows` fresh sequences)."""
    per = 1 if kind == "decode" else tokens // rows
    start = 39 if kind == "decode" else 0
    width = -(-(start + per) // block)
    tables = np.arange(1, 1 + rows * width, dtype=np.int32).reshape(rows, width)
    pos = np.tile(np.arange(start, start + per), rows).astype(np.int32)
    slots = tables[np.repeat(np.arange(rows), per), pos // block] * block + pos % block
    arrays = (slots, tables, np.full(rows, start + per), per * np.arange(rows + 1), rows)
    meta = PagedMeta(*(jnp.asarray(a, jnp.int32) for a in arrays), kind == "decode", BACKEND, None)
    return pos, meta, 1 + rows * width


def _unsplit(graphdef, inv_freq, state, caches, x, pos, meta):
    """The L layers on one device, one after another (the time a step takes without pipelining)."""
    h = x[None]
    for i, layer in enumerate(nnx.merge(graphdef, state)):
        h, _, _ = layer(h, pos[None], inv_freq, caches[i], meta)
    return h


BACKEND = "xla"  # the attention kernels (None: the device's default Pallas kernels); set by --backend


def main(argv=None) -> int:
    global BACKEND
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--preset", default="tiny", choices=("tiny", "smollm2_135m"))
    ap.add_argument("--layers", type=int, default=8, help="layers of the tiny preset")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--backend", default="xla", help="attention kernels; 'default': the device's fastest")
    ap.add_argument("--stages", default="2,4")
    ap.add_argument("--microbatches", default="1,2,4,8")
    ap.add_argument("--decode_rows", type=int, default=16)
    ap.add_argument("--prefill", default="4x128", help="ROWSxTOKENS of the prefill batch")
    args = ap.parse_args(argv)
    BACKEND = None if args.backend == "default" else args.backend
    dtype = jnp.dtype(args.dtype)
    if args.preset == "tiny":
        cfg = ModelConfig.tiny(num_layers=args.layers, num_heads=8, num_kv_heads=2, hidden_size=256, head_dim=32)
    else:
        cfg = ModelConfig.smollm2_135m()
    block, (prefill_rows, prefill_tokens) = 16, map(int, args.prefill.split("x"))
    rows_out = []
    for kind, rows, tokens in (
        ("decode", args.decode_rows, args.decode_rows),
        ("prefill", prefill_rows, prefill_tokens),
    ):
        pos, meta, pages = batch(kind, rows, tokens, block)
        x = jnp.asarray(np.random.default_rng(0).standard_normal((len(pos), cfg.hidden_size)), dtype)
        model = random_model(cfg, dtype, seed=0)
        inv = rope_inv_freq(cfg.head_dim, cfg.rope_theta, None)
        caches = init_paged_cache(cfg.num_layers, pages, block, cfg.num_kv_heads, cfg.head_dim, dtype)
        gd, st = nnx.split(model.layers)

        unsplit = jax.jit(functools.partial(_unsplit, gd, inv))

        want = unsplit(st, caches, x, jnp.asarray(pos), meta)  # the pipelined output must match it
        base = median_seconds(unsplit, st, caches, x, jnp.asarray(pos), meta, iters=3, reps=3)
        for p in map(int, args.stages.split(",")):
            mesh = make_mesh(ParallelConfig(pp=p), devices=jax.devices()[:p])
            cache = init_stage_cache(cfg.num_layers, pages, block, cfg.num_kv_heads, cfg.head_dim, dtype, mesh)
            for m in map(int, args.microbatches.split(",")):
                layers = PipelinedLayers(random_model(cfg, dtype, seed=0), mesh, num_microbatches=m)
                graphdef, state = nnx.split(layers)
                run = jax.jit(lambda s, c, x, q, mt: nnx.merge(graphdef, s).run(x, q, c, mt))  # noqa: B023
                y, _, busy = run(state, cache[0], x, jnp.asarray(pos), meta)
                diff = float(jnp.max(jnp.abs(y.astype(jnp.float32) - want[0].astype(jnp.float32))))
                ticks = m + p - 1
                seconds = median_seconds(run, state, cache[0], x, jnp.asarray(pos), meta, iters=3, reps=3)
                row = dict(
                    batch=kind,
                    tokens=len(pos),
                    stages=p,
                    microbatches=m,
                    ticks=ticks,
                    busy_per_stage=np.asarray(busy).tolist(),
                    max_abs_diff=diff,
                    measured=float(np.asarray(busy).sum() / (p * ticks)),
                    formula=m / (m + p - 1),
                    step_ms=1e3 * seconds,
                    unsplit_ms=1e3 * base,
                    # GPipe with perfect scaling: each of the m + p - 1 ticks costs 1 / (m p) of the unsplit step
                    ideal_ms=1e3 * base * ticks / (m * p),
                )
                rows_out.append(row)
                print(json.dumps(row), flush=True)
    result = dict(
        device=f"{jax.devices()[0].device_kind} x{jax.device_count()}",
        preset=args.preset,
        dtype=args.dtype,
        backend=args.backend,
        rows=rows_out,
    )
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
