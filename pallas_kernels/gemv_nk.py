"""Weight-streaming GEMV over a K-contiguous weight: decode's one-row projections read the same [N, K] bytes that the
Hopper streaming kernel (stream_matmul_mgpu.py) and the W8A8 tensor-core kernel (w8a8_matmul.py) read, so a
quantised weight needs one stored copy for every batch size.

    x [M, K] (bf16 / f16 / f32)  @  (wt [N, K] (bf16 | int8 | fp8 e4m3))^T * scale[N]  ->  [M, N] in out_dtype

Data flow, grid = (N tiles, K chunks): program (j, c) loads `steps` tiles [bn, bk] of wt (each row's bk codes
contiguous: one 128-byte line per row and tile at bk 128 for 8-bit codes), issuing every load before the first
multiply (a static unroll, as gemv.py's tuned configs do), converts the codes to exact float32 (gemv.convert: integer
bit tricks for int8, the hardware cast for e4m3 unless `bit_convert`), and accumulates acc_r [bn, bk] += w * x_r[None, :]
on the FMA units; one reduction along K ends it: out[c, r, n tile] = sum(acc_r, axis 1) (* per-channel scale).
Chunks' f32 partials [C, M, N] are summed and cast by XLA (C = 1 stores the output dtype directly).

Weight layout: model/quant.py's "nk" (QuantizedArray.layout), values [N, K] with scales f32 [N] or [] (per tensor).
On CPU the same pallas_call runs in the Pallas interpreter (tests); "xla" is the reference.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.backend import out_struct, resolve_backend
from pallas_kernels.gemv import FP8_OUT_SCALE, convert

FORMATS = ("bf16", "int8", "fp8")
KERNEL_NAME = "gemv_nk"
MAX_ROWS = 4  # accumulators are [bn, bk] f32 per row of x: registers bound the rows


@dataclasses.dataclass(frozen=True)
class GemvNKConfig:
    """Tile sizes (a static argument).

    Attributes:
        block_n: weight rows (output columns) per program.
        block_k: K columns per tile (contiguous bytes of one weight row).
        steps: tiles per program along K, all loaded before the first multiply.
        num_warps: Triton warps per program.
        bit_convert: gemv.convert's integer bit tricks (False: plain dtype casts).
    """

    block_n: int = 32
    block_k: int = 128
    steps: int = 4
    num_warps: int = 4
    bit_convert: bool = True

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 8 or value & (value - 1):
                raise ValueError(f"GemvNKConfig.{name} must be a power of two >= 8, got {value}")
        if self.steps < 1:
            raise ValueError(f"GemvNKConfig.steps must be >= 1, got {self.steps}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"GemvNKConfig.num_warps must be a power of 2 <= 16, got {self.num_warps}")


def _load(ref, r0, height, c0, width, masked: bool):
    """ref[r0 : r0 + height, c0 : c0 + width] of a 2-D ref, zero outside its bounds when `masked`."""
    if not masked:
        return ref[pl.ds(r0, height), pl.ds(c0, width)]
    rows = r0 + jnp.arange(height)
    cols = c0 + jnp.arange(width)
    mask = (rows < ref.shape[0])[:, None] & (cols < ref.shape[1])[None, :]
    return pltriton.load(ref.at[rows[:, None], cols[None, :]], mask=mask, other=0)


def _gemv_nk_kernel(x_ref, w_ref, s_ref, o_ref, *, fmt, rows, k, bk, bn, steps, masked_k, masked_n, bit_convert):
    """x_ref [M * K] flat (as given); w_ref [N, K]; s_ref [N] f32 or None; o_ref [C, M, N] f32 or [M, N]."""
    n0 = pl.program_id(0) * bn
    chunk = pl.program_id(1)
    k0 = chunk * (steps * bk)
    masked = masked_k or masked_n
    tiles = [_load(w_ref, n0, bn, k0 + i * bk, bk, masked) for i in range(steps)]  # every load first
    xs = []
    for i in range(steps):
        cols = k0 + i * bk + jnp.arange(bk)
        for r in range(rows):
            view = x_ref.at[r * k + cols]
            xs.append(pltriton.load(view, mask=cols < k, other=0) if masked_k else pltriton.load(view))
    accs = [jnp.zeros((bn, bk), jnp.float32) for _ in range(rows)]
    for i, tile in enumerate(tiles):
        w = convert(tile, fmt, bit_convert)  # [bn, bk] f32
        for r in range(rows):
            accs[r] = accs[r] + w * xs[i * rows + r].astype(jnp.float32)[None, :]
    cols = n0 + jnp.arange(bn)
    for r in range(rows):
        out = jnp.sum(accs[r], axis=1)  # [bn]
        if fmt == "fp8" and bit_convert:
            out = out * FP8_OUT_SCALE
        if s_ref is not None:
            if masked_n:
                out = out * pltriton.load(s_ref.at[cols], mask=cols < s_ref.shape[0], other=0)
            else:
                out = out * s_ref[pl.ds(n0, bn)]
        lead = (r,) if len(o_ref.shape) == 2 else (chunk, r)
        out = out.astype(o_ref.dtype)
        if masked_n:
            pltriton.store(o_ref.at[(*lead, cols)], out, mask=cols < o_ref.shape[-1])
        else:
            o_ref[(*lead, pl.ds(n0, bn))] = out


@dataclasses.dataclass(frozen=True)
class _Plan:
    bn: int
    bk: int
    steps: int
    chunks: int

    def k_pad(self) -> int:
        return self.chunks * self.steps * self.bk


def plan(n: int, k: int, config: GemvNKConfig) -> _Plan:
    """Tiles of one call; steps shrink for short K (no empty tiles)."""
    bk = min(config.block_k, max(8, 1 << (k - 1).bit_length()))
    bn = min(config.block_n, max(8, 1 << (n - 1).bit_length()))
    tiles = -(-k // bk)
    steps = min(config.steps, tiles)
    return _Plan(bn, bk, steps, -(-tiles // steps))


def _pallas(x2, values, scales, *, fmt, config, interpret, out_dtype):
    rows, k = x2.shape
    n = values.shape[0]
    p = plan(n, k, config)
    if fmt == "fp8":
        values = jax.lax.bitcast_convert_type(values, jnp.uint8)
    if scales is not None:
        scales = jnp.broadcast_to(scales.astype(jnp.float32), (n,))
    operands = [a for a in (x2, values, scales) if a is not None]
    if p.chunks == 1:
        out_shape = out_struct((rows, n), out_dtype, operands)
    else:
        out_shape = out_struct((p.chunks, rows, n), jnp.float32, operands)
    kernel = functools.partial(
        _gemv_nk_kernel,
        fmt=fmt,
        rows=rows,
        k=k,
        bk=p.bk,
        bn=p.bn,
        steps=p.steps,
        masked_k=p.k_pad() != k,
        masked_n=n % p.bn != 0,
        bit_convert=config.bit_convert,
    )
    out = pl.pallas_call(
        kernel,
        grid=(-(-n // p.bn), p.chunks),
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=1),
        name=f"gemv_nk_{fmt}_m{rows}_n{p.bn}_k{p.bk}x{p.steps}_c{p.chunks}",
    )(x2.reshape(rows * k), values, scales)
    if p.chunks > 1:
        out = out.sum(axis=0)
    return out.astype(out_dtype)


def _validate(x, values, scales, fmt):
    """Raises ValueError naming the bad argument; returns the logical (K, N)."""
    if fmt not in FORMATS:
        raise ValueError(f"gemv_nk: unknown fmt {fmt!r}; expected one of {FORMATS}")
    if values.ndim != 2:
        raise ValueError(f"gemv_nk: values must be a 2-D weight [N, K], got shape {values.shape}")
    if x.ndim < 1 or x.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise ValueError(f"gemv_nk: x must be [..., K] bfloat16, float16 or float32, got {x.dtype}{x.shape}")
    rows = math.prod(x.shape[:-1])
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"gemv_nk: x has {rows} rows; the kernel takes 1 to {MAX_ROWS}")
    n, k = values.shape
    expected = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}.get(fmt)
    if fmt == "bf16" and values.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise ValueError(f"gemv_nk: fmt 'bf16' takes a float weight, got {values.dtype}")
    if expected is not None and values.dtype != expected:
        raise ValueError(f"gemv_nk: fmt {fmt!r} stores values as {jnp.dtype(expected)}, got {values.dtype}")
    if x.shape[-1] != k:
        raise ValueError(f"gemv_nk: x's last axis {x.shape[-1]} != the weight's K {k} (values are [N, K])")
    if fmt != "bf16" and (scales is None or scales.shape not in ((n,), ())):
        raise ValueError(f"gemv_nk: {fmt} scales must be [N]={n} or [] (per tensor), got {scales}")
    return k, n


def gemv_nk(
    x: jax.Array,
    values: jax.Array,
    scales: jax.Array | None = None,
    *,
    fmt: str = "bf16",
    config: GemvNKConfig | None = None,
    backend: str | None = None,
    out_dtype=None,
) -> jax.Array:
    """x [..., K] @ (values [N, K] * scales[N, None])^T -> [..., N] in `out_dtype` (default x's; f32
    accumulation), for 1 to MAX_ROWS rows of x.

    Args:
        x: activations [..., K] (bfloat16, float16 or float32).
        values: the weight stored K-contiguous, [N, K]: bf16 / f16 / f32, int8 or float8_e4m3fn.
        scales: int8 / fp8: f32 [N] (per output channel) or [] (per tensor); None for bf16.
        fmt: "bf16", "int8" or "fp8".
        config: tile sizes (GemvNKConfig()).
        backend: None (this device's choice), "triton", "interpret" or "xla" (the reference).
        out_dtype: the output's dtype (float32 keeps the accumulation).

    Raises:
        ValueError: shapes, dtypes, format, row count or backend do not fit.
    """
    _validate(x, values, scales, fmt)
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    resolved = resolve_backend(backend, KERNEL_NAME)
    if resolved == "xla":
        return _reference(x, values, scales, out_dtype=out_dtype)
    config = config or GemvNKConfig()
    return _kernel_jit(
        x, values, scales, fmt=fmt, config=config, interpret=resolved == "interpret", out_dtype=out_dtype
    )


@functools.partial(jax.jit, static_argnames=("fmt", "config", "interpret", "out_dtype"))
def _kernel_jit(x, values, scales, *, fmt, config, interpret, out_dtype):
    x2 = x.reshape(-1, x.shape[-1])
    out = _pallas(x2, values, scales, fmt=fmt, config=config, interpret=interpret, out_dtype=out_dtype)
    return out.reshape(*x.shape[:-1], values.shape[0])


def _reference(x, values, scales, *, out_dtype):
    w = values.astype(jnp.float32)
    if scales is not None:
        w = w * jnp.broadcast_to(scales.astype(jnp.float32), (values.shape[0],))[:, None]
    out = jnp.einsum("...k,nk->...n", x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
    return out.astype(out_dtype)


def reference(x, values, scales=None, *, fmt="bf16", config=None, backend=None, out_dtype=None):
    """Plain-jnp oracle with gemv_nk's signature: dequantise to f32, dot at HIGHEST, cast to out_dtype."""
    del config, backend
    _validate(x, values, scales, fmt)
    return _reference(x, values, scales, out_dtype=jnp.dtype(out_dtype or x.dtype))
