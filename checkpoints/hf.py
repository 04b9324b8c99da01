"""Hugging Face safetensors checkpoints -> canonical params, for every architecture of checkpoints/architectures.py.

Data flow: config.json -> `config_from_hf` (checkpoints/architectures.py) -> ModelConfig; then every tensor named in
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
    Qwen3-MoE  as Qwen2-MoE, without the shared expert

gpt-oss stores each layer's experts as whole [E, ...] tensors (gate / up interleaved, with biases), in MXFP4 as
OpenAI publishes them: checkpoints/gpt_oss_hf.py reads them, MXFP4 dequantised at load.

Fused tensors (Phi-3) are split by output rows on read, each part read alone (safetensors slices):

    self_attn.qkv_proj.weight [q + 2 kv, D] -> wq | wk | wv;  mlp.gate_up_proj.weight [2F, D] -> w_gate | w_up
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

from checkpoints import gpt_oss_hf
from checkpoints.architectures import LLAMA_LAYER_TENSORS, MOE_TENSORS, Architecture, architecture_of, config_from_hf
from checkpoints.gguf import expected_shapes  # Canonical name -> shape, shared by every loader.
from checkpoints.lazy import LazyParams
from model.config import ModelConfig

__all__ = ["config_from_hf", "lazy_hf", "load_hf", "load_hf_tokenizer", "is_hf_dir", "canonical_name"]

_log = logging.getLogger(__name__)

_INDEX_FILE = "model.safetensors.index.json"
# The Llama layout with the MoE names (`canonical_name` without an architecture).
_LAYER_TENSORS = {**LLAMA_LAYER_TENSORS, **MOE_TENSORS}
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


def canonical_name(hf_name: str, arch: Architecture | None = None) -> tuple[str, bool] | None:
    """Maps an HF tensor name to (canonical name, transpose?) under `arch` (default Llama's layout, with the MoE
    names), or None when the name is not a known weight of it."""
    if hf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[hf_name]
    layer_tensors = arch.layer_tensors if arch is not None else _LAYER_TENSORS
    match = _LAYER_RE.fullmatch(hf_name)
    if match and match.group(2) in layer_tensors:
        suffix, transpose = layer_tensors[match.group(2)]
        return f"layers.{match.group(1)}.{suffix}", transpose
    return None


def split_parts(hf_name: str, arch: Architecture, config: ModelConfig) -> list[tuple[str, int, int]] | None:
    """A fused HF tensor (Phi-3's qkv_proj, gate_up_proj) -> [(canonical name, first row, end row)] of its
    [out, in] rows, or None when `hf_name` is not one."""
    match = _LAYER_RE.fullmatch(hf_name)
    parts = arch.splits.get(match.group(2)) if match else None
    if parts is None:
        return None
    widths = {"wq": config.q_size, "wk": config.kv_size, "wv": config.kv_size}
    out, row = [], 0
    for part in parts:
        width = widths.get(part, config.intermediate_size)
        out.append((f"layers.{match.group(1)}.{part}", row, row + width))
        row += width
    return out


def expert_part(hf_name: str) -> tuple[str, int, str] | None:
    """Maps an HF routed-expert tensor name to (canonical name, expert, "gate" | "up" | "down"), else None."""
    match = _LAYER_RE.fullmatch(hf_name)
    sub = _EXPERT_RE.fullmatch(match.group(2)) if match else None
    if sub is None:
        return None
    suffix, part = _EXPERT_PARTS[sub.group(2)]
    return f"layers.{match.group(1)}.{suffix}", int(sub.group(1)), part


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


def _read_one(fn: str, hf_name: str, transpose: bool, dtype: Any, rows: tuple[int, int] | None = None) -> np.ndarray:
    """One tensor (or its [out, in] rows `rows` of a fused one), in canonical layout and (when given) `dtype`."""
    with safe_open(fn, framework="numpy") as f:
        array = f.get_tensor(hf_name) if rows is None else f.get_slice(hf_name)[rows[0] : rows[1]]
    if transpose:
        array = np.ascontiguousarray(array.T)
    return array if dtype is None else array.astype(dtype, copy=False)


# HF name -> [(canonical name, transpose?, [out, in] rows of a fused tensor or None)].
_Wanted = dict[str, list[tuple[str, bool, tuple[int, int] | None]]]


def _wanted(path: str, arch: Architecture, config: ModelConfig, files: dict[str, str]) -> _Wanted:
    """Every tensor the config needs, by HF name; unknown or missing ones raise."""
    known = {n: canonical_name(n, arch) for n in files}
    splits = {n: split_parts(n, arch, config) for n in files}
    unknown = sorted(
        n
        for n in files
        if known[n] is None
        and splits[n] is None
        and (arch.moe is None or expert_part(n) is None)
        and (arch.moe != "gpt_oss" or gpt_oss_hf.expert_tensor(n) is None)
        and not _IGNORED_RE.fullmatch(n)
    )
    if unknown:
        raise ValueError(
            f"unexpected tensor(s) for {config.name} ({arch.hf_name}; unsupported variant?): {unknown[:8]}"
            + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else "")
        )
    shapes = expected_shapes(config)
    # A tied model may still store lm_head.weight; names outside `shapes` are skipped, not read.
    wanted: _Wanted = {}
    for hf_name in files:
        if known[hf_name] is not None and known[hf_name][0] in shapes:
            wanted[hf_name] = [(*known[hf_name], None)]
        elif splits[hf_name] is not None:
            wanted[hf_name] = [(name, True, (lo, hi)) for name, lo, hi in splits[hf_name]]
    experts = {part[0] for n in files if (part := expert_part(n)) is not None}
    experts |= gpt_oss_hf.canonical_names(files) if arch.moe == "gpt_oss" else set()
    missing = sorted(set(shapes) - {c for parts in wanted.values() for c, _, _ in parts} - experts)
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
        hf_config = json.load(f)
    arch = architecture_of(hf_config)
    config = config_from_hf(hf_config, name=os.path.basename(os.path.normpath(path)))
    files = _weight_files(path)
    wanted = _wanted(path, arch, config, files)
    stored = _stored_shapes({n: files[n] for n in wanted})
    expected = expected_shapes(config)
    loaders, shapes = {}, {}
    for hf_name, parts in wanted.items():
        if len(parts) > 1 and stored[hf_name][0] != parts[-1][2][1]:
            raise ValueError(f"tensor {hf_name} has {stored[hf_name][0]} rows; expected {parts[-1][2][1]}")
        for name, transpose, rows in parts:
            shape = stored[hf_name] if rows is None else (rows[1] - rows[0], *stored[hf_name][1:])
            shape = shape[::-1] if transpose else shape
            if shape != expected[name]:
                raise ValueError(
                    f"tensor {hf_name} has shape {shape} after layout change; expected {expected[name]} for {name}"
                )
            loaders[name] = functools.partial(_read_one, files[hf_name], hf_name, transpose, dtype, rows)
            shapes[name] = shape
    for name, parts in _expert_tensors(path, config, files).items():
        loaders[name] = functools.partial(_read_experts, parts, dtype)
        shapes[name] = expected[name]
    if arch.moe == "gpt_oss":
        for name, (loader, shape) in gpt_oss_hf.expert_loaders(path, config, files, dtype).items():
            loaders[name], shapes[name] = loader, shape
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
