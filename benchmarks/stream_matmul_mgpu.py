"""Mosaic GPU streaming matmul (pallas_kernels/stream_matmul_mgpu.py) beside the Triton kernel, XLA and cuBLAS.

    PYTHONPATH=. python3 benchmarks/stream_matmul_mgpu.py --out $OUT/stream_matmul_mgpu.json [--budget_s 220]

Order (the JSON is rewritten after every case, so a run cut short keeps what it measured):
    1. check: the new kernel against quantized_matmul.reference on real and odd shapes, every format, A handed to
       wgmma from registers; a format whose register path fails (compile or error) is retried with A through
       SMEM (`a_via_smem`) and timed that way.
    2. the new kernel, default config, every format x the four Llama-3-8B layer shapes x M = 1, 64.
    3. peers in the same run: XLA bf16 dot, torch cuBLAS bf16 (and cuBLASLt fp8), then the Triton kernel (default
       tiles, --triton_formats) while the budget lasts.
    4. a config sweep of the new kernel in the time left of --budget_s (tile_k, ring depth, K splits, x multicast
       cluster, rows per warpgroup, A path, int4 dequantise / wgmma overlap); every timed config, the defaults of
       stage 2 included, is first checked against the reference on the case's first weight copy.
Timing rule, weight bytes and formats are benchmarks/quantized_matmul.py's (C copies of the weight >= 160 MB per
timed call, so every matmul reads HBM; bytes = the stored values + scales + zero points in the model's layout).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import quantized_matmul as qbench  # noqa: E402
from pallas_kernels import quantized_matmul as qmm  # noqa: E402
from pallas_kernels import stream_matmul_mgpu as sm  # noqa: E402

FORMAT_NAMES = ("bf16", "int8", "fp8", "int4_g128", "int4_g32_asym")
S = sm.StreamConfig
CANDIDATES = {  # tried after the default (auto tile_k: 256 bytes of weight a row), in this order, while time is left
    "dense": (S(tile_k=128, max_concurrent_steps=6), S(tile_k=256, max_concurrent_steps=6), S(64, 8), S(0, 3)),
    "int4": (S(tile_k=256, max_concurrent_steps=6), S(tile_k=512, max_concurrent_steps=3), S(128, 8)),
}
CHECK_CASES = ((1, 4096, 4096), (64, 4096, 1024), (17, 384, 200))  # K a multiple of every group


def stream_weights(fmt_name, k, n):
    """C prepared copies (the kernel's layout) and the stored bytes of one copy in the model's layout."""
    fmt, g, _, _ = qbench.FORMATS[fmt_name]
    raw = qbench.weights_for(fmt_name, k, n)
    nbytes = qbench.nbytes(raw[0])
    prepared = [sm.prepare(*w, fmt=fmt, group_size=g) for w in raw]
    del raw
    return prepared, nbytes


def ours(config, interpret):
    num_sms = 4 if interpret is not None else sm._num_sms()
    return lambda x, w: sm._stream_jit(x, w, config=config, interpret=interpret, num_sms=num_sms)


def check(rows, formats, interpret):
    """Kernel vs reference per format; returns {format: a_via_smem} for the formats that pass (None: failed)."""
    mode = {}
    for name in formats:
        fmt, g, _, _ = qbench.FORMATS[name]
        for via_smem in (False, True):
            worst, failed = 0.0, False
            for m, k, n in CHECK_CASES:
                w = qbench.make_weight(name, k, n, jax.random.key(k + n))
                x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
                row = dict(fmt=name, m=m, k=k, n=n, a_via_smem=via_smem)
                try:
                    got = ours(S(a_via_smem=via_smem), interpret)(x, sm.prepare(*w, fmt=fmt, group_size=g))
                    ref = np.asarray(qmm.reference(x, *w, fmt=fmt, group_size=g), np.float32)
                    err = float(np.linalg.norm(np.asarray(got, np.float32) - ref) / np.linalg.norm(ref))
                    row["rel_err"] = err if np.isfinite(err) else 1e9
                    failed |= not row["rel_err"] < 1e-2
                    worst = max(worst, row["rel_err"])
                except Exception as e:  # record and go on: one path failing must not hide the others
                    row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
                    failed = True
                rows.append(row)
                print(f"check {name:14s} M={m:<3d} {k}x{n} smem={via_smem}: {row.get('rel_err', row.get('error'))}")
                if failed:
                    break
            if not failed:
                mode[name] = via_smem
                break
        mode.setdefault(name, None)
        print(f"check {name}: {'FAILED both A paths' if mode[name] is None else f'ok, a_via_smem={mode[name]}'}")
    return mode


def time_case(fmt_name, k, n, m, configs, deadline, interpret):
    """[(config, seconds)] of the configs that ran and matched the reference, stopping at the deadline once one has."""
    weights, nbytes = stream_weights(fmt_name, k, n)
    x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
    tried = []
    want = np.asarray(sm.stream_reference(x, weights[0]), np.float32)
    for config in configs:
        if tried and time.time() > deadline:
            break
        try:  # _validate first: a config over the SMEM budget fails in microseconds, not after a compile
            sm._validate(x, weights[0], config, 4 if interpret is not None else sm._num_sms())
            got = np.asarray(ours(config, interpret)(x, weights[0]), np.float32)
            err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
            if not err < 1e-2:  # every timed config is checked: the sweep must not pick a wrong kernel
                raise ValueError(f"wrong result: norm-relative error {err:.3g}")
            tried.append((config, qbench.stream_seconds(ours(config, interpret), x, weights)))
        except Exception as e:  # a config over the SMEM or register budget is skipped, not fatal
            print(f"  {fmt_name} {k}x{n} M={m} {config}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    return tried, nbytes


def sweep_configs(fmt_name, best: sm.StreamConfig, m, k, n):
    """The candidates around a best config: other tiles / depths, K splits around the auto choice, the other A path."""
    kind = "int4" if fmt_name.startswith("int4") else "dense"
    out = [dataclasses.replace(c, a_via_smem=best.a_via_smem) for c in CANDIDATES[kind]]
    fmt, g, asym, _ = qbench.FORMATS[fmt_name]
    shape = (-(-n // sm.N_ALIGN) * sm.N_ALIGN, -(-k // sm.K_ALIGN) * sm.K_ALIGN)
    like = sm.StreamWeight(jax.ShapeDtypeStruct(shape, jnp.int8), None, None, fmt, g, k, n)  # plan() reads shapes only
    auto = sm.plan(m, like, best, sm._num_sms()).splits
    out += [dataclasses.replace(best, num_splits=s) for s in sorted({1, max(1, auto // 2), auto * 2} - {auto})]
    if m > 16:  # x multicast to a cluster of N-neighbour CTAs: x re-read from L2 costs most at large M
        out += [dataclasses.replace(best, cluster=c) for c in (2, 4)]
    out.append(dataclasses.replace(best, wg_rows=64 if 32 <= m <= 128 and fmt != "int4" else 128))  # the other one
    if fmt == "int4" and not best.a_via_smem:
        out.insert(0, dataclasses.replace(best, overlap=True))
    if fmt in ("int8", "fp8") and not best.a_via_smem:  # the conversion paths behind flags, first: untimed so far
        flags = (dict(upcast_load=True), dict(overlap=True), dict(upcast_load=True, overlap=True))
        out[:0] = [dataclasses.replace(best, **f) for f in flags]
    out.append(dataclasses.replace(best, a_via_smem=not best.a_via_smem))
    return [c for c in out if c != best]


def print_table(rows, shapes):
    impls = sorted({(r["impl"], r["fmt"]) for r in rows})
    print(f"{'impl':28s}" + "".join(f"{k}x{n} M={m:<3d}".rjust(17) for k, n in shapes for m in (1, 64)))
    for impl, fmt in impls:
        cells = []
        for k, n in shapes:
            for m in (1, 64):
                hit = [r for r in rows if (r["impl"], r["fmt"], r["k"], r["n"], r["m"]) == (impl, fmt, k, n, m)]
                cells.append(f"{hit[0]['tb_s']:.2f}".rjust(17) if hit else "-".rjust(17))
        print(f"{impl + ':' + fmt:28s}" + "".join(cells))


def peer_rows(formats, shapes, deadline, dump):
    """XLA bf16 and torch (cuBLAS bf16, cuBLASLt fp8) on every case, then the Triton kernel while time is left."""
    peers = []
    for k, n in shapes:
        for m in (1, 64):
            weights = qbench.weights_for("bf16", k, n)
            x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
            sec = qbench.stream_seconds(qbench.xla_calls()["xla_bf16"][1], x, weights)
            b = qbench.nbytes(weights[0])
            peers.append(dict(impl="xla", fmt="bf16", k=k, n=n, m=m, seconds=sec, bytes=b, tb_s=b / sec / 1e12))
    qbench.torch_rows(peers)  # rows without a fmt: name it from the impl
    for r in peers:
        r.setdefault("fmt", "fp8" if "fp8" in r["impl"] else "bf16")
    dump(peers)
    for name in formats:
        for k, n in shapes:
            for m in (1, 64):
                if time.time() > deadline:
                    return peers
                weights = qbench.weights_for(name, k, n)
                x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
                try:
                    sec = qbench.stream_seconds(qbench.ours(name, qmm.QuantizedMatmulConfig()), x, weights)
                except Exception as e:  # a Triton failure must not end the run
                    print(f"triton {name} {k}x{n} M={m}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                b = qbench.nbytes(weights[0])
                peers.append(dict(impl="triton", fmt=name, k=k, n=n, m=m, seconds=sec, bytes=b, tb_s=b / sec / 1e12))
                print(f"triton {name:14s} {k:5d}x{n:<5d} M={m:<3d} {b / sec / 1e12:.2f} TB/s", flush=True)
                dump(peers)
    return peers


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/stream_matmul_mgpu.json")
    parser.add_argument("--budget_s", type=float, default=220.0, help="wall-clock budget of the whole run")
    parser.add_argument("--formats", default=",".join(FORMAT_NAMES))
    parser.add_argument("--skip_peers", action="store_true")
    parser.add_argument("--triton_formats", default="bf16,int8,int4_g128", help="formats timed on the Triton kernel")
    parser.add_argument("--smoke", action="store_true", help="CPU: tiny shapes through the interpreter")
    parser.add_argument("--shapes", default="", help="KxN,KxN (default: the four Llama-3-8B layer shapes)")
    args = parser.parse_args(argv)
    t0 = time.time()
    deadline = t0 + args.budget_s
    shapes, interpret = qbench.SHAPES, None
    if args.shapes:
        shapes = tuple(tuple(int(d) for d in s.split("x")) for s in args.shapes.split(","))
    if args.smoke:
        shapes, interpret, qbench.COPY_BYTES = ((256, 128),), sm.plgpu.InterpretGPUParams(), 1
        qbench.SHAPES, qbench.INTERPRET = shapes, True  # the peers' rows too (Triton through its interpreter)
        globals()["CHECK_CASES"] = ((3, 384, 72),)
    formats = [f for f in args.formats.split(",") if f]
    result = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__, check=[], rows=[], peers=[])
    result["mode"] = mode = check(result["check"], formats, interpret)
    qbench.dump(args.out, result)

    best = {}  # stage 2: the default config everywhere, format by format
    for case in [(f, k, n, m) for f in formats if mode.get(f) is not None for k, n in shapes for m in (1, 64)]:
        if time.time() > deadline:
            break
        tried, nbytes = time_case(*case, [S(a_via_smem=mode[case[0]])], 0, interpret)
        if tried:
            best[case] = (tried[0][0], tried[0][1], nbytes, [(dataclasses.asdict(c), s) for c, s in tried])
            print(f"mgpu default {case[0]:14s} {case[1]:5d}x{case[2]:<5d} M={case[3]:<3d} "
                  f"{nbytes / tried[0][1] / 1e12:.2f} TB/s", flush=True)  # fmt: skip
            qbench.dump(args.out, result | dict(rows=qbench.rows_of(best, "mgpu")))
    result["rows"] = qbench.rows_of(best, "mgpu")

    if not args.skip_peers:  # stage 3: peers of the same run
        triton = [f for f in args.triton_formats.split(",") if f]
        result["peers"] = peer_rows(triton, shapes, deadline, lambda p: qbench.dump(args.out, result | dict(peers=p)))
        for r in result["peers"]:
            print(f"{r['impl']:20s} {r['fmt']:14s} {r['k']:5d}x{r['n']:<5d} M={r['m']:<3d} {r['tb_s']:.2f} TB/s")

    for i, case in enumerate(list(best)):  # stage 4: sweep in the time left, an equal share per case
        if time.time() > deadline:
            break
        case_deadline = time.time() + (deadline - time.time()) / (len(best) - i)
        config, sec, nbytes, tried_rows = best[case]
        tried, _ = time_case(
            *case, sweep_configs(case[0], config, m=case[3], k=case[1], n=case[2]), case_deadline, interpret
        )
        tried_rows = tried_rows + [(dataclasses.asdict(c), s) for c, s in tried]
        top = min([(config, sec)] + tried, key=lambda t: t[1])
        best[case] = (top[0], top[1], nbytes, tried_rows)
        print(f"mgpu sweep({len(tried_rows)}) {case[0]:14s} {case[1]:5d}x{case[2]:<5d} M={case[3]:<3d} "
              f"{nbytes / top[1] / 1e12:.2f} TB/s {top[0]}", flush=True)  # fmt: skip
        qbench.dump(args.out, result | dict(rows=qbench.rows_of(best, "mgpu")))
    result["rows"] = qbench.rows_of(
        best, "mgpu"
    )  # stage 2's rows were dumped as they came; these are the bests after the sweep
    result["sweep"] = [dict(fmt=c[0], k=c[1], n=c[2], m=c[3], tried=v[3]) for c, v in best.items()]
    result["elapsed_s"] = time.time() - t0
    qbench.dump(args.out, result)
    print_table(result["rows"] + result["peers"], shapes)


if __name__ == "__main__":
    sys.exit(main())
