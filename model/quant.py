"""Quantised weights: one pytree type for every format, and the matmul door the linear layers call.

    QuantizedArray(values, scales, zeros, fmt, group_size)    logical weight [in, out], stored quantised
    matmul(x [..., in], w: QuantizedArray | jax.Array) -> [..., out]   dispatch by w.fmt

Formats (values dtype / scales shape for a logical [K, N] weight):
    "int8"       int8 [K, N]              scales float32 [N]           per output channel, symmetric
                                          or [K // g, N] with group_size g > 0 (GGUF Q8_0: g = 32)
    "fp8"        float8_e4m3fn [K, N]     scales float32 [N] or []     per channel or per tensor
    "int4"       uint8 [K // 2, N]        scales float32 [K // g, N]   group-wise along K (g = group_size);
                 (two 4-bit codes a byte: row 2i in the low nibble, 2i+1 in the high)   zeros [K // g, N] or None
                 symmetric: w = (code - 8) * scale; asymmetric: w = (code - zero) * scale

Optional extensions (all default off, so the layouts above are unchanged):
    pre_scale  float32 [K]   activations are multiplied by it before the matmul (AWQ / SmoothQuant move a
                             per-input-channel factor from x into the weight); logical weight = pre_scale[:, None] * w
    act_fmt    "int8" | "fp8" | ""   W8A8: x (after pre_scale) is quantised per token (dynamic) or with the static
                             per-tensor `act_scale` [] and dequantised before the dot (the numerics of a W8A8 kernel)
    layout     "kn" | "nk"   how `values` is stored: [K, N] (every format), or, per-channel int8 / fp8 only,
                             transposed [N, K] (K contiguous: what Hopper's 8-bit wgmma and the streaming kernel
                             read, so W8A8 weights are stored so at quantisation and never transposed per call);
                             scales keep their [N] / [] shape; `shape` and `dequantize` are the logical [K, N]

This file holds the data type and the plain-jnp dequantise-then-dot path; the Pallas streaming kernel
(pallas_kernels/quantized_matmul.py) is selected by `matmul` on GPUs where it was measured faster than XLA;
W8A8 weights of >= W8A8_MIN_ROWS rows take the 8-bit tensor-core kernel (pallas_kernels/w8a8_matmul.py) on Hopper.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

FORMATS = ("int8", "fp8", "int4")
LAYOUTS = ("kn", "nk")
ACT_FORMATS = ("", "int8", "fp8")
ACT_MAX = {"int8": 127.0, "fp8": 448.0}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
    """A weight [K, N] stored quantised (see the module docstring for each format's layout)."""

    values: jax.Array
    scales: jax.Array
    zeros: jax.Array | None = None
    fmt: str = dataclasses.field(default="int8", metadata=dict(static=True))
    group_size: int = dataclasses.field(default=0, metadata=dict(static=True))
    pre_scale: jax.Array | None = None
    act_scale: jax.Array | None = None
    act_fmt: str = dataclasses.field(default="", metadata=dict(static=True))
    stream: Any = None  # opt-in: the same weight in stream_matmul_mgpu's layout (`with_stream_layout`)
    layout: str = dataclasses.field(default="kn", metadata=dict(static=True))

    def __post_init__(self):
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown quantised format {self.fmt!r}; choose one of {FORMATS}")
        if self.act_fmt not in ACT_FORMATS:
            raise ValueError(f"unknown activation format act_fmt={self.act_fmt!r}; choose one of {ACT_FORMATS}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown quantised layout {self.layout!r}; choose one of {LAYOUTS}")
        if self.layout == "nk" and (self.fmt == "int4" or self.group_size):
            raise ValueError(f"layout 'nk' is for per-channel int8 / fp8 weights, not {self.fmt} g{self.group_size}")

    def __getitem__(self, index):
        """`w[...]` is `w` itself, so an nnx.Param slot can hold a QuantizedArray and layers read it as usual."""
        if index is not Ellipsis:
            raise TypeError("a QuantizedArray is read whole: w[...]")
        return self

    @property
    def shape(self) -> tuple[int, int]:
        k, n = self.values.shape[-2:][:: -1 if self.layout == "nk" else 1]
        return (2 * k, n) if self.fmt == "int4" else (k, n)

    @property
    def values_kn(self) -> jax.Array:
        """`values` as [K, N] (a transpose of an "nk" weight: for load-time readers, not per-call paths)."""
        return self.values.T if self.layout == "nk" else self.values

    @property
    def nbytes(self) -> int:
        arrays = (self.values, self.scales, self.zeros, self.pre_scale, self.act_scale)
        return sum(int(a.size * a.dtype.itemsize) for a in arrays if a is not None)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The logical weight [K, N] in `dtype` (pre_scale folded in)."""
        w = self._dequantize_stored()
        if self.pre_scale is not None:
            w = w * self.pre_scale.astype(jnp.float32)[:, None]
        return w.astype(dtype)

    def _dequantize_stored(self) -> jax.Array:
        if self.fmt in ("int8", "fp8"):
            scales = self.scales.astype(jnp.float32)
            if self.group_size and scales.ndim == 2:  # grouped int8 (GGUF Q8_0)
                scales = jnp.repeat(scales, self.group_size, axis=0)
            return self.values_kn.astype(jnp.float32) * scales
        lo = (self.values & 0xF).astype(jnp.float32)
        hi = (self.values >> 4).astype(jnp.float32)
        k2, n = self.values.shape
        codes = jnp.stack([lo, hi], axis=1).reshape(2 * k2, n)  # row 2i low nibble, 2i+1 high nibble
        g = self.group_size
        zeros = 8.0 if self.zeros is None else jnp.repeat(self.zeros.astype(jnp.float32), g, axis=0)
        return (codes - zeros) * jnp.repeat(self.scales.astype(jnp.float32), g, axis=0)


def to_layout(w: QuantizedArray, layout: str) -> QuantizedArray:
    """w with `values` stored as `layout` ("kn" [K, N] or "nk" [N, K]); the same logical weight."""
    if layout == w.layout:
        return w
    return dataclasses.replace(w, values=w.values.T, layout=layout)


def fake_quantize_activations(x: jax.Array, act_fmt: str, act_scale: jax.Array | None) -> jax.Array:
    """x quantised to int8 / e4m3 and back (per token from its own max unless a static scale is given): the jnp
    passes of pallas_kernels/act_quant.py (the W8A8 kernel's own quantiser: one rounding rule), codes kept."""
    from pallas_kernels.act_quant import fake_quantize_reference

    return fake_quantize_reference(x, act_fmt, act_scale)


def codes_barrier(codes: jax.Array) -> jax.Array:
    """8-bit codes XLA must keep: on the GPU it elides a convert f32 -> e4m3 -> f32 inside one jit (excess
    precision; measured on the H200, session 9: the round trip returned x unchanged), so every quantise-dequantise
    round trip (fake quantisation, scale searches, GPTQ's fp8 rounding) passes its codes through this barrier."""
    return jax.lax.optimization_barrier(codes)


def _prepare_input(x: jax.Array, w: QuantizedArray) -> jax.Array:
    if w.pre_scale is not None:
        x = (x.astype(jnp.float32) * w.pre_scale.astype(jnp.float32)).astype(x.dtype)
    if w.act_fmt:
        x = fake_quantize_activations(x, w.act_fmt, w.act_scale)
    return x


def reference_matmul(x: jax.Array, w: QuantizedArray) -> jax.Array:
    """x [..., K] @ dequantize(w) [K, N] -> [..., N] in x's dtype, float32 accumulation (the oracle)."""
    if w.act_fmt:
        x = _prepare_input(x, w)
        w = dataclasses.replace(w, pre_scale=None, act_fmt="", act_scale=None)
    # The f32 operands behind a barrier (as w8a8_matmul.exact_reference): XLA on a GPU may otherwise fold the
    # converts and scales into an 8-bit GEMM whose accumulation the oracle would share (x was already rounded by
    # fake_quantize_activations' codes_barrier: without it the H200 elided the e4m3 round trip, session 9).
    x32, wd = jax.lax.optimization_barrier((x.astype(jnp.float32), w.dequantize(jnp.float32)))
    return jnp.einsum("...k,kn->...n", x32, wd, precision="highest").astype(x.dtype)


# Where the streaming kernel (pallas_kernels/quantized_matmul.py, default tiles) beat XLA on the H200, by format:
# the largest row count M it is used for. From benchmarks/results/quantized_matmul_h200.json (one run, 8 cases per
# format: Llama-3-8B shapes at M = 1 and 64): bf16 beat XLA's dot in 7 of 8 (lost 4096x1024 at M = 64), int8 beat
# XLA's upcast-then-dot in all 4 at M = 1 and lost 3 of 4 at M = 64, fp8 beat XLA's fp8 dot in all 8. int4 was not
# compared with XLA's dequantise-then-dot in that run, so it is not selected yet. Plain bf16 weights (the engine's
# default path) stay on XLA's dot until the kernel has run inside the whole engine on a GPU (the 2.19 vs 2.11 TB/s
# kernel-level gain of that run does not yet justify changing every bf16 model's decode path unverified).
KERNEL_MAX_ROWS = {"int8": 16, "fp8": 64}


def use_kernel(fmt: str, rows: int, n: int, x_dtype) -> bool:
    """Whether matmul takes the Pallas streaming kernel for this call (GPU backends, bf16 / f16 activations)."""
    from pallas_kernels.backend import default_backend

    if default_backend("quantized_matmul") not in ("triton", "mosaic_gpu"):
        return False
    if x_dtype not in (jnp.bfloat16, jnp.float16) or (fmt == "bf16" and n <= 1024 and rows > 16):
        return False
    return rows <= KERNEL_MAX_ROWS.get(fmt, 0)


def with_stream_layout(w: QuantizedArray) -> QuantizedArray:
    """w plus a copy in the Hopper streaming kernel's layout (transposed; built once, at load): `matmul` then takes
    pallas_kernels/stream_matmul_mgpu.py for up to 256 rows on GPUs that run Mosaic GPU (the engine's opt-in
    `quantized_stream_layout`; faster 8B decode for int8 / fp8 on the H200, BENCHMARKS.md; int4 of any group size,
    symmetric or with zero points, GGUF Q4_0 / Q4_1 included, streams at 0.7-0.9 TB/s against XLA's 0.27); keeps
    `values`, so the weight's memory doubles. Grouped int8 (GGUF Q8_0) is returned as is."""
    from pallas_kernels.stream_matmul_mgpu import prepare

    if w.fmt == "int8" and w.group_size:
        return w
    stream = prepare(w.values_kn, w.scales, w.zeros, fmt=w.fmt, group_size=w.group_size)
    # prepare may hand back w's own scales: no leaf may be one buffer twice (in-place weight updates donate them).
    mine = {id(x) for x in jax.tree.leaves(w)}
    stream = jax.tree.map(lambda x: jnp.copy(x) if id(x) in mine else x, stream)
    return dataclasses.replace(w, stream=stream)


# The GEMV (pallas_kernels/gemv.py): decode's smallest batches, every [K, N] format read as stored (no second copy),
# the codes converted on the FMA units. The largest row count it takes per format; 0 = never. One row everywhere: on
# an H100 it beat every other JAX path in 24 of 25 one-row cases (BENCHMARKS.md "GEMV", session 13) and never lost
# whole-step time in 8B batch-1 decode (int4 5.9x, fp8 1.3x, int8 1.1x, bf16 even; "GEMV, session 14"); not yet
# measured on the H200.
GEMV_MAX_ROWS = {"bf16": 1, "int8": 1, "fp8": 1, "int4": 1}
# Tile configs per format as GemvConfig fields ("int8_g" is grouped int8): the fastest on 4096x14336 at M = 1 in
# session 14's two H100 sweeps (benchmarks/results/gemv_sweep_h100_session14{a,b}.log; the loops keeping tiles in
# flight lost to these unrolled programs in every format; fp8 and bf16 converting by plain casts tie the bit tricks).
# Atomic split-K (GemvConfig.atomic) won 3-4% in isolation for bf16 and fp8 but is left off: it adds a memset per
# call in the decode step (0.13 ms per 8B step) and makes the sums' order, hence the last bits, vary run to run.
GEMV_CONFIGS: dict[str, Any] = {
    "bf16": dict(block_n=128, block_k=32, steps=8, num_warps=4, bit_convert=False),
    "int8": dict(block_n=128, block_k=64, steps=4, num_warps=4),
    "int8_g": dict(block_n=128, block_k=8, steps=16, num_warps=4),
    "fp8": dict(block_n=128, block_k=32, steps=8, num_warps=4, bit_convert=False),
    "int4": dict(block_n=128, block_k=16, steps=4, num_warps=4),
}
GEMV_BACKEND = "triton"  # tests set "interpret" to run it in the interpreter on a CPU


def use_gemv(w: QuantizedArray | jax.Array, rows: int, x_dtype) -> bool:
    """Whether matmul takes the GEMV for x [rows, K] @ w (a GPU that runs it, or the interpreter in tests)."""
    from pallas_kernels.backend import device_supports

    if isinstance(w, QuantizedArray):
        grouped = w.fmt == "int4" or (w.fmt == "int8" and w.group_size)
        fits = (
            w.values.ndim == 2
            and w.layout == "kn"
            and (w.group_size in (16, 32, 64, 128) if grouped else not w.group_size)
        )
        fmt = w.fmt if fits else ""
    else:
        fmt = "bf16" if w.dtype in (jnp.bfloat16, jnp.float16) and w.ndim == 2 else ""
    # One device only: under a mesh XLA's partitioner would gather a custom call's sharded weight onto every device.
    return (
        rows <= GEMV_MAX_ROWS.get(fmt, 0)
        and x_dtype in (jnp.bfloat16, jnp.float16, jnp.float32)
        and (GEMV_BACKEND == "interpret" or (device_supports(GEMV_BACKEND) and jax.device_count() == 1))
    )


def gemv_config_key(fmt: str, group_size: int) -> str:
    """GEMV_CONFIGS' key of a stored format: grouped int8 (GGUF Q8_0) is tuned apart from per-channel int8."""
    return fmt + ("_g" if fmt == "int8" and group_size else "")


def _gemv_matmul(x, w: QuantizedArray | jax.Array, out_dtype):
    from pallas_kernels.gemv import GemvConfig, gemv

    if not isinstance(w, QuantizedArray):
        config = GemvConfig(**GEMV_CONFIGS.get("bf16", {}))
        return gemv(x, w, fmt="bf16", config=config, backend=GEMV_BACKEND, out_dtype=out_dtype)
    config = GemvConfig(**GEMV_CONFIGS.get(gemv_config_key(w.fmt, w.group_size), {}))
    kw = dict(fmt=w.fmt, group_size=w.group_size, config=config, backend=GEMV_BACKEND, out_dtype=out_dtype)
    return gemv(x, w.values, w.scales, w.zeros, **kw)


STREAM_BACKEND = "mosaic_gpu"  # tests set "interpret" to run the streaming kernel in the interpreter on a CPU


def _stream_ok(rows: int, x_dtype, out_dtype) -> bool:
    from pallas_kernels.backend import device_supports
    from pallas_kernels.stream_matmul_mgpu import MAX_ROWS

    return (
        x_dtype in (jnp.bfloat16, jnp.float16)
        and out_dtype == x_dtype
        and rows <= MAX_ROWS
        and device_supports(STREAM_BACKEND)
    )


# W8A8 prefill (act_fmt == fmt, per-channel or per-tensor weight scales): from this many rows on a Hopper GPU the
# 8-bit tensor-core kernel (pallas_kernels/w8a8_matmul.py) replaces fake-quantise-then-bf16-dot. Same activation
# quantiser (per token, or the static act_scale), exact 8-bit products instead of bf16-rounded dequantised ones.
# Decode-sized calls keep the path above. The 256 is the prefill threshold, not yet a measured crossover.
W8A8_MIN_ROWS = 256
W8A8_BACKEND = "mosaic_gpu"  # tests set "interpret" to drive this path through the Mosaic GPU interpreter on a CPU
# The activation quantiser before it (pallas_kernels/act_quant.py): None is "interpret" under an interpreted
# W8A8_BACKEND, else "triton"; "xla" is the two-pass jnp quantiser (benchmarks/w8a8_matmul.py compares them).
ACT_QUANT_BACKEND: str | None = None


def _act_quantiser(default: str) -> str:
    """pallas_kernels/act_quant.py's backend: ACT_QUANT_BACKEND when set, the interpreter under an interpreted
    W8A8_BACKEND, else `default`."""
    return ACT_QUANT_BACKEND or ("interpret" if W8A8_BACKEND == "interpret" else default)


def _fake_quantize_input(x: jax.Array, w: QuantizedArray) -> jax.Array:
    """`_prepare_input` for matmul's paths below W8A8_MIN_ROWS: where the act_quant kernel runs (a GPU, or the
    interpreter in tests), pre-scale, quantise and dequantise in its one pass and launch (XLA's quantiser takes
    a row-max pass, the divide-and-round pass and the dequantise pass behind a barrier: three launches a matmul,
    in every layer of a decode step); elsewhere the plain jnp passes. Same rule, so the same numbers (the kernel's
    codes may differ from XLA's only at rounding boundaries, as the W8A8 prefill path's do). One device only, as
    the GEMV: a row's max runs over all of K, which a tensor-parallel layout may split."""
    from pallas_kernels.backend import device_supports

    quantiser = _act_quantiser("triton" if device_supports("triton") and jax.device_count() == 1 else "xla")
    if not w.act_fmt or quantiser == "xla" or x.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        return _prepare_input(x, w)
    from pallas_kernels.act_quant import fake_quantize

    return fake_quantize(x, w.act_fmt, w.act_scale, w.pre_scale, backend=quantiser)


def use_w8a8_kernel(w: QuantizedArray, rows: int, x_dtype, out_dtype) -> bool:
    """Whether matmul takes the W8A8 kernel for x [rows, K] @ w."""
    if not w.act_fmt or w.fmt != w.act_fmt or w.group_size or w.values.ndim != 2 or rows < W8A8_MIN_ROWS:
        return False
    if x_dtype not in (jnp.bfloat16, jnp.float16) or out_dtype not in (jnp.bfloat16, jnp.float16):
        return False
    from pallas_kernels import backend, w8a8_matmul

    return backend.device_supports(W8A8_BACKEND) and w8a8_matmul.supports(w.fmt, *w.shape)


def _w8a8_kernel_matmul(x, w: QuantizedArray, out_dtype):
    from pallas_kernels.act_quant import quantize_activations
    from pallas_kernels.w8a8_matmul import w8a8_matmul

    x2 = x.reshape(-1, x.shape[-1])
    # One pass over x: SmoothQuant's pre_scale (rounded to x's dtype, as _prepare_input does) and the per-token or
    # static quantisation fused in a Pallas kernel (the same numbers as fake_quantize_activations).
    quantiser = _act_quantiser("triton")
    xq, x_scale = quantize_activations(x2, w.act_fmt, w.act_scale, w.pre_scale, backend=quantiser)
    wq, layout = w.values, w.layout  # 8-bit wgmma reads the weight K-major: quantize_model stores it [N, K] ...
    if layout == "kn" and w.stream is not None and w.stream.wt.shape == w.values.shape[::-1]:
        wq, layout = w.stream.wt, "nk"  # ... or with_stream_layout built the unpadded [N, K] copy at load
    out = w8a8_matmul(xq, wq, x_scale, w.scales, wq_layout=layout, out_dtype=out_dtype, backend=W8A8_BACKEND)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _nk_stream(w: QuantizedArray):
    """An "nk" weight viewed as the streaming kernel's StreamWeight without a copy (its [N, K] values already are
    that layout where N and K need no padding: the Llama-3-8B shapes), else None."""
    from pallas_kernels.stream_matmul_mgpu import K_ALIGN, N_ALIGN, StreamWeight

    k, n = w.shape
    if w.layout != "nk" or n % N_ALIGN or k % K_ALIGN:
        return None
    return StreamWeight(w.values, jnp.broadcast_to(w.scales.astype(jnp.float32), (n,)), None, w.fmt, 0, k, n)


def _kernel_matmul(x, values, scales, zeros, fmt, group_size):
    from pallas_kernels.quantized_matmul import quantized_matmul

    return quantized_matmul(x, values, scales, zeros, fmt=fmt, group_size=group_size, backend="triton")


def matmul(x: jax.Array, w: QuantizedArray | jax.Array, out_dtype=None) -> jax.Array:
    """The door every linear layer goes through: x [..., K] @ w [K, N] -> [..., N] in `out_dtype` (default x's).

    Plain arrays (bf16 / f32) and every quantised format enter here; the implementation is chosen by the format.
    Accumulation is float32; `out_dtype=jnp.float32` keeps it (the LM head's logits). On a GPU the Pallas
    streaming kernel runs where `use_kernel` says it beat XLA (outputs in x's dtype only); plain jnp elsewhere.
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    rows = math.prod(x.shape[:-1])
    if isinstance(w, QuantizedArray) and use_w8a8_kernel(w, rows, x.dtype, out_dtype):
        return _w8a8_kernel_matmul(x, w, out_dtype)
    if isinstance(w, QuantizedArray) and (w.pre_scale is not None or w.act_fmt):
        x = _fake_quantize_input(x, w)
        w = dataclasses.replace(w, pre_scale=None, act_fmt="", act_scale=None)
    if use_gemv(w, rows, x.dtype):
        return _gemv_matmul(x, w, out_dtype)
    if isinstance(w, QuantizedArray) and _stream_ok(rows, x.dtype, out_dtype):
        stream = w.stream if w.stream is not None else _nk_stream(w)  # a W8A8 weight's decode reads its [N, K]
        if stream is not None:
            from pallas_kernels.stream_matmul_mgpu import stream_matmul

            return stream_matmul(x, stream, backend=STREAM_BACKEND)
    fmt = w.fmt if isinstance(w, QuantizedArray) else ("bf16" if w.dtype == jnp.bfloat16 else "")
    # No Triton kernel for grouped int8, nor for [N, K] values (those take XLA below where no stream kernel runs).
    other = isinstance(w, QuantizedArray) and ((fmt != "int4" and w.group_size) or w.layout == "nk")
    if fmt and not other and out_dtype == x.dtype and use_kernel(fmt, rows, w.shape[-1], x.dtype):
        if fmt == "bf16":
            return _kernel_matmul(x, w, None, None, "bf16", 0)
        return _kernel_matmul(x, w.values, w.scales, w.zeros, w.fmt, w.group_size)
    if not isinstance(w, QuantizedArray):
        return jnp.einsum("...i,io->...o", x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(out_dtype)
    wd = w.dequantize(x.dtype)
    return jnp.einsum("...i,io->...o", x, wd, preferred_element_type=jnp.float32).astype(out_dtype)
