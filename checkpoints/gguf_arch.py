"""What differs by GGUF architecture: metadata -> ModelConfig fields, and tensors llama.cpp stores fused or stacked.

checkpoints/gguf.py reads the fields every architecture shares (`{arch}.block_count`, `.embedding_length`, head
counts, RoPE base, RMSNorm epsilon); `arch_fields` adds the rest, from the keys llama.cpp's converter
(convert_hf_to_gguf.py) writes and llama.cpp reads, with llama.cpp's defaults where a file leaves one out:

    llama     llama3 RoPE scaling from the `rope_freqs` tensor of per-frequency divisors (llama.cpp's converter
              writes no key for it; `rope.scaling.*` keys are read when present), `attention.sliding_window`
              (Mistral: every layer)
    qwen3     q/k RMSNorm
    qwen3moe  q/k RMSNorm; `expert_count`, `expert_used_count`, `expert_feed_forward_length`; top-k weights
              renormalised (llama.cpp builds qwen3moe with normalised weights, as HF's norm_topk_prob)
    gemma2    `attn_logit_softcapping` (50), `final_logit_softcapping` (30), `attention.sliding_window` (4096) on
              even layers (odd layers global); attention scale 1/sqrt(head_dim), 1/sqrt(D / heads) for the 46-layer
              27B (llama.cpp fixes it by size; the file has no query_pre_attn_scalar), or `attention.scale` if given
    gemma3    every 6th layer global, local RoPE base 10k, query_pre_attn_scalar = head_dim
    phi3      head_dim = D / heads (`rope.dimension_count` must equal it: partial rotary is refused);
              longrope from the `rope_factors_short` / `rope_factors_long` tensors, `rope.scaling.attn_factor` and
              `rope.scaling.original_context_length`; `attention.sliding_window` (0: none) on every layer, as HF's
              Phi3 applies it (llama.cpp itself currently ignores Phi-3's window)
    gpt-oss   `expert_count`, `expert_used_count`, `expert_feed_forward_length`; softmax over the top-k router
              logits, router / expert / output-projection biases, attention sinks; `attention.sliding_window` on
              even layers (llama.cpp `set_swa_pattern(2)`); YaRN from `rope.scaling.*` (attention factor
              `yarn_attn_factor`, else 0.1 ln(factor) + 1), its ramp bounds unrounded as gpt-oss's own RoPE and HF's
              config (truncate false; ggml's RoPE rounds them); SwiGLU clamp `swiglu_clamp_exp` (llama.cpp's fixed 7
              when absent), alpha 1.702
    deepseek2 builds model/deepseek.py's DeepseekConfig (MLA), not a ModelConfig: `attention.q_lora_rank` (absent: a
              full attn_q), `attention.kv_lora_rank`, `rope.dimension_count` (Dr); per-head q/k and v widths from
              `attention.key_length_mla` / `value_length_mla`, or, in files written before llama.cpp split kv_b,
              `attention.key_length` / `value_length`; `leading_dense_block_count`, `expert_*` counts,
              `expert_weights_scale` (1), `expert_weights_norm` (false), `expert_gating_func` 2 (sigmoid) -> V3
              routing with the exp_probs_b bias, else softmax (llama.cpp's default) -> V2's greedy, group-limited
              when `expert_group_used_count` < `expert_group_count` (transformers' V2; llama.cpp sums each group's
              two best); RoPE interleaved (llama.cpp's "normal" RoPE for deepseek2); YaRN with mscale =
              mscale_all_dim = `yarn_log_multiplier` / 0.1 (llama.cpp's reading: cos / sin unscaled, the softmax
              scale by mscale(factor, mscale_all_dim)^2), or the cos / sin factor `yarn_attn_factor` when given;
              without the multiplier, llama.cpp's mscale(factor) on both

Tensors stored differently from the canonical layout (docs/ARCHITECTURE.md), as `fused_rows` and `EXPERT_NAMES`
map them (checkpoints/gguf.py assembles them):

    phi3      blk.N.attn_qkv [q + 2 kv, D] rows -> wq | wk | wv;  blk.N.ffn_up [2F, D] rows -> w_gate | w_up
    qwen3moe  blk.N.ffn_{gate,up}_exps [E, F, D] -> w_gate_up [E, D, 2F] (gate | up columns, each transposed),
              blk.N.ffn_down_exps [E, D, F] -> w_experts_down [E, F, D], blk.N.ffn_gate_inp [E, D] -> w_router [D, E]
    gpt-oss   the same, or the fused blk.N.ffn_gate_up_exps [E, 2F, D] (gate rows, then up); their .bias [E, F]
              -> b_gate_up [E, 2F], ffn_down_exps.bias -> b_experts_down; MXFP4 experts dequantised by the `gguf`
              package; post_attention_norm is the MLP's input norm (mlp_norm), attn_sinks -> sinks
    deepseek2 checkpoints/gguf_mla.py (model/deepseek.py's parameter slots)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from model.config import RopeScaling
from model.mla import MlaConfig, YarnScaling, yarn_mscale

GEMMA3_SLIDING_WINDOW_PATTERN = 6  # llama.cpp `set_swa_pattern(6)`, HF Gemma3TextConfig's layer_types
GEMMA3_ROPE_LOCAL_THETA = 10000.0  # HF Gemma3TextConfig rope_local_base_freq
GEMMA2_DEFAULTS = dict(sliding_window=4096, attn_logit_softcap=50.0, final_logit_softcap=30.0)  # llama.cpp's
GEMMA2_27B_LAYERS = 46  # llama.cpp's LLM_TYPE_27B, whose attention scale is 1/sqrt(D / heads)

GPT_OSS_SWIGLU = dict(swiglu_limit=7.0, swiglu_alpha=1.702)  # llama.cpp's fixed ggml_swiglu_oai constants
MLA_ARCHITECTURES = ("deepseek2",)  # built as model/deepseek.py's DeepseekConfig (checkpoints/gguf_mla.py)
GATING_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID (1: softmax)

# Per-layer GGUF suffix -> canonical leaf, for tensors only some architectures have.
ROUTER_NAMES = {
    "ffn_gate_inp.weight": "w_router",
    "ffn_gate_inp.bias": "b_router",
    "attn_output.bias": "bo",
    "attn_sinks.weight": "sinks",
}
# Per-architecture renames of shared suffixes: gpt-oss's post-attention norm is its MLP's input norm.
LAYER_RENAMES = {"gpt-oss": {"post_attention_norm.weight": "mlp_norm"}}
# Stacked expert tensors -> (canonical leaf, column block of it, in order).
EXPERT_NAMES = {
    "ffn_gate_exps.weight": ("w_gate_up", 0),
    "ffn_up_exps.weight": ("w_gate_up", 1),
    "ffn_gate_up_exps.weight": ("w_gate_up", 0),
    "ffn_down_exps.weight": ("w_experts_down", 0),
    "ffn_gate_exps.bias": ("b_gate_up", 0),
    "ffn_up_exps.bias": ("b_gate_up", 1),
    "ffn_gate_up_exps.bias": ("b_gate_up", 0),
    "ffn_down_exps.bias": ("b_experts_down", 0),
}


def field(reader, key: str, default: Any = None) -> Any:
    """A metadata value of a GGUFReader, or `default` when the file lacks the key."""
    found = reader.fields.get(key)
    return default if found is None else found.contents()


def _tensor(reader, name: str) -> np.ndarray | None:
    from gguf import quants

    t = next((t for t in reader.tensors if t.name == name), None)
    return None if t is None else np.asarray(quants.dequantize(t.data, t.tensor_type), np.float64).reshape(-1)


def llama3_factors(scaling: RopeScaling, head_dim: int, theta: float) -> np.ndarray:
    """The per-frequency divisors of llama3 RoPE scaling (what llama.cpp's converter stores as `rope_freqs`)."""
    freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freq
    old, low, high = scaling.original_max_position_embeddings, scaling.low_freq_factor, scaling.high_freq_factor
    smooth = (old / wavelen - low) / (high - low)
    band = 1.0 / ((1 - smooth) / scaling.factor + smooth)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, scaling.factor, band))


def llama3_from_factors(factors: np.ndarray, head_dim: int, theta: float) -> RopeScaling:
    """llama3 RoPE scaling whose divisors are `factors` (a file's `rope_freqs`): the largest is `factor`; with
    Meta's low / high frequency factors (1, 4) a divisor inside the band fixes the original context. Checked by
    recomputing every divisor; ValueError when the tensor is not llama3-shaped."""
    factor = float(factors.max())
    defaults = RopeScaling(factor=factor)
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    band = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    original = defaults.original_max_position_embeddings
    if band.any():
        i = int(np.argmax(band))
        smooth = (1 / factors[i] - 1 / factor) / (1 - 1 / factor)
        low, high = defaults.low_freq_factor, defaults.high_freq_factor
        original = round(float(wavelen[i] * (smooth * (high - low) + low)))
    scaling = dataclasses.replace(defaults, original_max_position_embeddings=original)
    if not np.allclose(llama3_factors(scaling, head_dim, theta), factors, rtol=1e-4):
        raise ValueError("llama GGUF: rope_freqs does not follow llama3 RoPE scaling; other per-frequency factors "
                         "are not supported")  # fmt: skip
    return scaling


def _llama(reader, a: str, *, head_dim: int, **_) -> dict[str, Any]:
    factors = _tensor(reader, "rope_freqs.weight")  # llama.cpp's converter writes llama3 scaling as this tensor
    theta = float(field(reader, f"{a}.rope.freq_base", 10000.0))
    if factors is not None and len(factors) != head_dim // 2:
        raise ValueError(f"llama GGUF: rope_freqs holds {len(factors)} values; head_dim / 2 is {head_dim // 2}")
    if factors is not None and not np.allclose(factors, 1.0):
        return dict(rope_scaling=llama3_from_factors(factors, head_dim, theta))
    if field(reader, f"{a}.rope.scaling.type") == "llama3" or field(reader, f"{a}.rope.scaling.factor"):
        scaling = RopeScaling(
            factor=float(field(reader, f"{a}.rope.scaling.factor", 8.0)),
            original_max_position_embeddings=int(field(reader, f"{a}.rope.scaling.original_context_length", 8192)),
        )
        return dict(rope_scaling=scaling)
    return {}


def require(reader, a: str, keys: tuple[str, ...]) -> None:
    """ValueError naming every `{a}.{key}` the file lacks."""
    missing = [f"{a}.{k}" for k in keys if field(reader, f"{a}.{k}") is None]
    if missing:
        raise ValueError(f"GGUF file lacks required metadata: {', '.join(missing)}")


_EXPERT_KEYS = ("expert_count", "expert_used_count", "expert_feed_forward_length")


def _qwen3moe(reader, a: str, **_) -> dict[str, Any]:
    require(reader, a, _EXPERT_KEYS)
    return dict(
        qk_norm=True,
        num_experts=int(field(reader, f"{a}.expert_count")),
        num_experts_per_tok=int(field(reader, f"{a}.expert_used_count")),
        moe_intermediate_size=int(field(reader, f"{a}.expert_feed_forward_length")),
        norm_topk_prob=True,
    )


def _gemma2(reader, a: str, *, hidden: int, heads: int, head_dim: int, layers: int) -> dict[str, Any]:
    scale = field(reader, f"{a}.attention.scale")
    if scale:
        query_pre_attn_scalar = 1.0 / float(scale) ** 2
    else:
        query_pre_attn_scalar = float(hidden // heads if layers == GEMMA2_27B_LAYERS else head_dim)
    d = GEMMA2_DEFAULTS
    return dict(
        arch="gemma2",
        sliding_window=int(field(reader, f"{a}.attention.sliding_window", d["sliding_window"])),
        sliding_window_pattern=2,  # llama.cpp `set_swa_pattern(2)`: layer 0 sliding, layer 1 global, ...
        attn_logit_softcap=float(field(reader, f"{a}.attn_logit_softcapping", d["attn_logit_softcap"])),
        final_logit_softcap=float(field(reader, f"{a}.final_logit_softcapping", d["final_logit_softcap"])),
        query_pre_attn_scalar=query_pre_attn_scalar,
    )


def _gemma3(reader, a: str, *, head_dim: int, **_) -> dict[str, Any]:
    if float(field(reader, f"{a}.rope.scaling.factor", 1.0)) != 1.0:
        raise ValueError("gemma3 GGUF with rope scaling (Gemma 3 4B and larger) is not supported yet")
    return dict(
        arch="gemma3",
        sliding_window_pattern=GEMMA3_SLIDING_WINDOW_PATTERN,
        rope_local_theta=GEMMA3_ROPE_LOCAL_THETA,
        query_pre_attn_scalar=float(head_dim),  # HF's default 256 = head_dim for the 270M..12B models
    )


def _phi3(reader, a: str, *, hidden: int, heads: int, head_dim: int, **_) -> dict[str, Any]:
    rope_dims = int(field(reader, f"{a}.rope.dimension_count", hidden // heads))
    if rope_dims != head_dim:
        raise ValueError(f"phi3 GGUF with partial rotary embeddings ({rope_dims} of {head_dim} dims) is not supported")
    window = int(field(reader, f"{a}.attention.sliding_window", 0) or 0)
    out: dict[str, Any] = dict(sliding_window=window or None)
    long, short = _tensor(reader, "rope_factors_long.weight"), _tensor(reader, "rope_factors_short.weight")
    if long is None and short is None:
        return out
    if long is None or short is None or len(long) != len(short) or len(long) != head_dim // 2:
        raise ValueError(f"phi3 GGUF: rope_factors_long / rope_factors_short must both hold {head_dim // 2} values")
    original = field(reader, f"{a}.rope.scaling.original_context_length")
    if original is None:
        raise ValueError(f"phi3 GGUF with rope factors lacks {a}.rope.scaling.original_context_length")
    original = int(original)
    factor = int(field(reader, f"{a}.context_length", original)) / original
    attention = field(reader, f"{a}.rope.scaling.attn_factor")
    if attention is None:  # HF's longrope default
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    out["rope_scaling"] = RopeScaling(
        rope_type="longrope",
        factor=float(factor),
        original_max_position_embeddings=original,
        short_factor=tuple(float(x) for x in short),
        long_factor=tuple(float(x) for x in long),
        attention_factor=float(attention),
    )
    return out


def _yarn_keys(reader, a: str) -> dict[str, Any] | None:
    """llama.cpp's YaRN keys (`rope.scaling.type` "yarn"), None for other RoPE."""
    if field(reader, f"{a}.rope.scaling.type") != "yarn":
        return None
    require(reader, a, ("rope.scaling.factor", "rope.scaling.original_context_length"))
    attention = field(reader, f"{a}.rope.scaling.yarn_attn_factor")
    return dict(
        factor=float(field(reader, f"{a}.rope.scaling.factor")),
        original=int(field(reader, f"{a}.rope.scaling.original_context_length")),
        beta_fast=float(field(reader, f"{a}.rope.scaling.yarn_beta_fast", 32.0)),
        beta_slow=float(field(reader, f"{a}.rope.scaling.yarn_beta_slow", 1.0)),
        attention=None if attention is None else float(attention),
    )


def _swiglu_limit(reader, a: str) -> float:
    clamp = field(reader, f"{a}.swiglu_clamp_exp")
    if clamp is None:
        return GPT_OSS_SWIGLU["swiglu_limit"]
    limits = {float(x) for x in (clamp if isinstance(clamp, list) else [clamp])}
    if len(limits) != 1:
        raise ValueError(f"gpt-oss GGUF: per-layer SwiGLU clamps {sorted(limits)} are not supported (one for all)")
    return limits.pop()


def _gpt_oss(reader, a: str, **_) -> dict[str, Any]:
    require(reader, a, (*_EXPERT_KEYS, "attention.sliding_window"))
    yarn, scaling = _yarn_keys(reader, a), None
    if yarn is not None:
        f = yarn["factor"]
        attention = yarn["attention"] if yarn["attention"] is not None else yarn_mscale(f)
        scaling = RopeScaling(
            rope_type="yarn",
            factor=f,
            original_max_position_embeddings=yarn["original"],
            beta_fast=yarn["beta_fast"],
            beta_slow=yarn["beta_slow"],
            truncate=False,
            attention_factor=float(attention),
        )
    window = int(field(reader, f"{a}.attention.sliding_window") or 0)
    return dict(
        num_experts=int(field(reader, f"{a}.expert_count")),
        num_experts_per_tok=int(field(reader, f"{a}.expert_used_count")),
        moe_intermediate_size=int(field(reader, f"{a}.expert_feed_forward_length")),
        moe_routing="topk_softmax",
        moe_bias=True,
        swiglu_limit=_swiglu_limit(reader, a),
        swiglu_alpha=GPT_OSS_SWIGLU["swiglu_alpha"],
        attention_sinks=True,
        attention_out_bias=True,
        rope_scaling=scaling,
        **(dict(sliding_window=window, sliding_window_pattern=2) if window else dict(sliding_window=None)),
    )


def _mla_yarn(reader, a: str) -> YarnScaling | None:
    """YaRN as llama.cpp's deepseek2 applies it (module docstring)."""
    y = _yarn_keys(reader, a)
    if y is None:
        return None
    args = (y["factor"], y["original"], y["beta_fast"], y["beta_slow"])
    log_mul = float(field(reader, f"{a}.rope.scaling.yarn_log_multiplier", 0.0) or 0.0)
    if not log_mul:  # llama.cpp then scales cos / sin and the softmax (squared) by mscale(factor)
        attention = y["attention"] if y["attention"] is not None else yarn_mscale(y["factor"])
        return YarnScaling(*args, mscale_all_dim=1.0, attention_factor=attention)
    m = log_mul / 0.1  # llama.cpp's converter stored 0.1 mscale_all_dim
    return YarnScaling(*args, mscale=m, mscale_all_dim=m, attention_factor=y["attention"])


def _mla(reader, a: str, hidden: int, heads: int) -> MlaConfig:
    require(reader, a, ("attention.kv_lora_rank", "rope.dimension_count"))
    rope = int(field(reader, f"{a}.rope.dimension_count"))
    if int(field(reader, f"{a}.attention.head_count_kv", heads)) == 1:  # the split (MQA) form: per-head widths
        require(reader, a, ("attention.key_length_mla", "attention.value_length_mla"))
    qk = field(reader, f"{a}.attention.key_length_mla") or field(reader, f"{a}.attention.key_length")
    v = field(reader, f"{a}.attention.value_length_mla") or field(reader, f"{a}.attention.value_length")
    if not qk or not v:
        raise ValueError(f"GGUF file lacks required metadata: {a}.attention.key_length / value_length")
    return MlaConfig(
        hidden_size=hidden,
        num_heads=heads,
        q_lora_rank=int(field(reader, f"{a}.attention.q_lora_rank", 0) or 0) or None,
        kv_lora_rank=int(field(reader, f"{a}.attention.kv_lora_rank")),
        qk_nope_head_dim=int(qk) - rope,
        qk_rope_head_dim=rope,
        v_head_dim=int(v),
        rms_norm_eps=float(field(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(field(reader, f"{a}.rope.freq_base", 10000.0)),
        rope_interleave=True,
        yarn=_mla_yarn(reader, a),
    )


def _deepseek2(reader, a: str, *, hidden: int, heads: int, **_) -> dict[str, Any]:
    """DeepseekConfig fields beyond the shared ones (checkpoints/gguf.py builds the config)."""
    require(reader, a, ("leading_dense_block_count", "expert_feed_forward_length", "expert_shared_count"))
    experts = int(field(reader, f"{a}.expert_count", 0) or 0)
    if experts:
        require(reader, a, ("expert_used_count",))
    gating = int(field(reader, f"{a}.expert_gating_func", 1) or 1)
    if gating not in (1, GATING_SIGMOID):
        raise ValueError(f"deepseek2 GGUF: expert_gating_func {gating} is not supported (1 softmax, 2 sigmoid)")
    groups = int(field(reader, f"{a}.expert_group_count", 1) or 1)
    used = int(field(reader, f"{a}.expert_group_used_count", groups) or groups)
    routing = "noaux_tc" if gating == GATING_SIGMOID else ("group_limited_greedy" if used < groups else "greedy")
    return dict(
        mla=_mla(reader, a, hidden, heads),
        first_k_dense_replace=int(field(reader, f"{a}.leading_dense_block_count")),
        n_routed_experts=experts,
        num_experts_per_tok=int(field(reader, f"{a}.expert_used_count", 0) or 0),
        n_shared_experts=int(field(reader, f"{a}.expert_shared_count")),
        moe_intermediate_size=int(field(reader, f"{a}.expert_feed_forward_length")),
        n_group=groups,
        topk_group=used,
        routed_scaling_factor=float(field(reader, f"{a}.expert_weights_scale", 1.0) or 1.0),
        norm_topk_prob=bool(field(reader, f"{a}.expert_weights_norm", False)),
        routing=routing,
    )


_FIELDS = {
    "llama": _llama,
    "qwen2": lambda reader, a, **_: {},
    "qwen3": lambda reader, a, **_: dict(qk_norm=True),
    "qwen3moe": _qwen3moe,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "phi3": _phi3,
    "gpt-oss": _gpt_oss,
    "deepseek2": _deepseek2,
}
SUPPORTED_ARCHITECTURES = tuple(_FIELDS)


def arch_fields(reader, a: str, *, hidden: int, heads: int, head_dim: int, layers: int) -> dict[str, Any]:
    """The ModelConfig fields of GGUF architecture `a` beyond the shared ones (module docstring)."""
    if a not in _FIELDS:
        raise ValueError(f"unsupported GGUF architecture {a!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return _FIELDS[a](reader, a, hidden=hidden, heads=heads, head_dim=head_dim, layers=layers)


def head_dim_of(reader, a: str, hidden: int, heads: int) -> int:
    """Per-head width: `attention.key_length`, else (not phi3, whose rope dims may be partial) the RoPE dims, else
    D / heads."""
    key = int(field(reader, f"{a}.attention.key_length", 0) or 0)
    rope = 0 if a == "phi3" else int(field(reader, f"{a}.rope.dimension_count", 0) or 0)
    return key or rope or hidden // heads


def fused_rows(a: str, rest: str, config) -> list[tuple[str, int, int]] | None:
    """A fused per-layer tensor of architecture `a` -> [(canonical leaf, first row, end row)] of its [out, in]
    rows, or None when `rest` (the name after "blk.N.") is not one."""
    if a != "phi3":
        return None
    if rest == "attn_qkv.weight":
        q, kv = config.q_size, config.kv_size
        return [("wq", 0, q), ("wk", q, q + kv), ("wv", q + kv, q + 2 * kv)]
    if rest == "ffn_up.weight":  # llama.cpp's phi3 FFN: gate rows first, then up (SwiGLU over the halves)
        f = config.intermediate_size
        return [("w_gate", 0, f), ("w_up", f, 2 * f)]
    return None
