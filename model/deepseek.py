"""DeepSeek-V2 / V3 decoder (Flax NNX): MLA attention, first dense layers, MoE with shared experts, grouped routing.

    tokens [B, T] -> embed -> L x (x + mla(norm(x)); x + mlp(norm(x))) -> norm -> lm_head -> logits [B, K, V]
    mlp = SwiGLU for the first `first_k_dense_replace` layers, then DeepseekMoE:
        router     V3 ("noaux_tc"): scores [T, E] = sigmoid(x @ w_router) (f32); choice = scores + router_bias
                   (aux-loss-free balancing: the bias picks experts, never weights them); E experts in n_group
                   groups, a group's score the sum of its two best choices; only the topk_group best groups
                   compete; top-k experts of those by choice; weights w [T, k] = their scores (/ their sum
                   when norm_topk_prob) * routed_scaling_factor
                   V2 ("greedy", "group_limited_greedy"): scores = softmax(x @ w_router); group-limited: a
                   group's score is its best expert, the others' scores are zeroed; top-k by score; weights
                   = scores * routed_scaling_factor (never renormalised, as transformers' DeepseekV2)
        experts    dropless sort by expert -> grouped SwiGLU (model/moe.py expert_matmul) -> weighted combine
        shared     + SwiGLU_shared(x) (n_shared_experts fused into one of width n_shared * F_moe), ungated

Attention and its latent cache are model/mla.py's; the caches and metadata follow model/kv.py (NoCache, a
contiguous latent cache per layer, or the paged latent pool). Checkpoints: checkpoints/deepseek_hf.py reads
HF DeepseekV2ForCausalLM / DeepseekV3ForCausalLM directories.

The engine (serving/engine) serves this model as it serves model/transformer.py's: the same call signature
(logits at chosen rows, the router's per-expert token counts, the hidden states), and a config that answers the
engine's questions (heads, experts, layers; one "KV head" of R + Dr values per token: the latent pool,
serving/engine/kv_pool.py). On the engine's mesh (`place_mla`) the attention is split by query heads over the
tensor axis and the rest replicated; pipeline and expert parallelism are refused for now.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from model.layers import Embedding, RMSNorm
from model.mla import MlaAttention, MlaConfig, YarnScaling
from model.moe import expert_matmul
from model.quant import QuantizedArray, matmul
from model.quantize_model import CALIBRATED, quantize_experts, quantize_weight
from sharding.mesh import EXPERT, PIPELINE, TENSOR


@dataclasses.dataclass(frozen=True)
class DeepseekConfig:
    """Shape and numerics of a DeepSeek-V2 / V3 decoder.

    Attributes:
        name: checkpoint name, for messages only.
        vocab_size, hidden_size: V and D.
        intermediate_size: width of the dense layers' SwiGLU.
        num_layers: decoder blocks L.
        mla: the attention layer's config (model/mla.py).
        first_k_dense_replace: the first layers with a dense MLP; the rest are MoE.
        n_routed_experts, num_experts_per_tok: E and top-k.
        n_shared_experts: shared experts (run on every token), fused into one SwiGLU.
        moe_intermediate_size: width F of one expert.
        n_group, topk_group: expert groups and how many of them a token may route into.
        routed_scaling_factor: factor on the routed experts' weights.
        norm_topk_prob: renormalise the top-k weights to sum 1 before the factor (V3 routing only).
        routing: "noaux_tc" (V3), "greedy" or "group_limited_greedy" (V2); see the module docstring.
        rms_norm_eps: epsilon of the residual-stream RMSNorms.
        tie_word_embeddings: the LM head is the embedding matrix.
        bos_token_id, eos_token_ids: special tokens.
        max_position_embeddings: longest context the model supports.
    """

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    mla: MlaConfig
    first_k_dense_replace: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    routing: str = "noaux_tc"
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    max_position_embeddings: int = 4096

    def __post_init__(self):
        if self.mla.hidden_size != self.hidden_size:
            raise ValueError(f"{self.name}: MLA width {self.mla.hidden_size} != hidden_size {self.hidden_size}")
        e = self.n_routed_experts
        if self.routing not in ROUTINGS:
            raise ValueError(f"{self.name}: routing must be one of {ROUTINGS}, got {self.routing!r}")
        if e:
            if not 0 < self.num_experts_per_tok <= e or self.n_group < 1 or e % self.n_group:
                raise ValueError(f"{self.name}: need 0 < top-k <= E and n_group dividing E, got {self}")
            pairs = self.routing == "noaux_tc" and self.n_group > 1  # a group's score needs two experts
            if not 0 < self.topk_group <= self.n_group or (pairs and e // self.n_group < 2):
                raise ValueError(f"{self.name}: need 0 < topk_group <= n_group and >= 2 experts per group")
            if self.num_experts_per_tok > self.topk_group * (e // self.n_group):
                raise ValueError(f"{self.name}: top-k exceeds the experts of the topk_group groups")

    def is_moe_layer(self, layer: int) -> bool:
        return self.n_routed_experts > 0 and layer >= self.first_k_dense_replace

    # What the engine asks of a model config (model/config.py ModelConfig's names).
    @property
    def num_heads(self) -> int:
        return self.mla.num_heads

    @property
    def num_kv_heads(self) -> int:
        """One: a token's cached row is the latent [c_kv | k_rope] that every query head reads."""
        return 1

    @property
    def head_dim(self) -> int:
        """Width of the one cached row per token: kv_lora_rank + qk_rope_head_dim."""
        return self.mla.latent_width

    @property
    def num_experts(self) -> int:
        return self.n_routed_experts

    @property
    def is_moe(self) -> bool:
        return self.n_routed_experts > 0

    @property
    def kv_window(self) -> None:
        """No sliding window: every cached row stays visible."""
        return None

    @classmethod
    def from_hf(cls, hf: dict[str, Any], name: str = "hf") -> DeepseekConfig:
        """From a parsed DeepseekV2 / V3 config.json (transformers 4 `rope_scaling` or 5 `rope_parameters`)."""
        if hf.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"{name}: unsupported hidden_act {hf.get('hidden_act')!r}")
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise ValueError(f"{name}: attention_bias / mlp_bias are not supported for DeepSeek")
        v2 = "DeepseekV2ForCausalLM" in (hf.get("architectures") or []) or hf.get("model_type") == "deepseek_v2"
        routing = hf.get("topk_method") or ("greedy" if v2 else "noaux_tc")
        scoring = hf.get("scoring_func") or ("softmax" if v2 else "sigmoid")
        if (scoring, routing in ROUTINGS[1:]) != (("softmax", True) if v2 else ("sigmoid", False)):
            raise ValueError(
                f"{name}: unsupported routing {scoring!r} / {routing!r} for DeepSeek-{'V2' if v2 else 'V3'}"
            )
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        kind = rope.get("rope_type", rope.get("type", "default"))
        yarn = None
        if kind == "yarn":
            factor = rope.get("factor")
            orig = int(rope["original_max_position_embeddings"])
            factor = float(hf["max_position_embeddings"] / orig if factor is None else factor)
            opt = {k: rope[k] for k in ("mscale", "mscale_all_dim", "attention_factor") if rope.get(k) is not None}
            fast, slow = rope.get("beta_fast") or 32.0, rope.get("beta_slow") or 1.0
            yarn = YarnScaling(factor, orig, float(fast), float(slow), truncate=bool(rope.get("truncate", True)), **opt)
        elif kind != "default":
            raise ValueError(f"{name}: unsupported RoPE scaling {kind!r} for MLA (default or yarn)")
        eos = hf.get("eos_token_id")
        mla = MlaConfig(
            hidden_size=int(hf["hidden_size"]),
            num_heads=int(hf["num_attention_heads"]),
            q_lora_rank=None if hf.get("q_lora_rank") is None else int(hf["q_lora_rank"]),
            kv_lora_rank=int(hf["kv_lora_rank"]),
            qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
            qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
            v_head_dim=int(hf["v_head_dim"]),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_interleave=v2 or bool(hf.get("rope_interleave", True)),  # V2: complex (pairwise) RoPE
            yarn=yarn,
        )
        return cls(
            name=name,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            mla=mla,
            first_k_dense_replace=int(hf.get("first_k_dense_replace", 0)),
            n_routed_experts=int(hf.get("n_routed_experts") or 0),
            num_experts_per_tok=int(hf.get("num_experts_per_tok") or 0),
            n_shared_experts=int(hf.get("n_shared_experts") or 0),
            moe_intermediate_size=int(hf.get("moe_intermediate_size") or 0),
            n_group=int(hf.get("n_group") or 1),
            topk_group=int(hf.get("topk_group") or 1),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            routing=routing,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=() if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos])),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        )


ROUTINGS = ("noaux_tc", "greedy", "group_limited_greedy")


def route_v2(logits_te, *, k: int, n_group: int, topk_group: int, grouped: bool, scaling: float):
    """DeepSeek-V2 routing: (weights [T, k] float32, experts [T, k] int32) from router logits [T, E]."""
    scores = jax.nn.softmax(logits_te.astype(jnp.float32), axis=-1)  # [T, E]
    t, e = scores.shape
    if grouped:
        group_scores = scores.reshape(t, n_group, e // n_group).max(-1)  # [T, G] best expert per group
        _, best = jax.lax.top_k(group_scores, topk_group)
        keep = jax.nn.one_hot(best, n_group, dtype=jnp.bool_).any(axis=1)  # [T, G]
        scores = jnp.where(jnp.repeat(keep, e // n_group, axis=1), scores, 0.0)
    weights, experts = jax.lax.top_k(scores, k)
    return weights * scaling, experts.astype(jnp.int32)


def route(logits_te, bias_e, *, k: int, n_group: int, topk_group: int, normalize: bool, scaling: float):
    """DeepSeek-V3 routing: (weights [T, k] float32, experts [T, k] int32) from router logits [T, E] (f32)."""
    scores = jax.nn.sigmoid(logits_te.astype(jnp.float32))  # [T, E]
    choice = scores + bias_e.astype(jnp.float32)[None, :]
    t, e = choice.shape
    if n_group > 1:
        groups = choice.reshape(t, n_group, e // n_group)
        group_scores = jax.lax.top_k(groups, 2)[0].sum(-1)  # [T, G] two best choices per group
        _, best = jax.lax.top_k(group_scores, topk_group)  # [T, topk_group]
        keep = jax.nn.one_hot(best, n_group, dtype=jnp.bool_).any(axis=1)  # [T, G]
        choice = jnp.where(jnp.repeat(keep, e // n_group, axis=1), choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, k)  # [T, k]
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if normalize:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * scaling, experts.astype(jnp.int32)


def _param(shape, dtype, rngs: nnx.Rngs | None, fan_in: int) -> nnx.Param:
    if rngs is None:
        return nnx.Param(jnp.zeros(shape, dtype))
    return nnx.Param(fan_in**-0.5 * jax.random.normal(rngs.params(), shape, dtype))


class SwiGLU(nnx.Module):
    """down(silu(x @ gate) * (x @ up)) with gate | up fused: w_gate_up [D, 2F], w_down [F, D]."""

    def __init__(self, d: int, f: int, dtype, rngs: nnx.Rngs | None):
        self.w_gate_up = _param((d, 2 * f), dtype, rngs, d)
        self.w_down = _param((f, d), dtype, rngs, f)

    def __call__(self, x):
        gate, up = jnp.split(matmul(x, self.w_gate_up.get_value()), 2, axis=-1)
        return matmul(jax.nn.silu(gate) * up, self.w_down.get_value())


class DeepseekMoE(nnx.Module):
    """Routed experts (w_gate_up [E, D, 2F], w_down [E, F, D]), router w_router [D, E] (+ router_bias [E] with
    V3 routing), and the fused shared experts."""

    def __init__(self, cfg: DeepseekConfig, dtype, rngs: nnx.Rngs | None, backend: str | None = None):
        d, e, f = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
        self.cfg, self.backend = cfg, backend
        self.w_router = _param((d, e), dtype, rngs, d)
        if cfg.routing == "noaux_tc":
            self.router_bias = nnx.Param(jnp.zeros((e,), jnp.float32))
        self.w_gate_up = _param((e, d, 2 * f), dtype, rngs, d)
        self.w_down = _param((e, f, d), dtype, rngs, f)
        self.shared = SwiGLU(d, cfg.n_shared_experts * f, dtype, rngs) if cfg.n_shared_experts else None

    def __call__(self, x, valid=None):
        """(y [..., D], tokens_per_expert [E] int32 of the tokens `valid` [...] marks real, default all)."""
        cfg = self.cfg
        lead, d = x.shape[:-1], x.shape[-1]
        x_td = x.reshape(-1, d)
        logits = matmul(x_td.astype(jnp.float32), self.w_router.get_value().astype(jnp.float32))
        groups = dict(k=cfg.num_experts_per_tok, n_group=cfg.n_group, topk_group=cfg.topk_group)
        if cfg.routing == "noaux_tc":
            bias = self.router_bias[...]
            weights_tk, experts_tk = route(
                logits, bias, **groups, normalize=cfg.norm_topk_prob, scaling=cfg.routed_scaling_factor
            )
        else:
            grouped = cfg.routing == "group_limited_greedy"
            weights_tk, experts_tk = route_v2(logits, **groups, grouped=grouped, scaling=cfg.routed_scaling_factor)
        t, k = experts_tk.shape
        flat_e = experts_tk.reshape(-1)  # [T*k] assignment a = token a // k
        order = jnp.argsort(flat_e, stable=True)
        sizes = jnp.bincount(flat_e, length=cfg.n_routed_experts).astype(jnp.int32)  # [E]
        rows = jnp.take(x_td, order // k, axis=0)  # [T*k, D] sorted by expert
        gate, up = jnp.split(expert_matmul(rows, self.w_gate_up.get_value(), sizes, self.backend), 2, axis=-1)
        act = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(rows.dtype)
        y_sorted = expert_matmul(act, self.w_down.get_value(), sizes, self.backend)  # [T*k, D]
        y_tkd = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(t, k, d)
        y = jnp.einsum("tkd,tk->td", y_tkd.astype(jnp.float32), weights_tk)
        if self.shared is not None:
            y = y + self.shared(x_td).astype(jnp.float32)
        real = jnp.ones((t,), jnp.int32) if valid is None else valid.reshape(t).astype(jnp.int32)
        counts = jnp.zeros((cfg.n_routed_experts,), jnp.int32).at[flat_e].add(jnp.repeat(real, k))
        return y.astype(x.dtype).reshape(*lead, d), counts


class DeepseekBlock(nnx.Module):
    def __init__(self, cfg: DeepseekConfig, dtype, rngs: nnx.Rngs | None, layer: int):
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attn = MlaAttention(cfg.mla, dtype, rngs)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.cfg_experts = cfg.n_routed_experts
        if cfg.is_moe_layer(layer):
            self.mlp = DeepseekMoE(cfg, dtype, rngs)
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, dtype, rngs)

    def __call__(self, x, positions, cache, meta, valid=None):
        """(x, cache, tokens_per_expert [E] int32: zeros for a dense layer)."""
        h, cache = self.attn(self.attn_norm(x), positions, cache, meta)
        x = x + h
        if isinstance(self.mlp, DeepseekMoE):
            y, counts = self.mlp(self.mlp_norm(x), valid)
            return x + y, cache, counts
        return x + self.mlp(self.mlp_norm(x)), cache, jnp.zeros((self.cfg_experts,), jnp.int32)


class DeepseekModel(nnx.Module):
    """The decoder; `dtype` is the compute and parameter dtype (float32 or bfloat16)."""

    def __init__(self, cfg: DeepseekConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.cfg, self.dtype = cfg, dtype
        self.embed = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, rngs)
        self.layers = nnx.List([DeepseekBlock(cfg, dtype, rngs, i) for i in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = _param((cfg.hidden_size, cfg.vocab_size), dtype, rngs, cfg.hidden_size)

    def __call__(
        self,
        tokens_bt,
        positions_bt,
        caches,
        meta,
        logits_index_bk=None,
        valid_bt=None,
        router_stats: bool = False,
        return_hidden: bool = False,
    ):
        """Runs the decoder, as model/transformer.py's Transformer does (the engine calls both alike).

        Args:
          tokens_bt, positions_bt: token ids and absolute positions [B, T].
          caches: per layer as model/mla.py's MlaAttention takes them, or None (NoCache).
          meta: attention metadata (model/kv.py).
          logits_index_bk: optional [B, K] indices into T: logits only there.
          valid_bt: optional [B, T] bool, the real tokens (only they count in the router statistics).
          router_stats: also return tokens_per_expert [L, E] int32 (zeros for the dense layers).
          return_hidden: also return the final-normed hidden states [B, K or T, D].

        Returns:
          (logits [B, K or T, V] float32, new caches), plus tokens_per_expert when router_stats, plus the hidden
          states when return_hidden.
        """
        x = self.embed(tokens_bt, self.dtype)
        new_caches, counts = [], []
        for i, layer in enumerate(self.layers):
            x, c, n = layer(x, positions_bt, None if caches is None else caches[i], meta, valid_bt)
            new_caches.append(c)
            counts.append(n)
        if logits_index_bk is not None:
            x = jnp.take_along_axis(x, logits_index_bk[:, :, None], axis=1)
        x = self.final_norm(x)
        out = self.head(x), (None if caches is None else new_caches)
        out = (*out, jnp.stack(counts)) if router_stats else out
        return (*out, x) if return_hidden else out

    def quantize_projections(self, method: str) -> list[str]:
        """Weight quantisation in place (`quantize_deepseek`): what model/quantize_model.py calls for this model."""
        return quantize_deepseek(self, method)

    def head(self, x_bkd):
        """Logits [B, K, V] float32 of final-normed hidden states [B, K, D]."""
        if self.cfg.tie_word_embeddings:
            return self.embed.attend(x_bkd)
        return matmul(x_bkd, self.lm_head.get_value(), out_dtype=jnp.float32)


def param_slots(model: DeepseekModel) -> dict[str, nnx.Param]:
    """Slot path ("layers.3.attn.w_a", "embed.weight", ...) -> the nnx.Param of every parameter of the model (the
    names checkpoints/deepseek_hf.py writes)."""
    out = {}
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param):
            out[".".join(str(p) for p in path)] = var
    return out


def model_params(model: DeepseekModel) -> dict:
    """The model's parameters by slot path: arrays, or QuantizedArray pytrees (read them, do not mutate)."""
    return {name: param.get_value() for name, param in param_slots(model).items()}


# Parameters split by query heads under tensor parallelism: their head-major columns (w_q_b, w_kv_b) or rows (w_o).
_HEAD_SPLIT = {"attn.w_q_b": (None, TENSOR), "attn.w_kv_b": (None, TENSOR), "attn.w_o": (TENSOR, None)}


def place_mla(model: DeepseekModel, mesh: jax.sharding.Mesh) -> DeepseekModel:
    """Every parameter of `model` put on `mesh`, in place (the engine's placement of this model): with a tensor
    axis, w_q_b, w_kv_b and w_o are split by query heads (each device absorbs, attends and projects its own heads;
    model/mla.py runs the kernel per device), everything else (w_a and the latent pool, the norms, routers,
    experts, MLPs, embeddings, quantised weights) is replicated.

    Raises:
        ValueError: a mesh with pipeline or expert parallelism (not supported for MLA models yet), or a tensor
            axis that does not divide the heads.
    """
    split = {a: n for a, n in dict(mesh.shape).items() if a in (PIPELINE, EXPERT) and n > 1}
    if split:
        flags = ", ".join(f"{a}_parallel_size={n}" for a, n in split.items())
        raise ValueError(
            f"{model.cfg.name}: {flags} is not supported for DeepSeek (MLA) models yet; use tensor_parallel_size "
            "and data_parallel_size"
        )
    tp = dict(mesh.shape).get(TENSOR, 1)
    if model.cfg.num_heads % tp:
        raise ValueError(f"{model.cfg.name}: tensor_parallel_size={tp} does not divide {model.cfg.num_heads} heads")
    P = jax.sharding.PartitionSpec
    for name, var in param_slots(model).items():
        value = var.get_value()
        spec = next((s for k, s in _HEAD_SPLIT.items() if name.endswith(k)), ())
        spec = () if tp == 1 or isinstance(value, QuantizedArray) else spec
        var.set_value(jax.device_put(value, jax.sharding.NamedSharding(mesh, P(*spec))))
    return model


def projections(model: DeepseekModel) -> dict[str, nnx.Param]:
    """The weights that pass through model/quant.py's `matmul` door, by slot path: MLA's w_a, w_q_b and w_o, the
    dense and shared SwiGLUs. w_kv_b (absorbed per head), the routers, the routed experts (grouped matmul) and the
    LM head stay in float."""
    out = {}
    for i, layer in enumerate(model.layers):
        attn = layer.attn
        out[f"layers.{i}.attn.w_a"], out[f"layers.{i}.attn.w_o"] = attn.w_a, attn.w_o
        if hasattr(attn, "w_q_b"):
            out[f"layers.{i}.attn.w_q_b"] = attn.w_q_b
        for prefix, mlp in (
            (f"layers.{i}.mlp", layer.mlp),
            (f"layers.{i}.mlp.shared", getattr(layer.mlp, "shared", None)),
        ):
            if isinstance(mlp, SwiGLU):
                out[f"{prefix}.w_gate_up"], out[f"{prefix}.w_down"] = mlp.w_gate_up, mlp.w_down
    return out


def quantize_deepseek(model: DeepseekModel, method: str) -> list[str]:
    """The `projections` quantised by `method` in place (model/quantize_model.py's quantize_model calls it through
    DeepseekModel.quantize_projections), and the routed experts (w_gate_up [E, D, 2F], w_down [E, F, D]) in its
    weight-only expert format (quantize_model.quantize_experts); returns their slot paths. Weights already
    quantised are kept.

    Raises:
        ValueError: a calibrated method (no calibration pass over this decoder yet), or an unknown one.
    """
    if method in CALIBRATED:
        raise ValueError(
            f"quantization={method!r} needs calibration, not supported for DeepSeek (MLA) models yet; "
            "use int8, int4_rtn or w8a8_fp8_rtn"
        )
    done = []
    for name, param in projections(model).items():
        if not isinstance(param.get_value(), QuantizedArray):
            param.set_value(quantize_weight(method, param.get_value(), None))
            done.append(name)
    experts = {
        f"layers.{i}.mlp.{attr}": getattr(layer.mlp, attr)
        for i, layer in enumerate(model.layers)
        if isinstance(layer.mlp, DeepseekMoE)
        for attr in ("w_gate_up", "w_down")
    }
    return done + quantize_experts(experts, method)
