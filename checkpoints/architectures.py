"""The registry of model architectures the engine serves, and HF config.json -> ModelConfig.

One `Architecture` per Hugging Face `architectures` class name says how its checkpoint maps onto the one decoder
of model/transformer.py: the block layout (`ModelConfig.arch`), extra per-layer tensors and their canonical names,
fused tensors to split, the MoE flavour, and which GGUF architecture (checkpoints/gguf.py) loads the same model.
checkpoints/hf.py reads tensors through it; README.md's supported-models table is generated from it
(`supported_models_table`), so the two cannot drift.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from model.config import ModelConfig, RopeScaling

# HF per-layer suffix -> (canonical suffix, transpose [out, in] -> [in, out]), shared by the Llama-style layouts.
LLAMA_LAYER_TENSORS = {
    "self_attn.q_proj.weight": ("wq", True),
    "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True),
    "self_attn.o_proj.weight": ("wo", True),
    "self_attn.q_proj.bias": ("bq", False),
    "self_attn.k_proj.bias": ("bk", False),
    "self_attn.v_proj.bias": ("bv", False),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
    "input_layernorm.weight": ("attn_norm", False),
    "post_attention_layernorm.weight": ("mlp_norm", False),
}
MOE_TENSORS = {
    "block_sparse_moe.gate.weight": ("w_router", True),
    "mlp.gate.weight": ("w_router", True),
    "mlp.shared_expert.gate_proj.weight": ("shared_w_gate", True),
    "mlp.shared_expert.up_proj.weight": ("shared_w_up", True),
    "mlp.shared_expert.down_proj.weight": ("shared_w_down", True),
    "mlp.shared_expert_gate.weight": ("shared_gate", True),
}
_QK_NORM_TENSORS = {"self_attn.q_norm.weight": ("q_norm", False), "self_attn.k_norm.weight": ("k_norm", False)}
# Gemma names its four norms by position: post_attention_layernorm is the attention branch's output norm.
_GEMMA_TENSORS = {
    "post_attention_layernorm.weight": ("post_attn_norm", False),
    "pre_feedforward_layernorm.weight": ("mlp_norm", False),
    "post_feedforward_layernorm.weight": ("post_mlp_norm", False),
}
# Fused HF tensors (Phi-3) -> the canonical parts their output rows hold, in order.
PHI3_SPLITS = {"self_attn.qkv_proj.weight": ("wq", "wk", "wv"), "mlp.gate_up_proj.weight": ("w_gate", "w_up")}
_PHI3_TENSORS = {k: v for k, v in LLAMA_LAYER_TENSORS.items() if not k.startswith(("self_attn.q", "self_attn.k"))}
_PHI3_TENSORS = {k: v for k, v in _PHI3_TENSORS.items() if not k.startswith(("self_attn.v", "mlp.gate", "mlp.up"))}
# gpt-oss: biased attention with sinks and a biased router; its experts are whole [E, ...] tensors (possibly
# MXFP4), read by checkpoints/gpt_oss_hf.py.
_GPT_OSS_TENSORS = {
    **{k: v for k, v in LLAMA_LAYER_TENSORS.items() if not k.startswith("mlp.")},
    "self_attn.o_proj.bias": ("bo", False),
    "self_attn.sinks": ("sinks", False),
    "mlp.router.weight": ("w_router", True),
    "mlp.router.bias": ("b_router", False),
}


@dataclasses.dataclass(frozen=True)
class Architecture:
    """How one HF architecture maps onto the decoder.

    Attributes:
        hf_name: the `architectures` entry of config.json.
        family: the model family, for messages and the README table.
        arch: ModelConfig.arch (block layout).
        layer_tensors: HF per-layer suffix -> (canonical suffix, transpose).
        splits: HF per-layer suffix of a fused tensor -> canonical parts stacked along its output rows.
        qkv_bias: q / k / v always carry a bias (else config.json's `attention_bias` decides).
        qk_norm: per-head RMSNorm of q and k before RoPE.
        attention: "gqa" (grouped-query heads, K and V cached per head) or "mla" (DeepSeek multi-head latent
            attention: one latent row per token cached, model/mla.py).
        moe: routed-expert flavour ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek": shared experts after the first
            dense layers) or None for a dense MLP.
        windows: "" (none), "config" (every layer when config.json enables a window) or "layer_types"
            (per layer, alternating sliding / global).
        window_default: whether a config.json `sliding_window` applies without `use_sliding_window`.
        gguf: the GGUF `general.architecture` that loads this family too, or None.
        notes: features for the README table.
        example: a checkpoint of this architecture people serve.
    """

    hf_name: str
    family: str
    arch: str = "llama"
    layer_tensors: dict[str, tuple[str, bool]] = dataclasses.field(default_factory=lambda: LLAMA_LAYER_TENSORS)
    splits: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    qkv_bias: bool = False
    qk_norm: bool = False
    attention: str = "gqa"
    moe: str | None = None
    windows: str = ""
    window_default: bool = False
    gguf: str | None = None
    notes: str = ""
    example: str = ""


ARCHITECTURES = {
    a.hf_name: a
    for a in (
        Architecture(
            "LlamaForCausalLM",
            "Llama 2 / 3 / 3.1 / 3.2, SmolLM2",
            gguf="llama",
            notes="llama3 RoPE scaling, tied embeddings",
            example="meta-llama/Llama-3.2-1B",
        ),
        Architecture(
            "MistralForCausalLM",
            "Mistral",
            windows="config",
            window_default=True,
            notes="sliding window on every layer",
            example="mistralai/Mistral-7B-v0.1",
        ),
        Architecture(
            "Qwen2ForCausalLM",
            "Qwen2 / Qwen2.5",
            qkv_bias=True,
            windows="config",
            gguf="qwen2",
            example="Qwen/Qwen2.5-7B",
        ),
        Architecture(
            "Qwen3ForCausalLM",
            "Qwen3",
            layer_tensors={**LLAMA_LAYER_TENSORS, **_QK_NORM_TENSORS},
            qk_norm=True,
            gguf="qwen3",
            notes="per-head q/k RMSNorm",
            example="Qwen/Qwen3-8B",
        ),
        Architecture(
            "MixtralForCausalLM",
            "Mixtral",
            layer_tensors={**LLAMA_LAYER_TENSORS, **MOE_TENSORS},
            moe="mixtral",
            windows="config",
            notes="MoE top-2, renormalised",
            example="mistralai/Mixtral-8x7B-v0.1",
        ),
        Architecture(
            "Qwen2MoeForCausalLM",
            "Qwen1.5-MoE / Qwen2-MoE",
            layer_tensors={**LLAMA_LAYER_TENSORS, **MOE_TENSORS},
            qkv_bias=True,
            moe="qwen2_moe",
            notes="MoE with a gated shared expert",
            example="Qwen/Qwen1.5-MoE-A2.7B",
        ),
        Architecture(
            "Qwen3MoeForCausalLM",
            "Qwen3-MoE",
            layer_tensors={**LLAMA_LAYER_TENSORS, **MOE_TENSORS, **_QK_NORM_TENSORS},
            qk_norm=True,
            moe="qwen3_moe",
            gguf="qwen3moe",
            notes="MoE top-k (normalised), per-head q/k RMSNorm",
            example="Qwen/Qwen3-30B-A3B",
        ),
        Architecture(
            "Gemma2ForCausalLM",
            "Gemma 2",
            arch="gemma2",
            layer_tensors={**LLAMA_LAYER_TENSORS, **_GEMMA_TENSORS},
            windows="layer_types",
            gguf="gemma2",
            notes="attention and final logit soft-capping, alternating sliding / global layers",
            example="google/gemma-2-9b",
        ),
        Architecture(
            "Gemma3ForCausalLM",
            "Gemma 3 (text)",
            arch="gemma3",
            layer_tensors={**LLAMA_LAYER_TENSORS, **_GEMMA_TENSORS, **_QK_NORM_TENSORS},
            windows="layer_types",
            gguf="gemma3",
            notes="local / global RoPE bases, sliding / global layers, q/k RMSNorm; GGUFs with RoPE scaling refused",
            example="google/gemma-3-1b-it",
        ),
        Architecture(
            "Phi3ForCausalLM",
            "Phi-3 / Phi-3.5 / Phi-4",
            layer_tensors=_PHI3_TENSORS,
            splits=PHI3_SPLITS,
            windows="config",
            window_default=True,
            gguf="phi3",
            notes="fused qkv / gate_up in the checkpoint, longrope (su) RoPE scaling",
            example="microsoft/Phi-3-mini-4k-instruct",
        ),
        Architecture(
            "GptOssForCausalLM",
            "gpt-oss",
            layer_tensors=_GPT_OSS_TENSORS,
            qkv_bias=True,
            moe="gpt_oss",
            windows="layer_types",
            gguf="gpt-oss",
            notes="attention sinks, YaRN RoPE, MXFP4 experts dequantised at load; harmony chat template from the "
            "checkpoint",
            example="openai/gpt-oss-20b",
        ),
    )
}


# Decoders of model/deepseek.py (MLA): checkpoints/deepseek_hf.py reads them; checkpoints/loader.py sends their
# directories there, and the engine caches their latent rows (serving/engine/kv_pool.py).
_MLA_SERVING = "; tensor parallel by heads; int8 / int4_rtn / w8a8_fp8_rtn weights (routed experts weight-only)"
MLA_ARCHITECTURES = {
    a.hf_name: a
    for a in (
        Architecture(
            "DeepseekV2ForCausalLM",
            "DeepSeek-V2 / V2-Lite",
            arch="deepseek",
            layer_tensors={},
            attention="mla",
            moe="deepseek",
            gguf="deepseek2",
            notes="softmax (group-limited) greedy routing, q LoRA or a full q projection, complex YaRN RoPE"
            + _MLA_SERVING,
            example="deepseek-ai/DeepSeek-V2-Lite",
        ),
        Architecture(
            "DeepseekV3ForCausalLM",
            "DeepSeek-V3 / R1",
            arch="deepseek",
            layer_tensors={},
            attention="mla",
            moe="deepseek",
            gguf="deepseek2",
            notes="sigmoid grouped routing with a correction bias, interleaved YaRN RoPE; multi-token-prediction "
            "layers skipped" + _MLA_SERVING,
            example="deepseek-ai/DeepSeek-V3",
        ),
    )
}


def architecture_of(hf: dict[str, Any]) -> Architecture:
    """The registered model/transformer.py architecture named by config.json's `architectures`; ValueError when
    none is (an MLA one is named as such: checkpoints/deepseek_hf.py reads it)."""
    archs = hf.get("architectures") or []
    found = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    mla = next((a for a in archs if a in MLA_ARCHITECTURES), None)
    if mla is not None:
        raise ValueError(
            f"{mla} is an MLA model (model/deepseek.py): LLM(path), the server and checkpoints.loader.load_checkpoint "
            "read its directory; the Llama-layout reader and Orbax conversion do not support it yet"
        )
    if found is None:
        supported = sorted({**ARCHITECTURES, **MLA_ARCHITECTURES})
        raise ValueError(f"unsupported architecture {archs or hf.get('model_type')!r}; supported: {supported}")
    return found


# config.json -> ModelConfig -----------------------------------------------------------------------------------


def _rope_params(hf: dict[str, Any], layer_type: str | None = None) -> dict[str, Any]:
    """The RoPE parameters of transformers-5 `rope_parameters` (per layer type for Gemma 3) or transformers-4
    `rope_scaling`."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        return params[layer_type]
    return params


def rope_from_hf(hf: dict[str, Any], layer_type: str | None = None) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from either transformers-4 or transformers-5 config layouts.

    transformers 5 moves both into `rope_parameters`; transformers 4 keeps `rope_theta` top-level and scaling in
    `rope_scaling` (with the type under `rope_type`, or `type` in older files).
    """
    params = _rope_params(hf, layer_type)
    theta = float(hf.get("rope_theta", params.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling(rope_type="linear", factor=float(params["factor"]))
    if rope_type in ("longrope", "su"):
        return theta, _longrope(hf, params)
    if rope_type == "yarn":
        return theta, _yarn(params)
    if rope_type != "llama3":
        raise ValueError(
            f"unsupported RoPE scaling type {rope_type!r}; supported: 'default', 'llama3', 'linear', 'longrope', 'yarn'"
        )
    defaults = RopeScaling()
    scaling = RopeScaling(
        factor=float(params.get("factor", defaults.factor)),
        low_freq_factor=float(params.get("low_freq_factor", defaults.low_freq_factor)),
        high_freq_factor=float(params.get("high_freq_factor", defaults.high_freq_factor)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", defaults.original_max_position_embeddings)
        ),
    )
    return theta, scaling


def _longrope(hf: dict[str, Any], params: dict[str, Any]) -> RopeScaling:
    """Phi-3 longrope as transformers computes it: factor max / original positions unless given, attention factor
    sqrt(1 + ln(factor) / ln(original)) unless given (1 when factor <= 1)."""
    if any(float(c.get("partial_rotary_factor", 1.0)) != 1.0 for c in (params, hf)):
        raise ValueError("partial rotary embeddings (partial_rotary_factor < 1) are not supported")
    original = params.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
    if original is None:
        raise ValueError("longrope RoPE scaling needs original_max_position_embeddings")
    original = int(original)
    factor = params.get("factor") or int(hf.get("max_position_embeddings", original)) / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(
        rope_type="longrope",
        factor=float(factor),
        original_max_position_embeddings=original,
        short_factor=tuple(float(x) for x in params["short_factor"]),
        long_factor=tuple(float(x) for x in params["long_factor"]),
        attention_factor=float(attention),
    )


def _yarn(params: dict[str, Any]) -> RopeScaling:
    """YaRN as transformers reads it (gpt-oss): attention factor 0.1 ln(factor) + 1 unless given (or mscale's)."""
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor < 1) are not supported")
    if "factor" not in params or "original_max_position_embeddings" not in params:
        raise ValueError("yarn RoPE scaling needs factor and original_max_position_embeddings")
    factor = float(params["factor"])

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    attention = params.get("attention_factor")
    if attention is None and params.get("mscale") and params.get("mscale_all_dim"):
        attention = mscale(params["mscale"]) / mscale(params["mscale_all_dim"])
    return RopeScaling(
        rope_type="yarn",
        factor=factor,
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=float(mscale() if attention is None else attention),
    )


def _windows(hf: dict[str, Any], arch: Architecture) -> dict[str, Any]:
    """sliding_window / sliding_window_pattern from config.json (Mistral-style all layers, or Gemma layer types)."""
    window = hf.get("sliding_window")
    if not arch.windows and window and hf.get("use_sliding_window"):
        raise ValueError(f"{arch.family} with use_sliding_window is not supported")
    if arch.windows == "config":
        on = window and hf.get("use_sliding_window", arch.window_default)
        return dict(sliding_window=int(window) if on else None)
    if arch.windows != "layer_types" or not window:
        return dict(sliding_window=None)
    layers = int(hf["num_hidden_layers"])
    types = hf.get("layer_types")
    if types is None:  # transformers 4: Gemma 2 alternates from a sliding layer 0; Gemma 3 names its pattern
        pattern = int(hf.get("sliding_window_pattern", 2 if arch.arch == "gemma2" else 6))
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    if len(types) != layers or set(types) - {"full_attention", "sliding_attention"}:
        raise ValueError(f"layer_types {types!r} must name full_attention or sliding_attention for each layer")
    if "sliding_attention" not in types:
        return dict(sliding_window=None)
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    pattern = full[0] + 1 if full else 0
    if any((t == "full_attention") != bool(pattern and (i + 1) % pattern == 0) for i, t in enumerate(types)):
        raise ValueError(f"layer_types {types!r} do not repeat every {pattern} layers (one global layer each)")
    return dict(sliding_window=int(window), sliding_window_pattern=pattern)


def _moe_config(hf: dict[str, Any], arch: Architecture) -> dict[str, Any]:
    """The MoE fields of a Mixtral / Qwen2-MoE / Qwen3-MoE config.json (none for dense)."""
    if arch.moe == "mixtral":
        return dict(
            num_experts=int(hf.get("num_local_experts", 8)),
            num_experts_per_tok=int(hf.get("num_experts_per_tok", 2)),
            moe_intermediate_size=int(hf["intermediate_size"]),
            norm_topk_prob=True,
        )
    if arch.moe is None:
        return {}
    if arch.moe == "gpt_oss":  # top-k logits then softmax, biased router and experts, clamped SwiGLU; sinks
        return dict(
            num_experts=int(hf["num_local_experts"]),
            num_experts_per_tok=int(hf["num_experts_per_tok"]),
            moe_intermediate_size=int(hf["intermediate_size"]),
            moe_routing="topk_softmax",
            moe_bias=True,
            swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
            swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
            attention_sinks=True,
            attention_out_bias=True,
        )
    if int(hf.get("decoder_sparse_step", 1)) != 1 or hf.get("mlp_only_layers"):
        raise ValueError(
            f"{arch.family} with dense layers (decoder_sparse_step != 1 or mlp_only_layers) is not supported"
        )
    return dict(
        num_experts=int(hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"]),  # (transformers 5)
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size", 0)),
        norm_topk_prob=bool(hf.get("norm_topk_prob", arch.moe == "qwen3_moe")),
    )


def _gemma_fields(hf: dict[str, Any], arch: Architecture) -> dict[str, Any]:
    """Soft-capping, the attention scale and Gemma 3's local RoPE base (its global base is `rope_theta`)."""
    if arch.arch == "llama":
        return {}
    fields: dict[str, Any] = dict(
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or hf["head_dim"]),
        final_logit_softcap=hf.get("final_logit_softcapping"),
        attn_logit_softcap=hf.get("attn_logit_softcapping"),
    )
    if arch.arch == "gemma3":
        local_theta, local_scaling = rope_from_hf(hf, "sliding_attention")
        if local_scaling is not None:
            raise ValueError("RoPE scaling on Gemma 3's sliding layers is not supported")
        fields["rope_local_theta"] = float(hf.get("rope_local_base_freq", local_theta))
    return fields


def config_from_hf(hf: dict[str, Any], name: str = "hf") -> ModelConfig:
    """Builds a ModelConfig from a parsed HF config.json.

    Args:
        hf: the parsed config.json.
        name: ModelConfig.name, for messages.

    Raises:
        ValueError: unsupported architecture, activation or RoPE scaling, or missing required fields.
    """
    arch = architecture_of(hf)
    act = hf.get("hidden_activation") or hf.get("hidden_act", "silu")
    want = ("gelu_pytorch_tanh", "gelu_tanh") if arch.arch != "llama" else ("silu", "swish")
    if act not in want:
        raise ValueError(f"unsupported hidden_act {act!r} for {arch.family}; expected one of {want}")
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in required if k not in hf]
    if missing:
        raise ValueError(f"config.json lacks required field(s) {missing}")
    theta, scaling = rope_from_hf(hf, "full_attention")
    heads = int(hf["num_attention_heads"])
    eos = hf.get("eos_token_id")
    eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    bos = hf.get("bos_token_id")
    head_dim = int(hf.get("head_dim") or hf["hidden_size"] // heads)
    return ModelConfig(
        name=name,
        arch=arch.arch,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", arch.arch != "llama")),
        attention_bias=arch.qkv_bias or bool(hf.get("attention_bias", False)),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
        qk_norm=arch.qk_norm,
        **_windows(hf, arch),
        **_moe_config(hf, arch),
        **_gemma_fields({**hf, "head_dim": head_dim}, arch),
    )


# README ---------------------------------------------------------------------------------------------------------

TABLE_BEGIN = "<!-- supported-models:begin -->"
TABLE_END = "<!-- supported-models:end -->"


def supported_models_table() -> str:
    """The README's supported-models table (markdown), one row per registered architecture."""
    rows = [
        "| Architecture (config.json) | Family | Formats | Attention | MLP | Notes | Example |",
        "|---|---|---|---|---|---|---|",
    ]
    mlps = {None: "dense", "mixtral": "MoE", "qwen2_moe": "MoE + shared expert", "qwen3_moe": "MoE"}
    mlps["deepseek"] = "first layers dense, then MoE + shared experts"
    mlps["gpt_oss"] = "MoE (softmax over the top-k logits, router / expert biases), clamped"  # + SwiGLU
    for a in (*ARCHITECTURES.values(), *MLA_ARCHITECTURES.values()):
        formats = "HF safetensors" + (f", GGUF (`{a.gguf}`)" if a.gguf else "")
        windows = {"": "full causal", "config": "full or sliding window", "layer_types": "sliding + global layers"}
        attention = "GQA, " + windows[a.windows] + (", q/k norm" if a.qk_norm else "")
        attention += ", sinks" if a.moe == "gpt_oss" else ""
        if a.attention == "mla":
            attention = "MLA (latent KV cache: kv_lora_rank + rope dims per token), full causal"
        mlp = mlps[a.moe] + (", GELU-tanh" if a.arch.startswith("gemma") else ", SwiGLU")
        rows.append(f"| `{a.hf_name}` | {a.family} | {formats} | {attention} | {mlp} | {a.notes} | {a.example} |")
    return "\n".join(rows)


def with_table(text: str) -> str:
    """README text with the region between the markers replaced by the generated table; ValueError without them."""
    begin, end = text.find(TABLE_BEGIN), text.find(TABLE_END)
    if begin < 0 or end < begin:
        raise ValueError(f"README.md lacks the markers {TABLE_BEGIN} ... {TABLE_END}")
    return text[: begin + len(TABLE_BEGIN)] + "\n" + supported_models_table() + "\n" + text[end:]
