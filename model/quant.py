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

Stacked experts (model/moe.py `expert_matmul`, made by model/quantize_model.py `quantize_experts`): a weight
[E, K, N] of E experts is one QuantizedArray whose every array leaf leads with E (values [E, K, N], scales [E, N]
or [E, K // g, N], ...), each expert its own weight in the formats above; `shape` is then [E, K, N].

This file holds the data type, the plain-jnp dequantise-then-dot path and the choice among the Pallas kernels
(`MatmulOptions`: the GEMVs, the streaming kernels, the W8A8 tensor-core kernel, by format and row count).
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
    options: Any = dataclasses.field(default=None, metadata=dict(static=True))  # MatmulOptions; None: the defaults

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
        lead = self.values.shape[:-2]  # (E,) for stacked experts [E, K, N] (model/moe.py), else ()
        return (*lead, 2 * k, n) if self.fmt == "int4" else (*lead, k, n)

    @property
    def values_kn(self) -> jax.Array:
        """`values` as [K, N] (a transpose of an "nk" weight: for load-time readers, not per-call paths)."""
        return self.values.T if self.layout == "nk" else self.values

    @property
    def nbytes(self) -> int:
        arrays = (self.values, self.scales, self.zeros, self.pre_scale, self.act_scale)
        return sum(int(a.size * a.dtype.itemsize) for a in arrays if a is not None)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The logical weight [K, N] in `dtype` (pre_scale folded in); stacked experts [E, K, N] expert by expert."""
        if self.values.ndim == 3:  # every leaf leads with E (quantize_model.quantize_experts)
            return jax.vmap(lambda w: w.dequantize(dtype))(self)
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
    precision; measured on the H200: the round trip returned x unchanged), so every quantise-dequantise
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
    # fake_quantize_activations' codes_barrier: without it the H200 elided the e4m3 round trip).
    x32, wd = jax.lax.optimization_barrier((x.astype(jnp.float32), w.dequantize(jnp.float32)))
    return jnp.einsum("...k,kn->...n", x32, wd, precision="highest").astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class MatmulOptions:
    """Which kernel `matmul` takes, by stored format and row count M of x (a hashable, static value). A weight
    carries its own (QuantizedArray.options, set with `with_options`); None and plain arrays take DEFAULT_OPTIONS.

    The paths, tried in this order (each only where it applies; the rest take XLA's dequantise-then-dot):
        w8a8:    act_fmt == fmt weights from `w8a8_min_rows` rows on Hopper (pallas_kernels/w8a8_matmul.py)
        gemv:    M <= gemv_max_rows[fmt]: pallas_kernels/gemv.py ([K, N] values) or gemv_nk.py ([N, K] int8 / fp8,
                 keys "int8_nk" / "fp8_nk")
        stream:  M <= stream_max_rows on Hopper: pallas_kernels/stream_matmul_mgpu.py over the [N, K] values of an
                 "nk" weight (no copy) or the opt-in `with_stream_layout` copy
        kernel:  M <= kernel_max_rows[fmt]: pallas_kernels/quantized_matmul.py, dequantising [K, N] tiles in
                 registers for the tensor cores (Triton; any recent NVIDIA GPU)
    Tables are ((fmt, rows), ...) pairs; a format not listed takes 0 rows. Backends: "interpret" runs the kernel
    in the Pallas interpreter on a CPU (tests); the others as in pallas_kernels/backend.py.

    W8A8 weights (act_fmt == fmt, per-channel or per-tensor weight scales) take the 8-bit tensor-core kernel from
    `w8a8_min_rows` rows (the prefill threshold, not yet a measured crossover): the same activation quantiser (per
    token, or the static act_scale), exact 8-bit products instead of bf16-rounded dequantised ones. Below it their
    x is fake-quantised (act_quant.py's one pass) and takes the paths above. `act_quant_backend`: None is
    "interpret" under an interpreted w8a8_backend, else "triton" where it runs; "xla" the two-pass jnp quantiser.
    `fuse_act_quant`: a W8A8 weight's input quantiser runs in one kernel with the op that makes that input
    (model/quant_fused.py: the decoder's residual add + RMSNorm before q|k|v and gate|up, SwiGLU before the down
    projection) where the quantiser kernel runs; False: the op, then the quantiser (the same numbers).
    """

    gemv_max_rows: tuple[tuple[str, int], ...] = (
        ("bf16", 1),
        ("int8", 1),
        ("fp8", 1),
        ("int4", 1),
        ("int8_nk", 0),
        ("fp8_nk", 0),
    )
    stream_max_rows: int = 256
    kernel_max_rows: tuple[tuple[str, int], ...] = (("int8", 16), ("fp8", 64), ("int4", 64))
    gemv_backend: str = "triton"
    stream_backend: str = "mosaic_gpu"
    kernel_backend: str = "triton"
    w8a8_min_rows: int = 256
    w8a8_backend: str = "mosaic_gpu"
    act_quant_backend: str | None = None
    fuse_act_quant: bool = True

    def rows(self, table: str, fmt: str) -> int:
        """The largest row count `table` ("gemv_max_rows" / "kernel_max_rows") sends through its path."""
        return dict(getattr(self, table)).get(fmt, 0)

    def runs(self, backend: str) -> bool:
        """Whether a path on `backend` can run here: the interpreter anywhere, a GPU backend on one device that
        runs it (under a mesh XLA's partitioner would gather a custom call's sharded weight onto every device)."""
        from pallas_kernels.backend import device_supports

        return backend == "interpret" or (device_supports(backend) and jax.device_count() == 1)


# Crossovers (rows of x) per path, only where a GPU measurement backs them (BENCHMARKS.md; each path beat the one it
# replaces at that row count): the [K, N] GEMV serves one row in every format (on an H100 it beat every other JAX path
# in 24 of 25 one-row cases and never lost whole-step time in 8B batch-1 decode: int4 5.9x, fp8 1.3x, int8 1.1x);
# the streaming kernel [N, K] int8 / fp8 weights from one row to its 256 (on the H200, with the same [N, K] bytes as
# a second copy: 8B decode 265 / 275 tok/s at batch 1 against 215 / 176 before, 9,436 / 9,763 at batch 64 against
# bf16's 8,584; at 256 rows 146 us against XLA's dequantise-then-dot 308 on 4096x28672). The [N, K] GEMV
# (gemv_nk.py, "int8_nk" / "fp8_nk") is off until it is timed on a GPU against the streaming kernel's one row
# (benchmarks/matmul_rows.py --paths gemv_sweep,stream --rows 1). int4 takes the Triton kernel to 64 rows (H100,
# M = 64: 0.38-0.42 TB/s against XLA's 0.15) and XLA's dequantise-then-dot above, where its tensor-core GEMM should
# win (the Triton kernel converts every code once per 64 rows); the `quantized_stream_layout` copy, where kept, goes
# first (0.7-0.9 TB/s).
DEFAULT_OPTIONS = MatmulOptions()
# The paths before one layout served every row count (benchmarks' "old" path): 8-bit weights [K, N], the Triton
# kernel to 16 (int8) / 64 (fp8) rows, XLA's dequantise-then-dot beyond and for int4 above one row.
LEGACY_OPTIONS = MatmulOptions(kernel_max_rows=(("int8", 16), ("fp8", 64)))
# Every kernel path in the Pallas interpreter (CPU tests of the door).
INTERPRET_OPTIONS = MatmulOptions(
    gemv_backend="interpret", stream_backend="interpret", kernel_backend="interpret", w8a8_backend="interpret"
)


def with_options(tree, options: MatmulOptions | None):
    """Every QuantizedArray in `tree` (a model's state, a dict, one weight) carrying `options`."""

    def one(w):
        return dataclasses.replace(w, options=options) if isinstance(w, QuantizedArray) else w

    return jax.tree.map(one, tree, is_leaf=lambda w: isinstance(w, QuantizedArray))


def set_options(model, options: MatmulOptions | None) -> None:
    """Every QuantizedArray of an NNX model (in place) carrying `options`: its traced steps then take those paths."""
    from flax import nnx

    nnx.update(model, with_options(nnx.state(model), options))


def options_of(w) -> MatmulOptions:
    return (w.options if isinstance(w, QuantizedArray) else None) or DEFAULT_OPTIONS


def _nk_aligned(fmt: str, group_size: int, k: int, n: int) -> bool:
    from pallas_kernels.stream_matmul_mgpu import K_ALIGN, N_ALIGN

    return fmt in ("int8", "fp8") and not group_size and k % K_ALIGN == 0 and n % N_ALIGN == 0


def decode_layout(w: QuantizedArray, options: MatmulOptions | None = None) -> QuantizedArray:
    """w in the one layout every decode path reads fastest on this device, no second copy: per-channel int8 / fp8
    weights whose K and N fill the streaming kernel's tiles are stored [N, K] ("nk") where the Hopper streaming
    kernel runs (one device): the GEMV (gemv_nk.py), the streaming kernel (2..256 rows) and the W8A8 kernel read it
    as stored, XLA's dot above 256 rows through a fused transpose. Everything else is returned as is."""
    options = options or options_of(w)
    if w.values.ndim != 2 or w.layout != "kn" or not _nk_aligned(w.fmt, w.group_size, *w.shape):
        return w
    if not options.runs(options.stream_backend) or options.stream_max_rows < 2:
        return w
    return to_layout(w, "nk")


def with_stream_layout(w: QuantizedArray) -> QuantizedArray:
    """w readable by the Hopper streaming kernel (pallas_kernels/stream_matmul_mgpu.py) for up to 256 rows (the
    engine's opt-in `quantized_stream_layout`): per-channel int8 / fp8 weights whose shapes fit its tiles move to
    [N, K] (no copy: `decode_layout`'s layout, whatever the device); other int4 / int8 / fp8 weights keep `values`
    and get a second copy in its layout (their memory doubles). Grouped int8 (GGUF Q8_0) is returned as is."""
    from pallas_kernels.stream_matmul_mgpu import prepare

    if w.fmt == "int8" and w.group_size:
        return w
    if w.layout == "nk" or (w.values.ndim == 2 and _nk_aligned(w.fmt, w.group_size, *w.shape)):
        return to_layout(w, "nk")
    stream = prepare(w.values_kn, w.scales, w.zeros, fmt=w.fmt, group_size=w.group_size)
    # prepare may hand back w's own scales: no leaf may be one buffer twice (in-place weight updates donate them).
    mine = {id(x) for x in jax.tree.leaves(w)}
    stream = jax.tree.map(lambda x: jnp.copy(x) if id(x) in mine else x, stream)
    return dataclasses.replace(w, stream=stream)


# GEMV tile configs per format as GemvConfig fields ("int8_g" is grouped int8): the fastest on 4096x14336 at M = 1
# in two H100 sweeps (benchmarks/results/gemv_sweep_h100_2026-12-06{a,b}.log; the loops keeping tiles in flight lost
# to these unrolled programs in every format; fp8 and bf16 converting by plain casts tie the bit tricks). Atomic
# split-K (GemvConfig.atomic) won 3-4% in isolation for bf16 and fp8 but is left off: it adds a memset per call in
# the decode step (0.13 ms per 8B step) and makes the sums' order, hence the last bits, vary run to run.
GEMV_CONFIGS: dict[str, Any] = {
    "bf16": dict(block_n=128, block_k=32, steps=8, num_warps=4, bit_convert=False),
    "int8": dict(block_n=128, block_k=64, steps=4, num_warps=4),
    "int8_g": dict(block_n=128, block_k=8, steps=16, num_warps=4),
    "fp8": dict(block_n=128, block_k=32, steps=8, num_warps=4, bit_convert=False),
    "int4": dict(block_n=128, block_k=16, steps=4, num_warps=4),
}
# The [N, K] GEMV's (pallas_kernels/gemv_nk.py): 32 KB of codes per program, as the [K, N] GEMV's tuned tiles.
GEMV_NK_CONFIGS: dict[str, Any] = {
    "int8": dict(block_n=64, block_k=128, steps=4, num_warps=4),
    "fp8": dict(block_n=64, block_k=128, steps=4, num_warps=4, bit_convert=False),
}


def _gemv_format(w: QuantizedArray | jax.Array) -> str:
    """The GEMV format key of a weight it can read, else ""."""
    if not isinstance(w, QuantizedArray):
        return "bf16" if w.dtype in (jnp.bfloat16, jnp.float16) and w.ndim == 2 else ""
    if w.values.ndim != 2:
        return ""
    if w.layout == "nk":
        return w.fmt + "_nk" if w.fmt in ("int8", "fp8") and not w.group_size else ""
    grouped = w.fmt == "int4" or (w.fmt == "int8" and w.group_size)
    return w.fmt if (w.group_size in (16, 32, 64, 128) if grouped else not w.group_size) else ""


def use_gemv(w: QuantizedArray | jax.Array, rows: int, x_dtype, options: MatmulOptions | None = None) -> bool:
    """Whether matmul takes the GEMV for x [rows, K] @ w (a GPU that runs it, or the interpreter in tests)."""
    options = options or options_of(w)
    return (
        rows <= options.rows("gemv_max_rows", _gemv_format(w))
        and x_dtype in (jnp.bfloat16, jnp.float16, jnp.float32)
        and options.runs(options.gemv_backend)
    )


def gemv_config_key(fmt: str, group_size: int) -> str:
    """GEMV_CONFIGS' key of a stored format: grouped int8 (GGUF Q8_0) is tuned apart from per-channel int8."""
    return fmt + ("_g" if fmt == "int8" and group_size else "")


def _gemv_matmul(x, w: QuantizedArray | jax.Array, out_dtype, options: MatmulOptions):
    from pallas_kernels.gemv import GemvConfig, gemv

    backend = options.gemv_backend
    if not isinstance(w, QuantizedArray):
        config = GemvConfig(**GEMV_CONFIGS.get("bf16", {}))
        return gemv(x, w, fmt="bf16", config=config, backend=backend, out_dtype=out_dtype)
    if w.layout == "nk":
        from pallas_kernels.gemv_nk import GemvNKConfig, gemv_nk

        config = GemvNKConfig(**GEMV_NK_CONFIGS.get(w.fmt, {}))
        return gemv_nk(x, w.values, w.scales, fmt=w.fmt, config=config, backend=backend, out_dtype=out_dtype)
    config = GemvConfig(**GEMV_CONFIGS.get(gemv_config_key(w.fmt, w.group_size), {}))
    kw = dict(fmt=w.fmt, group_size=w.group_size, config=config, backend=backend, out_dtype=out_dtype)
    return gemv(x, w.values, w.scales, w.zeros, **kw)


def _stream_ok(rows: int, x_dtype, out_dtype, options: MatmulOptions) -> bool:
    from pallas_kernels.backend import device_supports
    from pallas_kernels.stream_matmul_mgpu import MAX_ROWS

    return (
        x_dtype in (jnp.bfloat16, jnp.float16)
        and out_dtype == x_dtype
        and rows <= min(MAX_ROWS, options.stream_max_rows)
        and device_supports(options.stream_backend)
    )


def use_kernel(w: QuantizedArray | jax.Array, rows: int, x_dtype, options: MatmulOptions | None = None) -> bool:
    """Whether matmul takes the Triton streaming kernel (pallas_kernels/quantized_matmul.py) for x [rows, K] @ w:
    [K, N] values of a format it reads (no grouped int8), bf16 / f16 activations, a GPU that runs it."""
    options = options or options_of(w)
    if not isinstance(w, QuantizedArray) or w.values.ndim != 2 or w.layout != "kn":
        return False
    if (w.fmt != "int4" and w.group_size) or (w.fmt == "int4" and w.group_size not in (32, 64, 128)):
        return False
    if x_dtype not in (jnp.bfloat16, jnp.float16) or rows > options.rows("kernel_max_rows", w.fmt):
        return False
    return options.runs(options.kernel_backend)


def act_quantiser(options: MatmulOptions, default: str) -> str:
    """pallas_kernels/act_quant.py's backend: options.act_quant_backend when set, the interpreter under an
    interpreted w8a8_backend, else `default`."""
    return options.act_quant_backend or ("interpret" if options.w8a8_backend == "interpret" else default)


def _fake_quantize_input(x: jax.Array, w: QuantizedArray, options: MatmulOptions) -> jax.Array:
    """`_prepare_input` for matmul's paths below w8a8_min_rows: where the act_quant kernel runs (a GPU, or the
    interpreter in tests), pre-scale, quantise and dequantise in its one pass and launch (XLA's quantiser takes
    a row-max pass, the divide-and-round pass and the dequantise pass behind a barrier: three launches a matmul,
    in every layer of a decode step); elsewhere the plain jnp passes. Same rule, so the same numbers (the kernel's
    codes may differ from XLA's only at rounding boundaries, as the W8A8 prefill path's do). One device only, as
    the GEMV: a row's max runs over all of K, which a tensor-parallel layout may split."""
    from pallas_kernels.backend import device_supports

    quantiser = act_quantiser(options, "triton" if device_supports("triton") and jax.device_count() == 1 else "xla")
    if not w.act_fmt or quantiser == "xla" or x.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        return _prepare_input(x, w)
    from pallas_kernels.act_quant import fake_quantize

    return fake_quantize(x, w.act_fmt, w.act_scale, w.pre_scale, backend=quantiser)


def use_w8a8_kernel(w: QuantizedArray, rows: int, x_dtype, out_dtype, options: MatmulOptions | None = None) -> bool:
    """Whether matmul takes the W8A8 kernel for x [rows, K] @ w."""
    options = options or options_of(w)
    if not w.act_fmt or w.fmt != w.act_fmt or w.group_size or w.values.ndim != 2 or rows < options.w8a8_min_rows:
        return False
    if x_dtype not in (jnp.bfloat16, jnp.float16) or out_dtype not in (jnp.bfloat16, jnp.float16):
        return False
    from pallas_kernels import backend, w8a8_matmul

    return backend.device_supports(options.w8a8_backend) and w8a8_matmul.supports(w.fmt, *w.shape)


def w8a8_kernel_matmul(x, w: QuantizedArray, out_dtype, options: MatmulOptions | None = None, quantized=None):
    """x @ w through the W8A8 kernel (`use_w8a8_kernel`); `quantized`: x's (codes, scales) already made by a fused
    quantiser (pallas_kernels/act_quant_fused.py), else act_quant's one pass over x."""
    from pallas_kernels.act_quant import quantize_activations
    from pallas_kernels.w8a8_matmul import w8a8_matmul

    options = options or options_of(w)
    lead = x.shape[:-1] if quantized is None else quantized[0].shape[:-1]
    if quantized is None:
        # One pass over x: SmoothQuant's pre_scale (rounded to x's dtype, as _prepare_input does) and the per-token
        # or static quantisation fused in a Pallas kernel (the same numbers as fake_quantize_activations).
        quantiser = act_quantiser(options, "triton")
        x2 = x.reshape(-1, x.shape[-1])
        xq, x_scale = quantize_activations(x2, w.act_fmt, w.act_scale, w.pre_scale, backend=quantiser)
    else:
        xq, x_scale = (a.reshape(-1, a.shape[-1]) for a in quantized)
    wq, layout = w.values, w.layout  # 8-bit wgmma reads the weight K-major: quantize_model stores it [N, K] ...
    if layout == "kn" and w.stream is not None and w.stream.wt.shape == w.values.shape[::-1]:
        wq, layout = w.stream.wt, "nk"  # ... or with_stream_layout built the unpadded [N, K] copy at load
    backend = options.w8a8_backend
    out = w8a8_matmul(xq, wq, x_scale, w.scales, wq_layout=layout, out_dtype=out_dtype, backend=backend)
    return out.reshape(*lead, out.shape[-1])


def _nk_stream(w: QuantizedArray):
    """An "nk" weight viewed as the streaming kernel's StreamWeight without a copy (its [N, K] values already are
    that layout where N and K need no padding: the Llama-3-8B shapes), else None."""
    from pallas_kernels.stream_matmul_mgpu import K_ALIGN, N_ALIGN, StreamWeight

    k, n = w.shape
    if w.layout != "nk" or n % N_ALIGN or k % K_ALIGN:
        return None
    return StreamWeight(w.values, jnp.broadcast_to(w.scales.astype(jnp.float32), (n,)), None, w.fmt, 0, k, n)


# Tile configs of the Triton dequantising kernel (pallas_kernels/quantized_matmul.py) per format, as
# QuantizedMatmulConfig fields (a format not listed takes the defaults).
KERNEL_CONFIGS: dict[str, Any] = {}


def _kernel_matmul(x, w: QuantizedArray, options: MatmulOptions):
    from pallas_kernels.quantized_matmul import QuantizedMatmulConfig, quantized_matmul

    config = QuantizedMatmulConfig(**KERNEL_CONFIGS.get(w.fmt, {}))
    kw = dict(fmt=w.fmt, group_size=w.group_size, config=config, backend=options.kernel_backend)
    return quantized_matmul(x, w.values, w.scales, w.zeros, **kw)


def matmul(x: jax.Array, w: QuantizedArray | jax.Array, out_dtype=None, options: MatmulOptions | None = None):
    """The door every linear layer goes through: x [..., K] @ w [K, N] -> [..., N] in `out_dtype` (default x's).

    Plain arrays (bf16 / f32) and every quantised format enter here; the path is chosen by the format, the row count
    and `options` (default: the weight's own, else DEFAULT_OPTIONS; see MatmulOptions). Accumulation is float32;
    `out_dtype=jnp.float32` keeps it (the LM head's logits).
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    options = options or options_of(w)
    rows = math.prod(x.shape[:-1])
    if isinstance(w, QuantizedArray) and use_w8a8_kernel(w, rows, x.dtype, out_dtype, options):
        return w8a8_kernel_matmul(x, w, out_dtype, options)
    if isinstance(w, QuantizedArray) and (w.pre_scale is not None or w.act_fmt):
        x = _fake_quantize_input(x, w, options)
        w = dataclasses.replace(w, pre_scale=None, act_fmt="", act_scale=None)
    if use_gemv(w, rows, x.dtype, options):
        return _gemv_matmul(x, w, out_dtype, options)
    if isinstance(w, QuantizedArray) and _stream_ok(rows, x.dtype, out_dtype, options):
        stream = w.stream if w.stream is not None else _nk_stream(w)  # an "nk" weight's decode reads its [N, K]
        if stream is not None:
            from pallas_kernels.stream_matmul_mgpu import stream_matmul

            return stream_matmul(x, stream, backend=options.stream_backend)
    if out_dtype == x.dtype and use_kernel(w, rows, x.dtype, options):
        return _kernel_matmul(x, w, options)
    if not isinstance(w, QuantizedArray):
        return jnp.einsum("...i,io->...o", x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(out_dtype)
    wd = w.dequantize(x.dtype)
    return jnp.einsum("...i,io->...o", x, wd, preferred_element_type=jnp.float32).astype(out_dtype)
