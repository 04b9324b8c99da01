"""Mixture-of-experts MLP (Flax NNX): top-k router, dropless sort-based dispatch, grouped expert matmuls.

Data flow for x [T, D] (any leading dims are flattened), E experts, top-k, expert width F:

    router     logits [T, E] = x @ w_router (f32) -> softmax -> top-k weights w [T, k] and experts e [T, k]
               (renormalised to sum 1 when cfg.norm_topk_prob, as Mixtral; Qwen1.5-MoE keeps the raw softmax)
    dispatch   the T*k (token, expert) assignments sorted by expert (stable):  order [T*k],  rows x[order // k]
               group_sizes [E] = assignments per expert (the router load statistic; sums to T*k)
    experts    h [T*k, 2F] = grouped_matmul(rows, w_gate_up [E, D, 2F], group_sizes)   (gate | up columns)
               y_s [T*k, D] = grouped_matmul(silu(gate) * up, w_down [E, F, D], group_sizes)
    combine    y_s un-sorted back to [T, k, D], weighted by w and summed over k
    shared     (Qwen-MoE) + sigmoid(x @ w_shared_gate [D, 1]) * SwiGLU_shared(x)

Dropless: every assignment is computed (no capacity factor), so the grouped matmul sees ragged group sizes.
Expert weights go through `expert_matmul`, the grouped counterpart of `model.quant.matmul` (the one place a
quantised expert format will be added; plain arrays today). Expert parallelism will split E across the "expert"
mesh axis and replace the sort with an all-to-all; the router and the combine stay as they are.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from model.config import ModelConfig
from model.quant import QuantizedArray, matmul
from pallas_kernels import backend as backend_lib
from pallas_kernels import grouped_matmul as gm


def _param(shape: tuple[int, ...], dtype, rngs: nnx.Rngs | None, fan_in: int) -> nnx.Param:
    if rngs is None:
        return nnx.Param(jnp.zeros(shape, dtype))
    return nnx.Param(fan_in**-0.5 * jax.random.normal(rngs.params(), shape, dtype))


def expert_matmul(x: jax.Array, w, group_sizes: jax.Array, backend: str | None = None) -> jax.Array:
    """The door for expert weights: x [M, K] (rows sorted by expert) @ w[e] [E, K, N] -> [M, N] in x's dtype.

    `backend` None picks the Mosaic GPU grouped matmul where it runs (Hopper, bf16/f16, tile-aligned K and N)
    and `jax.lax.ragged_dot` otherwise; any `grouped_matmul` backend name forces that one.
    """
    if isinstance(w, QuantizedArray):
        raise ValueError("expert_matmul: quantised expert weights are not supported yet; pass a plain array")
    w = w.astype(x.dtype)
    if backend is None:
        fits = gm.supports(x.dtype, w.shape[1], w.shape[2]) and backend_lib.device_supports("mosaic_gpu")
        backend = "mosaic_gpu" if fits else "xla"
    return gm.grouped_matmul(x, w, group_sizes, backend=backend)


def route(logits_te: jax.Array, k: int, renormalize: bool) -> tuple[jax.Array, jax.Array]:
    """Top-k routing: (weights [T, k] float32, experts [T, k] int32) from router logits [T, E]."""
    probs = jax.nn.softmax(logits_te.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


class MoEMLP(nnx.Module):
    """The MoE MLP of one decoder layer: call it on x [..., D] to get (y [..., D], tokens_per_expert [E] int32).

    Attributes:
        w_router: [D, E] router projection.
        w_gate_up: [E, D, 2F] routed experts' gate (columns :F) and up (F:) projections, fused.
        w_down: [E, F, D] routed experts' down projections.
        shared_*: the shared expert (SwiGLU of width Fs) and its sigmoid gate [D, 1], when configured.
    """

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs | None, backend: str | None = None):
        if not cfg.is_moe:
            raise ValueError(f"MoEMLP needs an MoE config (num_experts > 0), got {cfg.name} with num_experts=0")
        d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        self.num_experts, self.top_k, self.renormalize = e, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.backend = backend
        self.w_router = _param((d, e), dtype, rngs, d)
        self.w_gate_up = _param((e, d, 2 * f), dtype, rngs, d)
        self.w_down = _param((e, f, d), dtype, rngs, f)
        fs = cfg.shared_expert_intermediate_size
        self.has_shared = fs > 0
        if self.has_shared:
            self.shared_gate = _param((d, 1), dtype, rngs, d)
            self.shared_w_gate = _param((d, fs), dtype, rngs, d)
            self.shared_w_up = _param((d, fs), dtype, rngs, d)
            self.shared_w_down = _param((fs, d), dtype, rngs, fs)

    def __call__(self, x: jax.Array, valid: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """y [..., D] and tokens_per_expert [E] int32 for x [..., D].

        `valid` [...] bool (optional) marks real tokens: padding rows of a bucketed batch are still computed
        (dispatch is dropless and shape-static) but left out of the statistics, which then sum to valid * k.
        """
        lead, d = x.shape[:-1], x.shape[-1]
        x_td = x.reshape(-1, d)
        logits_te = matmul(x_td, self.w_router.get_value(), out_dtype=jnp.float32)
        weights_tk, experts_tk = route(logits_te, self.top_k, self.renormalize)
        y_td, group_sizes = self._experts(x_td, weights_tk, experts_tk)
        if self.has_shared:
            y_td = y_td + self._shared(x_td)
        if valid is None:
            tokens_per_expert = group_sizes
        else:
            mask_tk = jnp.broadcast_to(valid.reshape(-1, 1), experts_tk.shape)
            counts = jnp.zeros((self.num_experts,), jnp.int32)
            tokens_per_expert = counts.at[experts_tk.reshape(-1)].add(mask_tk.reshape(-1).astype(jnp.int32))
        return y_td.astype(x.dtype).reshape(*lead, d), tokens_per_expert

    def _experts(self, x_td, weights_tk, experts_tk):
        """Dropless dispatch -> grouped SwiGLU experts -> weighted combine; also the assignments per expert."""
        t, k = experts_tk.shape
        flat_e = experts_tk.reshape(-1)  # [T*k], assignment a = token a // k, choice a % k
        order = jnp.argsort(flat_e, stable=True)  # [T*k] assignments sorted by expert
        group_sizes = jnp.bincount(flat_e, length=self.num_experts).astype(jnp.int32)  # [E]
        rows = jnp.take(x_td, order // k, axis=0)  # [T*k, D]
        h = expert_matmul(rows, self.w_gate_up.get_value(), group_sizes, self.backend)  # [T*k, 2F]
        gate, up = jnp.split(h, 2, axis=-1)
        act = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(x_td.dtype)
        y_sorted = expert_matmul(act, self.w_down.get_value(), group_sizes, self.backend)  # [T*k, D]
        y_tkd = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(t, k, -1)  # un-sort
        y_td = jnp.einsum("tkd,tk->td", y_tkd.astype(jnp.float32), weights_tk)
        return y_td, group_sizes

    def _shared(self, x_td):
        """Qwen-MoE's shared expert: sigmoid(x @ gate) * SwiGLU(x), in float32 for the sum."""
        h = jax.nn.silu(matmul(x_td, self.shared_w_gate.get_value())) * matmul(x_td, self.shared_w_up.get_value())
        y = matmul(h, self.shared_w_down.get_value()).astype(jnp.float32)
        return jax.nn.sigmoid(matmul(x_td, self.shared_gate.get_value(), out_dtype=jnp.float32)) * y
