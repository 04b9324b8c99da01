"""GEMV (pallas_kernels/gemv.py) benchmark: weight bytes per second at decode's M = 1..4 on the Llama-3-8B layer
shapes (the fused q|k|v and gate|up included), beside XLA's dot, the tensor-core streaming kernel
(pallas_kernels/quantized_matmul.py, default tiles) and torch/cuBLAS bf16, all in the same run.

    PYTHONPATH=. python3 benchmarks/gemv.py --out $OUT/gemv.json [--sweep] [--budget_s 300] [--rows 1,4]

Timing rule of benchmarks/quantized_matmul.py: every timed call streams C copies of the weight (C * bytes >= 160 MB,
the L2 is 60 MB), median of 5 x 3 calls, divided by C; bytes = stored values + scales + zero points. Each swept config
is checked against `reference()` before it is timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks import quantized_matmul as qb  # noqa: E402
from model import quant  # noqa: E402
from pallas_kernels import gemv as G  # noqa: E402
from pallas_kernels import quantized_matmul as qmm  # noqa: E402

SHAPES = ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (4096, 14336), (4096, 1024))
FORMATS = dict(qb.FORMATS, int8_g32=("int8", 32, False, False))  # + GGUF Q8_0's grouped int8
C = G.GemvConfig
CANDIDATES = (  # (block_n, block_k, steps, num_warps, depth / atomic); a grouped format's tile stays inside one group
    # the H100 sweep of 2026-12-06: the loops (depth > 0) lost to the unrolled programs in every format, so two stay;
    # the K chunks' partials now also meet by atomic adds (no XLA sum after the call), which favours fewer, longer
    # programs as well
    C(128, 64, 4, 4),
    C(128, 8, 16, 4),
    C(128, 16, 4, 4),
    C(128, 32, 8, 4, bit_convert=False),
    C(256, 8, 4, 4),
    C(64, 32, 4, 2),
    C(128, 64, 4, 4, atomic=True),
    C(128, 8, 16, 4, atomic=True),
    C(128, 16, 4, 4, atomic=True),
    C(128, 16, 8, 4, atomic=True),
    C(128, 32, 8, 4, bit_convert=False, atomic=True),
    C(128, 64, 8, 4, atomic=True),
    C(64, 64, 8, 4, atomic=True),
    C(128, 32, 32, 4, depth=2),
    C(128, 64, 16, 4, depth=1),
)


def make_weight(fmt_name, k, n, key):
    if fmt_name == "int8_g32":
        values, _, _ = qb.make_weight("int8", k, n, key)
        return values, jax.random.uniform(key, (k // 32, n), jnp.float32, 0.005, 0.02), None
    return qb.make_weight(fmt_name, k, n, key)


def weights_for(fmt_name, k, n, seed=0):
    first = make_weight(fmt_name, k, n, jax.random.key(seed))
    return [first] + [make_weight(fmt_name, k, n, jax.random.key(seed + i)) for i in range(1, qb.copies_for(first))]


def ours(fmt_name, config):
    fmt, g, _, _ = FORMATS[fmt_name]
    return lambda x, w: G._kernel_jit(x, *w, fmt=fmt, group_size=g, config=config, interpret=False)


def checked_seconds(fmt_name, config, x, weights):
    """Seconds per GEMV, after checking the config's output against the reference (raises if it is wrong)."""
    fmt, g, _, _ = FORMATS[fmt_name]
    got = ours(fmt_name, config)(x, weights[0])
    want = G.reference(x, *weights[0], fmt=fmt, group_size=g)
    err = float(jnp.linalg.norm((got - want).astype(jnp.float32)) / jnp.linalg.norm(want.astype(jnp.float32)))
    if not err < 1e-2:
        raise AssertionError(f"{fmt_name} {config}: rel. error {err:.3g}")
    return qb.stream_seconds(ours(fmt_name, config), x, weights)


def peers(fmt_name, k, n, m, x, weights):
    """XLA's path for the format and the tensor-core streaming kernel (default tiles), seconds per call."""
    fmt, g, _, _ = FORMATS[fmt_name]
    out = {}
    xla = qb.xla_calls()
    name = {"bf16": "xla_bf16", "int8": "xla_int8_upcast", "fp8": "xla_fp8"}.get(fmt)
    if name and not g:
        out[name] = qb.stream_seconds(xla[name][1], x, weights)
    elif fmt in ("int4", "int8"):  # XLA's dequantise-then-dot (what model.quant.matmul does without a kernel)
        out["xla_dequant"] = qb.stream_seconds(
            lambda x, w: jnp.dot(x, G.dequantize(*w, fmt=fmt, group_size=g).astype(x.dtype)), x, weights
        )
    if not g or fmt == "int4":
        for name, bits in (("qmm", False), ("qmm_bits", True)):
            if not bits or fmt in ("int8", "int4"):
                config = qmm.QuantizedMatmulConfig(bit_convert=bits)
                call = functools.partial(_qmm, fmt=fmt, group_size=g, config=config)
                out[name] = qb.stream_seconds(call, x, weights)
    return out


def _qmm(x, w, *, fmt, group_size, config):
    return qmm._kernel_jit(x, *w, fmt=fmt, group_size=group_size, config=config, interpret=False)


def torch_bf16(k, n, m):
    try:
        import torch
    except ImportError:
        return None
    per = k * n * 2
    copies = max(2, min(48, math.ceil(qb.COPY_BYTES / per)))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(k, n, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    return qb.torch_stream_seconds(lambda w: x @ w, ws)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/gemv.json")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--budget_s", type=float, default=300.0)
    parser.add_argument("--formats", default="bf16,int8,fp8,int4_g128,int4_g32_asym,int8_g32")
    parser.add_argument("--shapes", default="", help="KxN list (default: the six 8B decode shapes)")
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--sweep_shapes", default="4096x14336")
    parser.add_argument("--skip_peers", action="store_true")
    args = parser.parse_args(argv)
    shapes = SHAPES if not args.shapes else tuple(tuple(map(int, s.split("x"))) for s in args.shapes.split(","))
    sweep_shapes = {tuple(map(int, s.split("x"))) for s in args.sweep_shapes.split(",") if s}
    t0 = time.time()
    result = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__, rows=[], sweep=[], best={})
    best_config = {}
    if args.sweep:  # per format, the fastest candidate over the sweep shapes at M = 1 (sum of seconds)
        for fmt_name in args.formats.split(","):
            totals = {}
            for k, n in sorted(sweep_shapes):
                weights = weights_for(fmt_name, k, n)
                x = jax.random.normal(jax.random.key(1), (1, k), jnp.bfloat16)
                b = qb.nbytes(weights[0])
                for config in CANDIDATES + (dataclasses.replace(G.GemvConfig(), bit_convert=False),):
                    if time.time() - t0 > args.budget_s:
                        break
                    try:
                        sec = checked_seconds(fmt_name, config, x, weights)
                    except Exception as e:  # noqa: BLE001 - a config Triton rejects is skipped, not fatal
                        print(f"  {fmt_name} {k}x{n} {config}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                        continue
                    totals.setdefault(config, []).append(sec)
                    result["sweep"].append(
                        dict(fmt=fmt_name, k=k, n=n, config=dataclasses.asdict(config), tb_s=b / sec / 1e12)
                    )
                    print(f"sweep {fmt_name:14s} {k:5d}x{n:<5d} {b / sec / 1e12:.2f} TB/s  {config}", flush=True)
                del weights
            full = {c: sum(v) for c, v in totals.items() if len(v) == len(sweep_shapes)}
            if full:
                best_config[fmt_name] = min(full, key=full.get)
                print(f"best {fmt_name}: {best_config[fmt_name]}", flush=True)
                key = quant.gemv_config_key(*FORMATS[fmt_name][:2])
                result["best"].setdefault(key, dataclasses.asdict(best_config[fmt_name]))  # int4: the first swept
                qb.dump(args.out, result)
    for fmt_name in args.formats.split(","):
        config = best_config.get(fmt_name, G.GemvConfig())
        for k, n in shapes:
            weights = weights_for(fmt_name, k, n)
            b = qb.nbytes(weights[0])
            for m in map(int, args.rows.split(",")):
                x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
                row = dict(fmt=fmt_name, k=k, n=n, m=m, bytes=b, config=dataclasses.asdict(config))
                if m <= G.MAX_ROWS:
                    row["gemv"] = b / checked_seconds(fmt_name, config, x, weights) / 1e12
                if not args.skip_peers:
                    row |= {name: b / sec / 1e12 for name, sec in peers(fmt_name, k, n, m, x, weights).items()}
                    if fmt_name == "bf16":
                        sec = torch_bf16(k, n, m)
                        if sec:
                            row["torch_bf16"] = b / sec / 1e12
                result["rows"].append(row)
                cells = "  ".join(f"{key} {v:.2f}" for key, v in row.items() if isinstance(v, float))
                print(f"{fmt_name:14s} {k:5d}x{n:<5d} M={m}  TB/s: {cells}", flush=True)
            del weights
            qb.dump(args.out, result)
    result["elapsed_s"] = time.time() - t0
    qb.dump(args.out, result)


if __name__ == "__main__":
    main()
