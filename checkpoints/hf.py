"""Hugging Face safetensors checkpoints (Llama / Mistral / Qwen2, MoE: Mixtral / Qwen2-MoE) -> canonical params.

Data flow: config.json -> `config_from_hf` -> ModelConfig; then every tensor named in
model.safetensors.index.json (or found in the *.safetensors files when there is no index) is read one at a time
with safetensors' numpy API (by `lazy_hf` only when a model build asks for it), renamed to its canonical name
(docs/ARCHITECTURE.md) and, for linear layers, transposed from HF's `[out, in]` to our `[in, out]`. bfloat16
tensors come back as `ml_dtypes.bfloat16` numpy arrays (safetensors' numpy reader maps BF16 through ml_dtypes),
so no torch is needed.

MoE (model/moe.py): the router and the shared expert map one tensor to one canonical name, like a dense layer;
the routed experts are stored one tensor per expert and projection and are assembled on read:

    Mixtral    block_sparse_moe.gate.weight [E, D]               -> w_router [D, E]
               block_sparse_moe.experts.e.{w1, w3}.weight [F, D] -> w_gate_up[e] = [w1.T | w3.T]  [D, 2F]
               block_sparse_moe.experts.e.w2.weight [D, F]       -> w_experts_down[e] = w2.T     [F, D]
    Qwen2-MoE  mlp.gate.weight, mlp.experts.e.{gate,up,down}_proj.weight (the same way),
               mlp.shared_expert.{gate,up,down}_proj.weight -> shared_w_*, mlp.shared_expert_gate.weight [1, D]
               -> shared_gate [D, 1]
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from collections.abc import Callable
from typing import Any

import numpy as np
from safetensors import safe_open

from checkpoints.gguf import expected_shapes  # Canonical name -> shape, shared by every loader.
from checkpoints.lazy import LazyParams
from model.config import ModelConfig, RopeScaling

_log = logging.getLogger(__name__)

# Architecture -> whether q/k/v projections always carry a bias. Llama and Mistral read `attention_bias` from
# config.json instead (default False).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
    "MixtralForCausalLM": False,
    "Qwen2MoeForCausalLM": True,
}

_INDEX_FILE = "model.safetensors.index.json"

# HF per-layer suffix -> (canonical suffix, transpose [out, in] -> [in, out]).
_LAYER_TENSORS = {
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
_LAYER_TENSORS.update(
    {
        "block_sparse_moe.gate.weight": ("w_router", True),
        "mlp.gate.weight": ("w_router", True),
        "mlp.shared_expert.gate_proj.weight": ("shared_w_gate", True),
        "mlp.shared_expert.up_proj.weight": ("shared_w_up", True),
        "mlp.shared_expert.down_proj.weight": ("shared_w_down", True),
        "mlp.shared_expert_gate.weight": ("shared_gate", True),
    }
)
# Per-expert HF suffix -> (canonical suffix, which part): gate / up fill w_gate_up's column halves, down w_experts_down.
_EXPERT_RE = re.compile(r"(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w3|w2|gate_proj|up_proj|down_proj)\.weight")
_EXPERT_PARTS = {
    "w1": ("w_gate_up", "gate"),
    "gate_proj": ("w_gate_up", "gate"),
    "w3": ("w_gate_up", "up"),
    "up_proj": ("w_gate_up", "up"),
    "w2": ("w_experts_down", "down"),
    "down_proj": ("w_experts_down", "down"),
}
_GLOBAL_TENSORS = {
    "model.embed_tokens.weight": ("embed", False),
    "model.norm.weight": ("final_norm", False),
    "lm_head.weight": ("lm_head", True),
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Buffers some exporters write that carry no weights (RoPE frequencies are recomputed from the config).
_IGNORED_RE = re.compile(r".*rotary_emb\.inv_freq$")


def canonical_name(hf_name: str) -> tuple[str, bool] | None:
    """Maps an HF tensor name to (canonical name, transpose?), or None when the name is not a known weight."""
    if hf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[hf_name]
    match = _LAYER_RE.fullmatch(hf_name)
    if match and match.group(2) in _LAYER_TENSORS:
        suffix, transpose = _LAYER_TENSORS[match.group(2)]
        return f"layers.{match.group(1)}.{suffix}", transpose
    return None


def expert_part(hf_name: str) -> tuple[str, int, str] | None:
    """Maps an HF routed-expert tensor name to (canonical name, expert, "gate" | "up" | "down"), else None."""
    match = _LAYER_RE.fullmatch(hf_name)
    sub = _EXPERT_RE.fullmatch(match.group(2)) if match else None
    if sub is None:
        return None
    suffix, part = _EXPERT_PARTS[sub.group(2)]
    return f"layers.{match.group(1)}.{suffix}", int(sub.group(1)), part


# Config ------------------------------------------------------------------------------------------------------------


def _rope(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """Reads rope_theta and Llama-3 scaling from either transformers-4 or transformers-5 config layouts.

    transformers 5 moves both into `rope_parameters`; transformers 4 keeps `rope_theta` top-level and scaling in
    `rope_scaling` (with the type under `rope_type`, or `type` in older files).
    """
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = float(hf.get("rope_theta", params.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"unsupported RoPE scaling type {rope_type!r}; only 'llama3' and 'default' are supported")
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


def config_from_hf(hf: dict[str, Any], name: str = "hf") -> ModelConfig:
    """Builds a ModelConfig from a parsed HF config.json.

    Args:
        hf: the parsed config.json.
        name: ModelConfig.name, for messages.

    Returns:
        The model configuration.

    Raises:
        ValueError: unsupported architecture, activation or RoPE scaling, or missing required fields.
    """
    archs = hf.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"unsupported architecture {archs or hf.get('model_type')!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"unsupported hidden_act {act!r}; only silu-gated MLPs are supported")
    missing = [
        k
        for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        if k not in hf
    ]
    if missing:
        raise ValueError(f"config.json lacks required field(s) {missing}")
    window = None
    if hf.get("sliding_window") and hf.get("use_sliding_window", arch == "MistralForCausalLM"):
        window = int(hf["sliding_window"])  # Mistral-style: every layer windowed (ModelConfig.sliding_window)
    theta, scaling = _rope(hf)
    heads = int(hf["num_attention_heads"])
    eos = hf.get("eos_token_id")
    eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    bos = hf.get("bos_token_id")
    return _moe_config(hf, arch).replace(
        name=name,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=SUPPORTED_ARCHITECTURES[arch] or bool(hf.get("attention_bias", False)),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
        sliding_window=window,
    )


def _moe_config(hf: dict[str, Any], arch: str) -> ModelConfig:
    """A ModelConfig holding only the MoE fields of a Mixtral / Qwen2-MoE config.json (the default one for dense)."""
    if arch == "MixtralForCausalLM":
        return ModelConfig(
            num_experts=int(hf.get("num_local_experts", 8)),
            num_experts_per_tok=int(hf.get("num_experts_per_tok", 2)),
            moe_intermediate_size=int(hf["intermediate_size"]),
            norm_topk_prob=True,
        )
    if arch != "Qwen2MoeForCausalLM":
        return ModelConfig()
    if int(hf.get("decoder_sparse_step", 1)) != 1 or hf.get("mlp_only_layers"):
        raise ValueError("Qwen2-MoE with dense layers (decoder_sparse_step != 1 or mlp_only_layers) is not supported")
    return ModelConfig(
        num_experts=int(hf["num_experts"]),
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size", 0)),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
    )


# Tensors -----------------------------------------------------------------------------------------------------------


def _weight_files(path: str) -> dict[str, str]:
    """HF tensor name -> safetensors file path, from the index when there is one, else from every file."""
    index_path = os.path.join(path, _INDEX_FILE)
    if os.path.exists(index_path):
        with open(index_path) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        absent = sorted({fn for fn in weight_map.values() if not os.path.exists(os.path.join(path, fn))})
        if absent:
            raise ValueError(f"{index_path} names missing file(s): {absent}")
        return {name: os.path.join(path, fn) for name, fn in weight_map.items()}
    files = sorted(fn for fn in os.listdir(path) if fn.endswith(".safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {path}")
    names: dict[str, str] = {}
    for fn in files:
        with safe_open(os.path.join(path, fn), framework="numpy") as f:
            names.update((k, os.path.join(path, fn)) for k in f.keys())
    return names


def _stored_shapes(files: dict[str, str]) -> dict[str, tuple[int, ...]]:
    """HF name -> stored shape, from the safetensors headers (no tensor data is read)."""
    by_file: dict[str, list[str]] = {}
    for name, fn in files.items():
        by_file.setdefault(fn, []).append(name)
    shapes = {}
    for fn, names in by_file.items():
        with safe_open(fn, framework="numpy") as f:
            shapes.update((name, tuple(f.get_slice(name).get_shape())) for name in names)
    return shapes


def _read_one(fn: str, hf_name: str, transpose: bool, dtype: Any) -> np.ndarray:
    """One tensor, in canonical layout and (when given) `dtype`."""
    with safe_open(fn, framework="numpy") as f:
        array = f.get_tensor(hf_name)
    if transpose:
        array = np.ascontiguousarray(array.T)
    return array if dtype is None else array.astype(dtype, copy=False)


def _wanted(path: str, config: ModelConfig, files: dict[str, str]) -> dict[str, tuple[str, bool]]:
    """HF name -> (canonical name, transpose?) of every tensor the config needs; unknown or missing ones raise."""
    unknown = sorted(
        n for n in files if canonical_name(n) is None and expert_part(n) is None and not _IGNORED_RE.fullmatch(n)
    )
    if unknown:
        raise ValueError(
            f"unexpected tensor(s) for {config.name} (unsupported variant?): {unknown[:8]}"
            + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else "")
        )
    shapes = expected_shapes(config)
    # A tied model may still store lm_head.weight; names outside `shapes` are skipped, not read.
    wanted: dict[str, tuple[str, bool]] = {}
    for hf_name in files:
        mapped = canonical_name(hf_name)
        if mapped is not None and mapped[0] in shapes:
            wanted[hf_name] = mapped
    experts = {part[0] for n in files if (part := expert_part(n)) is not None}
    missing = sorted(set(shapes) - {c for c, _ in wanted.values()} - experts)
    if missing:
        raise ValueError(
            f"checkpoint {path} lacks tensor(s) {missing[:8]}"
            + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        )
    return wanted


def lazy_hf(
    path: str, *, dtype: Any = None, progress: Callable[[int, int, str], None] | None = None
) -> tuple[ModelConfig, LazyParams]:
    """Like `load_hf`, but each tensor is read from its (memory-mapped) file only when the mapping is indexed.

    Names, shapes and files are all checked here, from the safetensors headers, before any data is read.
    """
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"{path} is not an HF checkpoint directory (no config.json)")
    with open(config_path) as f:
        config = config_from_hf(json.load(f), name=os.path.basename(os.path.normpath(path)))
    files = _weight_files(path)
    wanted = _wanted(path, config, files)
    stored = _stored_shapes({n: files[n] for n in wanted})
    expected = expected_shapes(config)
    loaders, shapes = {}, {}
    for hf_name, (name, transpose) in wanted.items():
        shape = stored[hf_name][::-1] if transpose else stored[hf_name]
        if shape != expected[name]:
            raise ValueError(
                f"tensor {hf_name} has shape {shape} after layout change; expected {expected[name]} for {name}"
            )
        loaders[name] = functools.partial(_read_one, files[hf_name], hf_name, transpose, dtype)
        shapes[name] = shape
    for name, parts in _expert_tensors(path, config, files).items():
        loaders[name] = functools.partial(_read_experts, parts, dtype)
        shapes[name] = expected[name]
    return config, LazyParams(loaders, shapes, progress)


def _expert_tensors(path: str, config: ModelConfig, files: dict[str, str]) -> dict[str, list[list[tuple[str, str]]]]:
    """Canonical expert tensor -> per expert, its (file, HF name) parts in column order (gate, up | down); every
    part's stored shape is checked against the config."""
    found: dict[str, dict[tuple[int, str], str]] = {}
    for hf_name in files:
        part = expert_part(hf_name)
        if part is not None:
            found.setdefault(part[0], {})[part[1:]] = hf_name
    d, f = config.hidden_size, config.moe_intermediate_size
    stored = _stored_shapes({n: files[n] for parts in found.values() for n in parts.values()})
    out = {}
    for name, parts in found.items():
        kinds = ("down",) if name.endswith("w_experts_down") else ("gate", "up")
        want = (d, f) if kinds == ("down",) else (f, d)
        lost = [f"expert {e} {k}" for e in range(config.num_experts) for k in kinds if (e, k) not in parts]
        if lost or len(parts) != config.num_experts * len(kinds):
            raise ValueError(f"checkpoint {path}: {name} lacks {lost[:4]} or has experts beyond {config.num_experts}")
        bad = [n for n in parts.values() if stored[n] != want]
        if bad:
            raise ValueError(f"tensor {bad[0]} has shape {stored[bad[0]]}; expected {want} for {name}")
        out[name] = [[(files[parts[e, k]], parts[e, k]) for k in kinds] for e in range(config.num_experts)]
    return out


def _read_experts(experts: list[list[tuple[str, str]]], dtype: Any) -> np.ndarray:
    """[E, D, 2F] (gate | up columns) or [E, F, D] from per-expert [out, in] HF tensors, transposed."""
    stacked = [np.concatenate([_read_one(fn, n, True, dtype) for fn, n in parts], axis=1) for parts in experts]
    return np.stack(stacked)


def load_hf(
    path: str, *, dtype: Any = None, progress: Callable[[int, int, str], None] | None = None
) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Loads an HF safetensors checkpoint directory into canonical numpy params.

    Args:
        path: directory holding config.json and model.safetensors (or shards + model.safetensors.index.json).
        dtype: cast every tensor to this numpy dtype as it is read (None keeps the stored dtype).
        progress: called as progress(done, total, canonical_name) after each tensor, e.g. for a progress line.

    Returns:
        (config, params) with params in canonical names and `[in, out]` layout.

    Raises:
        ValueError: missing directory or files, unsupported architecture, unknown, missing or misshapen tensors.
    """
    config, params = lazy_hf(path, dtype=dtype, progress=progress)
    return config, dict(params)


def load_hf_tokenizer(path: str):
    """Returns the checkpoint's Tokenizer (checkpoints/tokenizer.py) when tokenizer.json exists, else None."""
    tokenizer_json = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tokenizer_json):
        return None
    from checkpoints.tokenizer import Tokenizer  # Lazy: tokenizers is only needed when there is one.

    tokenizer_config = os.path.join(path, "tokenizer_config.json")
    return Tokenizer.from_hf_files(tokenizer_json, tokenizer_config if os.path.isfile(tokenizer_config) else None)


def is_hf_dir(path: str) -> bool:
    """True when `path` looks like an HF checkpoint directory (config.json plus safetensors)."""
    return os.path.isfile(os.path.join(path, "config.json")) and any(
        fn.endswith(".safetensors") for fn in os.listdir(path)
    )
