"""Grouped (MoE expert) matmul on one GPU: our Mosaic GPU kernel vs `jax.lax.ragged_dot` vs the dense matmul.

Run from the repo root on the device machine:

    PYTHONPATH=. python3 benchmarks/grouped_matmul.py --out $OUT/grouped_matmul.json

Shapes (bf16, f32 accumulation): Mixtral-8x7B's w1 (8,192 routed rows = 4,096 tokens x top-2 over 8 experts,
4096 -> 14336) and Qwen1.5-MoE-A2.7B's fused gate+up and down projections (16,384 routed rows = 4,096 tokens x top-4
over 60 experts, 2048 -> 2 x 1408 and 1408 -> 2048). Group sizes: balanced (equal split) and skewed (Zipf, s=1.2,
some experts empty). Figure of merit: 2 * M * K * N useful FLOPs over the median time, in TFLOP/s, against the
dense [M, K] @ [K, N] matmul of the same size timed in the same run (the ceiling a grouped GEMM can approach).
Every kernel result is checked against ragged_dot (norm-relative error) before it is timed.

`--smoke` runs tiny shapes through the Mosaic GPU interpreter, to check this script on a CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import median_seconds
from pallas_kernels import grouped_matmul as gm

TIMING = dict(iters=10, reps=5)
SHAPES = [  # name, M (routed rows), K, N, G
    ("mixtral_w1", 8192, 4096, 14336, 8),
    ("qwen_moe_gate_up", 16384, 2048, 2816, 60),
    ("qwen_moe_down", 16384, 1408, 2048, 60),
]
SMOKE_SHAPES = [("smoke", 200, 128, 256, 3)]
Cfg = gm.GroupedMatmulConfig
CONFIGS = [
    Cfg(),
    Cfg(delay_release=0),
    Cfg(grid_tile_width=16),
    Cfg(grid_minor_m=False, grid_tile_width=8),
    Cfg(tile_m=64),
    Cfg(tile_n=64),
]
SMOKE_CONFIGS = [Cfg(tile_m=64, tile_n=64, max_concurrent_steps=2)]


def group_sizes(m: int, g: int, skewed: bool) -> np.ndarray:
    """Balanced: m split as evenly as possible. Skewed: Zipf(1.2) shares, rounded down (small ones become 0),
    the remainder to the largest group."""
    if not skewed:
        return np.full(g, m // g, np.int32) + (np.arange(g) < m % g)
    share = 1.0 / np.arange(1, g + 1) ** 1.2
    sizes = np.floor(m * share / share.sum() * 0.9).astype(np.int32)  # 10% headroom so some tail groups get 0
    sizes[g // 2 :: 3] = 0
    sizes[0] += m - sizes.sum()
    return np.random.default_rng(0).permutation(sizes).astype(np.int32)


def rel_error(out, ref) -> float:
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def bench_shape(name, m, k, n, g, configs, backend):
    key_l, key_r = jax.random.split(jax.random.key(0))
    lhs = jax.random.normal(key_l, (m, k), jnp.bfloat16)
    rhs = (jax.random.normal(key_r, (g, k, n), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
    flops = 2.0 * m * k * n
    tflops = lambda s: flops / s / 1e12  # noqa: E731
    dense = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype))
    ragged = jax.jit(gm.reference)
    dense_s = median_seconds(dense, lhs, rhs[0], **TIMING)
    rows = []
    for skewed in (False, True):
        sizes = jnp.asarray(group_sizes(m, g, skewed))
        ref = ragged(lhs, rhs, sizes)
        ragged_s = median_seconds(ragged, lhs, rhs, sizes, **TIMING)
        row = dict(
            shape=name, m=m, k=k, n=n, groups=g, skewed=skewed, group_sizes=[int(x) for x in sizes],
            dense_us=dense_s * 1e6, dense_tflops=tflops(dense_s),
            ragged_dot_us=ragged_s * 1e6, ragged_dot_tflops=tflops(ragged_s), configs=[],
        )  # fmt: skip
        for cfg in configs:
            entry = dict(config=dataclasses.asdict(cfg))
            try:
                fn = jax.jit(lambda a, b, s, cfg=cfg: gm.grouped_matmul(a, b, s, config=cfg, backend=backend))
                entry["rel_error"] = rel_error(fn(lhs, rhs, sizes), ref)
                seconds = median_seconds(fn, lhs, rhs, sizes, **TIMING)
                entry.update(us=seconds * 1e6, tflops=tflops(seconds), vs_dense=dense_s / seconds)
            except Exception as err:  # a config that does not compile is recorded, not fatal  # noqa: BLE001
                entry["error"] = f"{type(err).__name__}: {str(err)[:300]}"
            row["configs"].append(entry)
            print(json.dumps(dict(shape=name, skewed=skewed, **entry)), flush=True)
        timed = [c for c in row["configs"] if "us" in c and c["rel_error"] < 1e-2]
        row["best"] = min(timed, key=lambda c: c["us"]) if timed else None
        rows.append(row)
    return rows


def bench_moe_block(preset: str, tokens: int) -> dict:
    """One MoE MLP layer (model/moe.py) at a preset's shape, bf16 random weights: grouped kernel vs ragged_dot."""
    from flax import nnx  # noqa: PLC0415 (only this row needs the model)

    from model import moe  # noqa: PLC0415
    from model.config import ModelConfig  # noqa: PLC0415

    cfg = ModelConfig.preset(preset)
    x = jax.random.normal(jax.random.key(1), (tokens, cfg.hidden_size), jnp.bfloat16)
    row = dict(preset=preset, tokens=tokens)
    flops = 2.0 * tokens * cfg.num_experts_per_tok * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    outs = {}
    for backend in ("mosaic_gpu", "xla"):
        block = moe.MoEMLP(cfg, jnp.bfloat16, nnx.Rngs(params=0), backend=backend)
        graph, state = nnx.split(block)
        fn = jax.jit(lambda state, x, graph=graph: nnx.merge(graph, state)(x))
        outs[backend] = fn(state, x)[0]
        seconds = median_seconds(fn, state, x, **TIMING)
        row[f"{backend}_ms"] = seconds * 1e3
        row[f"{backend}_expert_tflops"] = flops / seconds / 1e12
        del block, state
    row["rel_error"] = rel_error(outs["mosaic_gpu"], outs["xla"])
    print(json.dumps(row), flush=True)
    return row


def summary(rows) -> str:
    lines = ["| shape | groups | dense TFLOP/s | ragged_dot | ours (default) | ours (best) | best / dense |"]
    lines.append("|---|---|---|---|---|---|---|")
    for r in rows:
        default = r["configs"][0].get("tflops", float("nan"))
        best = r["best"]["tflops"] if r["best"] else float("nan")
        lines.append(
            f"| {r['shape']} | {'skewed' if r['skewed'] else 'balanced'} | {r['dense_tflops']:.0f} | "
            f"{r['ragged_dot_tflops']:.0f} | {default:.0f} | {best:.0f} | {best / r['dense_tflops']:.2f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="grouped_matmul.json")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes in the Mosaic GPU interpreter (CPU)")
    parser.add_argument("--shapes", default="", help="comma-separated subset of shape names")
    parser.add_argument("--moe_block_tokens", type=int, default=0, help="also time one MoE layer on this many tokens")
    args = parser.parse_args()
    shapes, configs, backend = (SMOKE_SHAPES, SMOKE_CONFIGS, "interpret") if args.smoke else (SHAPES, CONFIGS, None)
    if args.shapes:
        shapes = [s for s in shapes if s[0] in args.shapes.split(",")]
    rows, blocks = [], []
    for shape in shapes:  # the JSON is rewritten after each shape, so a run cut short keeps what it measured
        rows += bench_shape(*shape, configs, backend)
        result = dict(
            device=str(jax.devices()[0].device_kind), date=datetime.date.today().isoformat(), jax=jax.__version__,
            timing=TIMING, rows=rows, moe_blocks=blocks,
        )  # fmt: skip
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if args.moe_block_tokens:
        for preset in ("mixtral_8x7b", "qwen_moe"):
            blocks.append(bench_moe_block(preset, args.moe_block_tokens))
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    print(summary(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
