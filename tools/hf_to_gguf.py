"""Writes an HF safetensors checkpoint directory as a GGUF file, the way llama.cpp's convert_hf_to_gguf.py does.

    .venv/bin/python tools/hf_to_gguf.py tests/data/hf_tiny/phi3 /tmp/phi3.gguf [--type F32|F16|Q8_0]

For the architectures checkpoints/gguf.py loads beside their HF form: llama, qwen3, qwen3moe, gemma2, phi3, gpt-oss,
deepseek2. Tensor names come from the `gguf` package's TensorNameMap (llama.cpp's own table); the per-architecture
edits are llama.cpp's:
  llama     Q / K rows permuted for llama.cpp's interleaved RoPE (`LlamaModel.permute`); llama3 RoPE scaling
            written as the `rope_freqs` tensor of per-frequency divisors
  qwen3moe  per-expert gate / up / down stacked into ffn_{gate,up,down}_exps [E, out, in]
  gemma2    every `*norm.weight` stored as 1 + w; lm_head dropped (tied); softcaps and the window as keys
  phi3      qkv_proj / gate_up_proj kept fused (attn_qkv, ffn_up); longrope factors as the rope_factors_long /
            rope_factors_short tensors with `rope.scaling.attn_factor`; `attention.sliding_window` 0 for none
  gpt-oss   gate_up_proj [E, D, 2F] (interleaved columns) split and transposed into ffn_gate_exps / ffn_up_exps
            [E, F, D] (+ their .bias), down_proj into ffn_down_exps [E, D, F]; MXFP4 experts (_blocks / _scales)
            repacked into ggml's MXFP4 blocks; sinks as attn_sinks.weight; YaRN and the window as keys
  deepseek2 head_count_kv 1, kv_b_proj split per head into attn_k_b [H, R, dn] (transposed) and attn_v_b [H, dv, R];
            experts stacked; e_score_correction_bias as exp_probs_b.bias; MTP layers dropped; MLA / MoE / YaRN keys
            (`rope.scaling.yarn_log_multiplier` = 0.1 mscale_all_dim)
Metadata keys are llama.cpp's names. One addition: a gemma2 checkpoint whose query_pre_attn_scalar is not what
llama.cpp derives from its size gets `attention.scale` (llama.cpp's key for an explicit attention scale), so the
file describes the same model; likewise a gpt-oss SwiGLU clamp other than llama.cpp's fixed 7 is written as
`swiglu_clamp_exp` and a DeepSeek YaRN whose mscale differs from mscale_all_dim (llama.cpp assumes them equal)
gets `rope.scaling.yarn_attn_factor` (HF's cos / sin factor). No tokenizer is converted (the tiny test checkpoints have none): `{arch}.vocab_size`
carries the vocabulary size, and --byte_vocab writes a byte-level vocabulary of the first V of the 256 bytes (a
`gpt2` tokenizer without merges) for a checkpoint of V <= 256 tokens, so that `LLM(path)`, which serves a model with its tokenizer, loads it.

--type: F32 (exact), F16, or Q8_0 for every tensor of two or more dimensions whose rows are whole 32-blocks (as
llama.cpp's `--outtype q8_0`; norms and other vectors stay F32). --legacy_mla writes a deepseek2 file as llama.cpp's
converter did before the MLA split (attn_kv_b whole, per-head key / value lengths, head_count_kv = heads), a form
GGUF files in the wild still have.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
from typing import Any

import numpy as np

ARCHS = {
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "Gemma2ForCausalLM": "gemma2",
    "Phi3ForCausalLM": "phi3",
    "GptOssForCausalLM": "gpt-oss",
    "DeepseekV2ForCausalLM": "deepseek2",
    "DeepseekV3ForCausalLM": "deepseek2",
}
TYPES = ("F32", "F16", "Q8_0")
GPT_OSS_SWIGLU_LIMIT, GPT_OSS_SWIGLU_ALPHA = 7.0, 1.702  # llama.cpp's fixed gpt-oss clamp (ggml_swiglu_oai)
_EXPERT_RE = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def _rope(hf: dict) -> dict:
    """RoPE parameters of a transformers-5 (`rope_parameters`) or -4 (`rope_theta`, `rope_scaling`) config."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    return params


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: HF rotate-half rows -> interleaved pairs, per head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(params: dict, head_dim: int) -> np.ndarray:
    """The per-frequency divisors llama.cpp writes as `rope_freqs` for llama3 RoPE scaling."""
    base, factor = float(params["rope_theta"]), float(params.get("factor", 8.0))
    low, high = float(params.get("low_freq_factor", 1.0)), float(params.get("high_freq_factor", 4.0))
    old = float(params.get("original_max_position_embeddings", 8192))
    out = []
    for freq in 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def _metadata(w, arch: str, hf: dict, legacy_mla: bool = False) -> list[tuple[str, np.ndarray]]:
    """Writes the model keys; returns the extra tensors (rope factors) the architecture stores."""
    heads, d = int(hf["num_attention_heads"]), int(hf["hidden_size"])
    head_dim = int(hf.get("head_dim") or d // heads)
    rope = _rope(hf)
    w.add_context_length(int(hf["max_position_embeddings"]))
    w.add_embedding_length(d)
    w.add_feed_forward_length(int(hf["intermediate_size"]))
    w.add_block_count(int(hf["num_hidden_layers"]))
    w.add_head_count(heads)
    mqa = arch == "deepseek2" and not legacy_mla  # llama.cpp's MLA: one latent "KV head"
    w.add_head_count_kv(1 if mqa else int(hf.get("num_key_value_heads") or heads))
    w.add_layer_norm_rms_eps(float(hf["rms_norm_eps"]))
    w.add_vocab_size(int(hf["vocab_size"]))
    for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id)):
        if isinstance(hf.get(key), int):
            add(hf[key])
    if arch != "gemma2":  # llama.cpp's Gemma2Model writes no RoPE base (llama.cpp's default, 10k, is Gemma 2's)
        w.add_rope_freq_base(float(rope["rope_theta"]))
    if arch not in ("phi3", "deepseek2") and hf.get("head_dim"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    extra: list[tuple[str, np.ndarray]] = []
    if arch == "gpt-oss":
        _gpt_oss(w, hf, rope)
    elif arch == "deepseek2":
        _deepseek2(w, hf, rope, legacy_mla)
    elif arch == "qwen3moe":
        w.add_expert_count(int(hf.get("num_experts") or hf["num_local_experts"]))
        w.add_expert_used_count(int(hf["num_experts_per_tok"]))
        w.add_expert_feed_forward_length(int(hf["moe_intermediate_size"]))
    elif arch == "gemma2":
        w.add_attn_logit_softcapping(float(hf["attn_logit_softcapping"]))
        w.add_final_logit_softcapping(float(hf["final_logit_softcapping"]))
        w.add_sliding_window(int(hf["sliding_window"]))
        implied = d // heads if hf["num_hidden_layers"] == 46 else head_dim  # llama.cpp's rule by model size
        if float(hf.get("query_pre_attn_scalar", implied)) != implied:
            w.add_attention_scale(float(hf["query_pre_attn_scalar"]) ** -0.5)
    elif arch == "phi3":
        extra = _phi3(w, hf, rope, d // heads)
    elif arch == "llama" and rope.get("rope_type") == "llama3":
        extra = [("rope_freqs.weight", llama3_rope_factors(rope, head_dim))]
    return extra


def _phi3(w, hf: dict, rope: dict, rope_dims: int) -> list[tuple[str, np.ndarray]]:
    original = int(hf.get("original_max_position_embeddings") or rope["original_max_position_embeddings"])
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_rope_dimension_count(rope_dims)
    w.add_sliding_window(int(hf.get("sliding_window") or 0))
    if rope.get("rope_type", rope.get("type")) not in ("longrope", "su"):
        return []
    scale = int(hf["max_position_embeddings"]) / original
    w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0)
    return [
        ("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32)),
        ("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32)),
    ]


def _yarn(w, rope: dict) -> None:
    """llama.cpp's YaRN keys (its converter's base `set_gguf_parameters`)."""
    import gguf

    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(float(rope["factor"]))
    w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    if rope.get("attention_factor") is not None:
        w.add_rope_scaling_yarn_attn_factor(float(rope["attention_factor"]))
    for key, add in (
        ("beta_fast", w.add_rope_scaling_yarn_beta_fast),
        ("beta_slow", w.add_rope_scaling_yarn_beta_slow),
    ):
        if rope.get(key) is not None:
            add(float(rope[key]))


def _gpt_oss(w, hf: dict, rope: dict) -> None:
    """llama.cpp's GptOssModel keys; a clamp other than llama.cpp's fixed 7 as `swiglu_clamp_exp` (module doc)."""
    w.add_expert_count(int(hf["num_local_experts"]))
    w.add_expert_used_count(int(hf["num_experts_per_tok"]))
    w.add_expert_feed_forward_length(int(hf["intermediate_size"]))
    w.add_sliding_window(int(hf["sliding_window"]))
    if rope.get("rope_type", rope.get("type")) != "yarn":
        raise ValueError(f"gpt-oss: llama.cpp converts only YaRN RoPE scaling, not {rope}")
    _yarn(w, rope)
    if float(hf.get("swiglu_alpha", GPT_OSS_SWIGLU_ALPHA)) != GPT_OSS_SWIGLU_ALPHA:
        raise ValueError(f"gpt-oss: llama.cpp fixes swiglu_alpha at {GPT_OSS_SWIGLU_ALPHA}; no key holds another")
    limit = float(hf.get("swiglu_limit", GPT_OSS_SWIGLU_LIMIT))
    if limit != GPT_OSS_SWIGLU_LIMIT:
        w.add_swiglu_clamp_exp([limit] * int(hf["num_hidden_layers"]))


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _deepseek2(w, hf: dict, rope: dict, legacy_mla: bool) -> None:
    """llama.cpp's DeepseekV2Model keys (MLA lengths, MoE, YaRN; the gating function always written)."""
    import gguf

    r, dr = int(hf["kv_lora_rank"]), int(hf["qk_rope_head_dim"])
    dn, dv = int(hf["qk_nope_head_dim"]), int(hf["v_head_dim"])
    experts = hf.get("n_routed_experts")
    first_dense = hf.get("first_k_dense_replace")
    w.add_leading_dense_block_count(
        int(first_dense if first_dense is not None else (0 if experts else hf["num_hidden_layers"]))
    )
    if hf.get("q_lora_rank") is not None:
        w.add_q_lora_rank(int(hf["q_lora_rank"]))
    w.add_kv_lora_rank(r)
    if legacy_mla:  # before the MLA split: per-head lengths, no *_mla keys
        w.add_key_length(dn + dr)
        w.add_value_length(dv)
    else:
        w.add_key_length(r + dr)
        w.add_value_length(r)
        w.add_key_length_mla(dn + dr)
        w.add_value_length_mla(dv)
    w.add_expert_feed_forward_length(int(hf.get("moe_intermediate_size") or hf["intermediate_size"]))
    if experts is not None:
        w.add_expert_count(int(experts))
        w.add_expert_used_count(int(hf["num_experts_per_tok"]))
    for key, add in (("n_group", w.add_expert_group_count), ("topk_group", w.add_expert_group_used_count)):
        if hf.get(key) is not None:
            add(int(hf[key]))
    v2 = "DeepseekV2ForCausalLM" in hf.get("architectures", [])
    scoring = hf.get("scoring_func") or ("softmax" if v2 else "sigmoid")  # as model/deepseek.py reads config.json
    gating = gguf.ExpertGatingFuncType
    w.add_expert_gating_func(gating.SIGMOID if scoring == "sigmoid" else gating.SOFTMAX)
    w.add_expert_shared_count(int(hf.get("n_shared_experts") or 0))
    if hf.get("routed_scaling_factor") is not None:
        w.add_expert_weights_scale(float(hf["routed_scaling_factor"]))
    if hf.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(dr)
    if rope.get("rope_type", rope.get("type")) == "yarn":
        _deepseek_yarn(w, rope)


def _deepseek_yarn(w, rope: dict) -> None:
    """YaRN keys; llama.cpp takes mscale = mscale_all_dim (cos / sin unscaled), so HF's factor is written when not."""
    _yarn(w, rope)
    m_all = rope.get("mscale_all_dim")
    if not m_all:
        raise ValueError("deepseek2: YaRN without mscale_all_dim has no llama.cpp form (it then scales the softmax)")
    w.add_rope_scaling_yarn_log_mul(0.1 * float(m_all))  # llama.cpp's converter stores 0.1 mscale_all_dim
    factor, mscale = float(rope["factor"]), float(rope.get("mscale") or 0.0)
    hf_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, float(m_all)) if mscale else _yarn_mscale(factor)
    if rope.get("attention_factor") is None and abs(hf_factor - 1.0) > 1e-7:
        w.add_rope_scaling_yarn_attn_factor(hf_factor)


def _name_map(arch: str, layers: int):
    """The `gguf` package's TensorNameMap of GGUF architecture `arch` (llama.cpp's HF -> GGUF name table)."""
    import gguf

    model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    return gguf.get_tensor_name_map(model_arch, layers)


def _edit(arch: str, hf: dict, name: str, value: np.ndarray, legacy_mla: bool) -> list[tuple[str, np.ndarray]]:
    """One HF tensor after llama.cpp's per-architecture edit: [(HF-style name to map, value)], [] to drop it."""
    heads = int(hf["num_attention_heads"])
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    if arch == "deepseek2" and layer and int(layer.group(1)) >= int(hf["num_hidden_layers"]):
        return []  # multi-token-prediction layers
    if name == "lm_head.weight" and (arch == "gemma2" or (arch == "deepseek2" and hf.get("tie_word_embeddings"))):
        return []
    if arch == "gemma2" and name.endswith("norm.weight"):
        value = value + np.float32(1.0)
    if arch == "llama" and name.endswith("self_attn.q_proj.weight"):
        value = _permute(value, heads)
    elif arch == "llama" and name.endswith("self_attn.k_proj.weight"):
        value = _permute(value, int(hf.get("num_key_value_heads") or heads))
    if arch == "gpt-oss" and name.endswith("self_attn.sinks"):
        name += ".weight"  # llama.cpp's GptOssModel: attn_sinks.weight
    if name.endswith("e_score_correction_bias"):
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")  # -> exp_probs_b.bias
    if arch == "deepseek2" and name.endswith("kv_b_proj.weight") and not legacy_mla:
        # llama.cpp's MLA split: per head [k_nope dn | v dv] rows -> k_b [H, R, dn] (transposed), v_b [H, dv, R]
        dn = int(hf["qk_nope_head_dim"])
        kv_b = value.reshape(heads, dn + int(hf["v_head_dim"]), value.shape[-1])
        k_b, v_b = kv_b[:, :dn].swapaxes(1, 2), kv_b[:, dn:]
        return [(name.replace("kv_b_proj", "k_b_proj"), k_b), (name.replace("kv_b_proj", "v_b_proj"), v_b)]
    return [(name, value)]


@dataclasses.dataclass(frozen=True)
class Packed:
    """Tensor bytes already in a ggml block format (MXFP4 experts), written as they are."""

    data: np.ndarray
    ggml_type: str


def mxfp4_to_ggml(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """OpenAI's MXFP4 (blocks [..., G, 16]: byte j holds elements 2j (low nibble) and 2j + 1; scales [..., G] E8M0)
    -> ggml MXFP4 rows [..., G * 17]: per block its scale byte, then byte j holding elements j (low) and j + 16,
    as llama.cpp's GptOssModel repacks them."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return np.concatenate([scales[..., None], qs], axis=-1).reshape(*scales.shape[:-1], -1)


_GPT_OSS_EXPERT_RE = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias|_blocks)?")


def _gpt_oss_experts(name: str, weights: dict[str, np.ndarray]) -> list[tuple[str, np.ndarray | Packed]] | None:
    """A gpt-oss expert tensor as llama.cpp writes it (HF-style names of the split parts), None for other tensors:
    gate_up's interleaved gate / up rows (columns of HF's [in, out]) split, weights to ggml's [E, out, in]."""
    match = _GPT_OSS_EXPERT_RE.fullmatch(name)
    if match is None:
        return [] if name.endswith("_scales") and "mlp.experts." in name else None  # scales go with their blocks
    base, kind = f"model.layers.{match.group(1)}.mlp.experts.", match.group(3) or ""
    x = weights[name]
    if kind == "_blocks":
        x = Packed(mxfp4_to_ggml(x, weights[name.replace("_blocks", "_scales")]), "MXFP4")  # [E, out, ...]
    elif kind == "":
        x = np.swapaxes(np.asarray(x, np.float32), -1, -2)  # [E, in, out] -> [E, out, in]
    else:
        x = np.asarray(x, np.float32)
    suffix = ".bias" if kind == "_bias" else ".weight"
    if match.group(2) == "down_proj":
        return [(base + "down_proj" + suffix, x)]
    if isinstance(x, Packed):
        gate, up = Packed(x.data[:, 0::2], x.ggml_type), Packed(x.data[:, 1::2], x.ggml_type)
    elif kind == "":  # rows of a weight [E, 2F, D]
        gate, up = x[:, 0::2], x[:, 1::2]
    else:  # columns of a bias [E, 2F]
        gate, up = x[..., 0::2], x[..., 1::2]
    return [(base + "gate_proj" + suffix, gate), (base + "up_proj" + suffix, up)]


def _tensors(arch: str, hf: dict, weights: dict[str, np.ndarray], legacy_mla: bool = False) -> list[tuple[str, Any]]:
    """HF tensors renamed (and edited) as llama.cpp's converter does, in float32 (Packed: MXFP4 experts)."""
    names = _name_map(arch, int(hf["num_hidden_layers"]))
    out, experts = [], {}
    for name, value in weights.items():
        parts = _gpt_oss_experts(name, weights) if arch == "gpt-oss" else None
        if parts is None:
            value = np.asarray(value, np.float32)
            match = _EXPERT_RE.fullmatch(name)
            if match:
                experts.setdefault((int(match.group(1)), match.group(3)), {})[int(match.group(2))] = value
                continue
            parts = _edit(arch, hf, name, value, legacy_mla)
        for part, part_value in parts:
            new = names.get_name(part, try_suffixes=(".weight", ".bias"))
            if new is None:
                raise ValueError(f"{part}: no GGUF name for it under {arch}")
            out.append((new, part_value))
    for (layer, proj), by_expert in sorted(experts.items()):
        if layer >= int(hf["num_hidden_layers"]):
            continue  # DeepSeek-V3's multi-token-prediction layer
        stacked = np.stack([by_expert[e] for e in sorted(by_expert)])
        out.append((names.get_name(f"model.layers.{layer}.mlp.experts.{proj}.weight", (".weight",)), stacked))
    return out


def _encode(name: str, value, tensor_type: str):
    """(data, raw_dtype) of one tensor under --type (Packed tensors as they are)."""
    from gguf import GGMLQuantizationType, quants

    if isinstance(value, Packed):
        return np.ascontiguousarray(value.data), GGMLQuantizationType[value.ggml_type]
    if tensor_type == "F32" or value.ndim < 2 or name.startswith("rope_"):
        return value.astype(np.float32), None
    if tensor_type == "Q8_0" and value.shape[-1] % 32 == 0:
        return quants.quantize(value, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0
    return value.astype(np.float16), None


def byte_tokens() -> list[str]:
    """GPT-2's byte-level alphabet: byte b's token text, in byte order (printable bytes stand for themselves)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(shifted)) for b in range(256)]


def _write_byte_vocab(w, hf: dict) -> None:
    """The first V byte tokens (V = vocab_size <= 256): token ids are bytes, so LLM(path) has a tokenizer."""
    vocab = int(hf["vocab_size"])
    if not 0 < vocab <= 256:
        raise ValueError(f"byte_vocab needs a checkpoint of at most 256 tokens, not {vocab}")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(byte_tokens()[:vocab])
    w.add_token_types([1] * vocab)


def convert(
    hf_dir: str, out_path: str, tensor_type: str = "F32", byte_vocab: bool = False, legacy_mla: bool = False
) -> str:
    """Writes `hf_dir` (config.json + *.safetensors) as the GGUF file `out_path`; returns the GGUF architecture.
    `byte_vocab`: also write a byte vocabulary; `legacy_mla`: deepseek2 in the pre-split form (module docstring)."""
    import gguf
    import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy, which safetensors' numpy reader needs
    from safetensors.numpy import load_file

    if tensor_type not in TYPES:
        raise ValueError(f"tensor_type must be one of {TYPES}, got {tensor_type!r}")
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf = json.load(f)
    arch = next((ARCHS[a] for a in hf.get("architectures") or [] if a in ARCHS), None)
    if arch is None:
        raise ValueError(f"{hf_dir}: architectures {hf.get('architectures')} not in {sorted(ARCHS)}")
    weights: dict[str, np.ndarray] = {}
    for fn in sorted(os.listdir(hf_dir)):
        if fn.endswith(".safetensors"):
            weights.update(load_file(os.path.join(hf_dir, fn)))
    writer = gguf.GGUFWriter(out_path, arch)
    writer.add_name(os.path.basename(os.path.normpath(hf_dir)))
    extra = _metadata(writer, arch, hf, legacy_mla)
    if byte_vocab:
        _write_byte_vocab(writer, hf)
    for name, value in [*extra, *_tensors(arch, hf, weights, legacy_mla)]:
        data, raw_dtype = _encode(name, value, tensor_type)
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return arch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("hf_dir")
    parser.add_argument("out")
    parser.add_argument("--type", default="F32", choices=TYPES)
    parser.add_argument("--byte_vocab", action="store_true", help="write a byte vocabulary (no tokenizer)")
    parser.add_argument("--legacy_mla", action="store_true", help="deepseek2: attn_kv_b whole (pre-split form)")
    args = parser.parse_args()
    try:
        arch = convert(args.hf_dir, args.out, args.type, args.byte_vocab, args.legacy_mla)
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
    print(f"{args.out}: {arch}, {args.type}")


if __name__ == "__main__":
    main()
