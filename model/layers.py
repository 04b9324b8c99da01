"""Building blocks of a Llama-family decoder (Flax NNX): RMSNorm, RoPE, gated MLP, embeddings, projections.

Weights are stored [in, out] (docs/ARCHITECTURE.md) and every projection goes through `model.quant.matmul`, the
one door for plain (bf16 / f32) and quantised weights: a projection's `nnx.Param` may hold a `QuantizedArray`
pytree instead of an array (NNX keeps any pytree as a Variable's value; `nnx.split` flattens its leaves), so
projections read their weight with `.get_value()`, not `[...]`. Embeddings and norms stay plain arrays.
Compute dtype is the activations' dtype; norms and softmax run in float32.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from model.config import ModelConfig, RopeScaling
from model.fused import group_parts, unfuse_output
from model.quant import matmul
from model.quant_fused import fuses_input, rms_norm_matmul, swiglu_matmul


def _param(shape: tuple[int, ...], dtype, rngs: nnx.Rngs | None, scale: float | None) -> nnx.Param:
    if rngs is None or scale is None:
        return nnx.Param(jnp.ones(shape, dtype) if scale is None else jnp.zeros(shape, dtype))
    return nnx.Param(scale * jax.random.normal(rngs.params(), shape, dtype))


class RMSNorm(nnx.Module):
    """y = x / rms(x) * (offset + weight), computed in float32.

    offset 0 is the Llama convention; Gemma stores w and scales by (1 + w) (offset 1), so a fresh norm is the
    identity either way (weight 1 - offset).
    """

    def __init__(self, dim: int, eps: float, dtype=jnp.float32, offset: float = 0.0):
        self.eps = eps
        self.offset = offset
        self.weight = nnx.Param(jnp.full((dim,), 1.0 - offset, dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * (self.offset + self.weight[...].astype(jnp.float32))).astype(x.dtype)

    def matmul(self, x: jax.Array, w, residual: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """(matmul(self(h), w), h) with h = x + residual (x without one): the residual add, this norm and the next
        projection through model/quant_fused.py's door, one kernel before the matmul for a W8A8 weight."""
        y, h = rms_norm_matmul(x, self.weight[...], self.eps, w, residual=residual, offset=self.offset)
        return y, (x if h is None else h)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> jax.Array:
    """Inverse frequencies [head_dim // 2] under `scaling` (model/config.py RopeScaling); longrope gives
    [2, head_dim // 2]: the short factors' row, then the long factors' (apply_rope picks per position)."""
    inv = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return inv
    if scaling.rope_type == "linear":
        return inv / scaling.factor
    if scaling.rope_type == "yarn":  # (model/mla.py's YaRN for DeepSeek shares this ramp)
        args = (scaling.factor, scaling.original_max_position_embeddings, scaling.beta_fast, scaling.beta_slow)
        return yarn_inv_freq(inv, head_dim, theta, *args, scaling.truncate)
    if scaling.rope_type == "longrope":
        if len(scaling.short_factor) != head_dim // 2:
            raise ValueError(
                f"longrope factors have {len(scaling.short_factor)} entries; head_dim / 2 is {head_dim // 2}"
            )
        factors = jnp.asarray([scaling.short_factor, scaling.long_factor], jnp.float32)
        return inv[None, :] / factors
    # Llama 3.1: wavelengths longer than old_len / low_freq_factor are divided by `factor`, shorter than
    # old_len / high_freq_factor are kept, and the band between is interpolated smoothly.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    interpolated = (1 - smooth) * inv / scaling.factor + smooth * inv
    return jnp.where(wavelen > low_wavelen, inv / scaling.factor, jnp.where(wavelen < high_wavelen, inv, interpolated))


def yarn_inv_freq(
    inv: jax.Array,
    dim: int,
    base: float,
    factor: float,
    original: int,
    beta_fast: float,
    beta_slow: float,
    truncate: bool,
) -> jax.Array:
    """YaRN's frequencies, as transformers computes them: plain RoPE inverse frequencies `inv` [dim / 2] of base
    `base` kept for the dims that rotate more than beta_fast times over the `original` context, divided by `factor`
    for those under beta_slow rotations, and a linear ramp between (its ends rounded out when `truncate`)."""

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp  # 1: keep the original frequency, 0: divide it by the factor
    return (inv / factor) * (1 - extrapolate) + inv * extrapolate


def apply_rope(x_bthd: jax.Array, positions_bt: jax.Array, inv_freq: jax.Array, long_from: int | None = None):
    """Rotate-half RoPE (HF / NeoX layout) on x [B, T, H, hd] at integer positions [B, T].

    inv_freq is [hd/2], or [2, hd/2] (longrope: row 1 from position `long_from` on, row 0 before it).
    """
    pos = positions_bt.astype(jnp.float32)[..., None]
    if inv_freq.ndim == 2:
        angles = jnp.where(positions_bt[..., None] >= long_from, pos * inv_freq[1], pos * inv_freq[0])
    else:
        angles = pos * inv_freq  # [B, T, hd/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x = x_bthd.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_bthd.dtype)


ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}


class GatedMLP(nnx.Module):
    """Gated MLP: down(act(x @ gate) * (x @ up)); act is SiLU (SwiGLU, Llama) or tanh-GELU (GeGLU, Gemma).
    gate and up are one fused weight, so the MLP reads its input projections in one matmul."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs | None):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.cfg = cfg
        self.activation = cfg.mlp_activation
        # gate|up fused into one weight [D, 2F] (model/fused.py), laid out for `gate_up_shards` shards.
        self.gate_up_shards = 1
        self.w_gate_up = _param((d, 2 * f), dtype, rngs, d**-0.5)
        self.w_down = _param((f, d), dtype, rngs, f**-0.5)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.from_gate_up(matmul(x, self.w_gate_up.get_value()))  # one matmul for both halves

    def from_gate_up(self, h: jax.Array) -> jax.Array:
        """The MLP after its input projection: h = x @ [gate | up] -> down(act(gate) * up)."""
        act = ACTIVATIONS[self.activation]
        w_down = self.w_down.get_value()
        if self.gate_up_shards == 1 and fuses_input(w_down):  # W8A8: quantise act(gate) * up as it is made
            return swiglu_matmul(h, w_down, self.activation)
        gate, up = unfuse_output(h, group_parts(self.cfg, "gate_up"), self.gate_up_shards)
        return matmul(act(gate) * up, self.w_down.get_value())


class Embedding(nnx.Module):
    """Token embedding table [V, D]; also the LM head when tied."""

    def __init__(self, vocab: int, dim: int, dtype, rngs: nnx.Rngs | None):
        self.weight = _param((vocab, dim), dtype, rngs, 1.0)

    def __call__(self, tokens: jax.Array, dtype) -> jax.Array:
        return jnp.take(self.weight[...], tokens, axis=0).astype(dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        """Logits x [..., D] @ weight.T -> [..., V] in float32."""
        return jnp.einsum("...d,vd->...v", x, self.weight[...].astype(x.dtype), preferred_element_type=jnp.float32)
