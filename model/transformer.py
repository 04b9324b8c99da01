"""Llama-family decoder in Flax NNX.

    tokens [B,T] -> embed -> L x (x + attn(norm(x)); x + mlp(norm(x))) -> norm -> lm_head -> logits [B,K,V]

Attention is grouped-query with rotate-half RoPE; how each layer writes and reads its KV cache is delegated to
the attention metadata (model/kv.py), so scoring, the contiguous reference path and the paged engine share this
code. Layers are a Python loop (unrolled under jit): on the H200 that is ~3x faster per decode step than a
`lax.scan` over stacked layers.

Creation: `build_model` and `random_model` start from `abstract_model` (nnx.eval_shape: every parameter a
ShapeDtypeStruct, nothing allocated) and write each parameter exactly once, in its final dtype and placement:

    params[name] (host / device array, QuantizedArray, or a LazyParams read)  --cast, device_put(sharding)-->  slot
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.config import ModelConfig
from model.layers import Embedding, GatedMLP, RMSNorm, _param, apply_rope, rope_inv_freq
from model.moe import MoEMLP
from model.quant import QuantizedArray, matmul


class Attention(nnx.Module):
    """Grouped-query self-attention: q/k/v projections, RoPE, cache write + attend (metadata), output projection."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs | None, layer: int = 0):
        d = cfg.hidden_size
        self.cfg = cfg
        self.window = cfg.layer_window(layer)
        if cfg.is_gemma:  # QK-norm: RMSNorm over each head's width, before RoPE
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, cfg.norm_offset)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, cfg.norm_offset)
        self.wq = _param((d, cfg.q_size), dtype, rngs, d**-0.5)
        self.wk = _param((d, cfg.kv_size), dtype, rngs, d**-0.5)
        self.wv = _param((d, cfg.kv_size), dtype, rngs, d**-0.5)
        self.wo = _param((cfg.q_size, d), dtype, rngs, cfg.q_size**-0.5)
        if cfg.attention_bias:
            self.bq = nnx.Param(jnp.zeros((cfg.q_size,), dtype))
            self.bk = nnx.Param(jnp.zeros((cfg.kv_size,), dtype))
            self.bv = nnx.Param(jnp.zeros((cfg.kv_size,), dtype))

    def __call__(self, x_btd, positions_bt, inv_freq, cache, meta):
        cfg = self.cfg
        b, t, _ = x_btd.shape
        q = matmul(x_btd, self.wq.get_value())
        k = matmul(x_btd, self.wk.get_value())
        v = matmul(x_btd, self.wv.get_value())
        if cfg.attention_bias:
            q, k, v = (
                q + self.bq[...].astype(q.dtype),
                k + self.bk[...].astype(k.dtype),
                v + self.bv[...].astype(v.dtype),
            )
        q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
        k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.is_gemma:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, positions_bt, inv_freq)
        k = apply_rope(k, positions_bt, inv_freq)
        v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        out, cache = meta.attend(q, k, v, positions_bt, cache, window=self.window, sm_scale=cfg.attn_scale)
        return matmul(out.reshape(b, t, cfg.q_size), self.wo.get_value()), cache


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs | None, layer: int = 0):
        norm = functools.partial(RMSNorm, cfg.hidden_size, cfg.rms_norm_eps, dtype, cfg.norm_offset)
        self.attn_norm = norm()
        self.attn = Attention(cfg, dtype, rngs, layer)
        self.mlp_norm = norm()
        self.post_norms = cfg.is_gemma  # Gemma 3 also norms each branch's output before the residual add
        if cfg.is_gemma:
            self.post_attn_norm, self.post_mlp_norm = norm(), norm()
        self.mlp = MoEMLP(cfg, dtype, rngs) if cfg.is_moe else GatedMLP(cfg, dtype, rngs)

    def __call__(self, x, positions, inv_freq, cache, meta, valid=None):
        """(x, cache, tokens_per_expert [E] int32 of the real tokens `valid` [B, T] (MoE) or None (dense))."""
        h, cache = self.attn(self.attn_norm(x), positions, inv_freq, cache, meta)
        x = x + (self.post_attn_norm(h) if self.post_norms else h)
        if not isinstance(self.mlp, MoEMLP):
            h = self.mlp(self.mlp_norm(x))
            return x + (self.post_mlp_norm(h) if self.post_norms else h), cache, None
        # The paged metadata carries the engine's mesh: the experts then run split over it (expert parallelism).
        y, tokens_per_expert = self.mlp(self.mlp_norm(x), valid, mesh=getattr(meta, "mesh", None))
        return x + y, cache, tokens_per_expert


class Transformer(nnx.Module):
    """The decoder. `dtype` is the compute and parameter dtype (float32 or bfloat16)."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.cfg = cfg
        self.dtype = dtype
        self.embed = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, rngs)
        self.layers = nnx.List([Block(cfg, dtype, rngs, layer=i) for i in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, cfg.norm_offset)
        if not cfg.tie_word_embeddings:
            self.lm_head = _param((cfg.hidden_size, cfg.vocab_size), dtype, rngs, cfg.hidden_size**-0.5)

    def __call__(
        self,
        tokens_bt: jax.Array,
        positions_bt: jax.Array,
        caches: Sequence[Any] | None,
        meta,
        logits_index_bk: jax.Array | None = None,
        valid_bt: jax.Array | None = None,
        router_stats: bool = False,
        return_hidden: bool = False,
    ):
        """Runs the decoder.

        Args:
          tokens_bt: token ids [B, T].
          positions_bt: absolute positions [B, T] (RoPE and causal masking).
          caches: per-layer caches in the layout `meta` expects, or None.
          meta: attention metadata (model/kv.py) deciding cache writes and visible keys.
          logits_index_bk: optional [B, K] indices into T; logits only there (saves the vocab matmul).
          valid_bt: optional [B, T] bool, the real (non-padding) tokens: only they count in the router statistics.
          router_stats: also return the MoE router's load, tokens_per_expert [L, E] int32 ([L, 0] when dense).
          return_hidden: also return the final-normed hidden states the head reads, [B, K or T, D] (the input of
            trained draft heads, model/medusa.py).

        Returns:
          (logits [B, K or T, V] float32, new caches), plus tokens_per_expert when router_stats, plus the hidden
          states when return_hidden.
        """
        cfg = self.cfg
        thetas = {cfg.layer_rope_theta(i) for i in range(cfg.num_layers)}  # Gemma 3: local and global bases
        inv_freqs = {theta: rope_inv_freq(cfg.head_dim, theta, cfg.rope_scaling) for theta in thetas}
        x = self.embed(tokens_bt, self.dtype)
        if cfg.is_gemma:  # embeddings scaled by sqrt(D), the factor rounded to the compute dtype as in HF
            x = x * jnp.asarray(cfg.hidden_size**0.5, self.dtype)
        new_caches, counts = [], []
        for i, layer in enumerate(self.layers):
            inv_freq = inv_freqs[cfg.layer_rope_theta(i)]
            x, c, n = layer(x, positions_bt, inv_freq, None if caches is None else caches[i], meta, valid_bt)
            new_caches.append(c)
            counts.append(jnp.zeros((0,), jnp.int32) if n is None else n)
        if logits_index_bk is not None:
            x = jnp.take_along_axis(x, logits_index_bk[:, :, None], axis=1)
        x = self.final_norm(x)
        out = self.head(x), (None if caches is None else new_caches)
        out = (*out, jnp.stack(counts)) if router_stats else out
        return (*out, x) if return_hidden else out

    def head(self, x_bkd: jax.Array) -> jax.Array:
        """Logits [B, K, V] float32 of final-normed hidden states [B, K, D]: the LM head (tied or not), softcap."""
        if self.cfg.tie_word_embeddings:
            logits = self.embed.attend(x_bkd)
        else:
            logits = matmul(x_bkd, self.lm_head.get_value(), out_dtype=jnp.float32)
        if self.cfg.final_logit_softcap is not None:
            logits = self.cfg.final_logit_softcap * jnp.tanh(logits / self.cfg.final_logit_softcap)
        return logits


# Canonical parameter names <-> module attributes ----------------------------------------------------------------

_LAYER_PATHS = {
    "attn_norm": ("attn_norm", "weight"),
    "mlp_norm": ("mlp_norm", "weight"),
    "post_attn_norm": ("post_attn_norm", "weight"),
    "post_mlp_norm": ("post_mlp_norm", "weight"),
    "q_norm": ("attn", "q_norm", "weight"),
    "k_norm": ("attn", "k_norm", "weight"),
    "wq": ("attn", "wq"),
    "wk": ("attn", "wk"),
    "wv": ("attn", "wv"),
    "wo": ("attn", "wo"),
    "bq": ("attn", "bq"),
    "bk": ("attn", "bk"),
    "bv": ("attn", "bv"),
    "w_gate": ("mlp", "w_gate"),
    "w_up": ("mlp", "w_up"),
    "w_down": ("mlp", "w_down"),
}
# An MoE layer (model/moe.py) has the attention and norms above and these instead of the dense MLP.
_MOE_LAYER_PATHS = {
    **{k: v for k, v in _LAYER_PATHS.items() if k not in ("w_gate", "w_up", "w_down")},
    "w_router": ("mlp", "w_router"),
    "w_gate_up": ("mlp", "w_gate_up"),
    "w_experts_down": ("mlp", "w_down"),
    "shared_gate": ("mlp", "shared_gate"),
    "shared_w_gate": ("mlp", "shared_w_gate"),
    "shared_w_up": ("mlp", "shared_w_up"),
    "shared_w_down": ("mlp", "shared_w_down"),
}
_QUANTISABLE = frozenset(("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head"))


def _param_slots(model: Transformer) -> dict[str, nnx.Param]:
    slots = {"embed": model.embed.weight, "final_norm": model.final_norm.weight}
    if not model.cfg.tie_word_embeddings:
        slots["lm_head"] = model.lm_head
    paths = _MOE_LAYER_PATHS if model.cfg.is_moe else _LAYER_PATHS
    for i, layer in enumerate(model.layers):
        for name, path in paths.items():
            node = layer
            for attr in path:  # (module, ..., attribute); optional slots (biases, Gemma norms) may be absent
                node = getattr(node, attr, None)
            if node is not None:
                slots[f"layers.{i}.{name}"] = node
    return slots


def model_params(model: Transformer) -> dict[str, Any]:
    """The model's parameters in canonical names (docs/ARCHITECTURE.md): arrays, or QuantizedArray pytrees."""
    return {name: slot.get_value() for name, slot in _param_slots(model).items()}


def abstract_model(cfg: ModelConfig, dtype=jnp.float32) -> Transformer:
    """The module with every parameter a jax.ShapeDtypeStruct (nnx.eval_shape): no memory is allocated."""
    return nnx.eval_shape(lambda: Transformer(cfg, dtype=dtype, rngs=None))


def _check_shardings(slots: Mapping[str, nnx.Param], shardings: Mapping[str, Any] | None) -> None:
    unknown = sorted(set(shardings or ()) - set(slots))
    if unknown:
        raise ValueError(f"shardings name parameters the model does not have: {unknown[:6]}")


def _place(name: str, value: Any, spec: jax.ShapeDtypeStruct, dtype, sharding) -> Any:
    """`value` checked against the slot, cast to `dtype` (arrays only) and put on `sharding` (or the default)."""
    if tuple(value.shape) != tuple(spec.shape):
        raise ValueError(f"{name}: shape {tuple(value.shape)} != expected {tuple(spec.shape)}")
    if isinstance(value, QuantizedArray):
        if name.rsplit(".", 1)[-1] not in _QUANTISABLE:
            raise ValueError(f"{name}: only linear weights {sorted(_QUANTISABLE)} may be QuantizedArray")
        if sharding is not None:
            raise ValueError(f"{name}: a sharding for a QuantizedArray parameter is not supported yet")
        return jax.device_put(value)
    if isinstance(value, jax.Array):
        return jax.device_put(value.astype(dtype), sharding)
    # Cast on the host, so only the converted bytes travel; the caller's buffer is dropped after this call.
    return jax.device_put(np.asarray(value).astype(dtype, copy=False), sharding)


def build_model(
    cfg: ModelConfig,
    params: Mapping[str, Any],
    dtype=jnp.float32,
    shardings: Mapping[str, jax.sharding.Sharding] | None = None,
) -> Transformer:
    """A Transformer holding `params` (canonical names), each written once, already cast and placed.

    The module is created abstractly (`abstract_model`), then each slot receives `params[name]` read once: a
    lazy mapping (checkpoints/lazy.py) is read, converted and placed one tensor at a time, so no zero-filled model
    and no second full copy ever exists.

    Args:
      cfg: the model configuration.
      params: canonical name -> numpy / jax array (cast to `dtype`) or QuantizedArray (a linear weight; kept).
      dtype: compute and parameter dtype.
      shardings: optional canonical name -> jax.sharding.Sharding (e.g. sharding/rules.py's NamedShardings);
        each array goes straight to its sharding with jax.device_put. Names left out get the default device.

    Raises:
      ValueError: unknown or missing names, wrong shapes, a quantised non-linear weight, unknown sharding names.
    """
    model = abstract_model(cfg, dtype)
    slots = _param_slots(model)
    missing = sorted(set(slots) - set(params))
    extra = sorted(set(params) - set(slots))
    if missing or extra:
        raise ValueError(f"parameters do not match the config: missing {missing[:6]}, unexpected {extra[:6]}")
    _check_shardings(slots, shardings)
    for name, slot in slots.items():
        sharding = None if shardings is None else shardings.get(name)
        slot.set_value(_place(name, params[name], slot.get_value(), dtype, sharding))
    return model


_NORMS = ("attn_norm", "mlp_norm", "final_norm", "post_attn_norm", "post_mlp_norm", "q_norm", "k_norm")


def _init_value(name: str, key: jax.Array, shape: tuple[int, ...], dtype, norm_value: float = 1.0) -> jax.Array:
    """The random initialiser of `Transformer(..., rngs=...)`, per canonical name: norms `norm_value` (1, or 0
    under Gemma's (1 + w) convention), biases 0, embedding N(0, 1), linear weights [in, out] N(0, 1/in)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf in _NORMS:
        return jnp.full(shape, norm_value, dtype)
    if leaf in ("bq", "bk", "bv"):
        return jnp.zeros(shape, dtype)
    scale = 1.0 if name == "embed" else shape[-2] ** -0.5  # fan-in: [in, out], or experts' [E, in, out]
    return scale * jax.random.normal(key, shape, dtype)


def random_model(
    cfg: ModelConfig,
    dtype=jnp.float32,
    seed: int = 0,
    shardings: Mapping[str, jax.sharding.Sharding] | None = None,
) -> Transformer:
    """A randomly initialised model (tests and performance work at real shapes).

    Each parameter is drawn on its device by one jitted call (output sharding `shardings[name]` when given), so
    the host holds no weights; slots of equal shape share one compilation.
    """
    model = abstract_model(cfg, dtype)
    slots = _param_slots(model)
    _check_shardings(slots, shardings)
    root = jax.random.key(seed)
    for i, (name, slot) in enumerate(slots.items()):
        spec = slot.get_value()
        sharding = None if shardings is None else shardings.get(name)
        kind = name if name == "embed" else name.rsplit(".", 1)[-1]  # Layers share one compilation per slot.
        init = _jitted_init(kind, tuple(spec.shape), jnp.dtype(dtype), sharding, 1.0 - cfg.norm_offset)
        slot.set_value(init(jax.random.fold_in(root, i)))
    return model


@functools.cache
def _jitted_init(kind: str, shape: tuple[int, ...], dtype, sharding, norm_value: float = 1.0):
    init = functools.partial(_init_value, kind, shape=shape, dtype=dtype, norm_value=norm_value)
    return jax.jit(init, out_shardings=sharding)
