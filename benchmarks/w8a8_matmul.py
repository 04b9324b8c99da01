"""W8A8 prefill matmul on one GPU: our Mosaic GPU kernel (fp8, int8) vs XLA (bf16, fp8, int8 dots) vs torch peers.

Run from the repo root on the device machine (`bash benchmarks/gpu.sh kernels w8a8` does, under 3 minutes on an H200):

    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python3 benchmarks/w8a8_matmul.py --out $OUT/w8a8_matmul.json

Shapes: M = 4096 tokens through the Llama-3-8B layer weights [K, N] = 4096x4096 (q / o), 4096x1024 (k / v),
4096x14336 (gate / up) and 14336x4096 (down). Figure of merit: 2 * M * K * N over the median time, in TFLOP/s.
Rows, per shape, all timed in the same process (benchmarks/timing.py's rule; the same rule, with
torch.cuda.synchronize, for torch):

    ours_fp8 / ours_int8         the kernel on a pre-transposed [N, K] weight (what it reads; a serving path that
                                 stores weights K-major pays nothing more); fp8 with its default promotion of the
                                 wgmma sums into an f32 total every 128 of K (W8A8Config.promote_every_k)
    ours_fp8_no_promote          the same tiles with promote_every_k = 0 (one accumulator over K): the cost of
                                 promotion is ours_fp8 vs this row, its gain the two rows' rel_error
    ours_fp8_no_promote_tm128    unpromoted at the int8 default tile_m = 128 (the fp8 default before promotion)
    ours_fp8_kn / ours_int8_kn   the same from a [K, N] weight, transposed in the same jit (what model/quant.py runs)
    xla_bf16                     bf16 x bf16 dot, f32 accumulation
    xla_fp8 / xla_int8           XLA's e4m3 x e4m3 (f32 acc) / s8 x s8 (s32 acc) dot with the same scale epilogue
    torch_scaled_mm              torch._scaled_mm, e4m3, row-wise scales [M, 1] x [1, N], bf16 out (cuBLASLt);
                                 _fast_accum: use_fast_accum=True (no periodic promotion of the wgmma sums to full
                                 f32: what ours_fp8_no_promote and XLA do)
    torch_int_mm                 torch._int_mm, s8 x s8 -> s32 (cuBLAS), without the scale epilogue
    quantize_{fp8,int8}_us       the per-token activation quantiser on bf16 x [M, K] (not in any TFLOP/s figure)
    model_{fmt}_*_path_us        model/quant.py's matmul from bf16 x on a W8A8 weight (on --model_path_shapes):
                                 kernel_path: as quantize_model stores it ([N, K]) with the one-pass Pallas
                                 quantiser (pallas_kernels/act_quant.py); kn_jnp_quant_path: a [K, N] weight
                                 transposed per call and the two-pass jnp quantiser (the path before); fake_quant_path:
                                 fake-quantise-then-bf16-dot; xla_bf16_us: the bf16 dot it competes with

`--model_path_only` times the kernel path and XLA bf16 on the four shapes at M = 4096, and on the first shape also
the paths before and each quantiser alone.

Before any timing, every kernel output is checked against `w8a8_matmul.exact_reference` (f32 upcasts behind an
optimization barrier, f32 dot at HIGHEST: never an fp8 dot, which would share the tensor core's accumulation
error): norm-relative error < 1e-2 (5e-2 for the main table's fp8 rows, whose error is part of what they
measure), else the failure is recorded and that row is not timed. `rel_error_vs_reference` is the error against
`w8a8_matmul.reference` (the same product as XLA compiles it, possibly through its own fp8 GEMM). `fp8_rel_error`
gathers the fp8 rows' errors. `--sweep_seconds` bounds a small config sweep (epilogue, tile sizes, ring depth,
grid walk, promotion span; on `--sweep_shapes`) run after the main table, most promising config first, until the
budget is spent.

`--smoke` runs a tiny shape through the Mosaic GPU interpreter, to check this script on a CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import median_seconds
from pallas_kernels import w8a8_matmul as wm

TIMING = dict(iters=10, reps=5)
M = 4096
SHAPES = [("q_o_4096x4096", 4096, 4096), ("k_v_4096x1024", 4096, 1024), ("gate_up_4096x14336", 4096, 14336)]
SHAPES.append(("down_14336x4096", 14336, 4096))
SMOKE = dict(m=200, shapes=[("smoke_256x256", 256, 256)])
Cfg = wm.W8A8Config
SWEEP = [  # most promising first: the budget may stop the sweep part way
    Cfg(swizzled_epilogue=True),
    Cfg(cluster_m=2, swizzled_epilogue=True),
    Cfg(cluster_m=2),
    Cfg(max_concurrent_steps=3),
    Cfg(tile_m=64, tile_n=256, max_concurrent_steps=2, swizzled_epilogue=True),
    Cfg(grid_tile_width=16, swizzled_epilogue=True),
    Cfg(grid_minor_m=False, swizzled_epilogue=True),
    Cfg(tile_m=64, tile_n=128, max_concurrent_steps=5, swizzled_epilogue=True),
    Cfg(delay_release=0, swizzled_epilogue=True),
    Cfg(tile_k=64, max_concurrent_steps=6, swizzled_epilogue=True),
]
SWEEP += [  # fp8 with promotion: warpgroup tiles of at most MAX_PROMOTED_TILE (the 128 x 128 ones above skip fp8)
    Cfg(tile_m=64, swizzled_epilogue=True),
    Cfg(tile_m=64, cluster_m=2, swizzled_epilogue=True),
    Cfg(tile_m=128, tile_n=64, swizzled_epilogue=True),
    Cfg(tile_m=64, promote_every_k=256, swizzled_epilogue=True),  # a 2-step span: half the waits
    Cfg(tile_m=64, max_concurrent_steps=5, swizzled_epilogue=True),
    Cfg(tile_m=64, delay_release=0, swizzled_epilogue=True),  # a span of 1 waits anyway: release the slot at once
]
SWEEP_SHAPES = "gate_up_4096x14336,q_o_4096x4096"
SMOKE_CFG = Cfg(tile_m=64, tile_n=64, max_concurrent_steps=2)
FP8_GATE = 5e-2  # the main table's fp8 rows are timed up to 5% error (unpromoted: ~2.6%), a broken kernel is not


def rel_error(out, ref) -> float:
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def make_inputs(fmt, m, k, n, seed=0):
    """Quantised activations (per token) and weights (per output channel) from f32 normal draws, on the device."""
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32)
    w = jax.random.normal(kw, (k, n), jnp.float32) * k**-0.5
    xq, xs = wm.quantize_activations(x, fmt)
    wq_t, ws = wm.quantize_activations(w.T, fmt)  # [N, K] with one scale per output channel
    return xq, wq_t, xs, ws.reshape(1, n)


def time_ours(fmt, m, k, n, cfg, backend, layout="nk", gate=1e-2):
    """One row for our kernel: correctness vs the exact f32 product first (timed if within `gate`), then the timing."""
    xq, wq_t, xs, ws = make_inputs(fmt, m, k, n)
    wq = wq_t if layout == "nk" else jnp.asarray(wq_t.T)
    fn = jax.jit(lambda a, b, c, d: wm.w8a8_matmul(a, b, c, d, wq_layout=layout, config=cfg, backend=backend))
    entry = dict(config=dataclasses.asdict(cfg), layout=layout)
    try:
        out = fn(xq, wq, xs, ws)
        entry["rel_error"] = rel_error(out, wm.exact_reference(xq, wq_t, xs, ws, wq_layout="nk"))
        entry["rel_error_vs_reference"] = rel_error(out, wm.reference(xq, wq_t, xs, ws, wq_layout="nk"))
        if entry["rel_error"] < gate:
            entry["us"] = median_seconds(fn, xq, wq, xs, ws, **TIMING) * 1e6
    except Exception as err:  # a config that does not compile is recorded, not fatal  # noqa: BLE001
        entry["error"] = f"{type(err).__name__}: {str(err)[:300]}"
    return entry


def time_xla(m, k, n):
    """XLA's dots: bf16, fp8 e4m3 and int8, the 8-bit ones with the same scale epilogue as ours."""
    rows = {}
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (k, n), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
    bf16 = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    rows["xla_bf16"] = median_seconds(bf16, x, w, **TIMING) * 1e6
    for fmt, acc in (("fp8", jnp.float32), ("int8", jnp.int32)):
        xq, wq_t, xs, ws = make_inputs(fmt, m, k, n)
        wq = jnp.asarray(wq_t.T)

        def dot(a, b, c, d, acc=acc):
            return (jnp.dot(a, b, preferred_element_type=acc).astype(jnp.float32) * c * d).astype(jnp.bfloat16)

        rows[f"xla_{fmt}"] = median_seconds(jax.jit(dot), xq, wq, xs, ws, **TIMING) * 1e6
    return rows


def torch_rows(m, k, n) -> dict:
    """torch._scaled_mm (fp8, row-wise scales) and torch._int_mm (int8), if torch with CUDA is importable here."""
    try:
        import torch  # noqa: PLC0415 (an optional peer: the device image has it, the CPU venv need not)
    except ImportError as err:
        return dict(torch_error=f"ImportError: {err}")
    if not torch.cuda.is_available():
        return dict(torch_error="torch has no CUDA device")

    def median_torch(fn):
        fn()
        torch.cuda.synchronize()
        samples = []
        for _ in range(TIMING["reps"]):
            start = time.perf_counter()
            for _ in range(TIMING["iters"]):
                fn()
            torch.cuda.synchronize()
            samples.append((time.perf_counter() - start) / TIMING["iters"])
        return statistics.median(samples) * 1e6

    rows = dict(torch_version=torch.__version__)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=gen)
    w_nk = torch.randn(n, k, device="cuda", generator=gen) * k**-0.5
    try:
        xs = x.abs().amax(dim=1, keepdim=True) / 448.0
        ws = (w_nk.abs().amax(dim=1, keepdim=True) / 448.0).T.contiguous()  # [1, N]
        xq = (x / xs).to(torch.float8_e4m3fn)
        wq = (w_nk / ws.T).to(torch.float8_e4m3fn)  # [N, K] row-major: .t() is the column-major [K, N] cuBLASLt wants
        for key, fast in (("torch_scaled_mm", False), ("torch_scaled_mm_fast_accum", True)):
            mm = lambda fast=fast: torch._scaled_mm(xq, wq.t(), xs, ws, out_dtype=torch.bfloat16, use_fast_accum=fast)  # noqa: E731
            rows[key] = median_torch(mm)
    except Exception as err:  # noqa: BLE001 (a torch build without row-wise fp8 scaling is recorded, not fatal)
        rows["torch_scaled_mm_error"] = f"{type(err).__name__}: {str(err)[:300]}"
    try:
        xi = torch.randint(-127, 128, (m, k), device="cuda", dtype=torch.int8, generator=gen)
        wi = torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8, generator=gen)
        rows["torch_int_mm"] = median_torch(lambda: torch._int_mm(xi, wi.t()))
    except Exception as err:  # noqa: BLE001
        rows["torch_int_mm_error"] = f"{type(err).__name__}: {str(err)[:300]}"
    del x, w_nk
    torch.cuda.empty_cache()
    return rows


def bench_shape(name, m, k, n, backend, cfg=None):
    tflops = lambda us: 2.0 * m * k * n / (us * 1e-6) / 1e12  # noqa: E731
    row = dict(shape=name, m=m, k=k, n=n, kernels={})
    for fmt in ("fp8", "int8"):
        fmt_cfg = cfg or Cfg.for_shape(n, fmt)
        for layout in ("nk", "kn"):
            key = f"ours_{fmt}" + ("_kn" if layout == "kn" else "")
            row["kernels"][key] = time_ours(
                fmt, m, k, n, fmt_cfg, backend, layout, gate=FP8_GATE if fmt == "fp8" else 1e-2
            )
    # fp8 promotion off, same process and inputs: its cost (time) and its gain (error)
    no_promote = dataclasses.replace(cfg or Cfg.for_shape(n, "fp8"), promote_every_k=0)
    row["kernels"]["ours_fp8_no_promote"] = time_ours("fp8", m, k, n, no_promote, backend, gate=FP8_GATE)
    if cfg is None and Cfg.for_shape(n, "int8").tile_m != no_promote.tile_m:
        before = dataclasses.replace(Cfg.for_shape(n, "int8"), promote_every_k=0)
        row["kernels"]["ours_fp8_no_promote_tm128"] = time_ours("fp8", m, k, n, before, backend, gate=FP8_GATE)
    row["fp8_rel_error"] = {key: e.get("rel_error") for key, e in row["kernels"].items() if key.startswith("ours_fp8")}
    row.update(time_xla(m, k, n))
    row.update(torch_rows(m, k, n))
    x = jax.random.normal(jax.random.key(2), (m, k), jnp.bfloat16)
    for fmt in ("fp8", "int8"):  # the per-token quantiser model/quant.py runs before the kernel (not in the TFLOP/s)
        quantize = jax.jit(lambda a, fmt=fmt: wm.quantize_activations(a, fmt))
        row[f"quantize_{fmt}_us"] = median_seconds(quantize, x, **TIMING) * 1e6
    row["tflops"] = {key: tflops(e["us"]) for key, e in row["kernels"].items() if "us" in e}
    row["tflops"].update({key: tflops(us) for key, us in row.items() if key.startswith(("xla_", "torch_")) and
                          isinstance(us, float)})  # fmt: skip
    print(json.dumps(row), flush=True)
    return row


def time_model_path(m, k, n, detail: bool = True, quantisers: bool = False, base=None) -> dict:
    """model/quant.py's matmul on a W8A8 QuantizedArray from bf16 x, end to end (module docstring's model_* rows).

    Each path's output is compared with quant.reference_matmul first (rel error recorded; timed unless it raised).
    Each path passes its own quant.MatmulOptions (over `base`, default quant.DEFAULT_OPTIONS) to quant.matmul.
    `detail` False: the kernel path only. `quantisers`: also the bf16 dot and, with `detail`, the activation
    quantisers alone (Pallas one-pass vs jnp) and the kernel on the Pallas quantiser's own codes against
    w8a8_matmul.reference (the kernel's error alone)."""
    from model import quant  # noqa: PLC0415
    from pallas_kernels import act_quant  # noqa: PLC0415

    x = jax.random.normal(jax.random.key(3), (m, k), jnp.bfloat16)
    rows = {}
    base = base or quant.DEFAULT_OPTIONS
    for fmt in ("fp8", "int8"):
        _, wq_t, _, ws = make_inputs(fmt, 8, k, n)
        kn = quant.QuantizedArray(jnp.asarray(wq_t.T), ws.reshape(n), fmt=fmt, act_fmt=fmt)
        ref = jax.jit(lambda a, b: quant.reference_matmul(a, b))(x, kn)
        paths = [("kernel_path", quant.to_layout(kn, "nk"), None, base.w8a8_min_rows)]
        if detail:
            paths += [("kn_jnp_quant_path", kn, "xla", base.w8a8_min_rows), ("fake_quant_path", kn, None, m + 1)]
        for path, q, quantiser, min_rows in paths:
            opts = dataclasses.replace(base, w8a8_min_rows=min_rows, act_quant_backend=quantiser)
            try:
                fn = jax.jit(functools.partial(quant.matmul, options=opts))
                rows[f"model_{fmt}_{path}_rel_error"] = rel_error(fn(x, q), ref)
                rows[f"model_{fmt}_{path}_us"] = median_seconds(fn, x, q, **TIMING) * 1e6
            except Exception as e:  # noqa: BLE001 (recorded, not fatal: the other rows still run)
                rows[f"model_{fmt}_{path}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        if quantisers and detail:
            for name, backend in (("pallas", None), ("jnp", "xla")):
                fn = jax.jit(
                    lambda a, fmt=fmt, backend=backend: act_quant.quantize_activations(a, fmt, backend=backend)
                )
                rows[f"quantize_{fmt}_{name}_us"] = median_seconds(fn, x, **TIMING) * 1e6
            xq, xs = act_quant.quantize_activations(x, fmt)
            got = jax.jit(lambda a, b, c, d: wm.w8a8_matmul(a, b, c, d, wq_layout="nk"))(xq, wq_t, xs, ws)
            want = wm.exact_reference(xq, wq_t, xs, ws, wq_layout="nk")
            rows[f"model_{fmt}_kernel_vs_w8a8_reference_rel_error"] = rel_error(got, want)
    if quantisers:
        w = (jax.random.normal(jax.random.key(4), (k, n), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
        bf16 = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
        rows["xla_bf16_us"] = median_seconds(bf16, x, w, **TIMING) * 1e6
    return rows


def model_path_summary(rows) -> str:
    """Model-path table: us per call and the speed-up over XLA's bf16 dot."""
    lines = [f"| shape (M = {rows[0]['m']}) | xla bf16 us | " + " | ".join(
        f"{fmt} {p} us (x bf16)" for fmt in ("fp8", "int8") for p in ("model", "before")) + " |"]  # fmt: skip
    lines.append("|---" * 6 + "|")
    for r in rows:
        base = r.get("xla_bf16_us", float("nan"))
        cells = []
        for fmt in ("fp8", "int8"):
            for key in ("kernel_path", "kn_jnp_quant_path"):
                us = r.get(f"model_{fmt}_{key}_us")
                cells.append("-" if us is None else f"{us:.0f} ({base / us:.2f}x)")
        lines.append(f"| {r['shape']} | {base:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sweep(shapes, m, backend, seconds: float, results: list, on_entry=lambda: None):
    """Configs beyond the default (config-major, then shape and format; kernel on [N, K] weights), appended to
    `results` (then `on_entry()`) until `seconds` are spent."""
    deadline = time.monotonic() + seconds
    for cfg in SWEEP:
        for name, k, n in shapes:
            for fmt in ("fp8", "int8"):
                if time.monotonic() > deadline:
                    return
                if n % (wm.COMPUTE_WGS * cfg.tile_n) or k % cfg.tile_k:
                    continue
                if cfg.promotes(fmt) and cfg.tile_m * cfg.tile_n > wm.MAX_PROMOTED_TILE:
                    continue  # no registers for the promoted total (w8a8_matmul raises)
                if fmt == "int8" and cfg.promote_every_k != Cfg.promote_every_k:
                    continue  # int8 ignores promotion: the same kernel as another entry
                entry = dict(shape=name, fmt=fmt, **time_ours(fmt, m, k, n, cfg, backend))
                if "us" in entry:
                    entry["tflops"] = 2.0 * m * k * n / (entry["us"] * 1e-6) / 1e12
                print(json.dumps(entry), flush=True)
                results.append(entry)
                on_entry()


def summary(rows) -> str:
    cols = ["ours_fp8", "ours_fp8_kn", "ours_fp8_no_promote", "ours_fp8_no_promote_tm128", "torch_scaled_mm"]
    cols += ["torch_scaled_mm_fast_accum", "xla_fp8", "ours_int8"]
    cols += ["ours_int8_kn", "torch_int_mm"]
    cols += ["xla_int8", "xla_bf16"]
    lines = [f"| shape (M = {rows[0]['m']}) | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for r in rows:
        vals = [f"{r['tflops'][c]:.0f}" if c in r["tflops"] else "-" for c in cols]
        lines.append(f"| {r['shape']} | " + " | ".join(vals) + " |")
    lines += ["", "| shape | fp8 rel error: " + " | ".join(rows[0]["fp8_rel_error"]) + " |"]
    lines.append("|---" * (len(rows[0]["fp8_rel_error"]) + 1) + "|")
    for r in rows:
        errs = [f"{e:.4%}" if e is not None else "-" for e in r["fp8_rel_error"].values()]
        lines.append(f"| {r['shape']} | " + " | ".join(errs) + " |")
    return "\n".join(lines)


def sweep_summary(result) -> str:
    """Per swept (shape, format): the default config's TFLOP/s and the best swept config (fields that differ)."""
    lines = [
        "| shape | fmt | default TFLOP/s | best swept TFLOP/s | best config (vs default) |",
        "|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        for fmt in ("fp8", "int8"):
            swept = [e for e in result["sweep"] if e["shape"] == row["shape"] and e["fmt"] == fmt and "tflops" in e]
            if not swept:
                continue
            best = max(swept, key=lambda e: e["tflops"])
            default = Cfg.for_shape(row["n"], fmt)  # fp8's default differs from int8's (tile_m 64, promotion)
            diff = {k: v for k, v in best["config"].items() if getattr(default, k) != v}
            base = row["tflops"].get(f"ours_{fmt}", float("nan"))
            lines.append(f"| {row['shape']} | {fmt} | {base:.0f} | {best['tflops']:.0f} | {diff} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="w8a8_matmul.json")
    parser.add_argument("--smoke", action="store_true", help="a tiny shape in the Mosaic GPU interpreter (CPU)")
    parser.add_argument("--shapes", default="", help="comma-separated subset of shape names")
    parser.add_argument("--sweep_seconds", type=float, default=45.0, help="time budget of the config sweep (0: none)")
    parser.add_argument("--sweep_shapes", default=SWEEP_SHAPES, help="comma-separated shapes the sweep runs on")
    parser.add_argument("--model_path_shapes", default=SWEEP_SHAPES, help="shapes that also time model/quant.py")
    parser.add_argument(
        "--model_path_only", action="store_true", help="only model/quant.py's W8A8 path vs XLA bf16, every shape"
    )
    args = parser.parse_args()
    if args.model_path_only:
        return model_path_main(args)
    m, shapes, backend = (SMOKE["m"], SMOKE["shapes"], "interpret") if args.smoke else (M, SHAPES, "mosaic_gpu")
    if args.shapes:
        shapes = [s for s in shapes if s[0] in args.shapes.split(",")]
    if args.smoke:  # the interpreter takes ~0.5 s a call: one timed call is enough to exercise the script
        TIMING.update(iters=1, reps=1)
    result = dict(
        device=str(jax.devices()[0].device_kind), date=datetime.date.today().isoformat(), jax=jax.__version__,
        timing=TIMING, m=m, rows=[], sweep=[],
    )  # fmt: skip

    def write():  # rewritten after each step, so a run cut short keeps what it measured
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    for name, k, n in shapes:
        cfg = SMOKE_CFG if args.smoke else None
        result["rows"].append(bench_shape(name, m, k, n, backend, cfg))
        if not args.smoke and name in args.model_path_shapes.split(","):
            result["rows"][-1].update(time_model_path(m, k, n))
            print(json.dumps({key: v for key, v in result["rows"][-1].items() if key.startswith("model_")}), flush=True)
        write()
    if args.sweep_seconds > 0 and not args.smoke:
        sweep_shapes = [s for s in SHAPES if s[0] in args.sweep_shapes.split(",")]
        sweep(sweep_shapes, m, backend, args.sweep_seconds, result["sweep"], write)
    print(summary(result["rows"]), flush=True)
    print(sweep_summary(result), flush=True)
    return 0


def model_path_main(args) -> int:
    """--model_path_only: model.quant.matmul end to end (quantiser + GEMM) vs XLA bf16 at M = 4096, four shapes."""
    m, shapes = M, [s for s in SHAPES if not args.shapes or s[0] in args.shapes.split(",")]
    base = None
    if args.smoke:  # CPU: both kernels in their interpreters, w8a8_min_rows rows (the kernel path's threshold)
        from model import quant  # noqa: PLC0415

        base = quant.MatmulOptions(w8a8_backend="interpret")
        m, shapes = base.w8a8_min_rows, SMOKE["shapes"]
        TIMING.update(iters=1, reps=1)
    else:  # ~25 compiles in all: a short timing keeps the four shapes inside a minute and a half
        TIMING.update(iters=5, reps=3)
    result = dict(device=str(jax.devices()[0].device_kind), date=datetime.date.today().isoformat(), m=m, rows=[])
    result.update(jax=jax.__version__, timing=TIMING)
    for i, (name, k, n) in enumerate(shapes):  # the paths before, the quantisers alone: on the first shape
        row = dict(shape=name, m=m, k=k, n=n, **time_model_path(m, k, n, detail=i == 0, quantisers=True, base=base))
        print(json.dumps(row), flush=True)
        result["rows"].append(row)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(model_path_summary(result["rows"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
