"""MLA latent-cache kernels on one GPU: decode bandwidth against the same attention through XLA.

Run from the repo root on the device machine:

    PYTHONPATH=. python3 benchmarks/kernels_mla.py --out $OUT/mla.json      (--smoke: tiny shapes, CPU interpreter)

Decode (bf16 latent pool [P, 16, 512 + 64], absorbed queries): DeepSeek-V2-Lite's 16 heads and V3's 128, batch
1 and 64, context 4096. Figure of merit: latent bytes read (B * ctx * 576 * 2) over the median time, in TB/s,
for the Pallas kernel and for `mla_paged_attention.reference` (the same absorbed attention as XLA ops, which
gathers every sequence's page list). Ragged: 4 prefill chunks of 256 tokens (context 1024) + 60 decode rows
at context 2048, one launch, with V2-Lite's heads.
"""

from __future__ import annotations

import argparse
import datetime
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import median_seconds
from pallas_kernels import mla_paged_attention as mpa
from pallas_kernels import mla_ragged_attention as mra

RANK, ROPE, PAGE = 512, 64, 16
SCALE = 0.1


def make_pool(key, kv_lens, rank, rope, page):
    """Random bf16 pool and shuffled block tables for sequences of `kv_lens` tokens."""
    blocks = [-(-n // page) for n in kv_lens]
    width = max(blocks)
    total = sum(blocks) + 1
    pool = jax.random.normal(key, (total, page, rank + rope), jnp.bfloat16)
    perm = np.random.default_rng(0).permutation(total)
    tables = np.zeros((len(kv_lens), width), np.int32)
    used = 0
    for s, b in enumerate(blocks):
        tables[s, :b] = perm[used : used + b]
        used += b
    return pool, jnp.asarray(tables)


def bench_decode(heads, batch, ctx, *, backend, rank, rope, page, timing):
    keys = jax.random.split(jax.random.key(heads * 1000 + batch), 3)
    pool, tables = make_pool(keys[0], [ctx] * batch, rank, rope, page)
    q_lat = jax.random.normal(keys[1], (batch, heads, rank), jnp.bfloat16)
    q_rope = jax.random.normal(keys[2], (batch, heads, rope), jnp.bfloat16)
    lens = jnp.full((batch,), ctx, jnp.int32)
    args = (q_lat, q_rope, pool, tables, lens)
    kernel = jax.jit(lambda *a: mpa.mla_paged_attention(*a, sm_scale=SCALE, backend=backend))
    xla = jax.jit(lambda *a: mpa.mla_paged_attention(*a, sm_scale=SCALE, backend="xla"))
    out, ref = kernel(*args), xla(*args)
    err = float(jnp.linalg.norm((out - ref).astype(jnp.float32)) / jnp.linalg.norm(ref.astype(jnp.float32)))
    nbytes = batch * ctx * (rank + rope) * 2
    row = dict(kind="decode", heads=heads, batch=batch, ctx=ctx, rel_err=err)
    for name, fn in (("pallas", kernel), ("xla", xla)):
        t = median_seconds(fn, *args, **timing)
        row[f"{name}_us"] = t * 1e6
        row[f"{name}_tbps"] = nbytes / t / 1e12
    return row


def bench_ragged(heads, *, backend, rank, rope, page, timing, chunks=4, chunk=256, decode_rows=60, ctx=2048):
    seqs = [(chunk, 4 * chunk)] * chunks + [(1, ctx)] * decode_rows
    keys = jax.random.split(jax.random.key(7), 3)
    pool, tables = make_pool(keys[0], [kv for _, kv in seqs], rank, rope, page)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum([q for q, _ in seqs])]), jnp.int32)
    tokens = int(cu[-1])
    q_lat = jax.random.normal(keys[1], (tokens, heads, rank), jnp.bfloat16)
    q_rope = jax.random.normal(keys[2], (tokens, heads, rope), jnp.bfloat16)
    args = (q_lat, q_rope, pool, tables, jnp.asarray([kv for _, kv in seqs], jnp.int32), cu, jnp.int32(len(seqs)))
    kernel = jax.jit(lambda *a: mra.mla_ragged_attention(*a, sm_scale=SCALE, backend=backend))
    xla = jax.jit(lambda *a: mra.mla_ragged_attention(*a, sm_scale=SCALE, backend="xla"))
    out, ref = kernel(*args), xla(*args)
    err = float(jnp.linalg.norm((out - ref).astype(jnp.float32)) / jnp.linalg.norm(ref.astype(jnp.float32)))
    row = dict(kind="ragged", heads=heads, chunks=chunks, chunk=chunk, decode_rows=decode_rows, rel_err=err)
    for name, fn in (("pallas", kernel), ("xla", xla)):
        row[f"{name}_us"] = median_seconds(fn, *args, **timing) * 1e6
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes through the interpreter (CPU check)")
    flags = parser.parse_args()
    if flags.smoke:
        dims = dict(backend="interpret", rank=32, rope=16, page=8, timing=dict(iters=1, reps=1))
        rows = [bench_decode(4, 2, 40, **dims), bench_ragged(4, chunks=1, chunk=8, decode_rows=2, ctx=24, **dims)]
    else:
        dims = dict(backend="triton", rank=RANK, rope=ROPE, page=PAGE, timing=dict(iters=20, reps=7))
        rows = [bench_decode(h, b, 4096, **dims) for h in (16, 128) for b in (1, 64)]
        rows.append(bench_ragged(16, **dims))
    for row in rows:
        print(json.dumps(row))
    if flags.out:
        meta = dict(device=str(jax.devices()[0].device_kind), date=datetime.date.today().isoformat())
        with open(flags.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
