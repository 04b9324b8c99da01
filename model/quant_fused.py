"""The matmul door for a projection whose input is made by an elementwise op the W8A8 activation quantiser can
absorb: the fused kernels of pallas_kernels/act_quant_fused.py for a W8A8 weight, model/quant.py's `matmul` after
the unfused ops for every other weight.

    swiglu_matmul(h [..., 2F], w_down, activation)             = matmul(act(gate) * up, w_down)
    rms_norm_matmul(x, norm weight, eps, w, residual=r)       = (matmul(rms_norm(x + r), w), x + r)
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from model import quant


def fuses_input(w) -> bool:
    """Whether a projection's input op goes through this module's doors for weight w: a W8A8 weight (act_fmt set)
    whose options fuse its activation quantiser (MatmulOptions.fuse_act_quant). Other weights keep the model's
    unfused ops. (The doors still run the unfused ops where the quantiser kernel does not: the same numbers.)"""
    return isinstance(w, quant.QuantizedArray) and bool(w.act_fmt) and quant.options_of(w).fuse_act_quant


def _fused_quantiser(w, x: jax.Array, options: quant.MatmulOptions) -> str:
    """The backend of pallas_kernels/act_quant_fused.py for an act_fmt weight's input x, or "" (unfused)."""
    from pallas_kernels.backend import device_supports

    if (
        not isinstance(w, quant.QuantizedArray)
        or not w.act_fmt
        or not options.fuse_act_quant
        or x.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32)
    ):
        return ""
    quantiser = quant.act_quantiser(
        options, "triton" if device_supports("triton") and jax.device_count() == 1 else "xla"
    )
    return "" if quantiser == "xla" else quantiser


def _after_fused(x, q, w: quant.QuantizedArray, out_dtype, options: quant.MatmulOptions, dequantized: bool):
    """matmul of a fused quantiser's output: (codes, scales) into the W8A8 kernel, or the codes' values into the
    weight's other paths (its activation format already applied)."""
    if not dequantized:
        return quant.w8a8_kernel_matmul(x, w, out_dtype, options, quantized=q)
    return quant.matmul(q, dataclasses.replace(w, pre_scale=None, act_fmt="", act_scale=None), out_dtype, options)


def swiglu_matmul(h: jax.Array, w, activation: str = "silu", options: quant.MatmulOptions | None = None) -> jax.Array:
    """matmul(act(gate) * up, w) for an MLP's fused gate|up output h = [gate | up] [..., 2F] (one shard). A W8A8
    weight's input is made by one kernel (pallas_kernels/act_quant_fused.py: act(gate) * up in f32 rounded once,
    quantised in the same pass) where it runs; everything else as the unfused ops."""
    from pallas_kernels.act_quant_fused import ACTIVATIONS, swiglu_quantize

    options = options or quant.options_of(w)
    if quantiser := _fused_quantiser(w, h, options) if activation in ACTIVATIONS else "":
        rows = math.prod(h.shape[:-1])
        whole = quant.use_w8a8_kernel(w, rows, h.dtype, h.dtype, options)
        kw = dict(act_scale=w.act_scale, pre_scale=w.pre_scale, dequantize=not whole, backend=quantiser)
        return _after_fused(None, swiglu_quantize(h, w.act_fmt, activation, **kw), w, h.dtype, options, not whole)
    if activation not in ACTIVATIONS:
        raise ValueError(f"swiglu_matmul: activation must be one of {ACTIVATIONS}, got {activation!r}")
    gate, up = jnp.split(h, 2, axis=-1)
    act = jax.nn.silu if activation == "silu" else functools.partial(jax.nn.gelu, approximate=True)
    return quant.matmul(act(gate) * up, w, options=options)  # model/layers.py GatedMLP's ops


def rms_norm_matmul(
    x: jax.Array, weight: jax.Array, eps: float, w, *, residual=None, offset: float = 0.0, options=None
) -> tuple[jax.Array, jax.Array | None]:
    """(matmul(rms_norm(h), w), h) with h = x + residual (x without one; None returned for h then): a decoder
    layer's residual add, its RMSNorm (model/layers.py) and the next projection. A W8A8 weight's input is made by one
    kernel (pallas_kernels/act_quant_fused.py: add, norm and activation quantisation in one pass) where it runs."""
    from pallas_kernels.act_quant_fused import rms_norm_quantize

    options = options or quant.options_of(w)
    if quantiser := _fused_quantiser(w, x, options):
        whole = quant.use_w8a8_kernel(w, math.prod(x.shape[:-1]), x.dtype, x.dtype, options)
        kw = dict(act_scale=w.act_scale, pre_scale=w.pre_scale, dequantize=not whole, backend=quantiser)
        out = rms_norm_quantize(x, weight, eps, w.act_fmt, residual=residual, offset=offset, **kw)
        q, h = out if residual is not None else (out, None)
        return _after_fused(x, q, w, x.dtype, options, not whole), h
    h = x if residual is None else x + residual
    h32 = h.astype(jnp.float32)
    y = h32 * jax.lax.rsqrt(jnp.mean(h32 * h32, axis=-1, keepdims=True) + eps)
    y = (y * (offset + weight.astype(jnp.float32))).astype(x.dtype)
    return quant.matmul(y, w, options=options), (h if residual is not None else None)
