"""The streaming decode matmul under Nsight Compute: why int8 / fp8 stream slower than bf16 in the same kernel.

    bash benchmarks/profile_stream_ncu.sh           (on the GPU machine: profiles, then prints the summary)

GEMV mode (`--gemv --fmt bf16 | int8 | fp8 | int4_g128 | int4_g32_asym | int8_g32 [--config depth=2]`): the same
weight shape through pallas_kernels/gemv.py at M = 1 with model.quant's tuned config (`bash benchmarks/gpu.sh
kernels ncu` runs it under `ncu -k regex:gemv`).

Launch mode (`--fmt int8 | fp8 | bf16 [--config upcast_load=True,overlap=True]`): one weight [4096, 14336] of that
format (pallas_kernels/stream_matmul_mgpu.py's layout), x [1, 4096] bf16; the call is compiled and run once, then
launched once more; ncu profiles every kernel of both (the Mosaic GPU kernel, XLA's pad and split-sum fusions).

Summary mode (`--summarise report.csv`, ncu's `--page raw --csv` of that report): per kernel, its duration, DRAM
throughput (% of peak and bytes/s), issue-slot utilisation and the largest warp stall reasons (cycles per issued
instruction) - the figures that tell a kernel starved of bytes in flight from one whose compute warps cannot keep up.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys

K, N = 4096, 14336
STALL = re.compile(r"smsp__average_warps?_(?:latency_)?issue_stalled_(\w+?)(?:_per_issue_active\.ratio)?$")
COLUMNS = {
    "duration": "gpu__time_duration.sum",
    "dram_%peak": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "gpu_dram_%peak": "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",  # this ncu's name for it
    "dram_bytes/s": "dram__bytes_read.sum.per_second",
    "issue_active_%": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "inst_issued_%": "sm__inst_issued.avg.pct_of_peak_sustained_active",
    "warps_active": "sm__warps_active.avg.per_cycle_active",
    "registers": "launch__registers_per_thread",
}


def launch(fmt: str, config: str) -> None:
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from pallas_kernels import stream_matmul_mgpu as sm  # noqa: PLC0415

    rng = np.random.default_rng(0)
    w32 = rng.standard_normal((K, N), np.float32) * K**-0.5
    if fmt == "bf16":
        w = sm.prepare(jnp.asarray(w32, jnp.bfloat16))
    else:
        scale = np.abs(w32).max(axis=0) / (127.0 if fmt == "int8" else 448.0)
        codes = w32 / scale
        codes = np.clip(np.round(codes), -127, 127).astype(np.int8) if fmt == "int8" else codes
        dtype = jnp.int8 if fmt == "int8" else jnp.float8_e4m3fn
        w = sm.prepare(jnp.asarray(codes, dtype), jnp.asarray(scale), fmt=fmt)
    cfg = sm.StreamConfig(**eval(f"dict({config})"))  # noqa: S307 (a command-line config of literals)
    x = jnp.asarray(rng.standard_normal((1, K)), jnp.bfloat16)
    fn = jax.jit(lambda x, w: sm.stream_matmul(x, w, config=cfg, backend="mosaic_gpu"))
    jax.block_until_ready(fn(x, w))  # compile + first run
    jax.block_until_ready(fn(x, w))
    print(f"launched: {fmt} {cfg}", flush=True)


def launch_gemv(fmt: str, config: str) -> None:
    """pallas_kernels/gemv.py at M = 1 on a [4096, 14336] weight of benchmarks/gemv.py's format (bf16, int8, fp8,
    int4_g128, int4_g32_asym, int8_g32), with model.quant's tuned config for it (fields overridden by --config)."""
    import dataclasses  # noqa: PLC0415

    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from benchmarks import gemv as gb  # noqa: PLC0415
    from model import quant  # noqa: PLC0415
    from pallas_kernels import gemv as G  # noqa: PLC0415

    base, group, _, _ = gb.FORMATS[fmt]
    key = quant.gemv_config_key(base, group)
    cfg = dataclasses.replace(G.GemvConfig(**quant.GEMV_CONFIGS[key]), **eval(f"dict({config})"))  # noqa: S307
    weights = gb.weights_for(fmt, K, N)[0]
    x = jax.random.normal(jax.random.key(1), (1, K), jnp.bfloat16)
    fn = jax.jit(lambda x, w: G.gemv(x, *w, fmt=base, group_size=group, config=cfg, backend="triton"))
    jax.block_until_ready(fn(x, weights))  # compile + first run
    jax.block_until_ready(fn(x, weights))
    print(f"launched: gemv {fmt} {cfg}", flush=True)


def summarise(path: str) -> None:
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r and not r[0].startswith("==")]
    header, units, kernels = rows[0], rows[1], rows[2:]
    col = {name: i for i, name in enumerate(header)}
    name_col = col.get("Kernel Name", 0)
    for r in kernels:
        name = r[name_col][:60]
        cells = [f"{label}={r[col[m]]}{units[col[m]]}" for label, m in COLUMNS.items() if m in col]
        stalls = []
        for m, i in col.items():
            hit = STALL.match(m)
            if hit:
                try:
                    stalls.append((float(r[i].replace(",", "")), hit.group(1)))
                except ValueError:
                    pass
        top = ", ".join(f"{reason} {v:.1f}" for v, reason in sorted(stalls, reverse=True)[:6])
        print(f"{name}\n    " + "  ".join(cells) + f"\n    stalls (cycles / issued instr): {top}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--fmt", default="int8", help="int8 / fp8 / bf16; --gemv also int4_g128, int4_g32_asym, int8_g32")
    p.add_argument("--gemv", action="store_true", help="profile pallas_kernels/gemv.py instead of the Mosaic kernel")
    p.add_argument("--config", default="", help="StreamConfig fields, e.g. upcast_load=True,overlap=True")
    p.add_argument("--summarise", default="", help="an ncu --page raw --csv file: print the key metrics")
    a = p.parse_args()
    if a.summarise:
        summarise(a.summarise)
    elif a.gemv:
        launch_gemv(a.fmt, a.config)
    else:
        launch(a.fmt, a.config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
