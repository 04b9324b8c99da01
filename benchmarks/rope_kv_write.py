"""RoPE + KV-page write (pallas_kernels/rope_kv_write.py) against the unfused XLA ops it replaces, per call, at
Llama-3-8B's attention shape (32 query heads, 8 KV heads, hd 128) for decode and prefill token counts.

    PYTHONPATH=. python3 benchmarks/rope_kv_write.py --out $OUT/rope_kv_write.json [--tokens 1,64,256,8192]

Each timed call is one jitted program of `--iters` applications that carries q and the pools (donated, as in a
decode step: no copy of the pool), with positions moving each application; microseconds per application, median of
5 calls. The loop is unrolled: a rolled loop gave both paths a 12-25 us floor per application at
T <= 256 on an H100, where the traced decode step shows the kernel at 1.8-3.4 us a layer. "xla" is what the model
runs without the kernel: the slices of q|k|v, RoPE on q and k and the scatters (model/kv.py write_pages /
write_scales, with their barriers); int8 pages add the quantiser.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from model import kv as kvmod  # noqa: E402
from model.layers import apply_rope, rope_inv_freq  # noqa: E402
from pallas_kernels import rope_kv_write as R  # noqa: E402


def unfused(qkv, positions, slots, inv_freq, *pools, num_q_heads):
    """The model's steps without the kernel (model/transformer.py Attention + PagedMeta._write_attend)."""
    hkv, hd = pools[0].shape[0], pools[0].shape[-1]
    t = qkv.shape[0]
    x = qkv.reshape(1, t, num_q_heads + 2 * hkv, hd)
    q, k, v = x[:, :, :num_q_heads], x[:, :, num_q_heads : num_q_heads + hkv], x[:, :, num_q_heads + hkv :]
    q, k = apply_rope(q, positions[None], inv_freq)[0], apply_rope(k, positions[None], inv_freq)[0]
    v = v[0]
    if len(pools) == 2:
        return q, kvmod.write_pages(pools[0], k, slots), kvmod.write_pages(pools[1], v, slots)
    (kc, ks), (vc, vs) = kvmod.quantize_kv(k, jnp.int8), kvmod.quantize_kv(v, jnp.int8)
    return (
        q,
        kvmod.write_pages(pools[0], kc, slots),
        kvmod.write_pages(pools[1], vc, slots),
        kvmod.write_scales(pools[2], ks, slots),
        kvmod.write_scales(pools[3], vs, slots),
    )


BACKEND = "triton"  # --backend interpret: a CPU check of this script


def fused(qkv, positions, slots, inv_freq, *pools, num_q_heads):
    return R.rope_kv_write(qkv, positions, slots, inv_freq, *pools, num_q_heads=num_q_heads, backend=BACKEND)


def time_loop(fn, t, hq, hkv, hd, pages, ps, page_dtype, iters, seed=0):
    rng = np.random.default_rng(seed)
    qkv = jnp.asarray(rng.standard_normal((t, (hq + 2 * hkv) * hd)), jnp.bfloat16)
    slots = jnp.asarray(rng.permutation(pages * ps)[:t], jnp.int32)
    positions = jnp.asarray(rng.integers(0, 8192, t), jnp.int32)
    inv_freq = rope_inv_freq(hd, 500000.0, None)
    shape = (hkv, pages, ps, hd)
    pools = [jnp.zeros(shape, page_dtype), jnp.zeros(shape, page_dtype)]
    if jnp.dtype(page_dtype) == jnp.int8:
        pools += [jnp.ones(shape[:3], jnp.float32), jnp.ones(shape[:3], jnp.float32)]

    def body(i, carry):
        _, *pools = carry
        return fn(qkv, positions + i, slots, inv_freq, *pools, num_q_heads=hq)

    def run(q0, *pools):
        return jax.lax.fori_loop(0, iters, body, (q0, *pools), unroll=True)

    run = jax.jit(run, donate_argnums=tuple(range(1, 1 + len(pools))))
    q0 = jnp.zeros((t, hq, hd), jnp.bfloat16)
    out = jax.block_until_ready(run(q0, *pools))  # compile
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        out = jax.block_until_ready(run(out[0], *out[1:]))
        samples.append((time.perf_counter() - start) / iters)
    return float(np.median(samples)) * 1e6


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="1,8,64,256,2048,8192")
    p.add_argument("--page_dtypes", default="bfloat16,int8")
    p.add_argument("--iters", type=int, default=64)
    p.add_argument("--pages", type=int, default=1024)
    p.add_argument("--backend", default="triton")
    p.add_argument("--out", default="rope_kv_write.json")
    a = p.parse_args()
    global BACKEND
    BACKEND = a.backend
    hq, hkv, hd, ps = 32, 8, 128, 16
    rows = []
    print(
        f"device {jax.devices()[0].device_kind}; Llama-3-8B attention shape, pool {a.pages} pages of {ps}", flush=True
    )
    for dtype in a.page_dtypes.split(","):
        for t in (int(x) for x in a.tokens.split(",")):
            us = {
                name: time_loop(fn, t, hq, hkv, hd, a.pages, ps, jnp.dtype(dtype), a.iters)
                for name, fn in (("fused", fused), ("xla", unfused))
            }
            row = dict(
                tokens=t,
                page_dtype=dtype,
                fused_us=round(us["fused"], 2),
                xla_us=round(us["xla"], 2),
                speedup=round(us["xla"] / us["fused"], 3),
            )
            rows.append(row)
            print(
                f"{dtype:9s} T={t:5d}: fused {us['fused']:8.2f} us, xla {us['xla']:8.2f} us, {row['speedup']:.2f}x",
                flush=True,
            )
    with open(a.out, "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
