"""Weight-streaming GEMV for decode's smallest batches (M <= 4): every weight byte read once, turned into an exact
float32 in registers (integer bit tricks or the hardware cast), and multiplied on the FMA units.

    x [M, K] (bf16 / f16 / f32)  @  w [K, N] (bf16 | int8 | fp8 e4m3 | packed int4)  ->  [M, N] in x's dtype

Why a second streaming kernel beside quantized_matmul.py: at M = 1 that kernel's tensor-core dot pads x to 16 rows
and moves every weight tile into the MMA operand layout, and its 8-bit and 4-bit paths convert each code twice on
the I2F/F2F units (int8 -> f32 -> bf16). Here a weight costs one FMA per row of x, and its conversion one or two
integer ops plus at most one float add (`bit_convert`; measured on an H100 against plain casts: int8 +11%, bf16
+-0, fp8 -13%, so fp8's tuned config keeps the hardware cast; BENCHMARKS.md "GEMV"):

    bf16   f32 bits = bf16 bits << 16
    int8   f32(u8(b) ^ 0x4B000080) - (2^23 + 128)             (0x4B000000 is 2^23: the byte lands in the mantissa)
    fp8    f16 bits = (b & 0x80) << 8 | (b & 0x7F) << 7        is w * 2^-8 (e4m3's exponent bias is 7, f16's 15),
           e4m3 subnormals landing on f16 subnormals; f16 -> f32 is exact; each sum is scaled by 2^8
    int4   lo: f32((b & 0x0F) | 0x4B000000) - 2^23             = code
           hi: f32((b & 0xF0) | 0x4B000000) - 2^23             = 16 code; x's odd columns are pre-scaled by 1/16
           the zero point z (any float: GGUF Q4_1's are) leaves the inner loop: sum_k x_k (code_k - z) s =
           s (sum_k x_k code_k) - s z (sum_k x_k), with the tile sums of x computed once outside

Data flow, grid = (N tiles, K chunks):

    program (j, c) walks its `steps` weight tiles [bk, bn]: depth 0 issues every tile's loads first (a static
    unroll: steps * bk * bn bytes in flight, then none while it multiplies); depth d > 0 loops and keeps d tiles in
    flight while it multiplies (a register ring). For each tile i:
        per-channel formats:  acc_r[bk, bn] += x[r, k_i : k_i + bk, None] * w_i
        grouped formats:      acc_r[bk, bn] += (x_r * w_i) * scale[group_i, None]     (a tile inside one group)
                              int4: corr_r[1, bn] += scale[group_i] * zero[group_i] * sum(x_r over tile i)
    and ends with one cross-thread reduction: out[c, r, n tile] = sum(acc_r, axis 0) - corr_r (* per-channel scale)
    f32 partials [C, M, N] are summed (and cast) by XLA, or meet by atomic adds in a zeroed f32 [M, N]
    (`atomic`); C = 1 stores the output dtype directly. x enters as given (flat [M * K]) and is converted in the
    kernel, so no XLA pass over x precedes the call, except for int4 (its even / odd split and tile sums: `_pallas`).

Weight layouts are those of model/quant.py ([K, N]; int4 [K/2, N] with row 2i in the low nibble); this module takes
raw arrays. On CPU the same pallas_call runs in the Pallas interpreter (tests); "xla" is the reference.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import quantized_matmul
from pallas_kernels.backend import out_struct, resolve_backend

FORMATS = ("bf16", "int8", "fp8", "int4")
KERNEL_NAME = "gemv"
MAX_ROWS = 4  # accumulators are [bk, bn] f32 per row of x: registers bound the rows
MAGIC = 0x4B000000  # float32 2^23
FP8_OUT_SCALE = 2.0**8  # fp8 codes are converted as w * 2^-8


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """Tile sizes (a static argument).

    Attributes:
        block_n: weight columns per program.
        block_k: weight rows per tile (grouped formats: at most one group's rows).
        steps: tiles per program, all loaded before the first multiply (bytes in flight = steps * tile bytes).
        num_warps: Triton warps per program.
        bit_convert: the integer bit-trick conversions above (False: plain dtype casts, for comparison).
        depth: 0 unrolls the `steps` tiles with every load issued first; d > 0 runs them in a loop that keeps d tiles
            in flight (a register ring), so a program streams continuously over many tiles.
        atomic: the K chunks' partial sums meet by f32 atomic adds in a zeroed output, not as [C, M, N] partials
            that XLA sums after the call (one kernel fewer; the order of the adds, hence the last bits, may vary). A
            call whose K fits one chunk has nothing to sum and stores its output directly either way.
    """

    block_n: int = 128
    block_k: int = 32
    steps: int = 8
    num_warps: int = 4
    bit_convert: bool = True
    depth: int = 0
    atomic: bool = False

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 8 or value & (value - 1):
                raise ValueError(f"GemvConfig.{name} must be a power of two >= 8, got {value}")
        if self.steps < 1:
            raise ValueError(f"GemvConfig.steps must be >= 1, got {self.steps}")
        if not 0 <= self.depth <= 8:
            raise ValueError(f"GemvConfig.depth must be 0 (unrolled) to 8 tiles in flight, got {self.depth}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"GemvConfig.num_warps must be a power of 2 <= 16, got {self.num_warps}")


# ---------------------------------------------------------------------------------------------------------
# Conversions: stored codes -> exact float32 (see the module docstring).
# ---------------------------------------------------------------------------------------------------------
def _f32(bits):
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _u32(tile):
    """A tile of 8- or 16-bit codes, zero-extended to uint32."""
    unsigned = {1: jnp.uint8, 2: jnp.uint16}[tile.dtype.itemsize]
    if tile.dtype != unsigned:
        tile = jax.lax.bitcast_convert_type(tile, unsigned)
    return tile.astype(jnp.uint32)


def convert(tile, fmt: str, bit_convert: bool = True):
    """int8 / fp8 (as uint8 bits) / bf16 tile -> float32 (fp8: times 2^-8 under bit_convert)."""
    if fmt == "bf16":
        if tile.dtype != jnp.bfloat16 or not bit_convert:
            return tile.astype(jnp.float32)
        return _f32(_u32(tile) << 16)
    if fmt == "int8":
        if not bit_convert:
            return tile.astype(jnp.float32)
        return _f32(_u32(tile) ^ (MAGIC | 0x80)) - (2.0**23 + 128.0)
    if fmt == "fp8":
        u = _u32(tile)
        if not bit_convert:
            return jax.lax.bitcast_convert_type(u.astype(jnp.uint8), jnp.float8_e4m3fn).astype(jnp.float32)
        bits = (((u & 0x80) << 8) | ((u & 0x7F) << 7)).astype(jnp.uint16)
        return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)
    raise ValueError(fmt)


def convert_int4(packed):
    """uint8 [bk, bn] of two codes a byte -> (code_lo, 16 code_hi) in float32."""
    u = _u32(packed)
    return _f32((u & 0x0F) | MAGIC) - 2.0**23, _f32((u & 0xF0) | MAGIC) - 2.0**23


# ---------------------------------------------------------------------------------------------------------
# Kernel body.
# ---------------------------------------------------------------------------------------------------------
def _load(ref, r0, height, c0, width, masked: bool):
    """ref[r0 : r0 + height, c0 : c0 + width] of a 2-D ref, zero outside its bounds when `masked`."""
    if not masked:
        return ref[pl.ds(r0, height), pl.ds(c0, width)]
    rows = r0 + jnp.arange(height)
    cols = c0 + jnp.arange(width)
    mask = (rows < ref.shape[0])[:, None] & (cols < ref.shape[1])[None, :]
    return pltriton.load(ref.at[rows[:, None], cols[None, :]], mask=mask, other=0)


def _load_row(ref, r, c0, width):
    """quantized_matmul's row loader (zero past N), the row clamped into bounds: a last chunk's padded tiles read
    the last group's scales, which meet zero columns of x."""
    return quantized_matmul._load_row(ref, None if r is None else jnp.minimum(r, ref.shape[0] - 1), c0, width)


def _load_x(x_ref, r, cols, k, masked: bool):
    """x[r, cols] of the flat [M * K] x as float32 (cols: a [bk] index vector), zero past K when `masked`."""
    if masked:
        return pltriton.load(x_ref.at[r * k + cols], mask=cols < k, other=0).astype(jnp.float32)
    return pltriton.load(x_ref.at[r * k + cols]).astype(jnp.float32)


def _gemv_kernel(
    x_ref,  # [M * K] x as given (bf16 / f16 / f32), flat; int4: [M, 2, Kp/2] f32 even columns, odd columns / 16
    xs_ref,  # int4 only: [M, tiles] f32 sums of x over each tile's K columns (0 past K)
    w_ref,  # [K, N] bf16 / int8 / uint8 (fp8 bits); int4: [K/2, N] uint8
    s_ref,  # [N] f32 per-channel scale; grouped: [K/g, N]; None for bf16
    z_ref,  # int4 only: [K/g, N] f32 zero points, or None (symmetric: 8)
    o_ref,  # [C, M, N] f32 partials; [M, N padded] f32 summed atomically (`atomic`); [M, N] out dtype when C == 1
    *,
    fmt: str,
    rows: int,
    k: int,
    bk: int,
    bn: int,
    steps: int,
    depth: int,
    per_group: int,
    grouped: bool,
    masked_k: bool,
    masked_n: bool,
    bit_convert: bool,
    atomic: bool,
):
    n0 = pl.program_id(0) * bn
    chunk = pl.program_id(1)
    k0 = chunk * (steps * bk)  # first stored weight row of this program

    def fetch(i):
        """Everything tile i of this program needs, loaded (asynchronously) ahead of its use."""
        r0 = k0 + i * bk
        group = r0 // per_group  # grouped formats: a tile lies inside one group
        tile = _load(w_ref, r0, bk, n0, bn, masked_k or masked_n)  # [bk, bn]
        if fmt == "int4":  # stored row i holds x columns 2i (low nibble) and 2i + 1 (high, pre-scaled by 1/16)
            xr = [(x_ref[r, 0, pl.ds(r0, bk)], x_ref[r, 1, pl.ds(r0, bk)], xs_ref[r, r0 // bk]) for r in range(rows)]
        else:
            xr = [_load_x(x_ref, r, r0 + jnp.arange(bk), k, masked_k) for r in range(rows)]  # [bk] per row
        scale = _load_row(s_ref, group, n0, bn) if grouped else None  # [bn]
        zero = _load_row(z_ref, group, n0, bn) if z_ref is not None else None
        return tile, xr, scale, zero

    def step(fetched, carry):
        tile, xr, scale, zero = fetched
        accs, corrs = carry
        if fmt == "int4":
            lo, hi = convert_int4(tile)  # [bk, bn] each
            scale_zero = scale[None, :] * (8.0 if zero is None else zero[None, :])  # [1, bn]
        else:
            w = convert(tile, fmt, bit_convert)  # [bk, bn]
        new_accs, new_corrs = [], []
        for r in range(rows):
            if fmt == "int4":
                xe, xo, xs = xr[r]
                part = xe[:, None] * lo + xo[:, None] * hi
                new_corrs.append(corrs[r] + scale_zero * xs)
            else:
                part = xr[r][:, None] * w
            new_accs.append(accs[r] + (part * scale[None, :] if grouped else part))
        return new_accs, (new_corrs if fmt == "int4" else corrs)

    carry = ([jnp.zeros((bk, bn), jnp.float32)] * rows, [jnp.zeros((1, bn), jnp.float32)] * rows)
    if depth == 0:  # static unroll: every tile's loads issued before the first multiply
        fetched = [fetch(i) for i in range(steps)]
        for f in fetched:
            carry = step(f, carry)
    else:  # a loop that keeps `depth` tiles in flight: tile i + depth is loaded while tile i is multiplied

        def body(i, state):
            carry, ahead = state
            nxt = fetch(jnp.minimum(i + depth, steps - 1))
            return step(ahead[0], carry), (*ahead[1:], nxt)

        ahead = tuple(fetch(i) for i in range(depth))
        carry, _ = jax.lax.fori_loop(0, steps, body, (carry, ahead))
    accs, corrs = carry
    cols = n0 + jnp.arange(bn)
    for r in range(rows):
        out = jnp.sum(accs[r], axis=0) - (jnp.sum(corrs[r], axis=0) if fmt == "int4" else 0.0)  # [bn]
        if fmt == "fp8" and bit_convert:
            out = out * FP8_OUT_SCALE
        if s_ref is not None and not grouped:
            out = out * _load_row(s_ref, None, n0, bn)
        if atomic:  # the chunks' partials meet in a zeroed f32 [M, N padded to bn], so no mask (the interpreter's
            # atomic takes none)
            pltriton.atomic_add(o_ref, (jnp.int32(r), pl.ds(n0, bn)), out)
            continue
        lead = (r,) if len(o_ref.shape) == 2 else (chunk, r)  # o_ref [M, N] or [C, M, N]
        out = out.astype(o_ref.dtype)
        if masked_n:
            pltriton.store(o_ref.at[(*lead, cols)], out, mask=cols < o_ref.shape[-1])
        else:
            o_ref[(*lead, pl.ds(n0, bn))] = out


# ---------------------------------------------------------------------------------------------------------
# pallas_call builder.
# ---------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static geometry of one call, in stored weight rows (int4: packed rows)."""

    bk: int
    bn: int
    steps: int
    chunks: int
    k_rows: int  # stored weight rows
    n: int
    atomic: bool  # the K chunks meet by atomic adds (GemvConfig.atomic, and more than one chunk)

    @property
    def k_pad(self) -> int:
        return self.chunks * self.steps * self.bk


def group_rows(fmt: str, group_size: int) -> int:
    """Stored weight rows per group (int4 packs two K rows a byte row)."""
    return group_size // 2 if fmt == "int4" else group_size


def plan(k_rows: int, n: int, fmt: str, group_size: int, config: GemvConfig) -> _Plan:
    """Tiles of one call: a grouped format's tile lies inside one group; steps shrink for short K (no empty tiles)."""
    bk = min(config.block_k, max(8, 1 << (k_rows - 1).bit_length()))
    if fmt == "int4" or group_size > 0:
        bk = min(bk, group_rows(fmt, group_size))
    bn = min(config.block_n, max(16, 1 << (n - 1).bit_length()))
    tiles = -(-k_rows // bk)
    steps = min(config.steps, tiles)
    chunks = -(-tiles // steps)
    return _Plan(bk, bn, steps, chunks, k_rows, n, config.atomic and chunks > 1)


def _build_call(p: _Plan, rows: int, k: int, out_dtype, inputs, *, fmt, group_size, grouped, config, interpret):
    operands = [a for a in inputs if a is not None]
    atomic = p.atomic
    if p.chunks == 1:
        out_shape = out_struct((rows, p.n), out_dtype, operands)
    else:
        n_out = -(-p.n // p.bn) * p.bn if atomic else p.n
        out_shape = out_struct(((rows,) if atomic else (p.chunks, rows)) + (n_out,), jnp.float32, operands)
    kernel = functools.partial(
        _gemv_kernel,
        fmt=fmt,
        rows=rows,
        k=k,
        bk=p.bk,
        bn=p.bn,
        steps=p.steps,
        depth=min(config.depth, p.steps),
        per_group=group_rows(fmt, group_size) if grouped else 1,
        grouped=grouped,
        masked_k=p.k_pad != p.k_rows,
        masked_n=p.n % p.bn != 0,
        bit_convert=config.bit_convert,
        atomic=atomic,
    )
    args, aliases = tuple(inputs), {}
    if atomic:  # the output starts as zeros: one more operand, aliased to the output the kernel adds into
        kernel = _with_output_alias(kernel)
        args, aliases = (*args, jnp.zeros(out_shape.shape, jnp.float32)), {len(operands): 0}  # flat index
    return pl.pallas_call(
        kernel,
        grid=(-(-p.n // p.bn), p.chunks),
        out_shape=out_shape,
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=1),
        name=f"gemv_{fmt}_m{rows}_n{p.bn}_k{p.bk}x{p.steps}_d{config.depth}_c{p.chunks}{'_atomic' if atomic else ''}",
    )(*args)


def _with_output_alias(kernel):
    """The kernel with the aliased zeros' input ref dropped (its output ref is the same buffer)."""

    def aliased(x_ref, xs_ref, w_ref, s_ref, z_ref, zeros_ref, o_ref):
        del zeros_ref
        kernel(x_ref, xs_ref, w_ref, s_ref, z_ref, o_ref)

    return aliased


def _pallas(x2, values, scales, zeros, *, fmt, group_size, config, interpret, out_dtype):
    """x2 [M, K] -> [M, N] in out_dtype through the kernel. x goes in as given (flat: no pass over it here), but
    for int4, whose kernel is bound by its instruction issue (78% of slots at 41% of DRAM bandwidth under Nsight
    Compute on an H100), the even / odd split and the tile sums of x are one small XLA fusion before the call:
    in the kernel they cost a cross-thread reduction per tile (8B int4 decode ran 5.5% slower with them there, where
    the unchanged XLA paths moved 2-4% between the two H100s of that comparison)."""
    rows, k = x2.shape
    n = values.shape[-1]
    p = plan(values.shape[0], n, fmt, group_size, config)
    x_in, xs = x2.reshape(rows * k), None
    if fmt == "int4":
        xf = x2.astype(jnp.float32)
        tiles = k // (2 * p.bk)  # the sums of x over each tile's 2 bk columns, 0 for the padded tiles
        xs = jnp.pad(xf.reshape(rows, tiles, 2 * p.bk).sum(axis=-1), ((0, 0), (0, p.k_pad // p.bk - tiles)))
        x_in = jnp.stack([xf[:, 0::2], xf[:, 1::2] * (1.0 / 16.0)], axis=1)  # [M, 2, K/2]
        x_in = jnp.pad(x_in, ((0, 0), (0, 0), (0, p.k_pad - values.shape[0])))
    if fmt == "fp8":
        values = jax.lax.bitcast_convert_type(values, jnp.uint8)
    grouped = fmt == "int4" or group_size > 0
    if scales is not None:
        scales = scales.astype(jnp.float32)
        if not grouped:
            scales = jnp.broadcast_to(scales, (n,))
    zeros = None if zeros is None else zeros.astype(jnp.float32)
    inputs = (x_in, xs, values, scales, zeros)
    kw = dict(fmt=fmt, group_size=group_size, grouped=grouped, config=config, interpret=interpret)
    out = _build_call(p, rows, k, out_dtype, inputs, **kw)
    if p.chunks > 1:
        out = out[:, :n] if p.atomic else out.sum(axis=0)
    return out.astype(out_dtype)


# ---------------------------------------------------------------------------------------------------------
# Public entry point and reference.
# ---------------------------------------------------------------------------------------------------------
def _validate(x, values, scales, zeros, fmt, group_size):
    """Raises ValueError naming the bad argument; returns the logical (K, N)."""
    if fmt not in FORMATS:
        raise ValueError(f"gemv: unknown fmt {fmt!r}; expected one of {FORMATS}")
    if values.ndim != 2:
        raise ValueError(f"gemv: values must be a 2-D weight [K, N], got shape {values.shape}")
    if x.ndim < 1 or x.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise ValueError(f"gemv: x must be [..., K] bfloat16, float16 or float32, got {x.dtype}{x.shape}")
    rows = math.prod(x.shape[:-1])
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"gemv: x has {rows} rows; the GEMV kernel takes 1 to {MAX_ROWS}")
    kv, n = values.shape
    expected = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "int4": jnp.uint8}.get(fmt)
    if fmt == "bf16" and values.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise ValueError(f"gemv: fmt 'bf16' takes a float weight, got {values.dtype}")
    if expected is not None and values.dtype != expected:
        raise ValueError(f"gemv: fmt {fmt!r} stores values as {jnp.dtype(expected)}, got {values.dtype}")
    k = 2 * kv if fmt == "int4" else kv
    if x.shape[-1] != k:
        raise ValueError(f"gemv: x's last axis {x.shape[-1]} != the weight's K {k}")
    grouped = fmt == "int4" or (fmt == "int8" and group_size)
    if fmt == "fp8" and group_size:
        raise ValueError("gemv: fp8 takes per-channel or per-tensor scales, not groups")
    if grouped:
        if group_size not in (16, 32, 64, 128):
            raise ValueError(f"gemv: {fmt} group_size must be 16, 32, 64 or 128, got {group_size}")
        if k % group_size:
            raise ValueError(f"gemv: K={k} is not a multiple of group_size={group_size}")
        if scales is None or scales.shape != (k // group_size, n):
            raise ValueError(f"gemv: {fmt} group scales must be [K/g, N]={(k // group_size, n)}")
        if zeros is not None and (fmt != "int4" or zeros.shape != (k // group_size, n)):
            raise ValueError(f"gemv: zero points are int4's only, [K/g, N]={(k // group_size, n)}")
    elif fmt in ("int8", "fp8") and (scales is None or scales.shape not in ((n,), ())):
        raise ValueError(f"gemv: {fmt} scales must be [N]={n} or [] (per tensor), got {scales}")
    return k, n


def gemv(
    x: jax.Array,
    values: jax.Array,
    scales: jax.Array | None = None,
    zeros: jax.Array | None = None,
    *,
    fmt: str = "bf16",
    group_size: int = 0,
    config: GemvConfig | None = None,
    backend: str | None = None,
    out_dtype=None,
) -> jax.Array:
    """x [..., K] @ dequantize(values, scales, zeros) [K, N] -> [..., N] in `out_dtype` (default x's; f32
    accumulation), for 1 to MAX_ROWS rows of x.

    Args:
        x: activations [..., K] (bfloat16, float16 or float32).
        values: stored weight (model/quant.py layouts): bf16 [K, N], int8 [K, N], float8_e4m3fn [K, N], or uint8
            [K/2, N] for int4 (row 2i in the low nibble, 2i+1 in the high).
        scales: int8 / fp8: f32 [N] or [] (per tensor); grouped int8 and int4: [K/g, N]; None for bf16.
        zeros: int4 only: [K/g, N] integer-valued zero points (None: symmetric, zero point 8).
        fmt: "bf16", "int8", "fp8" or "int4".
        group_size: int4 (and grouped int8, GGUF Q8_0) group along K: 16, 32, 64 or 128.
        config: tile sizes (GemvConfig()).
        backend: None (this device's choice), "triton", "interpret" or "xla" (the reference).
        out_dtype: the output's dtype (float32 keeps the accumulation: an LM head's logits).

    Raises:
        ValueError: shapes, dtypes, format, row count or backend do not fit.
    """
    _validate(x, values, scales, zeros, fmt, group_size)
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    resolved = resolve_backend(backend, KERNEL_NAME)
    if resolved == "xla":
        return _reference(x, values, scales, zeros, fmt=fmt, group_size=group_size, out_dtype=out_dtype)
    if resolved == "mosaic_gpu":
        resolved = "triton"  # one Triton-lowered kernel serves every NVIDIA GPU
    config = config or GemvConfig()
    interpret = resolved == "interpret"
    return _kernel_jit(
        x,
        values,
        scales,
        zeros,
        fmt=fmt,
        group_size=group_size,
        config=config,
        interpret=interpret,
        out_dtype=out_dtype,
    )


@functools.partial(jax.jit, static_argnames=("fmt", "group_size", "config", "interpret", "out_dtype"))
def _kernel_jit(x, values, scales, zeros, *, fmt, group_size, config, interpret, out_dtype=None):
    x2 = x.reshape(-1, x.shape[-1])
    out_dtype = x.dtype if out_dtype is None else out_dtype
    kw = dict(fmt=fmt, group_size=group_size, config=config, interpret=interpret, out_dtype=out_dtype)
    return _pallas(x2, values, scales, zeros, **kw).reshape(*x.shape[:-1], values.shape[-1])


def dequantize(values, scales=None, zeros=None, *, fmt="bf16", group_size=0) -> jax.Array:
    """The logical weight [K, N] in float32 (plain jnp): quantized_matmul's formats plus grouped int8."""
    if fmt == "int8" and group_size:
        return values.astype(jnp.float32) * jnp.repeat(scales.astype(jnp.float32), group_size, axis=0)
    return quantized_matmul.dequantize(values, scales, zeros, fmt=fmt, group_size=group_size)


def reference(
    x, values, scales=None, zeros=None, *, fmt="bf16", group_size=0, config=None, backend=None, out_dtype=None
):
    """Plain-jnp oracle with gemv's signature: dequantise to f32, dot at HIGHEST, cast to x's dtype."""
    del config, backend
    _validate(x, values, scales, zeros, fmt, group_size)
    return _reference(x, values, scales, zeros, fmt=fmt, group_size=group_size, out_dtype=out_dtype or x.dtype)


def _reference(x, values, scales, zeros, *, fmt, group_size, out_dtype):
    w = dequantize(values, scales, zeros, fmt=fmt, group_size=group_size)
    out = jnp.einsum("...k,kn->...n", x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
    return out.astype(out_dtype)
