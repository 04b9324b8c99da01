"""Weight-streaming matmul benchmark: weight bytes per second on the Llama-3-8B layer shapes, ours beside XLA and torch.

    PYTHONPATH=. python3 benchmarks/quantized_matmul.py --out $OUT/qmm.json [--sweep] [--check] [--budget_s 240]

Every timed call streams C copies of the weight (C * bytes >= 160 MB, C <= 48; the L2 is 60 MB) inside one jitted
function, so each matmul reads its weight from HBM; time per matmul = median time of the call / C. Bytes are the
stored bytes of the weight (values + scales + zero points). `--check` first compares the kernel with its reference
on odd and real shapes; `--sweep` tries tile configurations per (format, shape, M) and keeps the fastest.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.timing import median_seconds  # noqa: E402
from pallas_kernels import quantized_matmul as qmm  # noqa: E402

SHAPES = ((4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096))  # (K, N) = (in, out)
# name -> (fmt, group_size, asymmetric, per-tensor fp8 scale)
FORMATS = {
    "bf16": ("bf16", 0, False, False),
    "int8": ("int8", 0, False, False),
    "fp8": ("fp8", 0, False, False),
    "fp8_tensor": ("fp8", 0, False, True),
    "int4_g128": ("int4", 128, False, False),
    "int4_g128_asym": ("int4", 128, True, False),
    "int4_g64": ("int4", 64, False, False),
    "int4_g32_asym": ("int4", 32, True, False),
}
C = qmm.QuantizedMatmulConfig
DENSE_CANDIDATES = (
    C(128, 128, 128),
    C(64, 64, 128),
    C(64, 128, 256, num_warps=8, num_stages=3),
    C(64, 256, 64, num_warps=8),
    C(64, 64, 256, num_stages=3),
    C(64, 128, 64, num_stages=6),
    # untried on a GPU so far: more bytes in flight per program for the 1-byte formats (the first run's int8 / fp8
    # streamed at about half of bf16's rate with the same tile, i.e. like a latency-bound loop)
    C(64, 128, 512, num_warps=8, num_stages=3),
    C(64, 128, 256, prefetch=True),
    C(64, 64, 512, num_warps=8, prefetch=True),
)
INT4_CANDIDATES = (
    C(64, 128, 256),
    C(64, 128, 512),
    C(64, 64, 512),
    C(64, 256, 256, num_warps=8),
    C(64, 128, 1024, num_warps=8, num_stages=3),
    C(64, 64, 256, num_stages=6),
    C(64, 128, 512, prefetch=True),
    C(64, 128, 1024, num_warps=8, prefetch=True),
)
COPY_BYTES = 160 << 20
INTERPRET = False  # --smoke: tiny shapes through the interpreter (a CPU check of this script)


def make_weight(fmt_name: str, k: int, n: int, key):
    """Random stored weight (values, scales, zeros) of a format, built on device."""
    fmt, g, asym, per_tensor = FORMATS[fmt_name]
    kv, ks, kz = jax.random.split(key, 3)
    if fmt == "bf16":
        return jax.random.normal(kv, (k, n), jnp.bfloat16), None, None
    if fmt == "int8":
        return jax.random.randint(kv, (k, n), -127, 128, jnp.int32).astype(jnp.int8), jnp.full((n,), 0.01), None
    if fmt == "fp8":
        scale = jnp.float32(0.01) if per_tensor else jnp.full((n,), 0.01)
        return jax.random.normal(kv, (k, n), jnp.float32).astype(jnp.float8_e4m3fn), scale, None
    values = jax.random.randint(kv, (k // 2, n), 0, 256, jnp.int32).astype(jnp.uint8)
    scales = jax.random.uniform(ks, (k // g, n), jnp.float32, 0.005, 0.02)
    zeros = jax.random.randint(kz, (k // g, n), 0, 16, jnp.int32).astype(jnp.float32) if asym else None
    return values, scales, zeros


def nbytes(w) -> int:
    return sum(int(a.size * a.dtype.itemsize) for a in w if a is not None)


def stream_seconds(one_call, x, weights) -> float:
    """Seconds per matmul, streaming every copy in `weights` once per timed call."""
    fn = jax.jit(lambda x, ws: [one_call(x, w) for w in ws])
    return median_seconds(fn, x, weights, iters=3, reps=5) / len(weights)


def ours(fmt_name, config):
    fmt, g, _, _ = FORMATS[fmt_name]
    return lambda x, w: qmm._kernel_jit(x, *w, fmt=fmt, group_size=g, config=config, interpret=INTERPRET)


def xla_calls():
    """XLA's own paths: bf16 dot, int8 upcast-then-dot, fp8 x fp8 dot."""

    def bf16(x, w):
        return jnp.dot(x, w[0], preferred_element_type=jnp.float32).astype(x.dtype)

    def int8(x, w):
        return (jnp.dot(x, w[0].astype(x.dtype), preferred_element_type=jnp.float32) * w[1]).astype(x.dtype)

    def fp8(x, w):
        out = jnp.dot(x.astype(jnp.float8_e4m3fn), w[0], preferred_element_type=jnp.float32)
        return (out * w[1]).astype(x.dtype)

    return {"xla_bf16": ("bf16", bf16), "xla_int8_upcast": ("int8", int8), "xla_fp8": ("fp8", fp8)}


def copies_for(w) -> int:
    return copies_for_bytes(nbytes(w))


def copies_for_bytes(weight_bytes: int) -> int:
    """Copies of a weight that one timed call streams: >= COPY_BYTES in all (past the L2), between 2 and 48."""
    return max(2, min(48, math.ceil(COPY_BYTES / weight_bytes)))


def weights_for(fmt_name, k, n, seed=0):
    first = make_weight(fmt_name, k, n, jax.random.key(seed))
    return [first] + [make_weight(fmt_name, k, n, jax.random.key(seed + i)) for i in range(1, copies_for(first))]


def check(out_rows):
    """Kernel vs reference on odd and real shapes; norm-relative error per case."""
    small = C(16, 32, 64, num_splits=3)
    cases = [
        (1, 4096, 1024, C()),
        (3, 384, 333, small),
        (17, 256, 100, C()),
        (64, 4096, 4096, C()),
        (256, 1024, 512, C()),
        (5, 192, 96, small),
    ]
    worst = 0.0
    for m, k, n, config in cases:
        x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
        for name in ("bf16", "int8", "fp8", "fp8_tensor", "int4_g128", "int4_g32_asym"):
            fmt, g, _, _ = FORMATS[name]
            if fmt == "int4" and k % g:
                continue
            w = make_weight(name, k, n, jax.random.key(k + n))
            try:
                got = qmm._kernel_jit(x, *w, fmt=fmt, group_size=g, config=config, interpret=INTERPRET)
            except Exception as e:  # record and go on: one format failing to compile must not hide the others
                out_rows.append(dict(m=m, k=k, n=n, fmt=name, error=f"{type(e).__name__}: {str(e)[:300]}"))
                print(f"check {name} {m}x{k}x{n}: {out_rows[-1]['error']}", flush=True)
                worst = 1e9
                continue
            ref = qmm.reference(x, *w, fmt=fmt, group_size=g)
            d = np.asarray(got, np.float32) - np.asarray(ref, np.float32)
            err = float(np.linalg.norm(d) / np.linalg.norm(np.asarray(ref, np.float32)))
            worst = max(worst, err if np.isfinite(err) else 1e9)
            out_rows.append(dict(m=m, k=k, n=n, fmt=name, config=dataclasses.asdict(config), rel_err=err))
    print(f"check: {len(out_rows)} cases, worst norm-relative error {worst:.2e}", flush=True)
    return worst


def sweep_case(fmt_name, k, n, m, deadline, candidates):
    """Fastest config for one case; returns (config, seconds, tried)."""
    weights = weights_for(fmt_name, k, n)
    x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
    tried = []
    for config in candidates:
        if time.time() > deadline and tried:
            break
        try:
            tried.append((config, stream_seconds(ours(fmt_name, config), x, weights)))
        except Exception as e:  # a config Triton rejects (shared memory, registers) is skipped, not fatal
            print(f"  {fmt_name} {k}x{n} m{m} {config}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    if not tried:
        return None, float("inf"), [], nbytes(weights[0])
    best = min(tried, key=lambda t: t[1])
    p = qmm.plan(m, k, n, FORMATS[fmt_name][0], FORMATS[fmt_name][1], best[0])
    for splits in sorted({max(1, p.num_splits // 2), p.num_splits * 2} - {p.num_splits}):
        if time.time() > deadline:
            break
        config = dataclasses.replace(best[0], num_splits=splits)
        tried.append((config, stream_seconds(ours(fmt_name, config), x, weights)))
    best = min(tried, key=lambda t: t[1])
    return best[0], best[1], [(dataclasses.asdict(c), s) for c, s in tried], nbytes(weights[0])


def torch_stream_seconds(call, ws) -> float:
    """Seconds per call(w) over the weight copies `ws`, with CUDA events: median of 5 x 3 passes (torch)."""
    import torch

    for w in ws:
        call(w)
    torch.cuda.synchronize()
    samples = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            for w in ws:
                call(w)
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / (3 * len(ws)))
    return float(np.median(samples))


def torch_rows(rows):
    """cuBLAS bf16 and cuBLASLt fp8 (_scaled_mm) through torch, same streaming rule."""
    try:
        import torch
    except ImportError:
        print("torch not installed: no cuBLAS rows", flush=True)
        return
    for k, n in SHAPES:
        for m in (1, 64):
            for name in ("torch_bf16", "torch_scaled_mm_fp8"):
                per = k * n * (2 if name == "torch_bf16" else 1)
                copies = max(2, min(48, math.ceil(COPY_BYTES / per)))
                mp = max(16, m) if name != "torch_bf16" else m
                x = torch.randn(mp, k, device="cuda", dtype=torch.bfloat16)
                one = torch.tensor(1.0, device="cuda")
                if name == "torch_bf16":
                    ws = [torch.randn(k, n, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
                    call = lambda w, x=x: x @ w  # noqa: E731
                else:
                    xf = x.to(torch.float8_e4m3fn)
                    ws = [torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn).t() for _ in range(copies)]
                    call = lambda w, a=xf, s=one: torch._scaled_mm(a, w, scale_a=s, scale_b=s, out_dtype=torch.bfloat16)  # noqa: E731
                sec = torch_stream_seconds(call, ws)
                rows.append(dict(impl=name, k=k, n=n, m=m, seconds=sec, bytes=per, tb_s=per / sec / 1e12))
                del ws


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/quantized_matmul.json")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--budget_s", type=float, default=240.0)
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--shapes", default="", help="KxN list, e.g. 4096x14336 (default: the four 8B shapes)")
    parser.add_argument("--skip_peers", action="store_true", help="no XLA / torch rows (a tuning run)")
    args = parser.parse_args(argv)
    global SHAPES, INTERPRET, COPY_BYTES
    if args.shapes:
        SHAPES = tuple(tuple(int(v) for v in s.split("x")) for s in args.shapes.split(","))
    if args.smoke:
        SHAPES, INTERPRET, COPY_BYTES = ((256, 128),), True, 1 << 16
    t0 = time.time()
    result = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__, rows=[], check=[], sweep=[])
    if args.check:
        result["worst_rel_err"] = check(result["check"])
    for impl, (fmt_name, call) in ({} if args.skip_peers else xla_calls()).items():
        for k, n in SHAPES:
            for m in (1, 64):
                weights = weights_for(fmt_name, k, n)
                x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
                sec = stream_seconds(call, x, weights)
                b = nbytes(weights[0])
                result["rows"].append(
                    dict(impl=impl, fmt=fmt_name, k=k, n=n, m=m, seconds=sec, bytes=b, tb_s=b / sec / 1e12)
                )
                print(f"{impl:22s} {k:5d}x{n:<5d} M={m:<3d} {b / sec / 1e12:.2f} TB/s", flush=True)
    if not args.skip_peers:
        torch_rows(result["rows"])
    dump(args.out, result)
    cases = [(f, k, n, m) for f in args.formats.split(",") for k, n in SHAPES for m in (1, 64)]
    best = {}
    for case in cases:  # pass 1: the default config everywhere, so the table is complete whatever the budget
        config, sec, tried, b = sweep_case(*case, 0, candidates_for(case[0])[:1])
        best[case] = (config, sec, b, tried)
        print_case("default", case, b / sec / 1e12, config)
    dump(args.out, result | dict(rows=result["rows"] + rows_of(best)))
    deadline = t0 + args.budget_s
    for i, case in enumerate(cases if args.sweep else []):  # pass 2: the other candidates, in the time left
        if time.time() > deadline:
            break
        case_deadline = time.time() + (deadline - time.time()) / (len(cases) - i)
        config, sec, tried, b = sweep_case(*case, case_deadline, candidates_for(case[0])[1:])
        tried = best[case][3] + tried
        if sec < best[case][1]:
            best[case] = (config, sec, b, tried)
        else:
            best[case] = best[case][:3] + (tried,)
        print_case(f"sweep({len(tried)})", case, b / best[case][1] / 1e12, best[case][0])
    result["sweep"] = [dict(fmt=c[0], k=c[1], n=c[2], m=c[3], tried=v[3]) for c, v in best.items()]
    result["rows"] += rows_of(best)
    result["elapsed_s"] = time.time() - t0
    dump(args.out, result)
    print_table(result["rows"])


def candidates_for(fmt_name):
    return INT4_CANDIDATES if FORMATS[fmt_name][0] == "int4" else DENSE_CANDIDATES


def rows_of(best, impl: str = "ours"):
    """JSON rows of the best config per case: {(fmt, k, n, m): (config, seconds, bytes, _)}."""
    return [
        dict(
            impl=impl,
            fmt=c[0],
            k=c[1],
            n=c[2],
            m=c[3],
            seconds=sec,
            bytes=b,
            tb_s=b / sec / 1e12,
            config=dataclasses.asdict(config),
        )
        for c, (config, sec, b, _) in best.items()
    ]


def print_case(tag, case, tb_s, config):
    fmt_name, k, n, m = case
    print(f"ours {tag:10s} {fmt_name:15s} {k:5d}x{n:<5d} M={m:<3d} {tb_s:.2f} TB/s  {config}", flush=True)


def dump(path, result):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def print_table(rows):
    impls = sorted({r["impl"] + ("" if r["impl"] != "ours" else ":" + r["fmt"]) for r in rows})
    print(f"{'impl':28s}" + "".join(f"{k}x{n} M={m:<3d}".rjust(17) for k, n in SHAPES for m in (1, 64)))
    for impl in impls:
        cells = []
        for k, n in SHAPES:
            for m in (1, 64):
                hit = [
                    r
                    for r in rows
                    if (r["impl"] + ("" if r["impl"] != "ours" else ":" + r["fmt"])) == impl
                    and (r["k"], r["n"], r["m"]) == (k, n, m)
                ]
                cells.append(f"{hit[0]['tb_s']:.2f}".rjust(17) if hit else "-".rjust(17))
        print(f"{impl:28s}" + "".join(cells))


if __name__ == "__main__":
    sys.exit(main())
