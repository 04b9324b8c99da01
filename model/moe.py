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

Options (ModelConfig fields), as gpt-oss uses them:
    moe_routing "topk_softmax"   top-k of the router logits first, then the softmax over those k (the default,
                                 "softmax_topk", takes the top-k of the softmax over all E)
    moe_bias                     the router (b_router [E]) and the experts (b_gate_up [E, 2F], b_down [E, D])
                                 carry biases, added to each row by its expert after the grouped matmuls
    swiglu_limit / swiglu_alpha  clamped SwiGLU: gate <= limit, -limit <= up <= limit,
                                 act = (up + 1) * gate * sigmoid(alpha * gate)

Dropless: every assignment is computed (no capacity factor), so the grouped matmul sees ragged group sizes.
Expert weights go through `expert_matmul`, the grouped counterpart of `model.quant.matmul`: plain arrays take the
Mosaic GPU grouped matmul (pallas_kernels/grouped_matmul.py, bf16 / f16 only) where it runs, else XLA's
`ragged_dot`. Quantised experts (one QuantizedArray of all E experts, every leaf leading with E: model/quant.py;
made by model/quantize_model.py `quantize_experts`) always take `ragged_dot`, which has no dequantising kernel:

    int8, fp8 per output channel   ragged_dot(x, codes.astype(x.dtype)) [M, N] in float32, then each row times
                                   its expert's channel scales (scales [E, N] gathered by the row's expert id):
                                   the codes are exact in bf16 / f16 / f32, the scale is constant along K so it
                                   factors out of the sum, and the convert is an elementwise producer of the
                                   dot's operand that XLA may fuse into it (not yet checked on a GPU); no
                                   dequantised (scaled) copy of the experts is ever made
    int4 (groups along K), grouped int8 (GGUF Q8_0)   the scales vary along K and cannot factor out: the experts
                                   are dequantised to x's dtype (`QuantizedArray.dequantize`), then ragged_dot;
                                   at worst one transient copy in x's dtype per call

Quantised experts are weight-only: a QuantizedArray with a pre_scale or an activation format (AWQ, SmoothQuant,
W8A8) is refused here; quantize_model gives experts the weight-only form of such methods.

Expert parallelism (`mesh` given and sharding/rules.py splitting E over its expert/tensor axes, n shards): the
router runs replicated (the statistics need every token's routing), then inside `jax.shard_map` over those axes
each device holds E/n experts and T/n of the tokens (T padded up to a multiple of n with rows that route nowhere):

    dispatch   its T/n * k assignments sorted by expert, so grouped by destination device (expert // (E/n)),
               packed into [n, C, D] send slots (C = T/n * k: room for all of them on any one device, so no
               capacity factor and nothing dropped) with per-destination counts; one all_to_all
    experts    the received rows sorted by local expert -> the same grouped SwiGLU as above
    combine    a second all_to_all returns each row to its source, which un-sorts and weights them; the [T/n, D]
               results are all-gathered back into the replicated residual stream

jax 0.11.2's XLA:CPU has no ragged-all-to-all, hence the padded exchange: slots past a destination's count are
zeros that the grouped matmul leaves out (rows past the group sizes). Per layer this moves tokens, not the [T, D]
partial sums the all-reduce of a psum-based expert split would.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
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
    and `jax.lax.ragged_dot` otherwise; any `grouped_matmul` backend name forces that one. A QuantizedArray `w`
    takes `quantized_expert_matmul` (XLA's ragged_dot, whatever `backend`: the kernel reads bf16 / f16 only).
    """
    if isinstance(w, QuantizedArray):
        return quantized_expert_matmul(x, w, group_sizes)
    w = w.astype(x.dtype)
    if backend is None:
        fits = gm.supports(x.dtype, w.shape[1], w.shape[2]) and backend_lib.device_supports("mosaic_gpu")
        backend = "mosaic_gpu" if fits else "xla"
    return gm.grouped_matmul(x, w, group_sizes, backend=backend)


def row_experts(group_sizes: jax.Array, m: int) -> jax.Array:
    """The expert id [M] int32 of each of M rows sorted by expert (group_sizes [E]); rows past their sum get E."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))  # [E] one past each expert's last row
    return jnp.searchsorted(ends, jnp.arange(m, dtype=jnp.int32), side="right").astype(jnp.int32)


def _ragged_dot(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """x [M, K] @ w[e] [E, K, N] -> [M, N] float32 (rows past sum(group_sizes) are 0)."""
    gs = group_sizes.astype(jnp.int32)
    return jax.lax.ragged_dot(x, w, gs, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def quantized_expert_matmul(x: jax.Array, w: QuantizedArray, group_sizes: jax.Array) -> jax.Array:
    """x [M, K] (rows sorted by expert) @ dequantize(w)[e] [E, K, N] -> [M, N] in x's dtype, float32 accumulation;
    the path per format is the module docstring's (per-channel scales applied to the rows after the dot)."""
    if w.values.ndim != 3 or w.layout != "kn" or w.act_fmt or w.pre_scale is not None:
        raise ValueError(
            f"expert_matmul: quantised experts are weight-only [E, K, N] in layout 'kn', got values "
            f"{w.values.shape} layout={w.layout!r} act_fmt={w.act_fmt!r} pre_scale={w.pre_scale is not None}"
        )
    if w.fmt in ("int8", "fp8") and not w.group_size:
        y_mn = _ragged_dot(x, w.values.astype(x.dtype), group_sizes)  # codes: exact in x's dtype
        scales_en = w.scales.astype(jnp.float32).reshape(w.scales.shape[0], -1)  # [E, N], or [E, 1] per tensor
        rows = row_experts(group_sizes, x.shape[0])  # [M]; E past the groups: scale 0, as the rows are
        return (y_mn * jnp.take(scales_en, rows, axis=0, mode="fill", fill_value=0)).astype(x.dtype)
    return _ragged_dot(x, w.dequantize(x.dtype), group_sizes).astype(x.dtype)


def route(
    logits_te: jax.Array, k: int, renormalize: bool, routing: str = "softmax_topk"
) -> tuple[jax.Array, jax.Array]:
    """Top-k routing: (weights [T, k] float32, experts [T, k] int32) from router logits [T, E]; `routing`
    "topk_softmax" (gpt-oss) takes the softmax over the k largest logits instead (its weights sum to 1)."""
    if routing == "topk_softmax":
        top, experts = jax.lax.top_k(logits_te.astype(jnp.float32), k)
        return jax.nn.softmax(top, axis=-1), experts.astype(jnp.int32)
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
        b_router, b_gate_up, b_down: [E], [E, 2F], [E, D] biases, when cfg.moe_bias (gpt-oss).
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
        self.routing = cfg.moe_routing
        self.act = Activation(cfg.swiglu_limit, cfg.swiglu_alpha)
        if cfg.moe_bias:
            self.b_router = nnx.Param(jnp.zeros((e,), dtype))
            self.b_gate_up = nnx.Param(jnp.zeros((e, 2 * f), dtype))
            self.b_down = nnx.Param(jnp.zeros((e, d), dtype))
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
        if self.biases is not None:
            logits_te = logits_te + self.b_router[...].astype(jnp.float32)
        weights_tk, experts_tk = route(logits_te, self.top_k, self.renormalize, self.routing)
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

    @property
    def biases(self) -> tuple[jax.Array, jax.Array] | None:
        """(b_gate_up [E, 2F], b_down [E, D]) of gpt-oss-style experts, or None."""
        return (self.b_gate_up[...], self.b_down[...]) if hasattr(self, "b_gate_up") else None

    def _experts(self, x_td, weights_tk, experts_tk):
        """Dropless dispatch -> grouped SwiGLU experts -> weighted combine; also the assignments per expert."""
        t, k = experts_tk.shape
        flat_e = experts_tk.reshape(-1)  # [T*k], assignment a = token a // k, choice a % k
        order = jnp.argsort(flat_e, stable=True)  # [T*k] assignments sorted by expert
        group_sizes = jnp.bincount(flat_e, length=self.num_experts).astype(jnp.int32)  # [E]
        rows = jnp.take(x_td, order // k, axis=0)  # [T*k, D]
        weights = (self.w_gate_up.get_value(), self.w_down.get_value())
        y_sorted = _swiglu_experts(rows, *weights, group_sizes, self.backend, self.act, self.biases, flat_e[order])
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
        """Expert-parallel `_experts` (module docstring): tokens split over `axes`, sent to the devices that own
        their experts by one all-to-all, computed there, sent back by a second, combined, then all-gathered."""
        n = int(np.prod([mesh.shape[a] for a in axes]))
        t, k = experts_tk.shape
        t_pad = -(-t // n) * n  # each device takes t_pad / n tokens; the pad rows route nowhere (expert id E)
        if t_pad != t:
            x_td = jnp.pad(x_td, ((0, t_pad - t), (0, 0)))
            weights_tk = jnp.pad(weights_tk, ((0, t_pad - t), (0, 0)))
            experts_tk = jnp.pad(experts_tk, ((0, t_pad - t), (0, 0)), constant_values=self.num_experts)
        local = functools.partial(
            _dispatch_compute_combine, axes=axes, n=n, e_local=self.num_experts // n, backend=self.backend, act=self.act
        )
        rep, spec = P(), P(axes if len(axes) > 1 else axes[0])
        # Tokens go in replicated and each device slices its own: split in_specs would let GSPMD push the token
        # split back into attention and the router, with collectives of its own choosing there.
        fn = jax.shard_map(local, mesh=mesh, in_specs=(rep, rep, rep, spec, spec, spec), out_specs=spec)
        weights = (self.w_gate_up.get_value(), self.w_down.get_value())
        y_td = fn(x_td, weights_tk, experts_tk, *weights, self.biases)  # [T', D]
        # Replicated again (one all-gather), as the dense MLP's output is: the residual stream is not token-split.
        return jax.lax.with_sharding_constraint(y_td, NamedSharding(mesh, P()))[:t]

    def _shared(self, x_td):
        """Qwen-MoE's shared expert: sigmoid(x @ gate) * SwiGLU(x), in float32 for the sum."""
        h = jax.nn.silu(matmul(x_td, self.shared_w_gate.get_value())) * matmul(x_td, self.shared_w_up.get_value())
        y = matmul(h, self.shared_w_down.get_value()).astype(jnp.float32)
        return jax.nn.sigmoid(matmul(x_td, self.shared_gate.get_value(), out_dtype=jnp.float32)) * y


@dataclasses.dataclass(frozen=True)
class Activation:
    """The experts' gated activation: SwiGLU silu(gate) * up, or with `limit` gpt-oss's clamped variant
    (up + 1) * g * sigmoid(alpha * g) with g = min(gate, limit) and up clipped to [-limit, limit]."""

    limit: float | None = None
    alpha: float | None = None

    def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
        if self.limit is None:
            return jax.nn.silu(gate) * up
        gate = jnp.minimum(gate, self.limit)
        up = jnp.clip(up, -self.limit, self.limit)
        return (up + 1.0) * gate * jax.nn.sigmoid(gate * self.alpha)


def _swiglu_experts(rows_md, w_gate_up, w_down, group_sizes, backend, act=Activation(), biases=None, row_experts=None):
    """Rows sorted by expert [M, D] -> SwiGLU of each row's expert [M, D]; rows past sum(group_sizes) come out 0
    without `biases` ((b_gate_up [E, 2F], b_down [E, D]), added per row by `row_experts` [M]; ids >= E add 0)."""
    h = expert_matmul(rows_md, w_gate_up, group_sizes, backend)  # [M, 2F]
    if biases is not None:
        h = h + jnp.take(biases[0], row_experts, axis=0, mode="fill", fill_value=0).astype(h.dtype)
    gate, up = jnp.split(h, 2, axis=-1)
    y = expert_matmul(act(gate, up).astype(rows_md.dtype), w_down, group_sizes, backend)  # [M, D]
    if biases is not None:
        y = y + jnp.take(biases[1], row_experts, axis=0, mode="fill", fill_value=0).astype(y.dtype)
    return y


def _dispatch_compute_combine(
    x_td, weights_tk, experts_tk, w_gate_up, w_down, biases, *, axes, n, e_local, backend, act
):
    """One device's share of expert parallelism (inside shard_map over `axes`, n devices, e_local experts each).

    In: every token x [T, D] with its routing [T, k] (expert id E marks a pad token), of which this device takes
    t = T/n, and its experts' weights. Out: y [t, D] float32 of its own tokens.

        send     the a = t*k assignments sorted by expert are, in that order, grouped by destination device
                 (expert // e_local); buffer [n, C=a, D]: slot (d, j) holds the j-th row bound for device d, for
                 j < counts[d] (capacity a per destination: even if every assignment goes to one device, none
                 is dropped; the rest of the slot is zero padding)
        a2a      all_to_all: device d receives [n, C, D], source s's rows first, and their local expert ids
                 (e_local for padding), then sorts them by local expert for the grouped matmul
        a2a      the outputs go back the same way; the source scatters them to their sorted positions, un-sorts
                 and combines with the router weights
    """
    t, k = experts_tk.shape[0] // n, experts_tk.shape[1]
    a = t * k
    first = jax.lax.axis_index(axes) * t  # this device's tokens: rows first .. first + t of the replicated input
    x_td, weights_tk, experts_tk = (jax.lax.dynamic_slice_in_dim(v, first, t) for v in (x_td, weights_tk, experts_tk))
    flat_e = experts_tk.reshape(-1)  # [a]
    order = jnp.argsort(flat_e, stable=True)  # [a] assignments by expert, so by destination device
    dest = flat_e // e_local  # [a]; a pad assignment has dest n
    counts = jnp.sum(dest[None, :] == jnp.arange(n)[:, None], axis=1).astype(jnp.int32)  # [n] rows to each device
    starts = jnp.cumsum(counts) - counts  # [n] first sorted position bound for each device
    slot = jnp.arange(a)[None, :]  # [1, C]
    used = slot < counts[:, None]  # [n, C]
    pos = jnp.where(used, starts[:, None] + slot, 0)  # [n, C] sorted position held by each slot
    picked = order[pos]  # [n, C] assignment ids
    send_x = jnp.where(used[..., None], jnp.take(x_td, picked // k, axis=0), 0)  # [n, C, D]
    send_e = jnp.where(used, flat_e[picked] - jnp.arange(n)[:, None] * e_local, e_local)  # [n, C] local ids

    recv_x = jax.lax.all_to_all(send_x, axes, 0, 0, tiled=True).reshape(n * a, -1)  # [n*C, D] by source
    recv_e = jax.lax.all_to_all(send_e, axes, 0, 0, tiled=True).reshape(n * a)  # [n*C]
    order2 = jnp.argsort(recv_e, stable=True)  # this device's rows by local expert, padding last
    sizes = jnp.sum(recv_e[None, :] == jnp.arange(e_local)[:, None], axis=1).astype(jnp.int32)  # [e_local]
    rows = jnp.take(recv_x, order2, axis=0)
    y_rows = _swiglu_experts(rows, w_gate_up, w_down, sizes, backend, act, biases, recv_e[order2])
    y_recv = jnp.zeros_like(y_rows).at[order2].set(y_rows).reshape(n, a, -1)  # [n, C, D] in arrival order
    y_back = jax.lax.all_to_all(y_recv, axes, 0, 0, tiled=True)  # [n, C, D]: slot (d, j) computed by device d

    y_sorted = jnp.zeros((a + 1, y_back.shape[-1]), y_back.dtype).at[jnp.where(used, pos, a)].set(y_back)[:a]
    y_tkd = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(t, k, -1)  # un-sort
    return jnp.einsum("tkd,tk->td", y_tkd.astype(jnp.float32), weights_tk)  # [t, D] f32
