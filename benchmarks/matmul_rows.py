"""Which matmul path wins at which row count: model/quant.py's `matmul` (the engine's door) against each path it
could take, for quantised weights at the Llama-3-8B layer shapes, M from decode's 1 row to a prefill chunk's 8,192.
The crossovers of `quant.MatmulOptions` (DEFAULT_OPTIONS) come from this table.

    PYTHONPATH=. python3 benchmarks/matmul_rows.py --out $OUT/matmul_rows.json [--rows 1,64,128,256,512,2048,8192]
        [--formats int8,fp8,int4,w8a8_fp8] [--paths bf16,engine,legacy,gemv,stream,kernel,xla_dequant]

    bf16         XLA's dot on a bf16 weight (the peer every format must beat)
    engine       quant.matmul as the engine calls it: the weight in quant.decode_layout's layout (8-bit per-channel
                 weights [N, K] on Hopper, one copy), DEFAULT_OPTIONS' crossovers
    legacy       quant.matmul on the [K, N] weight with quant.LEGACY_OPTIONS (the paths before one layout served
                 every row count: Triton kernel to 16 / 64 rows for int8 / fp8, XLA's dequantise-then-dot above)
    gemv         the GEMV on the weight's decode layout (gemv.py [K, N] or gemv_nk.py [N, K]; <= 4 rows)
    stream       pallas_kernels/stream_matmul_mgpu.py (<= 256 rows): the [N, K] weight as stored, or for int4 the
                 `with_stream_layout` copy
    kernel       pallas_kernels/quantized_matmul.py on the [K, N] weight (Triton: dequantise in registers, tensor cores)
    xla_dequant  dequantise to bf16, XLA dot
    w8a8         the fp8 tensor-core kernel with its activation quantiser (w8a8_fp8 only)
    xla_fp8      XLA's own fp8 x fp8 dot, x cast to e4m3 (fp8 formats)

Timing is benchmarks/quantized_matmul.py's: C copies of the weight (C x bytes >= 160 MB) per timed call, so each
matmul reads HBM; per case: microseconds, weight TB/s (stored bytes) and TFLOP/s. `--smoke` runs tiny shapes on a
CPU (XLA paths only; a check of the script). The JSON is rewritten after every case.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.quantized_matmul import copies_for_bytes  # noqa: E402
from benchmarks.timing import median_seconds  # noqa: E402
from model import quant  # noqa: E402
from model import quant_methods as qm  # noqa: E402
from serving.engine.quantize import quantize_weight  # noqa: E402

SHAPES = ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096))  # (K, N): fused qkv, o, fused gate|up, down
FORMATS = ("fp8", "w8a8_fp8", "int8", "int4")
PATHS = ("bf16", "engine", "legacy", "gemv", "stream", "kernel", "xla_dequant", "w8a8", "xla_fp8", "gemv_sweep")
PATHS += ("kernel_sweep",)
# Candidate tiles of the sweep paths (each timed as its own path, named by its fields).
GEMV_NK_CANDIDATES = (
    dict(block_n=64, block_k=128, steps=4),
    dict(block_n=32, block_k=256, steps=4),
    dict(block_n=128, block_k=64, steps=4),
    dict(block_n=64, block_k=256, steps=2),
    dict(block_n=16, block_k=512, steps=4, num_warps=2),
)
KERNEL_CANDIDATES = (
    dict(block_m=64, block_n=128, block_k=128),
    dict(block_m=64, block_n=64, block_k=128, num_stages=3),
    dict(block_m=64, block_n=128, block_k=256, num_warps=8, num_stages=3),
    dict(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3),
    dict(block_m=64, block_n=128, block_k=128, bit_convert=True),
    dict(block_m=16, block_n=128, block_k=256),
)


def sweep_calls(path: str, fmt: str, rows: int, gpu: bool) -> dict:
    """{path name: call} of the sweep paths: the [N, K] GEMV (8-bit formats, <= 4 rows) or the Triton kernel on the
    [K, N] weight, once per candidate config (the name carries its fields)."""
    if not gpu or fmt == "w8a8_fp8":
        return {}
    name = lambda base, c: base + "[" + ",".join(f"{k}={v}" for k, v in c.items()) + "]"  # noqa: E731
    if path == "gemv_sweep" and rows <= 4 and fmt in ("int8", "fp8"):
        from pallas_kernels.gemv_nk import GemvNKConfig, gemv_nk

        def one(c):
            config = GemvNKConfig(**(dict(bit_convert=fmt == "int8") | c))
            return lambda x, wb, q, qd: gemv_nk(x, qd.values, qd.scales, fmt=fmt, config=config, backend="triton")

        return {name("gemv_nk", c): one(c) for c in GEMV_NK_CANDIDATES}
    if path == "kernel_sweep":
        from pallas_kernels.quantized_matmul import QuantizedMatmulConfig, quantized_matmul

        def one(c):
            config = QuantizedMatmulConfig(**c)
            kw = dict(fmt=fmt, config=config, backend="triton")
            return lambda x, wb, q, qd: quantized_matmul(x, q.values, q.scales, q.zeros, group_size=q.group_size, **kw)

        return {name("kernel", c): one(c) for c in KERNEL_CANDIDATES if c["block_m"] <= max(16, rows)}
    return {}


def make_weight(fmt: str, k: int, n: int, seed: int, gpu: bool):
    """(bf16 weight, its [K, N] quantised twin, the twin as the paths read it): round to nearest (the timing does not
    depend on how the scales were chosen); the third is decode_layout's for engine / gemv / stream (int4 on a GPU:
    with_stream_layout's copy beside the [K, N] values, read by the stream path only)."""
    w = jax.random.normal(jax.random.key(seed), (k, n), jnp.float32) * 0.02
    if fmt == "w8a8_fp8":
        q = quantize_weight("w8a8_fp8_rtn", w, None)  # stored [N, K], as the loader stores it
        return w.astype(jnp.bfloat16), q, q
    if fmt == "int4":
        q = qm.rtn(w, "int4", group_size=128, asymmetric=True, zero_point="float")  # quantize_weight's int4_rtn
        return w.astype(jnp.bfloat16), q, quant.with_stream_layout(q) if gpu else q
    q = qm.rtn(w, fmt)
    return w.astype(jnp.bfloat16), q, quant.decode_layout(q)


def call_for(path: str, fmt: str, rows: int, gpu: bool):
    """(x, bf16 weight, [K, N] weight, decode-layout weight) -> [rows, N] for one path, or None where it does not
    apply."""
    eight_bit = fmt in ("fp8", "int8")
    if path == "bf16":
        return lambda x, wb, q, qd: jnp.dot(x, wb, preferred_element_type=jnp.float32).astype(x.dtype)
    if path == "engine":
        return lambda x, wb, q, qd: quant.matmul(x, qd if fmt != "int4" else q)
    if path == "legacy":
        return lambda x, wb, q, qd: quant.matmul(x, q, options=quant.LEGACY_OPTIONS)
    if path == "xla_dequant":
        return lambda x, wb, q, qd: jnp.einsum(
            "mk,kn->mn", x, q.dequantize(x.dtype), preferred_element_type=jnp.float32
        ).astype(x.dtype)
    if path == "xla_fp8" and "fp8" in fmt:

        def fp8(x, wb, q, qd):
            out = jnp.einsum("mk,kn->mn", x.astype(jnp.float8_e4m3fn), q.values_kn, preferred_element_type=jnp.float32)
            return (out * q.scales).astype(x.dtype)

        return fp8
    if not gpu:
        return None
    if path == "gemv" and rows <= 4 and fmt != "w8a8_fp8":
        opts = quant.MatmulOptions(gemv_max_rows=((fmt, 4), (fmt + "_nk", 4)))
        return lambda x, wb, q, qd: quant.matmul(x, qd if eight_bit else q, options=opts)
    if path == "stream" and rows <= 256:
        from pallas_kernels.stream_matmul_mgpu import stream_matmul

        return lambda x, wb, q, qd: stream_matmul(x, qd.stream if qd.stream is not None else quant._nk_stream(qd))
    if path == "kernel" and fmt != "w8a8_fp8":
        opts = quant.MatmulOptions(gemv_max_rows=(), stream_max_rows=0, kernel_max_rows=((fmt, 1 << 30),))
        return lambda x, wb, q, qd: quant.matmul(x, q, options=opts)
    if path == "w8a8" and fmt == "w8a8_fp8":
        return lambda x, wb, q, qd: quant.w8a8_kernel_matmul(x, q, x.dtype)
    return None


def seconds(call, x, pairs) -> float:
    fn = jax.jit(lambda x, ps: [call(x, *p) for p in ps])
    return median_seconds(fn, x, pairs, iters=3, reps=5) / len(pairs)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="matmul_rows.json")
    p.add_argument("--rows", default="1,64,128,192,256,512,2048,8192")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--shapes", default="", help="KxN list (default: the four 8B layer shapes, fused as the engine)")
    p.add_argument("--budget_s", type=float, default=400.0, help="stop starting cases after this many seconds")
    p.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, XLA paths only")
    a = p.parse_args()
    for flag, given, known in (("--formats", a.formats, FORMATS), ("--paths", a.paths, PATHS)):
        if unknown := sorted(set(given.split(",")) - set(known)):
            p.error(f"{flag}: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    gpu = jax.default_backend() == "gpu"
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",") if s] or list(SHAPES)
    if a.smoke:
        shapes = [(256, 128)]
    rows_list = [int(r) for r in a.rows.split(",")]
    res = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "cases": []}
    start = time.perf_counter()
    bf16_done = set()
    for fmt in a.formats.split(","):
        for k, n in shapes:
            first = make_weight(fmt, k, n, 0, gpu)
            copies = 2 if a.smoke else copies_for_bytes(first[1].nbytes)
            pairs = [first] + [make_weight(fmt, k, n, i, gpu) for i in range(1, copies)]
            for rows in rows_list:
                x = jax.random.normal(jax.random.key(rows), (rows, k), jnp.bfloat16)
                named = []
                for path in a.paths.split(","):
                    named += list(sweep_calls(path, fmt, rows, gpu).items()) or [(path, call_for(path, fmt, rows, gpu))]
                for path, call in named:
                    if call is None or time.perf_counter() - start > a.budget_s:
                        continue
                    if path == "bf16" and (k, n, rows) in bf16_done:  # the same XLA dot for every format
                        continue
                    if path == "bf16":
                        bf16_done.add((k, n, rows))
                    try:
                        s = seconds(call, x, pairs)
                    except Exception as e:  # a path that does not lower for this shape: recorded, not fatal
                        res["cases"].append(dict(fmt=fmt, k=k, n=n, rows=rows, path=path, error=str(e)[:300]))
                        continue
                    wbytes = 2 * k * n if path == "bf16" else first[1].nbytes
                    case = dict(
                        fmt=fmt,
                        k=k,
                        n=n,
                        rows=rows,
                        path=path,
                        us=s * 1e6,
                        weight_tb_s=wbytes / s / 1e12,
                        tflop_s=2 * rows * k * n / s / 1e12,
                    )
                    res["cases"].append(case)
                    print(
                        f"matmul_rows {fmt:8s} {k}x{n} M={rows:5d} {path:12s} {s * 1e6:9.1f} us "
                        f"{case['weight_tb_s']:5.2f} TB/s {case['tflop_s']:6.1f} TFLOP/s",
                        flush=True,
                    )
                    with open(a.out, "w") as f:
                        json.dump(res, f, indent=1)
            del pairs, first
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
