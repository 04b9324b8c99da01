"""The W8A8 activation quantiser fused with the elementwise op before it: one pass and one launch where the model
took an XLA fusion writing the op's output and then the quantiser reading it back.

    rms_norm_quantize(x [M, K], weight [K], eps, fmt, residual=r)  ->  (xq [M, K], x_scale [M, 1], h [M, K])
        h = x + r (rounded to x's dtype, as the decoder's residual add; h = x without a residual)
        y = h / rms(h) * (offset + weight) in f32, rounded to x's dtype       (model/layers.py RMSNorm)
        xq, x_scale = act_quant.quantize_activations(y, fmt, act_scale, pre_scale)
    swiglu_quantize(h [M, 2F], fmt, activation)  ->  (xq [M, F], x_scale [M, 1])
        y = act(gate) * up, gate = h[:, :F], up = h[:, F:], in f32 rounded once to h's dtype (model/layers.py
        GatedMLP's `act(gate) * up` in bf16, whose XLA evaluation rounds in between or not, by backend: 50-75% of
        its bf16 values equal the once-rounded f32 on a CPU), then quantised as above

`dequantize=True` writes the codes' values (codes * scale) in x's dtype instead of codes and scales: the input of
the bf16 decode kernels for a W8A8 weight's decode-sized calls (model/quant.py), as act_quant.fake_quantize does.

Data flow (one program owns `block_m` whole rows, as act_quant.py's kernel): the row block's chunks are loaded once
into registers (float32), the prologue computes y chunk by chunk (RMSNorm: a sum-of-squares pass over the chunks
in registers first), then the amax, the per-row scale and the codes, exactly as act_quant's epilogue (IEEE divide,
round half to even). Backends: "triton" (GPU), "interpret" (CPU tests), "xla" (the jnp `reference_*`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import backend as backend_lib
from pallas_kernels.act_quant import DTYPES, ActQuantConfig, _chunk, _div, _round_half_even
from pallas_kernels.act_quant import reference as quant_reference
from pallas_kernels.w8a8_matmul import ACT_RECIP

ACTIVATIONS = ("silu", "gelu_tanh")


def activation_f32(g, activation: str):
    """act(g) in float32 (jax.nn.silu / jax.nn.gelu(approximate=True) on f32)."""
    if activation == "silu":
        return g * jax.nn.sigmoid(g)
    return 0.5 * g * (1.0 + jnp.tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))  # sqrt(2 / pi)


def _kernel(*refs, mode, fmt, bm, k, eps, offset, activation, has_res, has_pre, static, exact_div, dequantize):
    # rms:    x_ref [M, K], res_ref [M, K] (has_res), w_ref [K] f32 norm weight
    # swiglu: x_ref [M, 2K] (gate | up)
    # then pre_ref [K] f32 (has_pre), act_ref [1] f32 (static); outputs q_ref [M, K] (codes or values),
    # s_ref [M] f32 (not when dequantize), h_ref [M, K] (rms with a residual: the new residual stream)
    refs = list(refs)
    x_ref = refs.pop(0)
    res_ref = refs.pop(0) if has_res else None
    w_ref = refs.pop(0) if mode == "rms" else None
    pre_ref = refs.pop(0) if has_pre else None
    act_ref = refs.pop(0) if static else None
    q_ref = refs.pop(0)
    s_ref = None if dequantize else refs.pop(0)
    h_ref = refs.pop(0) if has_res else None
    m, dtype = x_ref.shape[0], x_ref.dtype
    chunk = _chunk(k)
    n_chunks = max(1, k // chunk)
    col_mask = chunk * n_chunks != k
    rows = pl.program_id(0) * bm + jnp.arange(bm)
    row_ok = rows < m
    rnd = lambda v: v.astype(dtype).astype(jnp.float32)  # noqa: E731

    def cols_mask(c):
        cols = c * chunk + jnp.arange(chunk)
        mask = None if m % bm == 0 else jnp.broadcast_to(row_ok[:, None], (bm, chunk))
        if col_mask:
            mask = row_ok[:, None] & (cols < k)[None, :]
        return cols, mask

    def load(ref, c, shift=0):
        cols, mask = cols_mask(c)
        view = ref.at[rows[:, None], shift + cols[None, :]]
        return pltriton.load(view, mask=mask, other=0 if mask is not None else None).astype(jnp.float32)

    def load_vec(ref, c):
        cols, _ = cols_mask(c)
        return pltriton.load(ref.at[cols], mask=cols < k if col_mask else None, other=0 if col_mask else None)

    ys = []
    if mode == "rms":
        hs = []
        for c in range(n_chunks):
            h = load(x_ref, c)
            if res_ref is not None:
                h = rnd(h + load(res_ref, c))
                cols, mask = cols_mask(c)
                pltriton.store(h_ref.at[rows[:, None], cols[None, :]], h.astype(dtype), mask=mask)
            hs.append(h)
        ss = sum(jnp.sum(h * h, axis=1) for h in hs)  # [bm]
        inv = lax.rsqrt(ss / k + eps)[:, None]
        for c, h in enumerate(hs):
            ys.append(rnd(h * inv * (offset + load_vec(w_ref, c)[None, :])))
    else:
        for c in range(n_chunks):
            ys.append(rnd(activation_f32(load(x_ref, c), activation) * load(x_ref, c, shift=k)))
    if pre_ref is not None:  # rounded to x's dtype, as model/quant.py's _prepare_input does
        ys = [rnd(y * load_vec(pre_ref, c)[None, :]) for c, y in enumerate(ys)]
    if act_ref is None:
        amax = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(y), axis=1) for y in ys])
        scale = jnp.where(amax > 0, amax * ACT_RECIP[fmt], 1.0)
    else:
        scale = jnp.broadcast_to(act_ref[...], (bm,))
    for c, y in enumerate(ys):
        v = _div(y, scale[:, None], exact_div)
        if fmt == "int8":
            q = _round_half_even(jnp.clip(v, -127.0, 127.0))
            q = (q * scale[:, None]).astype(dtype) if dequantize else q.astype(jnp.int8)
        elif dequantize:
            e4m3 = jnp.clip(v, -448.0, 448.0).astype(jnp.float8_e4m3fn).astype(jnp.float32)
            q = (e4m3 * scale[:, None]).astype(dtype)
        else:
            q = lax.bitcast_convert_type(jnp.clip(v, -448.0, 448.0).astype(jnp.float8_e4m3fn), jnp.uint8)
        cols, mask = cols_mask(c)
        pltriton.store(q_ref.at[rows[:, None], cols[None, :]], q, mask=mask)
    if s_ref is not None:
        pltriton.store(s_ref.at[rows], scale, mask=None if m % bm == 0 else row_ok)


@functools.partial(
    jax.jit, static_argnames=("mode", "fmt", "k", "eps", "offset", "activation", "dequantize", "config", "interpret")
)
def _call(
    x2, res, weight, pre_scale, act_scale, *, mode, fmt, k, eps, offset, activation, dequantize, config, interpret
):
    m = x2.shape[0]
    bm = config.block_m(k)
    inputs = [x2]
    if res is not None:
        inputs.append(res)
    if mode == "rms":
        inputs.append(weight.astype(jnp.float32).reshape(k))
    if pre_scale is not None:
        inputs.append(pre_scale.astype(jnp.float32).reshape(k))
    if act_scale is not None:
        inputs.append(jnp.asarray(act_scale, jnp.float32).reshape(1))
    code_dtype = x2.dtype if dequantize else (jnp.int8 if fmt == "int8" else jnp.uint8)
    out_shape = [backend_lib.out_struct((m, k), code_dtype, [x2])]
    if not dequantize:
        out_shape.append(backend_lib.out_struct((m,), jnp.float32, [x2]))
    if res is not None:
        out_shape.append(backend_lib.out_struct((m, k), x2.dtype, [x2]))
    kernel = functools.partial(
        _kernel,
        mode=mode,
        fmt=fmt,
        bm=bm,
        k=k,
        eps=eps,
        offset=offset,
        activation=activation,
        has_res=res is not None,
        has_pre=pre_scale is not None,
        static=act_scale is not None,
        exact_div=not interpret,
        dequantize=dequantize,
    )
    outs = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(m, bm),),
        out_shape=tuple(out_shape),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=1),
        name=f"{mode}_quant_{fmt}_bm{bm}_c{_chunk(k)}",
    )(*inputs)
    outs = list(outs)
    q = outs.pop(0)
    if not dequantize and fmt == "fp8":
        q = lax.bitcast_convert_type(q, jnp.float8_e4m3fn)
    scale = None if dequantize else outs.pop(0).reshape(m, 1)
    return q, scale, (outs.pop(0) if res is not None else None)


def _backend(x, fmt, k, act_scale, pre_scale, backend) -> str:
    if fmt not in DTYPES:
        raise ValueError(f"act_quant_fused: fmt must be one of {tuple(DTYPES)}, got {fmt!r}")
    if x.ndim < 1 or x.shape[-1] == 0 or x.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise ValueError(f"act_quant_fused: x must be [..., K] float16 / bfloat16 / float32, got {x.dtype}{x.shape}")
    if pre_scale is not None and pre_scale.size != k:
        raise ValueError(f"act_quant_fused: pre_scale must have K={k} elements, got shape {pre_scale.shape}")
    if act_scale is not None and jnp.size(act_scale) != 1:
        raise ValueError(f"act_quant_fused: act_scale must be one per-tensor scale, got {jnp.shape(act_scale)}")
    if backend in (None, "mosaic_gpu"):
        backend = "triton" if backend_lib.device_supports("triton") else "xla"
    return backend_lib.resolve_backend(backend, "act_quant_fused")


def _finish(q, scale, lead, k, dequantize):
    q = q.reshape(*lead, k)
    return q if dequantize else (q, scale.reshape(*lead, 1))


def rms_norm_quantize(
    x, weight, eps: float, fmt: str, *, residual=None, offset=0.0, act_scale=None, pre_scale=None, dequantize=False,
    config: ActQuantConfig | None = None, backend: str | None = None,
):  # fmt: skip
    """RMSNorm (+ the residual add before it) and the activation quantiser in one pass (module docstring).

    Returns ((xq, x_scale) or, with `dequantize`, the codes' values in x's dtype) and, with a residual, the new
    residual stream h = x + residual in x's dtype: ((xq, x_scale), h) / (values, h); without one, no h.

    Raises:
        ValueError: an unknown fmt or backend, a non-float x, weight / residual / scales of the wrong shape.
    """
    k = x.shape[-1]
    backend = _backend(x, fmt, k, act_scale, pre_scale, backend)
    if weight.shape != (k,) or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"rms_norm_quantize: weight must be [K]={k} and residual x's shape {x.shape}")
    if backend == "xla" or x.size == 0:
        out = reference_rms_norm_quantize(x, weight, eps, fmt, residual, offset, act_scale, pre_scale, dequantize)
    else:
        lead, x2 = x.shape[:-1], x.reshape(-1, k)
        res = None if residual is None else residual.reshape(-1, k)
        kw = dict(mode="rms", fmt=fmt, k=k, eps=float(eps), offset=float(offset), activation="", dequantize=dequantize)
        q, s, h = _call(
            x2,
            res,
            weight,
            pre_scale,
            act_scale,
            **kw,
            config=config or ActQuantConfig(),
            interpret=backend == "interpret",
        )
        out = (_finish(q, s, lead, k, dequantize), None if h is None else h.reshape(x.shape))
    return out if residual is not None else out[0]


def swiglu_quantize(
    h, fmt: str, activation: str = "silu", *, act_scale=None, pre_scale=None, dequantize=False,
    config: ActQuantConfig | None = None, backend: str | None = None,
):  # fmt: skip
    """act(gate) * up of h = [gate | up] [..., 2F] and the activation quantiser in one pass: (xq [..., F],
    x_scale [..., 1]), or with `dequantize` the codes' values [..., F] in h's dtype.

    Raises:
        ValueError: an unknown fmt, activation or backend, a non-float h, an odd last axis, scales of the wrong size.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"swiglu_quantize: activation must be one of {ACTIVATIONS}, got {activation!r}")
    if h.ndim < 1 or h.shape[-1] % 2:
        raise ValueError(f"swiglu_quantize: h must be [..., 2F] (gate | up), got shape {h.shape}")
    k = h.shape[-1] // 2
    backend = _backend(h, fmt, k, act_scale, pre_scale, backend)
    if backend == "xla" or h.size == 0:
        return reference_swiglu_quantize(h, fmt, activation, act_scale, pre_scale, dequantize)
    kw = dict(mode="swiglu", fmt=fmt, k=k, eps=0.0, offset=0.0, activation=activation, dequantize=dequantize)
    q, s, _ = _call(
        h.reshape(-1, 2 * k), None, None, pre_scale, act_scale, **kw,
        config=config or ActQuantConfig(), interpret=backend == "interpret",
    )  # fmt: skip
    return _finish(q, s, h.shape[:-1], k, dequantize)


def _quantized(y, fmt, act_scale, pre_scale, dequantize):
    q, scale = quant_reference(y, fmt, act_scale, pre_scale)
    if not dequantize:
        return q, scale
    return (lax.optimization_barrier(q).astype(jnp.float32) * scale).astype(y.dtype)


def reference_rms_norm_quantize(
    x, weight, eps, fmt, residual=None, offset=0.0, act_scale=None, pre_scale=None, dequantize=False
):
    """The unfused ops in plain jnp: the residual add in x's dtype, model/layers.py's RMSNorm, act_quant.reference."""
    h = x if residual is None else x + residual
    h32 = h.astype(jnp.float32)
    y = h32 * lax.rsqrt(jnp.mean(h32 * h32, axis=-1, keepdims=True) + eps)
    y = (y * (offset + weight.astype(jnp.float32))).astype(x.dtype)
    out = _quantized(y, fmt, act_scale, pre_scale, dequantize)
    return (out, h) if residual is not None else (out, None)


def reference_swiglu_quantize(h, fmt, activation="silu", act_scale=None, pre_scale=None, dequantize=False):
    """The unfused ops in plain jnp: act(gate) * up in f32 rounded once to h's dtype, act_quant.reference."""
    gate, up = jnp.split(h.astype(jnp.float32), 2, axis=-1)
    y = (activation_f32(gate, activation) * up).astype(h.dtype)
    return _quantized(y, fmt, act_scale, pre_scale, dequantize)
