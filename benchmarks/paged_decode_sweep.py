"""The paged decode kernel's tiles per page dtype at the engine's throughput shapes (Llama-3-8B heads, page 16).

    PYTHONPATH=. python3 benchmarks/paged_decode_sweep.py --out $OUT/paged_decode_sweep.json [--budget_s 200]

Why: in the W8A8 fp8 1,000 x 1,000 run (BENCHMARKS.md, Throughput) attention is the largest kernel of a batch-256
decode step, and int8 pages were read at ~2.0 TB/s against bf16 pages' ~3.0 in the same engine: one-byte pages
move half the bytes per tile, so the default tile (64 tokens, 4 warps, 4 stages; tuned on bf16) may keep too few
bytes in flight. For each (batch, context) of --shapes and each page dtype, every config of CONFIGS is checked
against the kernel's reference once and timed; the row reports microseconds and the page bytes read per second
(codes + per-token scales; K and V). The default config comes first, so its row is the baseline of that case. The
JSON is rewritten after every row; --smoke runs tiny shapes through the interpreter (a CPU check of the script).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

from benchmarks.kernels_paged import HKV, HQ, PAGE, D, make_pool, rel_err
from benchmarks.timing import median_seconds
from model.kv import quantize_kv
from pallas_kernels import paged_attention as pa

C = pa.PagedAttentionConfig
CONFIGS = [C()] + [
    C(block_tokens=bt, num_warps=w, num_stages=st)
    for bt, w, st in [
        (64, 4, 3),
        (64, 8, 4),
        (128, 4, 3),
        (128, 8, 3),
        (128, 4, 4),
        (256, 8, 2),
        (256, 8, 3),
        (32, 4, 4),
    ]
]
PAGE_DTYPES = {"bf16": jnp.bfloat16, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


def quantised_pool(k_pages, v_pages, dtype):
    """bf16 pages [Hkv, P, ps, D] -> (k, v, k_scales, v_scales) in `dtype` (scales None for bf16)."""
    if dtype == jnp.bfloat16:
        return k_pages, v_pages, None, None
    (kq, ks), (vq, vs) = (quantize_kv(p, dtype) for p in (k_pages, v_pages))
    return kq, vq, ks, vs


def attend(q, k, v, tables, lengths, k_scales, v_scales, *, backend, config):
    return pa.paged_attention(
        q, k, v, tables, lengths, k_scales=k_scales, v_scales=v_scales, backend=backend, config=config
    )


def page_bytes(batch, ctx, dtype) -> int:
    per_token = HKV * (D * jnp.dtype(dtype).itemsize + (0 if dtype == jnp.bfloat16 else 4))
    return 2 * batch * ctx * per_token


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="paged_decode_sweep.json")
    p.add_argument("--shapes", default="256x1536,256x576,64x1536", help="BATCHxCONTEXT list")
    p.add_argument("--page_dtypes", default="int8,bf16", help=f"from {', '.join(PAGE_DTYPES)}")
    p.add_argument("--budget_s", type=float, default=200.0, help="stop starting rows after this many seconds")
    p.add_argument("--smoke", action="store_true", help="CPU: one tiny shape, two configs, the interpreter")
    a = p.parse_args()
    if unknown := sorted(set(a.page_dtypes.split(",")) - set(PAGE_DTYPES)):
        p.error(f"--page_dtypes: unknown {', '.join(unknown)}; choose from {', '.join(PAGE_DTYPES)}")
    backend, configs, shapes = "triton", CONFIGS, [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    if a.smoke:
        backend, configs, shapes = "interpret", CONFIGS[:2], [(2, 40)]
    res = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "rows": []}
    start = time.perf_counter()
    for batch, ctx in shapes:
        key = jax.random.key(batch * 7 + ctx)
        k_pages, v_pages, tables = make_pool(key, batch, -(-ctx // PAGE) * PAGE)
        q = jax.random.normal(jax.random.fold_in(key, 1), (batch, HQ, D), jnp.bfloat16)
        lengths = jnp.full((batch,), ctx, jnp.int32)  # the last page partly filled where ctx is not a multiple
        for name in a.page_dtypes.split(","):
            dtype = PAGE_DTYPES[name]
            kq, vq, ks, vs = quantised_pool(k_pages, v_pages, dtype)
            args = (q, kq, vq, tables, lengths, ks, vs)
            ref = pa.reference(*args[:5], k_scales=ks, v_scales=vs)
            for config in configs:
                if time.perf_counter() - start > a.budget_s:
                    break
                fn = jax.jit(lambda *x, c=config: attend(*x, backend=backend, config=c))
                row = dict(batch=batch, ctx=ctx, pages=name, config=str(config))
                try:
                    row["rel_err"] = rel_err(fn(*args), ref)
                    s = median_seconds(fn, *args, iters=2 if a.smoke else 20, reps=2 if a.smoke else 7)
                except Exception as e:  # noqa: BLE001 - a config that fails to compile is reported, not fatal
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                else:
                    row.update(us=round(s * 1e6, 2), tb_s=round(page_bytes(batch, ctx, dtype) / s / 1e12, 3))
                res["rows"].append(row)
                print("paged_decode_sweep", json.dumps(row), flush=True)
                with open(a.out, "w") as f:
                    json.dump(res, f, indent=1)
    errors = [r for r in res["rows"] if "error" in r or r["rel_err"] > 2e-2]
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    if errors:
        raise SystemExit(f"paged_decode_sweep: {len(errors)} rows failed or disagree with the reference")


if __name__ == "__main__":
    main()
