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
quantised expert format will be added; plain arrays today).

Expert parallelism (`mesh` given and sharding/rules.py splitting E over its expert/tensor axes, n shards): the
router runs replicated, then inside `jax.shard_map` each device holds E/n experts and every token's routing:

    local experts e0 .. e0 + E/n    their assignments are one contiguous run of the expert-sorted order, starting
                                    at starts[e0]; the order is rotated so that the run comes first, and the
                                    grouped matmul with the E/n local group sizes computes exactly those rows
                                    (rows past the local groups come out zero)
    combine                         each device's weighted partial sum [T, D], then one psum over the n shards

Tokens are not moved (they are replicated over the expert axis already), so dispatch needs no all-to-all; the
price is the one psum of [T, D] per layer, the same as a tensor-parallel MLP's all-reduce.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from model.config import ModelConfig
from model.quant import QuantizedArray, matmul
from pallas_kernels import backend as backend_lib
from pallas_kernels import grouped_matmul as gm
from sharding.rules import param_partition_spec


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

    def __call__(
        self, x: jax.Array, valid: jax.Array | None = None, mesh: jax.sharding.Mesh | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """y [..., D] and tokens_per_expert [E] int32 for x [..., D].

        `valid` [...] bool (optional) marks real tokens: padding rows of a bucketed batch are still computed
        (dispatch is dropless and shape-static) but left out of the statistics, which then sum to valid * k.
        `mesh` (optional): the experts run split over it where sharding/rules.py splits them (module docstring).
        """
        lead, d = x.shape[:-1], x.shape[-1]
        x_td = x.reshape(-1, d)
        logits_te = matmul(x_td, self.w_router.get_value(), out_dtype=jnp.float32)
        weights_tk, experts_tk = route(logits_te, self.top_k, self.renormalize)
        axes = self._expert_axes(mesh)
        if axes:
            y_td = self._experts_sharded(x_td, weights_tk, experts_tk, mesh, axes)
            group_sizes = jnp.bincount(experts_tk.reshape(-1), length=self.num_experts).astype(jnp.int32)
        else:
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

    def _expert_axes(self, mesh) -> tuple[str, ...]:
        """Mesh axes the experts' E dimension is split over (empty: not split, or no mesh)."""
        if mesh is None:
            return ()
        spec = param_partition_spec("layers.0.w_gate_up", self.w_gate_up.get_value().shape, mesh)
        axes = spec[0] if len(spec) else None
        return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)

    def _experts_sharded(self, x_td, weights_tk, experts_tk, mesh, axes):
        """Expert-parallel `_experts` (module docstring): local experts per device, one psum of [T, D] f32."""
        e_local = self.num_experts // int(np.prod([mesh.shape[a] for a in axes]))
        num_experts, backend = self.num_experts, self.backend
        t, k = experts_tk.shape

        def local(x_td, weights_tk, experts_tk, w_gate_up, w_down):
            e0 = jax.lax.axis_index(axes) * e_local
            flat_e = experts_tk.reshape(-1)
            order = jnp.argsort(flat_e, stable=True)
            group_sizes = jnp.bincount(flat_e, length=num_experts).astype(jnp.int32)
            start = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(group_sizes)])[e0]
            local_sizes = jax.lax.dynamic_slice_in_dim(group_sizes, e0, e_local)
            picked = order[(jnp.arange(t * k) + start) % (t * k)]  # the local experts' assignments first
            rows = jnp.take(x_td, picked // k, axis=0)
            h = expert_matmul(rows, w_gate_up, local_sizes, backend)
            gate, up = jnp.split(h, 2, axis=-1)
            act = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(x_td.dtype)
            y_rows = expert_matmul(act, w_down, local_sizes, backend)  # zero past the local groups
            y_tkd = jnp.zeros_like(y_rows).at[picked].set(y_rows).reshape(t, k, -1)
            return jax.lax.psum(jnp.einsum("tkd,tk->td", y_tkd.astype(jnp.float32), weights_tk), axes)

        rep, split = P(), P(axes if len(axes) > 1 else axes[0])
        fn = jax.shard_map(local, mesh=mesh, in_specs=(rep, rep, rep, split, split), out_specs=rep, check_vma=False)
        return fn(x_td, weights_tk, experts_tk, self.w_gate_up.get_value(), self.w_down.get_value())

    def _shared(self, x_td):
        """Qwen-MoE's shared expert: sigmoid(x @ gate) * SwiGLU(x), in float32 for the sum."""
        h = jax.nn.silu(matmul(x_td, self.shared_w_gate.get_value())) * matmul(x_td, self.shared_w_up.get_value())
        y = matmul(h, self.shared_w_down.get_value()).astype(jnp.float32)
        return jax.nn.sigmoid(matmul(x_td, self.shared_gate.get_value(), out_dtype=jnp.float32)) * y
