"""All kernel benchmarks in one device call, with the card's ceilings measured in the same run.

    PYTHONPATH=. python3 benchmarks/kernels.py --out_dir $OUT

1. Ceilings: HBM copy bandwidth (a large bf16 array copied by XLA: bytes read + written over time) and bf16 / fp8
   matmul TFLOP/s (8192^3 dots), so every kernel figure sits beside what this very card reached in this process.
2. benchmarks/kernels_flash.py (FlashAttention vs cuDNN and JAX's examples).
3. benchmarks/kernels_paged.py (paged decode and ragged attention vs JAX's example and the XLA reference).
Writes ceilings.json, flash.json and paged.json into --out_dir and prints each table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

# The ceilings run in this process and the kernel benchmarks in child processes that need the GPU's memory: without
# this, JAX here would keep 75% of the card preallocated while the children run (the 2026-12-01 run logged failed
# 105 GiB preallocations in the children, which then fell back to smaller pools).
_CHILD_ENV = dict(os.environ)
os.environ["XLA_PYTHON_CLIENT_ALLOCATOR"] = "platform"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.timing import median_seconds  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def ceilings() -> dict:
    """HBM copy TB/s and dense matmul TFLOP/s on the default device."""
    n = 1 << 30  # 1 Gi bf16 elements = 2 GiB
    x = jnp.ones((n,), jnp.bfloat16)
    copy = jax.jit(lambda a: a * jnp.bfloat16(1.0001))
    t = median_seconds(copy, x)
    out = {"device": str(jax.devices()[0].device_kind), "hbm_copy_TBps": 2 * x.nbytes / t / 1e12}
    m = 8192
    for name, dtype in (("bf16", jnp.bfloat16), ("fp8_e4m3", jnp.float8_e4m3fn)):
        # Random data: the 2026-12-01 run used all-ones matrices (830 TFLOP/s bf16), above the 769-798 KINDS.md saw on
        # random data on another H200, so ones likely flatter the ceiling.
        a = jax.random.normal(jax.random.key(0), (m, m), jnp.float32).astype(dtype)
        mm = jax.jit(lambda p, q: jnp.dot(p, q, preferred_element_type=jnp.bfloat16))
        try:
            out[f"matmul_{name}_TFLOPs"] = 2 * m**3 / median_seconds(mm, a, a) / 1e12
        except Exception as e:  # fp8 dots need Hopper; report rather than fail the whole run.
            out[f"matmul_{name}_TFLOPs"] = f"unavailable: {type(e).__name__}"
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out_dir", default=".")
    parser.add_argument("--quick", action="store_true", help="one config of ours per flash pass")
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    ceil = ceilings()
    print(json.dumps(ceil, indent=1), flush=True)
    with open(os.path.join(args.out_dir, "ceilings.json"), "w") as f:
        json.dump(ceil, f, indent=2)
    env = dict(_CHILD_ENV, PYTHONPATH=os.path.dirname(HERE), OUT=args.out_dir)  # kernels_flash writes $OUT/flash.json
    flash = [sys.executable, os.path.join(HERE, "kernels_flash.py")]
    paged = [sys.executable, os.path.join(HERE, "kernels_paged.py"), "--out", os.path.join(args.out_dir, "paged.json")]
    status = 0
    for cmd in (flash + (["--quick"] if args.quick else []), paged):
        status |= subprocess.run(cmd, env=env).returncode
    return status


if __name__ == "__main__":
    sys.exit(main())
