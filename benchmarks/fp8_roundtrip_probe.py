"""Two H200 probes of the fp8 W8A8 model path's 2.56% error, and its CPU interpreter check.

    PYTHONPATH=. python benchmarks/fp8_roundtrip_probe.py            # on the GPU: both probes
    PYTHONPATH=. python benchmarks/fp8_roundtrip_probe.py --cpu      # the interpreter check (Mosaic GPU interpret)

Probe 1: the W8A8 fp8 kernel (per-channel scales as [1, N] and [N]) and model.quant.matmul, eager and jitted,
against the exact f32 product of the same codes (w8a8_matmul.exact_reference), at 4096 x 4096 x 4096. Probe 2:
whether XLA keeps a convert f32 -> e4m3 -> f32 inside one jit (on the H200, 2026-12-03, it returned x unchanged,
before model.quant.codes_barrier).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import w8a8_matmul as bench
from model import quant
from pallas_kernels import act_quant
from pallas_kernels import w8a8_matmul as wm


def kernel_probe() -> None:
    xq, wq_t, xs, ws = bench.make_inputs("fp8", 4096, 4096, 4096)
    ref = wm.exact_reference(xq, wq_t, xs, ws, wq_layout="nk")
    for name, s in (("ws(1,N)", ws), ("ws(N,)", ws.reshape(-1))):
        print(name, bench.rel_error(wm.w8a8_matmul(xq, wq_t, xs, s, wq_layout="nk"), ref), flush=True)
    x = jax.random.normal(jax.random.key(3), (4096, 4096), jnp.bfloat16)
    q = quant.QuantizedArray(wq_t, ws.reshape(-1), fmt="fp8", act_fmt="fp8", layout="nk")
    xq2, xs2 = act_quant.quantize_activations(x, "fp8")
    ref2 = wm.exact_reference(xq2, wq_t, xs2, ws, wq_layout="nk")
    print("direct on x", bench.rel_error(wm.w8a8_matmul(xq2, wq_t, xs2, ws, wq_layout="nk"), ref2))
    print("model path", bench.rel_error(quant.matmul(x, q), ref2))
    print("model path jit", bench.rel_error(jax.jit(quant.matmul)(x, q), ref2))


def roundtrip_probe() -> None:
    x = jax.random.normal(jax.random.key(0), (1024,), jnp.float32)
    f = jax.jit(lambda a: jnp.clip(a, -448.0, 448.0).astype(jnp.float8_e4m3fn).astype(jnp.float32))
    want = np.asarray(x).astype(jnp.float8_e4m3fn).astype(np.float32)
    got = np.asarray(f(x))
    print(
        "roundtrip equals x (elided):",
        bool((got == np.asarray(x)).all()),
        "equals fp8 values:",
        bool((got == want).all()),
    )
    kept = np.asarray(jax.jit(lambda a: quant.codes_barrier(a.astype(jnp.float8_e4m3fn)).astype(jnp.float32))(x))
    print("with codes_barrier equals fp8 values:", bool((kept == want).all()))


def interpreter_check() -> None:
    base = quant.MatmulOptions(w8a8_backend="interpret")
    bench.TIMING.update(iters=1, reps=1)
    for m, k, n in ((256, 512, 4096), (256, 4096, 512)):
        r = bench.time_model_path(m, k, n, detail=False, quantisers=False, base=base)
        print(m, k, n, {key: v for key, v in r.items() if "error" in key}, flush=True)


if __name__ == "__main__":
    if "--cpu" in sys.argv:
        interpreter_check()
    else:
        roundtrip_probe()
        kernel_probe()
