"""Device benchmark: our FlashAttention against cuDNN and JAX's example kernels, in one run.

Run on the GPU machine from the repo root:
    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/kernels_flash.py [--quick] [--only-backward] [--json NAME]
Prints a table and writes every number to $OUT/flash.json (or ./flash.json without $OUT; --json renames it).
Backward rows time vjp(do) alone: ours on Mosaic GPU (forward + backward through flash_attention, and the
kernels called directly with each MGPU_BWD_CONFIGS entry), ours on Triton, cuDNN, and JAX's attention_mgpu
example (non-causal only); rel_err_vs_cudnn is the largest of the dq/dk/dv errors against cuDNN's gradients.

TFLOP/s counts matmul FLOPs only: 4*B*H*S*S*D for a non-causal forward, half of that causal, and 2.5x the
forward for the backward (shapes.AttentionShape). Each time is the median of several timed batches after a
warm-up that includes compilation; inputs are fresh random normals (never zeros).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import median_seconds
from pallas_kernels import flash_attention_mgpu_bwd as mgpu_bwd
from pallas_kernels import shapes
from pallas_kernels.flash_attention import BlockSizes, flash_attention
from pallas_kernels.flash_attention_common import KernelStatic
from pallas_kernels.flash_attention_mgpu import MgpuConfig
from pallas_kernels.flash_attention_mgpu import forward as mgpu_forward

# First H200 run (results/flash_*_triton_first.json): q128k64w8s3 best causal, q64k64w4s3 best full (+1%).
FWD_CONFIGS = {
    "q128k64w8s3": BlockSizes(block_q=128, block_k=64, num_warps=8, num_stages=3),
    "q64k64w4s3": BlockSizes(block_q=64, block_k=64, num_warps=4, num_stages=3),
}
MGPU_CONFIGS = {
    "q64k128s2": MgpuConfig(block_q=64, block_kv=128, max_concurrent_steps=2),
    "q64k64s3": MgpuConfig(block_q=64, block_kv=64, max_concurrent_steps=3),
    "q64k128s3": MgpuConfig(block_q=64, block_kv=128, max_concurrent_steps=3),
}
# Mosaic GPU backward: dk/dv ring depth s, dq kernel keys per step k and ring depth; "fused" = one kernel with
# dq TMA-reduce-added in fp32 (first H200 run: 312 causal / 348 full TFLOP/s, below the Triton backward).
MGPU_BWD_CONFIGS = {
    "fused_s2": mgpu_bwd.MgpuBwdConfig(fused=True, max_concurrent_steps=2),
    "s2_dq64x3": mgpu_bwd.MgpuBwdConfig(max_concurrent_steps=2, dq_block_kv=64, dq_steps=3),  # the default
    "s3_dq64x3": mgpu_bwd.MgpuBwdConfig(max_concurrent_steps=3, dq_block_kv=64, dq_steps=3),
    "s4_dq64x4": mgpu_bwd.MgpuBwdConfig(max_concurrent_steps=4, dq_block_kv=64, dq_steps=4),
}  # s3 with 128-key dq steps measured 1-2% under these (flash_bwd_2026-12-01.json)
# dq tile [block_q_dq, block_k_dq], dk/dv tile [block_k_dkv, block_q_dkv]; 64x64 w4 s2 led the first run.
BWD_CONFIGS = {
    "dq64x64_dkv64x64_w4s2": BlockSizes(),
    "dq64x64_dkv64x64_w4s3": BlockSizes(num_stages_bwd=3),
    "dq128x32_dkv32x128_w4s3": BlockSizes(
        block_q_dq=128, block_k_dq=32, block_q_dkv=32, block_k_dkv=128, num_warps_bwd=4, num_stages_bwd=3
    ),
    "dq128x64_dkv64x128_w8s3": BlockSizes(
        block_q_dq=128, block_k_dq=64, block_q_dkv=64, block_k_dkv=128, num_warps_bwd=8, num_stages_bwd=3
    ),
}


def time_fn(fn, *args, iters: int = 10, reps: int = 5) -> float:
    """Median seconds per call; the first call (compile + warm-up) is not timed."""
    return median_seconds(fn, *args, iters=iters, reps=reps)


def _rel_err(x, ref) -> float:
    x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def forward_impls(shape: shapes.AttentionShape, quick: bool, mgpu: bool = True):
    """name -> (jitted fn(q, k, v), input dtype override or None)."""
    causal = shape.causal
    impls = {}
    configs = {"q128k64w8s3": FWD_CONFIGS["q128k64w8s3"]} if quick else FWD_CONFIGS
    for cfg_name, cfg in configs.items():
        impls[f"ours_triton[{cfg_name}]"] = (
            jax.jit(functools.partial(flash_attention, causal=causal, backend="triton", block_sizes=cfg)),
            None,
        )
    if not mgpu:
        quick = True
    else:
        impls["ours_mosaic_gpu[default]"] = (
            jax.jit(functools.partial(flash_attention, causal=causal, backend="mosaic_gpu")),
            None,
        )
    st = KernelStatic(
        causal=causal,
        sm_scale=1 / math.sqrt(shape.head_dim),
        sliding_window=None,
        logits_soft_cap=None,
        q_len=shape.q_len,
        kv_len=shape.kv_len,
        has_segments=False,
        blocks=BlockSizes(),
        interpret=False,
        static_q_offset=0,
    )
    for cfg_name, cfg in ({} if quick else MGPU_CONFIGS).items():  # the kernel alone, on unpadded inputs
        impls[f"ours_mosaic_gpu[{cfg_name}]"] = (
            jax.jit(lambda q, k, v, cfg=cfg: mgpu_forward(q, k, v, st, cfg)[0]),
            None,
        )
    impls["cudnn"] = (
        jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=causal, implementation="cudnn")),
        None,
    )
    from jax.experimental.pallas.ops.gpu import attention as jax_attention  # noqa: PLC0415 (deprecated module)
    from jax.experimental.pallas.ops.gpu import attention_mgpu  # noqa: PLC0415

    impls["jax_example_mha_triton"] = (
        jax.jit(
            functools.partial(
                jax_attention.mha, segment_ids=None, sm_scale=1 / math.sqrt(shape.head_dim), causal=causal
            )
        ),
        None,
    )
    mgpu_cfg = attention_mgpu.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=causal)
    # The example's SMEM scratch is declared float16, so it is fed fp16 copies of the inputs; it also applies
    # no softmax scale, so its error against cuDNN is large by construction (it is here for speed only).
    impls["jax_example_attention_mgpu(fp16)"] = (
        jax.jit(functools.partial(attention_mgpu.attention, config=mgpu_cfg)),
        jnp.float16,
    )
    return impls


def backward_impls(shape: shapes.AttentionShape, quick: bool):
    """name -> (differentiable fn(q, k, v), input dtype override or None); each is timed on vjp(do) alone."""
    causal = shape.causal
    impls = {}
    impls["cudnn"] = (functools.partial(jax.nn.dot_product_attention, is_causal=causal, implementation="cudnn"), None)
    # Mosaic GPU forward + the fused Mosaic GPU backward (flash_attention_mgpu_bwd.py).
    impls["ours_mosaic_gpu[default]"] = (functools.partial(flash_attention, causal=causal, backend="mosaic_gpu"), None)
    for cfg_name, cfg in MGPU_BWD_CONFIGS.items():
        impls[f"ours_mosaic_gpu[{cfg_name}]"] = (_mgpu_kernel_vjp(shape, cfg), None)
    configs = {"dq64x64_dkv64x64_w4s2": BWD_CONFIGS["dq64x64_dkv64x64_w4s2"]} if quick else BWD_CONFIGS
    for cfg_name, cfg in configs.items():
        impls[f"ours_triton[{cfg_name}]"] = (
            functools.partial(flash_attention, causal=causal, backend="triton", block_sizes=cfg),
            None,
        )
    if not causal:  # the example's backward raises NotImplementedError for causal
        from jax.experimental.pallas.ops.gpu import attention_mgpu  # noqa: PLC0415

        for wgs in (1, 2):
            cfg = attention_mgpu.TuningConfig(
                block_q=64,
                block_kv=128,
                max_concurrent_steps=2,
                causal=False,
                compute_wgs_bwd=wgs,
                block_q_dkv=64,
                block_kv_dkv=64,
                block_q_dq=64,
                block_kv_dq=64,
            )
            impls[f"jax_example_attention_mgpu(fp16)[bwd_wgs{wgs}]"] = (
                functools.partial(attention_mgpu.attention, config=cfg),
                jnp.float16,
            )
    return impls


def _mgpu_kernel_vjp(shape: shapes.AttentionShape, cfg):
    """Mosaic GPU forward + backward kernels called directly (unpadded bench shapes), with a bwd config."""
    st = KernelStatic(
        causal=shape.causal,
        sm_scale=1 / math.sqrt(shape.head_dim),
        sliding_window=None,
        logits_soft_cap=None,
        q_len=shape.q_len,
        kv_len=shape.kv_len,
        has_segments=False,
        blocks=BlockSizes(),
        interpret=False,
        static_q_offset=0,
    )

    @jax.custom_vjp
    def attn(q, k, v):
        return mgpu_forward(q, k, v, st)[0]

    def fwd(q, k, v):
        o, lse = mgpu_forward(q, k, v, st)
        return o, (q, k, v, o, lse)

    def bwd(res, do):
        q, k, v, o, lse = res
        return mgpu_bwd.backward(q, k, v, o, lse, do, jnp.zeros_like(lse), st, cfg)

    attn.defvjp(fwd, bwd)
    return attn


def run_shape(shape, rows, quick: bool, with_backward: bool, mgpu: bool):
    q, k, v = shape.make_inputs(seed=hash(shape.name) % 1000)
    ref = None
    for name, (fn, dtype) in forward_impls(shape, quick, mgpu).items():
        args = (q, k, v) if dtype is None else tuple(x.astype(dtype) for x in (q, k, v))
        row = dict(shape=shape.name, impl=name, pass_="fwd")
        try:
            out = fn(*args)
            if name == "cudnn":
                ref = out
            seconds = time_fn(fn, *args)
            row.update(
                ms=seconds * 1e3,
                tflops=shape.forward_flops() / seconds / 1e12,
                rel_err_vs_cudnn=None if ref is None else _rel_err(out, ref),
            )
        except Exception as err:  # noqa: BLE001 - a failing contender is recorded, not fatal
            row.update(error=f"{type(err).__name__}: {str(err)[:300]}")
        rows.append(row)
        print_row(row)
    if not with_backward:
        return
    run_backward(shape, rows, quick, (q, k, v))


def run_backward(shape, rows, quick: bool, qkv):
    """Times vjp(do) of every backward contender; errors of dq/dk/dv are relative to cuDNN's gradients."""
    do = jax.random.normal(jax.random.key(7), qkv[0].shape, qkv[0].dtype)
    ref = None
    for name, (fn, dtype) in backward_impls(shape, quick).items():
        row = dict(shape=shape.name, impl=name, pass_="bwd")
        args = qkv if dtype is None else tuple(x.astype(dtype) for x in qkv)
        try:
            _, vjp = jax.jit(lambda q, k, v, fn=fn: jax.vjp(fn, q, k, v))(*args)
            bwd = jax.jit(lambda vjp, do: vjp(do))
            grads = bwd(vjp, do.astype(args[0].dtype))
            if name == "cudnn":
                ref = grads
            seconds = time_fn(bwd, vjp, do.astype(args[0].dtype), iters=5, reps=3)
            row.update(ms=seconds * 1e3, tflops=shape.backward_flops() / seconds / 1e12)
            if ref is not None:
                row["rel_err_vs_cudnn"] = max(_rel_err(g, r) for g, r in zip(grads, ref))
        except Exception as err:  # noqa: BLE001
            row.update(error=f"{type(err).__name__}: {str(err)[:300]}")
        rows.append(row)
        print_row(row)


def print_row(row):
    if "error" in row:
        print(f"{row['shape']:<28} {row['pass_']:<4} {row['impl']:<36} ERROR {row['error'][:150]}", flush=True)
        return
    err = row.get("rel_err_vs_cudnn")
    err_s = "" if err is None else f"  err_vs_cudnn={err:.2e}"
    print(
        f"{row['shape']:<28} {row['pass_']:<4} {row['impl']:<36} {row['ms']:9.3f} ms {row['tflops']:7.1f} TFLOP/s"
        f"{err_s}",
        flush=True,
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="one config of ours per pass")
    parser.add_argument("--no-backward", action="store_true")
    parser.add_argument("--no-mgpu", action="store_true", help="skip our Mosaic GPU kernel")
    parser.add_argument("--only-backward", action="store_true", help="backward rows of the B4 shapes only")
    parser.add_argument("--json", default="flash.json", help="file name written under $OUT")
    args = parser.parse_args()
    print(jax.devices(), flush=True)
    rows = []
    for shape in shapes.BENCH_FLASH:
        with_backward = not args.no_backward and shape.batch == 4
        try:
            if args.only_backward:
                if with_backward:
                    run_backward(shape, rows, args.quick, shape.make_inputs(seed=hash(shape.name) % 1000))
            else:
                run_shape(shape, rows, args.quick, with_backward, not args.no_mgpu)
        except Exception:  # noqa: BLE001 - keep the other shapes' numbers
            traceback.print_exc()
    print("\n=== summary (best of ours vs cuDNN) ===")
    for shape in shapes.BENCH_FLASH:
        for pass_ in ("fwd", "bwd"):
            ok = [r for r in rows if r["shape"] == shape.name and r["pass_"] == pass_ and "tflops" in r]
            ours = [r for r in ok if r["impl"].startswith("ours")]
            cudnn = [r for r in ok if r["impl"] == "cudnn"]
            if ours and cudnn:
                best = max(ours, key=lambda r: r["tflops"])
                print(
                    f"{shape.name:<28} {pass_}: ours {best['tflops']:6.1f} ({best['impl']}) "
                    f"cudnn {cudnn[0]['tflops']:6.1f}  ratio {best['tflops'] / cudnn[0]['tflops']:.2f}"
                )
    result = dict(
        date=datetime.date.today().isoformat(), device=str(jax.devices()[0].device_kind), jax=jax.__version__, rows=rows
    )
    path = os.path.join(os.environ.get("OUT", "."), args.json)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
