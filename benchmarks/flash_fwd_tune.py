"""Forward tuning: our Mosaic GPU forward variants vs cuDNN and JAX's attention_mgpu, one run.

Every variant is first checked against the f32 reference on two heads of the benchmark inputs (finite, relative
L2 error < 1e-2); only the ones that pass are timed. TFLOP/s = 4*B*H*S^2*D (halved when causal) over the median
time (benchmarks/timing.py). Rows are appended to the JSON after each measurement, so a run cut short still
leaves what it measured.

    python3 benchmarks/flash_fwd_tune.py --out benchmarks/results/flash_fwd_tune_2026-12-01.json
"""

from __future__ import annotations

import argparse
import functools
import json
import time
import traceback

import jax
import jax.numpy as jnp

from benchmarks.timing import median_seconds
from pallas_kernels import flash_attention as fa
from pallas_kernels import flash_attention_mgpu as mgpu
from pallas_kernels.flash_attention_common import BlockSizes, KernelStatic

# name -> MgpuConfig; flags spelled out (the 2026-12-01 run was made while split_refill defaulted to True).
_SPLIT = dict(split_refill=True)
VARIANTS = {
    "q64k128s2": mgpu.MgpuConfig(**_SPLIT),  # the earlier default tiles, K refilled apart from V
    "q64k128s2_joint_refill": mgpu.MgpuConfig(split_refill=False),  # the earlier kernel (causal default)
    "q64k128s2_r240": mgpu.MgpuConfig(compute_registers=240, **_SPLIT),
    "q64k128s2_pipe": mgpu.MgpuConfig(pipelined=True, **_SPLIT),  # non-causal D=128 default since tuning run 3
    "q64k128s2_pipe_r240": mgpu.MgpuConfig(pipelined=True, compute_registers=240, **_SPLIT),
    "q128k64s3_r240": mgpu.MgpuConfig(
        block_q=128, block_kv=64, max_concurrent_steps=3, compute_registers=240, **_SPLIT
    ),
    "q64k128s2_qfast": mgpu.MgpuConfig(q_tiles_fastest=True, **_SPLIT),
    "q64k128s2_pipe_r240_qfast": mgpu.MgpuConfig(pipelined=True, compute_registers=240, q_tiles_fastest=True, **_SPLIT),
}


def _inputs(batch, seq, heads, head_dim, dtype, seed=0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    shape = (batch, seq, heads, head_dim)
    return tuple(jax.random.normal(key, shape, dtype) for key in (kq, kk, kv))


def _ours(cfg, causal, seq, head_dim):
    st = KernelStatic(
        causal=causal,
        sm_scale=head_dim**-0.5,
        sliding_window=None,
        logits_soft_cap=None,
        q_len=seq,
        kv_len=seq,
        has_segments=False,
        blocks=BlockSizes(),
        interpret=False,
        static_q_offset=0,
    )
    return jax.jit(lambda q, k, v: mgpu.forward(q, k, v, st, cfg=cfg)[0])


def _check(fn, q, k, v, causal, heads=2):
    """Relative L2 error of fn's output on the first `heads` heads against the f32 reference."""
    out = fn(q, k, v)[:, :, :heads].astype(jnp.float32)
    ref = fa.reference(q[:, :, :heads], k[:, :, :heads], v[:, :, :heads], causal=causal).astype(jnp.float32)
    finite = bool(jnp.isfinite(out).all())
    err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
    return finite, err


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--causal", default="0,1", help="comma list of 0/1")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--shapes", default="4x4096x32x128,1x16384x32x128", help="BxSxHxD,...")
    args = parser.parse_args()
    rows = []
    meta = dict(device=str(jax.devices()[0]), jax=jax.__version__, date=time.strftime("%Y-%m-%d %H:%M:%S"))

    def save():
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)

    from jax.experimental.pallas.ops.gpu import attention_mgpu  # noqa: PLC0415

    for causal in [bool(int(c)) for c in args.causal.split(",")]:
        for batch, seq, heads, head_dim in [tuple(map(int, x.split("x"))) for x in args.shapes.split(",")]:
            flops = 4 * batch * heads * seq * seq * head_dim * (0.5 if causal else 1.0)
            bf = _inputs(batch, seq, heads, head_dim, jnp.bfloat16)
            f16 = tuple(x.astype(jnp.float16) for x in bf)
            impls = {name: (_ours(VARIANTS[name], causal, seq, head_dim), bf) for name in args.variants.split(",")}
            if not causal:
                impls["ours_fp16_q64k128s2"] = (_ours(VARIANTS["q64k128s2"], causal, seq, head_dim), f16)
                # The public entry point's default (in the 2026-12-01 run: q64k128s2 with split refill).
                impls["ours_entry_point"] = (
                    jax.jit(functools.partial(fa.flash_attention, causal=causal, backend="mosaic_gpu")),
                    bf,
                )
            impls["cudnn"] = (
                jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=causal, implementation="cudnn")),
                bf,
            )
            cfg = attention_mgpu.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=causal)
            impls["jax_attention_mgpu_fp16_noscale"] = (
                jax.jit(functools.partial(attention_mgpu.attention, config=cfg)),
                f16,
            )
            for name, (fn, xs) in impls.items():
                row = dict(impl=name, batch=batch, seq=seq, heads=heads, head_dim=head_dim, causal=causal)
                try:
                    t0 = time.perf_counter()
                    if name.startswith("jax_attention_mgpu"):  # no sm_scale: check shape/finiteness only
                        out = fn(*xs)
                        row.update(finite=bool(jnp.isfinite(out.astype(jnp.float32)).all()), rel_err=None)
                    else:
                        finite, err = _check(fn, *xs, causal)
                        row.update(finite=finite, rel_err=err)
                    row["compile_check_s"] = round(time.perf_counter() - t0, 2)
                    if row["finite"] and (row["rel_err"] is None or row["rel_err"] < 1e-2):
                        sec = median_seconds(fn, *xs)
                        row.update(ms=sec * 1e3, tflops=flops / sec / 1e12)
                except Exception as e:  # noqa: BLE001 - record and continue with the next variant
                    row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
                    traceback.print_exc()
                rows.append(row)
                save()
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
