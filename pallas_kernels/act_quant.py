"""Per-token activation quantiser for the W8A8 matmul: one pass over x, fused pre-scale, 8-bit codes and scales.

    x [M, K] (bf16 / f16 / f32)  ->  xq [M, K] int8 | float8_e4m3fn,  x_scale [M, 1] float32,  x ~= xq * x_scale

What it replaces: pallas_kernels/w8a8_matmul.quantize_activations in jnp (two passes over x in XLA, a row max then
the divide-and-round, 56-71 us at 4096 x 4096 bf16 on the H200) and, for SmoothQuant, the pre-scale multiply
before it (a third pass). Here one program owns `block_m` whole rows:

    program i:  x rows [bm, K] in registers, loaded in chunks of the largest power of two dividing K (<= 4096:
                Triton's tensors are powers of two; 14336 = 7 x 2048) with no column mask, so loads and stores
                vectorise (small odd K: one block of K rounded up, masked)  -> f32  (* pre_scale[K], rounded to
                x's dtype as model/quant.py does)
                amax [bm] = max |x| over the row  ->  scale = amax * (1 / ACT_MAX) (1 for an all-zero row: codes 0)
                            or the static per-tensor scale
                codes = round-half-even(clip(x / scale)) int8  |  clip(x / scale) -> e4m3 (RTNE), stored as bytes
                store codes [bm, K] and scale [bm]

So x is read once and the codes written once (K + 1 bytes a row against 2K read twice). The numbers are those
of `reference` (quantize_activations): the scale as max|x| times the f32 reciprocal of ACT_MAX, bit for bit;
codes from x / scale as an IEEE divide (PTX div.rn.f32 on the GPU: Triton lowers `/` to the approximate
div.full.f32), the same clip, round half to even (Triton has no round: floor plus the tie rule, exact in f32 for
|v| <= 127). The interpreter matches the reference bit for bit. On the H200 the scales match bit for
bit and the codes except at rounding boundaries (x and amax are bf16, so exact ties are common): XLA's fused
reference may rewrite the divide (x / scale as the rule: 2 of 58.7M codes differed by one on the H200; x * (1 /
scale) in both, tried too: 2,436 of 16.8M int8 codes at 4096 x 4096, so the divide stays);
the GPU test allows a different code only where x / scale lies within 2^-18 of a boundary.

`fake_quantize` is the same pass writing codes * scale in x's dtype instead (the codes' dequantised values, one
output, one launch): a W8A8 weight's decode-sized calls feed it to the bf16 streaming kernels (model/quant.py),
where XLA took a row-max pass, a divide-and-round pass and a dequantise pass behind a barrier.

Backends: "triton" (GPU), "interpret" (the Pallas interpreter, CPU tests), "xla" (`reference`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import backend as backend_lib
from pallas_kernels.w8a8_matmul import ACT_RECIP  # one table: the same scales, bit for bit

DTYPES = {"fp8": jnp.dtype(jnp.float8_e4m3fn), "int8": jnp.dtype(jnp.int8)}
KERNEL_NAME = "act_quant"


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class ActQuantConfig:
    """Tiles of the quantiser (a static argument).

    Attributes:
        max_block_elems: most elements of x a program holds (bm * Kp; bm is the largest power of two that fits,
            at least 1): 16384 f32 are 64 per thread at 8 warps.
        num_warps: Triton warps per program.
    """

    max_block_elems: int = 16384
    num_warps: int = 8

    def __post_init__(self):
        if self.max_block_elems < 1 or self.max_block_elems & (self.max_block_elems - 1):
            raise ValueError(f"ActQuantConfig.max_block_elems must be a power of two, got {self.max_block_elems}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"ActQuantConfig.num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")

    def block_m(self, k: int) -> int:
        return max(1, self.max_block_elems // _next_pow2(k))


# Layer 1: the kernel -----------------------------------------------------------------------------------------------


def _round_half_even(v):
    """Round to nearest, ties to even, from floor (exact in f32 for the clipped |v| <= 127)."""
    r = jnp.floor(v)
    d = v - r
    odd = (r - 2.0 * jnp.floor(r * 0.5)) == 1.0
    return r + jnp.where((d > 0.5) | ((d == 0.5) & odd), 1.0, 0.0)


def _div(a, b, exact: bool):
    """a / b in f32 rounded to nearest (IEEE), as XLA divides; `exact` False: the interpreter's own (IEEE) divide."""
    a, b = jnp.broadcast_arrays(a, b)
    if not exact:
        return a / b
    (out,) = pltriton.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;",
        args=[a, b],
        constraints="=f,f,f",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)],
    )
    return out


def _chunk(k: int) -> int:
    """Columns per load: the largest power of two (<= 4096) dividing K, so that whole-row chunks need no column
    mask (a mask that varies along the columns keeps Triton from vectorising: 1-byte stores, 2-byte loads); K with
    no such chunk of 64 or more (small odd K) is read as one masked block of K rounded up to a power of two."""
    chunk = min(k & -k, 4096)
    return chunk if chunk >= 64 else _next_pow2(k)


def _kernel(x_ref, *refs, fmt: str, bm: int, has_pre: bool, static: bool, exact_div: bool, dequantize: bool):
    # x_ref:   [M, K] bf16 / f16 / f32
    # pre_ref: [K] f32 per-input-channel factor (SmoothQuant), when has_pre
    # act_ref: [1] f32 static per-tensor scale, when static
    # q_ref:   [M, K] int8 codes, or uint8 bits of e4m3 (masked fp8 stores are not lowered: bytes are)
    # s_ref:   [M] f32 per-row scale
    # dequantize: one output [M, K] in x's dtype, codes * scale (fake quantisation), in place of q_ref and s_ref
    rest = list(refs)
    pre_ref = rest.pop(0) if has_pre else None
    act_ref = rest.pop(0) if static else None
    q_ref, s_ref = (rest[0], None) if dequantize else rest
    m, k = x_ref.shape
    chunk = _chunk(k)
    n_chunks = max(1, k // chunk)
    col_mask = chunk * n_chunks != k  # the small-odd-K fallback: one block past K
    rows = pl.program_id(0) * bm + jnp.arange(bm)
    row_ok = rows < m

    def block(c):  # (cols [chunk], mask [bm, chunk] or None) of chunk c; the row mask is constant along columns
        cols = c * chunk + jnp.arange(chunk)
        mask = None if m % bm == 0 else jnp.broadcast_to(row_ok[:, None], (bm, chunk))
        if col_mask:
            mask = row_ok[:, None] & (cols < k)[None, :]
        return cols, mask

    def load(ref, c):  # [bm, chunk] of a 2-D ref, zero where masked
        cols, mask = block(c)
        return pltriton.load(ref.at[rows[:, None], cols[None, :]], mask=mask, other=0 if mask is not None else None)

    xs = []  # the row block in registers, chunk by chunk: x is read once
    for c in range(n_chunks):
        x = load(x_ref, c).astype(jnp.float32)  # [bm, chunk]
        if pre_ref is not None:  # rounded to x's dtype, as model/quant.py's _prepare_input does before quantising
            cols, _ = block(c)
            pre = pltriton.load(pre_ref.at[cols], mask=cols < k if col_mask else None, other=0 if col_mask else None)
            x = (x * pre[None, :]).astype(x_ref.dtype).astype(jnp.float32)
        xs.append(x)
    if act_ref is None:
        amax = jnp.max(jnp.abs(xs[0]), axis=1)  # [bm]; masked columns are 0
        for x in xs[1:]:
            amax = jnp.maximum(amax, jnp.max(jnp.abs(x), axis=1))
        scale = jnp.where(amax > 0, amax * ACT_RECIP[fmt], 1.0)  # as w8a8_matmul.quantize_activations
    else:
        scale = jnp.broadcast_to(act_ref[...], (bm,))
    for c, x in enumerate(xs):
        v = _div(x, scale[:, None], exact_div)
        if fmt == "int8":
            q = _round_half_even(jnp.clip(v, -127.0, 127.0))
            q = (q * scale[:, None]).astype(q_ref.dtype) if dequantize else q.astype(jnp.int8)
        elif dequantize:
            q = (jnp.clip(v, -448.0, 448.0).astype(jnp.float8_e4m3fn).astype(jnp.float32) * scale[:, None]).astype(
                q_ref.dtype
            )
        else:
            q = lax.bitcast_convert_type(jnp.clip(v, -448.0, 448.0).astype(jnp.float8_e4m3fn), jnp.uint8)
        cols, mask = block(c)
        pltriton.store(q_ref.at[rows[:, None], cols[None, :]], q, mask=mask)
    if s_ref is not None:
        pltriton.store(s_ref.at[rows], scale, mask=None if m % bm == 0 else row_ok)


# Layer 2: the pallas_call builder ----------------------------------------------------------------------------------


def _act_quant_call(x2, fmt, act_scale, pre_scale, config: ActQuantConfig, interpret: bool, dequantize: bool = False):
    m, k = x2.shape
    bm = config.block_m(k)
    inputs = [x2]
    if pre_scale is not None:
        inputs.append(pre_scale.astype(jnp.float32).reshape(k))
    if act_scale is not None:
        inputs.append(jnp.asarray(act_scale, jnp.float32).reshape(1))
    kernel = functools.partial(
        _kernel,
        fmt=fmt,
        bm=bm,
        has_pre=pre_scale is not None,
        static=act_scale is not None,
        exact_div=not interpret,  # inline PTX: the interpreter runs no assembly (and divides exactly anyway)
        dequantize=dequantize,
    )
    if dequantize:  # one output: the codes' values in x's dtype
        out_shape, name = backend_lib.out_struct((m, k), x2.dtype, [x2]), "fake_quant"
    else:
        code_dtype = jnp.int8 if fmt == "int8" else jnp.uint8
        out_shape = (
            backend_lib.out_struct((m, k), code_dtype, [x2]),
            backend_lib.out_struct((m,), jnp.float32, [x2]),
        )
        name = KERNEL_NAME
    out = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(m, bm),),
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=1),
        name=f"{name}_{fmt}_bm{bm}_c{_chunk(k)}",
    )(*inputs)
    if dequantize:
        return out
    q, s = out
    if fmt == "fp8":
        q = lax.bitcast_convert_type(q, jnp.float8_e4m3fn)
    return q, s.reshape(m, 1)


# Layer 3: the validated, jitted entry point ------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("fmt", "config", "interpret"))
def _act_quant_jit(x, act_scale, pre_scale, *, fmt, config, interpret):
    q, s = _act_quant_call(x.reshape(-1, x.shape[-1]), fmt, act_scale, pre_scale, config, interpret)
    return q.reshape(x.shape), s.reshape(*x.shape[:-1], 1)


@functools.partial(jax.jit, static_argnames=("fmt", "config", "interpret"))
def _fake_quant_jit(x, act_scale, pre_scale, *, fmt, config, interpret):
    out = _act_quant_call(x.reshape(-1, x.shape[-1]), fmt, act_scale, pre_scale, config, interpret, dequantize=True)
    return out.reshape(x.shape)


def fake_quantize(x, fmt, act_scale=None, pre_scale=None, *, config=None, backend=None):
    """x [..., K] -> x quantised and back in x's dtype, (codes * scale) of `quantize_activations`, in one pass
    (one launch, nothing else written): what a W8A8 weight's decode-sized calls feed the bf16 streaming kernels.
    Arguments and errors as `quantize_activations`; "xla" runs `reference` and dequantises."""
    backend = _checked_backend(x, fmt, act_scale, pre_scale, backend)
    if backend == "xla" or x.size == 0:
        return fake_quantize_reference(x, fmt, act_scale, pre_scale)
    return _fake_quant_jit(
        x, act_scale, pre_scale, fmt=fmt, config=config or ActQuantConfig(), interpret=backend == "interpret"
    )


def _checked_backend(x, fmt, act_scale, pre_scale, backend) -> str:
    """The validation of both entry points; the resolved backend."""
    if fmt not in DTYPES:
        raise ValueError(f"act_quant: fmt must be one of {tuple(DTYPES)}, got {fmt!r}")
    if x.ndim < 1 or x.shape[-1] == 0 or not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype.itemsize > 4:
        raise ValueError(
            f"act_quant: x must be [..., K] float16 / bfloat16 / float32 with K > 0, got {x.dtype}{x.shape}"
        )
    k = x.shape[-1]
    if pre_scale is not None and pre_scale.size != k:
        raise ValueError(f"act_quant: pre_scale must have K={k} elements, got shape {pre_scale.shape}")
    if act_scale is not None and jnp.size(act_scale) != 1:
        raise ValueError(f"act_quant: act_scale must be one per-tensor scale, got shape {jnp.shape(act_scale)}")
    if backend == "mosaic_gpu":
        raise ValueError("act_quant: backend 'mosaic_gpu' is not implemented; use 'triton', 'interpret' or 'xla'")
    if backend is None:
        backend = "triton" if backend_lib.device_supports("triton") else "xla"
    return backend_lib.resolve_backend(backend, KERNEL_NAME)


def quantize_activations(
    x: jax.Array,
    fmt: str,
    act_scale: jax.Array | None = None,
    pre_scale: jax.Array | None = None,
    *,
    config: ActQuantConfig | None = None,
    backend: str | None = None,
):
    """x [..., K] -> (xq [..., K] int8 / float8_e4m3fn, x_scale [..., 1] float32), x * pre_scale ~= xq * x_scale.

    Args:
        x: [..., K] bfloat16, float16 or float32 activations.
        fmt: "int8" or "fp8" (e4m3).
        act_scale: None (per token: each row's max|x| / ACT_MAX, an all-zero row scale 1) or a static per-tensor
            scale [] / [1].
        pre_scale: None or [K]: x is multiplied by it first (and rounded to x's dtype), as model/quant.py does.
        config: tiles (ActQuantConfig()).
        backend: None ("triton" on a GPU that runs it, else "xla"), "triton", "interpret" or "xla" (`reference`).

    Raises:
        ValueError: an unknown fmt or backend, a non-float x, or scales of the wrong size.
    """
    backend = _checked_backend(x, fmt, act_scale, pre_scale, backend)
    if backend == "xla" or x.size == 0:
        return reference(x, fmt, act_scale, pre_scale)
    return _act_quant_jit(
        x, act_scale, pre_scale, fmt=fmt, config=config or ActQuantConfig(), interpret=backend == "interpret"
    )


# Layer 4: the reference --------------------------------------------------------------------------------------------


def fake_quantize_reference(x, fmt, act_scale=None, pre_scale=None):
    """`fake_quantize` in plain jnp: `reference`'s codes times its scales in x's dtype. The codes pass a barrier:
    XLA on a GPU elides an f32 -> e4m3 -> f32 round trip (model/quant.py codes_barrier; model.quant's
    fake_quantize_activations is this)."""
    q, scale = reference(x, fmt, act_scale, pre_scale)
    return (lax.optimization_barrier(q).astype(jnp.float32) * scale).astype(x.dtype)


def reference(x, fmt, act_scale=None, pre_scale=None, **_):
    """Plain jnp: the pre-scale rounded to x's dtype, then w8a8_matmul.quantize_activations (two passes)."""
    from pallas_kernels.w8a8_matmul import quantize_activations as jnp_quantize  # noqa: PLC0415

    if pre_scale is not None:
        x = (x.astype(jnp.float32) * pre_scale.astype(jnp.float32)).astype(x.dtype)
    return jnp_quantize(x, fmt, act_scale)
