"""Does a speculative verify row fit the ragged kernel's small tile, and what does a bigger small tile cost?

    PYTHONPATH=. python benchmarks/ragged_verify_tile.py --out benchmarks/results/ragged_verify_tile_h200.json
    PYTHONPATH=. python benchmarks/ragged_verify_tile.py --smoke       # tiny shapes in interpret mode (CPU check)

A verify row of k+1 query tokens takes the small tile only when (k+1) x padded group rows <= small_q_rows. With the
default 16 rows and a group of 4 (Llama-3-8B 32/8 heads, SmolLM2 9/3 padded to 4) a tile holds 4 tokens, so k = 4
(5 tokens) falls back to the 128-row prefill tile. This times one ragged launch of `batch` rows of q_len tokens
(1 = decode, 5 = k 4 verify, 8 = k 7 verify) at context `ctx`, for small_q_rows 16 / 32 / 64, in bf16 and float32,
against the kernel's reference for correctness, and prints which tile each row took.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import subprocess

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import median_seconds
from pallas_kernels import ragged_paged_attention as rpa

SHAPES = {"llama3_8b": (32, 8, 128), "smollm2_135m": (9, 3, 64)}


def inputs(key, batch, q_len, ctx, hq, hkv, d, page, dtype):
    blocks = -(-ctx // page)
    num_pages = batch * blocks + 8
    kk, kv, kp, kq = jax.random.split(key, 4)
    k_pages = jax.random.normal(kk, (hkv, num_pages, page, d), dtype)
    v_pages = jax.random.normal(kv, (hkv, num_pages, page, d), dtype)
    tables = jax.random.permutation(kp, num_pages)[: batch * blocks].reshape(batch, blocks).astype(jnp.int32)
    cu = jnp.arange(batch + 1, dtype=jnp.int32) * q_len
    q = jax.random.normal(kq, (batch * q_len, hq, d), dtype)
    return q, k_pages, v_pages, tables, jnp.full((batch,), ctx, jnp.int32), cu, jnp.int32(batch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="llama3_8b,smollm2_135m")
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--q_lens", default="1,5,8")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--small_rows", default="16,32,64")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default="ragged_verify_tile.json")
    args = ap.parse_args()
    backend, page, ctx = ("interpret", 16, 40) if args.smoke else (None, 16, args.ctx)
    batches = [1, 2] if args.smoke else [int(b) for b in args.batches.split(",")]
    rows = []
    for shape in args.shapes.split(","):
        hq, hkv, d = SHAPES[shape]
        for dtype in args.dtypes.split(","):
            for batch in batches:
                for q_len in (int(x) for x in args.q_lens.split(",")):
                    a = inputs(jax.random.key(batch * 31 + q_len), batch, q_len, ctx, hq, hkv, d, page, dtype)
                    ref = np.asarray(jax.jit(rpa.reference)(*a), np.float32)
                    base = None
                    for small in (int(x) for x in args.small_rows.split(",")):
                        cfg = dataclasses.replace(rpa.RaggedConfig(), small_q_rows=small)
                        fn = jax.jit(lambda *x, c=cfg: rpa.ragged_paged_attention(*x, backend=backend, config=c))
                        out = np.asarray(fn(*a), np.float32)
                        err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
                        fits = cfg.tokens_per_tile(rpa._next_pow2(hq // hkv))[1] >= q_len
                        t = median_seconds(fn, *a, iters=3 if args.smoke else 20, reps=2 if args.smoke else 7)
                        base = base or t
                        row = dict(
                            shape=shape,
                            dtype=dtype,
                            batch=batch,
                            q_len=q_len,
                            ctx=ctx,
                            small_q_rows=small,
                            small_tile=bool(fits),
                            time_us=round(t * 1e6, 2),
                            vs_16=round(t / base, 3),
                            rel_err=err,
                        )
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = dict(device=str(jax.devices()[0]), date=datetime.datetime.now(datetime.UTC).isoformat(), commit=commit)
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
