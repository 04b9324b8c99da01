"""Which matmul path wins at which row count: model/quant.py's `matmul` (the engine's door) against each path it
could take, for 8-bit weights at the Llama-3-8B layer shapes, M from decode's 1 row to a prefill chunk's 8,192.

    PYTHONPATH=. python3 benchmarks/matmul_rows.py --out $OUT/matmul_rows.json [--rows 1,64,128,256,512,2048,8192]

The engine's fp8 throughput run (1,000 x 1,000, max_num_seqs 256) spends its steps at 256 decode rows and in mixed
steps of up to 8,192 tokens; this says what each of those costs per path, in the same run as the bf16 peer:

    bf16         XLA's dot on a bf16 weight (the peer the fp8 goal must beat)
    engine       quant.matmul as the engine calls it (fp8 W8A16 with the streaming layout; w8a8_fp8 stored [N, K])
    xla_dequant  the fallback above the streaming kernel's 256 rows: dequantise to bf16, XLA dot
    stream       pallas_kernels/stream_matmul_mgpu.py alone (<= 256 rows)
    w8a8         the fp8 tensor-core kernel with its activation quantiser (w8a8_fp8 only; the engine takes it from
                 quant.W8A8_MIN_ROWS rows)
    xla_fp8      XLA's own fp8 x fp8 dot, x cast to e4m3 (what XLA does with fp8 operands)

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
FORMATS = ("fp8", "w8a8_fp8")
PATHS = ("bf16", "engine", "xla_dequant", "stream", "w8a8", "xla_fp8")


def make_weight(fmt: str, k: int, n: int, seed: int, gpu: bool):
    """A bf16 weight and its fp8 twin as the engine stores it for `fmt` (see the module docstring): round to
    nearest (the timing does not depend on how the scales were chosen)."""
    w = jax.random.normal(jax.random.key(seed), (k, n), jnp.float32) * 0.02
    if fmt == "fp8":
        q = qm.rtn(w, "fp8")
        q = quant.with_stream_layout(q) if gpu else q
    else:
        q = quantize_weight("w8a8_fp8_rtn", w, None)  # stored [N, K], as the loader stores it
    return w.astype(jnp.bfloat16), q


def call_for(path: str, fmt: str, rows: int, gpu: bool):
    """(x, bf16 weight, QuantizedArray) -> [rows, N] for one path, or None where the path does not apply."""
    if path == "bf16":
        return lambda x, wb, q: jnp.dot(x, wb, preferred_element_type=jnp.float32).astype(x.dtype)
    if path == "engine":
        return lambda x, wb, q: quant.matmul(x, q)
    if path == "xla_dequant":
        return lambda x, wb, q: jnp.einsum(
            "mk,kn->mn", x, q.dequantize(x.dtype), preferred_element_type=jnp.float32
        ).astype(x.dtype)
    if path == "xla_fp8":

        def fp8(x, wb, q):
            out = jnp.einsum("mk,kn->mn", x.astype(jnp.float8_e4m3fn), q.values_kn, preferred_element_type=jnp.float32)
            return (out * q.scales).astype(x.dtype)

        return fp8
    if not gpu:
        return None
    if path == "stream" and rows <= 256:
        from pallas_kernels.stream_matmul_mgpu import stream_matmul

        return lambda x, wb, q: stream_matmul(x, q.stream if q.stream is not None else quant._nk_stream(q))
    if path == "w8a8" and fmt == "w8a8_fp8":
        return lambda x, wb, q: quant._w8a8_kernel_matmul(x, q, x.dtype)
    return None


def seconds(call, x, pairs) -> float:
    fn = jax.jit(lambda x, ps: [call(x, wb, q) for wb, q in ps])
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
    for fmt in a.formats.split(","):
        for k, n in shapes:
            first = make_weight(fmt, k, n, 0, gpu)
            copies = 2 if a.smoke else copies_for_bytes(first[1].nbytes)
            pairs = [first] + [make_weight(fmt, k, n, i, gpu) for i in range(1, copies)]
            for rows in rows_list:
                x = jax.random.normal(jax.random.key(rows), (rows, k), jnp.bfloat16)
                for path in a.paths.split(","):
                    call = call_for(path, fmt, rows, gpu)
                    if call is None or time.perf_counter() - start > a.budget_s:
                        continue
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
