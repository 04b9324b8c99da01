"""Weight-streaming matmul for small M (decode), dequantising the weight tile in registers.

    x [..., K] (bf16 / f16)  @  w [K, N] (bf16 | int8 | fp8 e4m3 | packed int4)  ->  [..., N] in x's dtype

Data flow (Triton / interpret backends), grid = (M tiles, N tiles, K splits):

    program (m, n, s) walks K steps [s * steps_per_split, ...) of one [block_k, block_n] weight column strip:
        x tile  [bm, bk]  (rows padded to a power of two >= 16: Triton's dot needs 16)
        w tile  [bk, bn]  quantised codes -> compute dtype (int8 and e4m3 convert exactly to bf16)
        acc    += x @ w                                              f32 [bm, bn]
    int8 / fp8: acc *= scale[n] once at the end (per-channel or broadcast per-tensor scale)
    int4:       one dot per group of g rows: acc += (x_even @ (lo - z) + x_odd @ (hi - z)) * scale[group, n]
                (x is split into its even and odd K columns outside the kernel, so the two nibbles of a byte
                 never need interleaving in registers)
    num_splits == 1: the program stores its tile in x's dtype; else f32 partials [S * Mp, N] summed by XLA.

Weight layouts are those of model/quant.py (this module takes raw arrays, so kernels do not import the model).
M tiles are the fastest grid axis: programs sharing a weight strip run side by side and re-read it from L2.
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

FORMATS = ("bf16", "int8", "fp8", "int4")
KERNEL_NAME = "quantized_matmul"


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class QuantizedMatmulConfig:
    """Tile sizes of the streaming matmul (a static argument).

    Attributes:
        block_m: most rows of x per program (more rows add M tiles that re-read the weight strip from L2).
        block_n: weight columns per program.
        block_k: weight rows per K step (int4: rounded down to whole groups).
        num_splits: K splits across programs; 0 picks enough to give every SM a few programs.
        num_warps: Triton warps per program.
        num_stages: Triton software-pipelining depth of the K loop.
        prefetch: load the next K step's weight tiles before computing this one (opt-in: not yet measured).
        bit_convert: int8 and int4 codes become bf16 through integer bit tricks instead of the I2F/F2F conversion
            units (bf16 x only): int8 v = bf16(0x4300 | v & 0x7F) - bf16(0x4300 | v & 0x80), i.e. (128 + low 7
            bits) - (128 or 256); int4 dots 128 + code (bf16 0x4300 | code) and subtracts (128 + zero) * sum(x) per
            group (the zero point leaves the inner loop, so float zero points stay exact).
    """

    block_m: int = 64
    block_n: int = 128
    block_k: int = 128
    num_splits: int = 0
    num_warps: int = 4
    num_stages: int = 4
    prefetch: bool = False
    bit_convert: bool = False

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if not _is_pow2(value) or value < 16:
                raise ValueError(f"QuantizedMatmulConfig.{name} must be a power of two >= 16, got {value}")
        if self.num_splits < 0:
            raise ValueError(f"QuantizedMatmulConfig.num_splits must be >= 0 (0 = auto), got {self.num_splits}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"QuantizedMatmulConfig.num_warps must be a power of 2 <= 16, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"QuantizedMatmulConfig.num_stages must be >= 1, got {self.num_stages}")


@functools.cache
def _num_sms() -> int:
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def choose_num_splits(config: QuantizedMatmulConfig, tiles: int, num_steps: int) -> int:
    """K splits: the configured number, or (auto) enough programs for ~2 waves of the SMs, capped by the steps."""
    if config.num_splits:
        return max(1, min(config.num_splits, num_steps))
    return max(1, min(num_steps, math.ceil(2 * _num_sms() / tiles)))


# ---------------------------------------------------------------------------------------------------------
# Kernel bodies.
# ---------------------------------------------------------------------------------------------------------
def _load_tile(ref, r0, height, c0, width):
    """ref[r0 : r0 + height, c0 : c0 + width], zero outside ref's bounds (only where the static shape needs it).

    Partial tiles use all-array indices with a mask: the interpreter then masks as Triton does (a pl.ds clamps).
    """
    r_total, n_total = ref.shape
    if r_total % height == 0 and n_total % width == 0:
        return ref[pl.ds(r0, height), pl.ds(c0, width)]
    rows = r0 + jnp.arange(height)
    cols = c0 + jnp.arange(width)
    mask = (rows < r_total)[:, None] & (cols < n_total)[None, :]
    return pltriton.load(ref.at[rows[:, None], cols[None, :]], mask=mask, other=0)


def _load_row(ref, r, c0, width):
    """ref[r, c0 : c0 + width] of a 2-D ref (or ref[c0 : c0 + width] of a 1-D one when r is None), zero past N."""
    n_total = ref.shape[-1]
    if n_total % width == 0:
        return ref[pl.ds(c0, width)] if r is None else ref[r, pl.ds(c0, width)]
    cols = c0 + jnp.arange(width)
    view = ref.at[cols] if r is None else ref.at[r, cols]
    return pltriton.load(view, mask=cols < n_total, other=0)


def _dot(x, w):
    return jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _store(o_ref, acc, m0, n0):
    """o_ref[m0 : m0 + bm, n0 : n0 + bn] = acc; rows are padded (in bounds), columns past N are masked."""
    bm, bn = acc.shape
    acc = acc.astype(o_ref.dtype)
    if o_ref.shape[-1] % bn == 0:
        o_ref[pl.ds(m0, bm), pl.ds(n0, bn)] = acc
        return
    rows = m0 + jnp.arange(bm)
    cols = n0 + jnp.arange(bn)
    mask = jnp.broadcast_to((cols < o_ref.shape[-1])[None, :], (bm, bn))
    pltriton.store(o_ref.at[rows[:, None], cols[None, :]], acc, mask=mask)


def _program_range(bm, bn, num_steps, steps_per_split):
    """(m0, n0, first step, end step) of this program."""
    first = pl.program_id(2) * steps_per_split
    return pl.program_id(0) * bm, pl.program_id(1) * bn, first, jnp.minimum(first + steps_per_split, num_steps)


def _split_row(m0, mp: int, num_splits: int):
    """First output row of this program: partials of split s lie at rows [s * Mp, (s + 1) * Mp) of [S * Mp, N]."""
    return m0 if num_splits == 1 else pl.program_id(2) * mp + m0


def _k_loop(first, last, load, step, acc, prefetch: bool):
    """acc = step(i, acc, load(i)) for i in [first, last); with `prefetch` the tiles of step i + 1 are loaded
    before step i computes (a register double buffer: one more weight tile in flight per program)."""
    if not prefetch:
        return jax.lax.fori_loop(first, last, lambda i, acc: step(i, acc, load(i)), acc)

    def body(i, carry):
        acc, tiles = carry
        upcoming = load(jnp.minimum(i + 1, last - 1))
        return step(i, acc, tiles), upcoming

    return jax.lax.fori_loop(first, last, body, (acc, load(first)))[0]


def _dense_kernel(
    x_ref,  # [Mp, Kp] compute dtype, K zero-padded to whole steps
    w_ref,  # [K, N] bf16 / f16 / int8 / float8_e4m3fn (uint8 bits of e4m3 when tiles are partial)
    s_ref,  # [N] f32 per-channel scale (None for plain weights)
    o_ref,  # [Mp, N] x dtype (one split) or [S * Mp, N] f32 partials
    *,
    mp: int,
    num_splits: int,
    bm: int,
    bn: int,
    bk: int,
    num_steps: int,
    steps_per_split: int,
    fp8_bits: bool,
    prefetch: bool,
    bit_convert: bool,
):
    m0, n0, first, last = _program_range(bm, bn, num_steps, steps_per_split)

    def load(i):
        return _load_tile(w_ref, i * bk, bk, n0, bn)  # [bk, bn]

    def step(i, acc, w):
        x = x_ref[pl.ds(m0, bm), pl.ds(i * bk, bk)]  # [bm, bk]
        if fp8_bits:  # masked loads cannot fill an fp8 tile in Triton's lowering: load the bytes, then view them
            w = jax.lax.bitcast_convert_type(w, jnp.float8_e4m3fn)
        if bit_convert and w.dtype == jnp.int8:
            u = jax.lax.bitcast_convert_type(w, jnp.uint8).astype(jnp.uint16)
            w = _bf16(0x4300 | (u & 0x7F)) - _bf16(0x4300 | (u & 0x80))  # exact: (128 + low bits) - (128 or 256)
        return acc + _dot(x, w.astype(x.dtype))

    acc = _k_loop(first, last, load, step, jnp.zeros((bm, bn), jnp.float32), prefetch)  # [bm, bn]
    if s_ref is not None:
        acc = acc * _load_row(s_ref, None, n0, bn)[None, :]
    _store(o_ref, acc, _split_row(m0, mp, num_splits), n0)


def _bf16(bits_u16):
    return jax.lax.bitcast_convert_type(bits_u16, jnp.bfloat16)


def _int4_kernel(
    xs_ref,  # bit_convert: [Mp, K/g] f32 sums of x over each group; else None
    xe_ref,  # [Mp, K/2] compute dtype: x's even K columns (low nibbles)
    xo_ref,  # [Mp, K/2] compute dtype: x's odd K columns (high nibbles)
    w_ref,  # [K/2, N] uint8, two codes a byte
    s_ref,  # [K/g, N] f32 group scales
    z_ref,  # [K/g, N] f32 integer zero points (None: symmetric, zero 8)
    o_ref,  # [Mp, N] x dtype (one split) or [S * Mp, N] f32 partials
    *,
    mp: int,
    num_splits: int,
    bm: int,
    bn: int,
    group_size: int,
    groups_per_step: int,
    num_steps: int,
    steps_per_split: int,
    prefetch: bool,
):
    m0, n0, first, last = _program_range(bm, bn, num_steps, steps_per_split)
    half = group_size // 2  # packed rows per group

    def load(i):  # static unroll: one [g/2, bn] uint8 tile per group of the step
        return tuple(_load_tile(w_ref, (i * groups_per_step + j) * half, half, n0, bn) for j in range(groups_per_step))

    def step(i, acc, tiles):
        for j, packed in enumerate(tiles):
            group = i * groups_per_step + j
            xe = xe_ref[pl.ds(m0, bm), pl.ds(group * half, half)]  # [bm, g/2]
            xo = xo_ref[pl.ds(m0, bm), pl.ds(group * half, half)]  # [bm, g/2]
            zero = 8.0 if z_ref is None else _load_row(z_ref, group, n0, bn)[None, :]  # [1, bn]
            scale = _load_row(s_ref, group, n0, bn)[None, :]  # [1, bn]
            if xs_ref is not None:  # bit_convert: dot 128 + code, then take (128 + zero) * sum(x) off
                u = packed.astype(jnp.uint16)
                lo, hi = _bf16((u & 0xF) | 0x4300), _bf16(((u >> 4) & 0xF) | 0x4300)  # [g/2, bn]
                xs = xs_ref[pl.ds(m0, bm), group][:, None]  # [bm, 1]
                acc = acc + (_dot(xe, lo) + _dot(xo, hi) - (128.0 + zero) * xs) * scale
                continue
            lo = ((packed & 0xF).astype(jnp.float32) - zero).astype(xe.dtype)  # [g/2, bn], exact integers
            hi = ((packed >> 4).astype(jnp.float32) - zero).astype(xe.dtype)
            acc = acc + (_dot(xe, lo) + _dot(xo, hi)) * scale
        return acc

    acc = _k_loop(first, last, load, step, jnp.zeros((bm, bn), jnp.float32), prefetch)  # [bm, bn]
    _store(o_ref, acc, _split_row(m0, mp, num_splits), n0)


# ---------------------------------------------------------------------------------------------------------
# pallas_call builder.
# ---------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static geometry of one call."""

    mp: int  # rows after padding (multiple of bm)
    bm: int
    bn: int
    bk: int  # logical K rows per step
    num_steps: int
    num_splits: int

    @property
    def steps_per_split(self) -> int:
        return -(-self.num_steps // self.num_splits)


def plan(m: int, k: int, n: int, fmt: str, group_size: int, config: QuantizedMatmulConfig) -> _Plan:
    bm = min(config.block_m, max(16, _next_pow2(m)))
    mp = -(-m // bm) * bm
    bn = min(config.block_n, max(16, _next_pow2(n)))
    if fmt == "int4":
        bk = group_size * max(1, config.block_k // group_size)
        while (k // group_size) % (bk // group_size):  # whole groups per step that divide K's groups
            bk -= group_size
    else:
        bk = min(config.block_k, max(16, _next_pow2(k)))
    num_steps = -(-k // bk)
    tiles = (mp // bm) * (-(-n // bn))
    splits = choose_num_splits(config, tiles, num_steps)
    splits = -(-num_steps // (-(-num_steps // splits)))  # no empty split
    return _Plan(mp, bm, bn, bk, num_steps, splits)


def _build_call(p: _Plan, n: int, out_dtype, inputs, *, fmt, group_size, config, interpret):
    grid = (p.mp // p.bm, -(-n // p.bn), p.num_splits)
    common = dict(
        prefetch=config.prefetch,
        mp=p.mp,
        num_splits=p.num_splits,
        bm=p.bm,
        bn=p.bn,
        num_steps=p.num_steps,
        steps_per_split=p.steps_per_split,
    )
    if fmt == "int4":
        kernel = functools.partial(_int4_kernel, group_size=group_size, groups_per_step=p.bk // group_size, **common)
    else:
        bits = fp8_needs_bits(fmt, inputs[1].shape, p)
        kernel = functools.partial(_dense_kernel, bk=p.bk, fp8_bits=bits, bit_convert=config.bit_convert, **common)
    if p.num_splits == 1:
        out_shape = out_struct((p.mp, n), out_dtype, [a for a in inputs if a is not None])
    else:
        out_shape = out_struct((p.num_splits * p.mp, n), jnp.float32, [a for a in inputs if a is not None])
    return pl.pallas_call(
        kernel,
        grid=grid,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        name=f"qmm_{fmt}_m{p.bm}_n{p.bn}_k{p.bk}_s{p.num_splits}",
    )(*inputs)


def fp8_needs_bits(fmt: str, shape, p: _Plan) -> bool:
    """Whether an fp8 weight travels as uint8 bits: only where its tiles are partial (masked loads)."""
    return fmt == "fp8" and bool(shape[0] % p.bk or shape[1] % p.bn)


def _pallas(x2, values, scales, zeros, *, fmt, group_size, config, interpret):
    """x2 [M, K] -> [M, N] through the kernel."""
    m, k = x2.shape
    n = values.shape[-1]
    p = plan(m, k, n, fmt, group_size, config)
    xp = jnp.pad(x2, ((0, p.mp - m), (0, p.num_steps * p.bk - k)))  # [Mp, Kp]
    if fmt == "int4":
        xs = None
        if config.bit_convert:  # group sums of the bf16 x the dots see
            xs = xp[:, :k].astype(jnp.float32).reshape(p.mp, k // group_size, group_size).sum(axis=-1)
        inputs = (xs, xp[:, 0::2], xp[:, 1::2], values, scales.astype(jnp.float32), zeros)
        inputs = inputs[:5] + (None if zeros is None else zeros.astype(jnp.float32),)
    elif fmt == "bf16":
        inputs = (xp, values, None)
    else:
        if fp8_needs_bits(fmt, values.shape, p):
            values = jax.lax.bitcast_convert_type(values, jnp.uint8)
        inputs = (xp, values, jnp.broadcast_to(scales.astype(jnp.float32), (n,)))
    out = _build_call(p, n, x2.dtype, inputs, fmt=fmt, group_size=group_size, config=config, interpret=interpret)
    if p.num_splits > 1:
        out = out.reshape(p.num_splits, p.mp, n).sum(axis=0)
    return out[:m].astype(x2.dtype)


# ---------------------------------------------------------------------------------------------------------
# Public entry point and reference.
# ---------------------------------------------------------------------------------------------------------
def _validate(x, values, scales, zeros, fmt, group_size):
    """Returns the logical (K, N); raises ValueError naming the bad argument."""
    if fmt not in FORMATS:
        raise ValueError(f"quantized_matmul: unknown fmt {fmt!r}; expected one of {FORMATS}")
    if values.ndim != 2:
        raise ValueError(f"quantized_matmul: values must be a 2-D weight [K, N], got shape {values.shape}")
    if x.ndim < 1:
        raise ValueError("quantized_matmul: x must have a K axis")
    if x.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise ValueError(f"quantized_matmul: x must be bfloat16, float16 or float32, got {x.dtype}")
    kv, n = values.shape
    expected = {"bf16": None, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "int4": jnp.uint8}[fmt]
    if fmt == "bf16" and values.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise ValueError(f"quantized_matmul: fmt 'bf16' takes a float weight, got {values.dtype}")
    if expected is not None and values.dtype != expected:
        raise ValueError(f"quantized_matmul: fmt {fmt!r} stores values as {jnp.dtype(expected)}, got {values.dtype}")
    k = 2 * kv if fmt == "int4" else kv
    if x.shape[-1] != k:
        raise ValueError(f"quantized_matmul: x's last axis {x.shape[-1]} != the weight's K {k}")
    if fmt in ("int8", "fp8") and (scales is None or scales.shape not in ((n,), ())):
        raise ValueError(f"quantized_matmul: {fmt} scales must be [N]={n} or [] (per tensor), got {scales}")
    if fmt == "int4":
        if group_size not in (32, 64, 128):
            raise ValueError(f"quantized_matmul: int4 group_size must be 32, 64 or 128, got {group_size}")
        if k % group_size:
            raise ValueError(f"quantized_matmul: int4 K={k} is not a multiple of group_size={group_size}")
        for name, a in (("scales", scales), ("zeros", zeros)):
            if (a is not None or name == "scales") and (a is None or a.shape != (k // group_size, n)):
                raise ValueError(f"quantized_matmul: int4 {name} must be [K/g, N]={(k // group_size, n)}")
    return k, n


def quantized_matmul(
    x: jax.Array,
    values: jax.Array,
    scales: jax.Array | None = None,
    zeros: jax.Array | None = None,
    *,
    fmt: str = "bf16",
    group_size: int = 0,
    config: QuantizedMatmulConfig | None = None,
    backend: str | None = None,
) -> jax.Array:
    """x [..., K] @ dequantize(values, scales, zeros) [K, N] -> [..., N] in x's dtype (f32 accumulation).

    Args:
        x: activations [..., K], bfloat16 or float16 on the kernel backends (float32 runs on "xla" only).
        values: the stored weight (model/quant.py layouts): bf16 [K, N], int8 [K, N], float8_e4m3fn [K, N], or
            uint8 [K/2, N] for int4 (row 2i in the low nibble, 2i+1 in the high).
        scales: int8 / fp8: f32 [N] (per channel) or [] (per tensor); int4: [K/g, N]; None for bf16.
        zeros: int4 only: [K/g, N] integer-valued zero points (None: symmetric, zero point 8).
        fmt: "bf16", "int8", "fp8" or "int4".
        group_size: int4 group along K (32, 64 or 128).
        config: tile sizes (QuantizedMatmulConfig()).
        backend: None, "triton", "interpret" or "xla" (see pallas_kernels.backend).

    Raises:
        ValueError: shapes, dtypes, format or backend do not fit.
    """
    _validate(x, values, scales, zeros, fmt, group_size)
    resolved = resolve_backend(backend, KERNEL_NAME)
    if resolved == "mosaic_gpu":
        raise ValueError(  # its layout is built once at load, not per call
            "quantized_matmul: backend 'mosaic_gpu' takes a prepared weight: "
            "pallas_kernels.stream_matmul_mgpu.stream_matmul(x, prepare(values, scales, zeros, ...))"
        )
    config = config or QuantizedMatmulConfig()
    if resolved == "xla":
        return _reference(x, values, scales, zeros, fmt=fmt, group_size=group_size)
    if x.dtype == jnp.float32:
        raise ValueError("quantized_matmul: the kernel takes bfloat16 / float16 x; float32 x needs backend='xla'")
    if config.bit_convert and fmt == "int4" and x.dtype != jnp.bfloat16:
        raise ValueError("quantized_matmul: bit_convert builds int4 codes as bfloat16: x must be bfloat16")
    return _kernel_jit(
        x, values, scales, zeros, fmt=fmt, group_size=group_size, config=config, interpret=resolved == "interpret"
    )


@functools.partial(jax.jit, static_argnames=("fmt", "group_size", "config", "interpret"))
def _kernel_jit(x, values, scales, zeros, *, fmt, group_size, config, interpret):
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    out = _pallas(x2, values, scales, zeros, fmt=fmt, group_size=group_size, config=config, interpret=interpret)
    return out.reshape(*lead, values.shape[-1])


def dequantize(values, scales=None, zeros=None, *, fmt="bf16", group_size=0) -> jax.Array:
    """The logical weight [K, N] in float32 (plain jnp)."""
    if fmt == "bf16":
        return values.astype(jnp.float32)
    if fmt in ("int8", "fp8"):
        return values.astype(jnp.float32) * scales.astype(jnp.float32)
    k2, n = values.shape
    codes = jnp.stack([values & 0xF, values >> 4], axis=1).reshape(2 * k2, n).astype(jnp.float32)
    zero = 8.0 if zeros is None else jnp.repeat(zeros.astype(jnp.float32), group_size, axis=0)
    return (codes - zero) * jnp.repeat(scales.astype(jnp.float32), group_size, axis=0)


def _reference(x, values, scales, zeros, *, fmt, group_size):
    w = dequantize(values, scales, zeros, fmt=fmt, group_size=group_size)
    out = jnp.einsum("...k,kn->...n", x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
    return out.astype(x.dtype)


def reference(x, values, scales=None, zeros=None, *, fmt="bf16", group_size=0, config=None, backend=None):
    """Plain-jnp oracle with quantized_matmul's signature: dequantise to f32, dot at HIGHEST, cast to x's dtype."""
    del config, backend
    _validate(x, values, scales, zeros, fmt, group_size)
    return _reference(x, values, scales, zeros, fmt=fmt, group_size=group_size)
