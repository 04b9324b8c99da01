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
from model.fused import GROUPS, PartSlot, fuse, fused_width, group_parts, split, unfuse_output
from model.kv import PagedMeta
from model.layers import Embedding, GatedMLP, RMSNorm, _param, apply_rope, rope_inv_freq
from model.moe import MoEMLP
from model.quant import QuantizedArray, matmul
from model.quant_fused import fuses_input
from sharding.rules import quantized_expert_sharding


class Attention(nnx.Module):
    """Grouped-query self-attention: q/k/v projections, RoPE, cache write + attend (metadata), output projection."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs | None, layer: int = 0):
        d = cfg.hidden_size
        self.cfg = cfg
        self.window = cfg.layer_window(layer)
        if cfg.has_qk_norm:  # QK-norm: RMSNorm over each head's width, before RoPE
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, cfg.norm_offset)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, cfg.norm_offset)
        # q|k|v fused into one weight (model/fused.py), laid out for `qkv_shards` tensor-parallel shards.
        self.qkv_shards = 1
        self.wqkv = _param((d, cfg.q_size + 2 * cfg.kv_size), dtype, rngs, d**-0.5)
        self.wo = _param((cfg.q_size, d), dtype, rngs, cfg.q_size**-0.5)
        if cfg.attention_bias:
            self.bqkv = nnx.Param(jnp.zeros((cfg.q_size + 2 * cfg.kv_size,), dtype))
        if cfg.attention_sinks:  # gpt-oss: a learned logit per query head in every softmax denominator
            self.sinks = nnx.Param(jnp.zeros((cfg.num_heads,), dtype))
        if cfg.attention_out_bias:
            self.bo = nnx.Param(jnp.zeros((d,), dtype))

    def __call__(self, x_btd, positions_bt, inv_freq, cache, meta):
        qkv = matmul(x_btd, self.wqkv.get_value())  # [B, T, q + 2 kv] (wider when KV heads repeat per shard)
        return self.from_qkv(qkv, positions_bt, inv_freq, cache, meta)

    def from_qkv(self, qkv, positions_bt, inv_freq, cache, meta):
        """The attention after its input projection qkv = x @ wqkv [B, T, q + 2 kv]: (output [B, T, D], cache)."""
        cfg = self.cfg
        b, t, _ = qkv.shape
        if cfg.attention_bias:
            qkv = qkv + self.bqkv[...].astype(qkv.dtype)
        # The fused RoPE + KV-write kernel takes plain RoPE: no QK-norm, longrope or attention softcap.
        plain = not cfg.has_qk_norm and inv_freq.ndim == 1 and cfg.attn_logit_softcap is None
        fused = plain and self.qkv_shards == 1 and isinstance(meta, PagedMeta)
        if fused and meta.fuses_rope(cache, cfg.num_kv_heads):  # RoPE + KV write in one kernel (model/kv.py)
            kw = dict(num_q_heads=cfg.num_heads, window=self.window, sm_scale=cfg.attn_scale, **self._sinks())
            out, cache = meta.rope_attend(qkv, positions_bt, inv_freq, cache, **kw)
            return self._output(out.reshape(b, t, cfg.q_size)), cache
        q, k, v = unfuse_output(qkv, group_parts(cfg, "wqkv"), self.qkv_shards)
        q = q.reshape(b, t, -1, cfg.head_dim)  # [B, T, Hq, hd]
        k = k.reshape(b, t, -1, cfg.head_dim)  # [B, T, Hkv (or tp, repeated), hd]
        if cfg.has_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        long_from = cfg.rope_scaling.original_max_position_embeddings if cfg.long_rope else None
        q = apply_rope(q, positions_bt, inv_freq, long_from)
        k = apply_rope(k, positions_bt, inv_freq, long_from)
        v = v.reshape(b, t, -1, cfg.head_dim)
        attn = dict(window=self.window, sm_scale=cfg.attn_scale, **self._sinks())
        if cfg.attn_logit_softcap is not None:
            attn["logit_softcap"] = cfg.attn_logit_softcap
        out, cache = meta.attend(q, k, v, positions_bt, cache, **attn)
        return self._output(out.reshape(b, t, cfg.q_size)), cache

    def _sinks(self) -> dict:
        return {"sinks": self.sinks[...]} if self.cfg.attention_sinks else {}

    def _output(self, out_btq):
        """The output projection [B, T, Hq * hd] -> [B, T, D] (plus its bias, gpt-oss)."""
        y = matmul(out_btq, self.wo.get_value())
        return y + self.bo[...].astype(y.dtype) if self.cfg.attention_out_bias else y


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs | None, layer: int = 0):
        norm = functools.partial(RMSNorm, cfg.hidden_size, cfg.rms_norm_eps, dtype, cfg.norm_offset)
        self.attn_norm = norm()
        self.attn = Attention(cfg, dtype, rngs, layer)
        self.mlp_norm = norm()
        self.post_norms = cfg.is_gemma  # Gemma 2 / 3 also norm each branch's output before the residual add
        if cfg.is_gemma:
            self.post_attn_norm, self.post_mlp_norm = norm(), norm()
        self.mlp = MoEMLP(cfg, dtype, rngs) if cfg.is_moe else GatedMLP(cfg, dtype, rngs)

    def __call__(self, x, positions, inv_freq, cache, meta, valid=None):
        """(x, cache, tokens_per_expert [E] int32 of the real tokens `valid` [B, T] (MoE) or None (dense))."""
        h, x, cache, tokens_per_expert = self.run(x, None, positions, inv_freq, cache, meta, valid)
        return x + h, cache, tokens_per_expert

    def run(self, x, residual, positions, inv_freq, cache, meta, valid=None):
        """The layer on the residual stream s = x + residual (s = x without one): (h, s', cache, tokens_per_expert)
        whose output stream is s' + h, that last residual add left to the caller: the next layer adds it in its
        first norm. Each norm before a W8A8 projection (q|k|v, gate|up) runs with the residual add before it and
        the projection's activation quantiser in one kernel (RMSNorm.matmul; model/quant_fused.py)."""
        wqkv = self.attn.wqkv.get_value()
        if fuses_input(wqkv):
            qkv, x = self.attn_norm.matmul(x, wqkv, residual)
            h, cache = self.attn.from_qkv(qkv, positions, inv_freq, cache, meta)
        else:
            x = x if residual is None else x + residual
            h, cache = self.attn(self.attn_norm(x), positions, inv_freq, cache, meta)
        h = self.post_attn_norm(h) if self.post_norms else h
        if isinstance(self.mlp, MoEMLP):
            x = x + h
            # The paged metadata carries the engine's mesh: the experts then run split over it (expert parallelism).
            y, tokens_per_expert = self.mlp(self.mlp_norm(x), valid, mesh=getattr(meta, "mesh", None))
            return y, x, cache, tokens_per_expert
        w_gate_up = self.mlp.w_gate_up.get_value()
        if fuses_input(w_gate_up):
            gate_up, x = self.mlp_norm.matmul(x, w_gate_up, h)
            h = self.mlp.from_gate_up(gate_up)
        else:
            x = x + h
            h = self.mlp(self.mlp_norm(x))
        return (self.post_mlp_norm(h) if self.post_norms else h), x, cache, None


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
        # Gemma 3: local and global bases (the global ones scaled)
        ropes = {(cfg.layer_rope_theta(i), cfg.layer_rope_scaling(i)) for i in range(cfg.num_layers)}
        inv_freqs = {rope: rope_inv_freq(cfg.head_dim, *rope) for rope in ropes}
        x = self.embed(tokens_bt, self.dtype)
        if cfg.is_gemma:  # embeddings scaled by sqrt(D), the factor rounded to the compute dtype as in HF
            x = x * jnp.asarray(cfg.hidden_size**0.5, self.dtype)
        new_caches, counts, pending = [], [], None  # pending: the last layer's output branch, not yet added to x
        for i, layer in enumerate(self.layers):
            inv_freq = inv_freqs[cfg.layer_rope_theta(i), cfg.layer_rope_scaling(i)]
            args = (positions_bt, inv_freq, None if caches is None else caches[i], meta, valid_bt)
            if isinstance(layer, Block):  # the residual add goes into the next layer's first norm
                pending, x, c, n = layer.run(x, pending, *args)
            else:  # model/pipeline.py's stages: whole layers
                x, c, n = layer(x if pending is None else x + pending, *args)
                pending = None
            new_caches.append(c)
            counts.append(jnp.zeros((0,), jnp.int32) if n is None else n)
        x = x if pending is None else x + pending
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

# Storage leaves (module attributes) per layer; a fused leaf (model/fused.py GROUPS) holds several canonical ones.
_LAYER_PATHS = {
    "attn_norm": ("attn_norm", "weight"),
    "mlp_norm": ("mlp_norm", "weight"),
    "post_attn_norm": ("post_attn_norm", "weight"),
    "post_mlp_norm": ("post_mlp_norm", "weight"),
    "q_norm": ("attn", "q_norm", "weight"),
    "k_norm": ("attn", "k_norm", "weight"),
    "wqkv": ("attn", "wqkv"),  # wq | wk | wv
    "wo": ("attn", "wo"),
    "bqkv": ("attn", "bqkv"),  # bq | bk | bv
    "bo": ("attn", "bo"),
    "sinks": ("attn", "sinks"),
    "gate_up": ("mlp", "w_gate_up"),  # w_gate | w_up
    "w_down": ("mlp", "w_down"),
}
# An MoE layer (model/moe.py) has the attention and norms above and these instead of the dense MLP.
_MOE_LAYER_PATHS = {
    **{k: v for k, v in _LAYER_PATHS.items() if k not in ("gate_up", "w_down")},
    "w_router": ("mlp", "w_router"),
    "w_gate_up": ("mlp", "w_gate_up"),
    "w_experts_down": ("mlp", "w_down"),
    "shared_gate": ("mlp", "shared_gate"),
    "shared_w_gate": ("mlp", "shared_w_gate"),
    "shared_w_up": ("mlp", "shared_w_up"),
    "shared_w_down": ("mlp", "shared_w_down"),
    "b_router": ("mlp", "b_router"),
    "b_gate_up": ("mlp", "b_gate_up"),
    "b_experts_down": ("mlp", "b_down"),
}
_SHARDS_ATTR = {"wqkv": "qkv_shards", "bqkv": "qkv_shards", "gate_up": "gate_up_shards"}  # on the owner module
_QUANTISABLE = frozenset(
    ("wq", "wk", "wv", "wqkv", "wo", "w_gate", "w_up", "gate_up", "w_down", "lm_head", "w_gate_up", "w_experts_down")
)


def _storage_slots(model: Transformer) -> dict[str, nnx.Param]:
    """Storage name ("layers.3.wqkv", "embed", ...) -> the nnx.Param holding it."""
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


def _fused_leaf(name: str) -> str | None:
    leaf = name.rsplit(".", 1)[-1]
    return leaf if name.startswith("layers.") and leaf in GROUPS else None


def _owner(model: Transformer, name: str) -> tuple[nnx.Module, str]:
    """(module, attribute) of the shard count of fused storage slot `name`."""
    _, i, leaf = name.split(".")
    return getattr(model.layers[int(i)], _LAYER_PATHS[leaf][0]), _SHARDS_ATTR[leaf]


def _parts(model: Transformer, name: str):
    """(prefix "layers.i.", parts, shards) of fused storage slot `name`."""
    leaf = _fused_leaf(name)
    owner, attr = _owner(model, name)
    return name[: -len(leaf)], group_parts(model.cfg, leaf), getattr(owner, attr)


def _param_slots(model: Transformer) -> dict[str, Any]:
    """Canonical name -> slot: the nnx.Param, or for a fused part a PartSlot view of its fused Param."""
    out: dict[str, Any] = {}
    for name, slot in _storage_slots(model).items():
        if _fused_leaf(name) is None:
            out[name] = slot
            continue
        prefix, parts, shards = _parts(model, name)
        for j, p in enumerate(parts):
            out[prefix + p.name] = PartSlot(slot, parts, j, shards)
    return out


def model_params(model: Transformer) -> dict[str, Any]:
    """The model's parameters in canonical names (docs/ARCHITECTURE.md): arrays, or QuantizedArray pytrees."""
    out: dict[str, Any] = {}
    for name, slot in _storage_slots(model).items():
        if _fused_leaf(name) is None:
            out[name] = slot.get_value()
            continue
        prefix, parts, shards = _parts(model, name)
        out.update({prefix + p.name: v for p, v in zip(parts, split(slot.get_value(), parts, shards))})
    return out


def abstract_model(cfg: ModelConfig, dtype=jnp.float32) -> Transformer:
    """The module with every parameter a jax.ShapeDtypeStruct (nnx.eval_shape): no memory is allocated."""
    return nnx.eval_shape(lambda: Transformer(cfg, dtype=dtype, rngs=None))


def _check_shardings(slots: Mapping[str, Any], shardings: Mapping[str, Any] | None) -> None:
    unknown = sorted(set(shardings or ()) - set(slots))
    if unknown:
        raise ValueError(f"shardings name parameters the model does not have: {unknown[:6]}")


def _place(name: str, value: Any, spec: jax.ShapeDtypeStruct, dtype, sharding, quantized_sharding=None) -> Any:
    """`value` checked against the slot, cast to `dtype` (arrays only) and put on `sharding` (or the default);
    a QuantizedArray goes to `quantized_sharding` (the engine's mesh, replicated) or the default device, except
    routed experts [E, K, N], split over E as `sharding` says (sharding/rules.py quantized_expert_sharding)."""
    if tuple(value.shape) != tuple(spec.shape):
        raise ValueError(f"{name}: shape {tuple(value.shape)} != expected {tuple(spec.shape)}")
    if isinstance(value, QuantizedArray):
        if name.rsplit(".", 1)[-1] not in _QUANTISABLE:
            raise ValueError(f"{name}: only linear weights {sorted(_QUANTISABLE)} may be QuantizedArray")
        if sharding is not None and quantized_sharding is None:
            raise ValueError(f"{name}: a sharding for a QuantizedArray parameter is not supported yet")
        experts = quantized_expert_sharding(value, sharding)
        return jax.device_put(value, quantized_sharding if experts is None else experts)
    if isinstance(value, jax.Array):
        return jax.device_put(value.astype(dtype), sharding)
    # Cast on the host, so only the converted bytes travel; the caller's buffer is dropped after this call.
    return jax.device_put(np.asarray(value).astype(dtype, copy=False), sharding)


def _fused_layout(parts, part_shardings: Sequence[Any], ndim: int, quantized: bool) -> tuple[int, Any]:
    """(shards, sharding) of a fused slot from its parts' shardings: the per-shard layout (model/fused.py), split
    over the mesh axis the first part's output columns shard on, when every other part shards there too or is
    replicated with fewer units than that axis has devices (KV heads: repeated); else the plain concatenation,
    replicated on the parts' mesh (or no sharding when none was given). Quantised slots stay replicated."""
    named = [s for s in part_shardings if isinstance(s, jax.sharding.NamedSharding)]
    if not named:
        return 1, (part_shardings[0] if part_shardings else None)
    mesh = named[0].mesh
    replicated = jax.sharding.NamedSharding(mesh, jax.P())

    def out_axis(s):
        spec = tuple(s.spec) if isinstance(s, jax.sharding.NamedSharding) else ()
        return spec[ndim - 1] if len(spec) >= ndim else None

    axis = out_axis(part_shardings[0])
    if quantized or not isinstance(axis, str) or len(named) != len(part_shardings):
        return 1, replicated
    size = mesh.shape[axis]
    for p, s in zip(parts, part_shardings):
        if not (out_axis(s) == axis or (out_axis(s) is None and p.units < size and size % p.units == 0)):
            return 1, replicated
    return size, part_shardings[0]


def _read_parts(name, shape, prefix, parts, read) -> list[Any]:
    """The canonical parts of fused slot `name` read in order, each checked against its canonical shape."""
    values = []
    for p in parts:
        v, want = read(prefix + p.name), (*tuple(shape)[:-1], p.width)
        if tuple(v.shape) != want:
            raise ValueError(f"{prefix + p.name}: shape {tuple(v.shape)} != expected {want}")
        values.append(v)
    return values


def storage_value(model: Transformer, name: str, read) -> Any:
    """The value of storage slot `name` from canonical values `read(name)`: a fused slot's parts concatenated
    in its current layout (model/fused.py)."""
    if _fused_leaf(name) is None:
        return read(name)
    prefix, parts, shards = _parts(model, name)
    shape = _storage_slots(model)[name].get_value().shape
    return fuse(_read_parts(name, shape, prefix, parts, read), parts, shards)


def replicated_like(sharding):
    """Replicated on the mesh of `sharding` (a NamedSharding), or None."""
    mesh = getattr(sharding, "mesh", None)
    return None if mesh is None else jax.sharding.NamedSharding(mesh, jax.P())


def write_params(
    model: Transformer,
    read,
    dtype,
    shardings: Mapping[str, Any] | None = None,
    quantized_sharding=None,
) -> Transformer:
    """Writes every slot of `model` once from canonical values `read(name)` (fused groups concatenated in the
    layout their parts' `shardings` call for, model/fused.py), cast to `dtype` and placed; returns `model`."""
    shardings = shardings or {}
    for name, slot in _storage_slots(model).items():
        spec = slot.get_value()
        if _fused_leaf(name) is None:
            slot.set_value(_place(name, read(name), spec, dtype, shardings.get(name), quantized_sharding))
            continue
        prefix, parts, _ = _parts(model, name)
        values = _read_parts(name, spec.shape, prefix, parts, read)
        owner, attr = _owner(model, name)
        quantized = any(isinstance(v, QuantizedArray) for v in values)
        part_shardings = [shardings.get(prefix + p.name) for p in parts]
        shards, sharding = _fused_layout(parts, part_shardings, len(spec.shape), quantized)
        if name.endswith("bqkv") and shards != getattr(owner, attr):  # the bias follows its weight's layout
            shards, sharding = getattr(owner, attr), None if sharding is None else replicated_like(sharding)
        setattr(owner, attr, shards)
        fused_spec = jax.ShapeDtypeStruct((*tuple(spec.shape)[:-1], fused_width(parts, shards)), jnp.float32)
        value = fuse(values, parts, shards)  # (the one copy of the fused weight)
        slot.set_value(_place(name, value, fused_spec, dtype, sharding, quantized_sharding))
    return model


def build_model(
    cfg: ModelConfig,
    params: Mapping[str, Any],
    dtype=jnp.float32,
    shardings: Mapping[str, jax.sharding.Sharding] | None = None,
) -> Transformer:
    """A Transformer holding `params` (canonical names), each written once, already cast and placed.

    The module is created abstractly (`abstract_model`), then each slot receives `params[name]` read once: a
    lazy mapping (checkpoints/lazy.py) is read, converted and placed one tensor at a time, so no zero-filled model
    and no second full copy ever exists. Fused slots (q|k|v, gate|up: model/fused.py) read their parts in order
    and are written once, concatenated.

    Args:
      cfg: the model configuration.
      params: canonical name -> numpy / jax array (cast to `dtype`) or QuantizedArray (a linear weight; kept).
      dtype: compute and parameter dtype.
      shardings: optional canonical name -> jax.sharding.Sharding (e.g. sharding/rules.py's NamedShardings);
        each array goes straight to its sharding with jax.device_put (a fused slot: its parts' split, in the
        per-shard layout). Names left out get the default device.

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
    return write_params(model, params.__getitem__, dtype, shardings)


_NORMS = ("attn_norm", "mlp_norm", "final_norm", "post_attn_norm", "post_mlp_norm", "q_norm", "k_norm")


def _init_value(name: str, key: jax.Array, shape: tuple[int, ...], dtype, norm_value: float = 1.0) -> jax.Array:
    """The random initialiser of `Transformer(..., rngs=...)`, per canonical name: norms `norm_value` (1, or 0
    under Gemma's (1 + w) convention), biases 0, embedding N(0, 1), linear weights [in, out] N(0, 1/in)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf in _NORMS:
        return jnp.full(shape, norm_value, dtype)
    if leaf in ("bq", "bk", "bv", "bo", "sinks", "b_router", "b_gate_up", "b_experts_down"):
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

    Each canonical parameter is drawn on its device by one jitted call (output sharding `shardings[name]` when
    given), so the host holds no weights; slots of equal shape share one compilation. Fused parts are drawn
    one by one (the same values as unfused) and concatenated into their slot.
    """
    model = abstract_model(cfg, dtype)
    slots = _param_slots(model)
    _check_shardings(slots, shardings)
    root = jax.random.key(seed)
    index = {name: i for i, name in enumerate(slots)}

    def draw(name):
        spec = slots[name].get_value()
        sharding = None if shardings is None else shardings.get(name)
        kind = name if name == "embed" else name.rsplit(".", 1)[-1]  # Layers share one compilation per slot.
        init = _jitted_init(kind, tuple(spec.shape), jnp.dtype(dtype), sharding, 1.0 - cfg.norm_offset)
        return init(jax.random.fold_in(root, index[name]))

    return write_params(model, draw, dtype, shardings)


@functools.cache
def _jitted_init(kind: str, shape: tuple[int, ...], dtype, sharding, norm_value: float = 1.0):
    init = functools.partial(_init_value, kind, shape=shape, dtype=dtype, norm_value=norm_value)
    return jax.jit(init, out_shardings=sharding)
