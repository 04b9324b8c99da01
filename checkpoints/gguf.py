"""GGUF checkpoints -> ModelConfig + canonical parameters + tokenizer metadata.

Data flow: `gguf.GGUFReader` memory-maps the file; each tensor is dequantised to float32 by the `gguf` package
(F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K and the other ggml types it knows); names are mapped to the canonical
flat dict of docs/ARCHITECTURE.md, linear weights transposed from ggml's [out, in] rows to our [in, out].
`lazy_params` does this per tensor on demand (checkpoints/lazy.py), so a model build holds one float32 tensor
at a time; `load_params` reads them all into a dict.

RoPE: llama.cpp's converter permutes the rows of attn_q / attn_k so that its "normal" (interleaved-pair) RoPE can be
applied. We undo that permutation here and keep HF's rotate-half RoPE everywhere, so GGUF and safetensors weights
are laid out identically and one attention implementation serves both. Gemma 3 (NeoX RoPE) is not permuted.

Gemma 3: llama.cpp stores every RMSNorm weight as (1 + w); HF (and our model, `ModelConfig.norm_offset`) keep w
and scale by (1 + w), so the loader subtracts 1 (as HF's GGUF loader does). The file names neither the local RoPE
base (10k) nor the global/local layer pattern (every 6th layer global), which llama.cpp and HF fix per
architecture; they are filled in here the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from checkpoints.lazy import LazyParams, shape_of
from model.config import ModelConfig, RopeScaling

SUPPORTED_ARCHITECTURES = ("llama", "gemma3")
GEMMA3_SLIDING_WINDOW_PATTERN = 6  # llama.cpp `set_swa_pattern(6)`, HF Gemma3TextConfig's layer_types
GEMMA3_ROPE_LOCAL_THETA = 10000.0  # HF Gemma3TextConfig rope_local_base_freq

_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm",
    "attn_q.weight": "wq",
    "attn_k.weight": "wk",
    "attn_v.weight": "wv",
    "attn_output.weight": "wo",
    "ffn_norm.weight": "mlp_norm",
    "ffn_gate.weight": "w_gate",
    "ffn_up.weight": "w_up",
    "ffn_down.weight": "w_down",
    "attn_q.bias": "bq",
    "attn_k.bias": "bk",
    "attn_v.bias": "bv",
    "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm",
    "post_attention_norm.weight": "post_attn_norm",
    "post_ffw_norm.weight": "post_mlp_norm",
}
_NORM_LEAVES = ("attn_norm", "mlp_norm", "final_norm", "post_attn_norm", "post_mlp_norm", "q_norm", "k_norm")
_GLOBAL_NAMES = {"token_embd.weight": "embed", "output_norm.weight": "final_norm", "output.weight": "lm_head"}


@dataclasses.dataclass(frozen=True)
class GGUFMetadata:
    """Non-tensor content of a GGUF file that the tokenizer and the binaries need."""

    architecture: str
    name: str
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    tokenizer_model: str
    pre_tokenizer: str
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos_token: bool
    chat_template: str | None
    file_type: int | None


def _open(path: str):
    import gguf  # Imported lazily: only GGUF loading needs it.

    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return gguf.GGUFReader(path, "r")
    except Exception as e:  # The reader raises bare ValueError/struct errors on garbage.
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def read_metadata(reader) -> GGUFMetadata:
    arch = _field(reader, "general.architecture", "")
    return GGUFMetadata(
        architecture=arch,
        name=_field(reader, "general.name", "gguf"),
        tokens=list(_field(reader, "tokenizer.ggml.tokens", [])),
        token_types=list(_field(reader, "tokenizer.ggml.token_type", [])),
        merges=list(_field(reader, "tokenizer.ggml.merges", [])),
        tokenizer_model=_field(reader, "tokenizer.ggml.model", ""),
        pre_tokenizer=_field(reader, "tokenizer.ggml.pre", "default"),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        add_bos_token=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        chat_template=_field(reader, "tokenizer.chat_template"),
        file_type=_field(reader, "general.file_type"),
    )


def config_from_metadata(reader, meta: GGUFMetadata, eos_token_ids: tuple[int, ...]) -> ModelConfig:
    """Builds a ModelConfig from `llama.*` keys."""
    if meta.architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {meta.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    a = meta.architecture
    required = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")
    missing = [f"{a}.{k}" for k in required if _field(reader, f"{a}.{k}") is None]
    if missing:
        raise ValueError(f"GGUF file lacks required metadata: {', '.join(missing)}")
    hidden = int(_field(reader, f"{a}.embedding_length"))
    heads = int(_field(reader, f"{a}.attention.head_count"))
    scaling = None
    if a == "gemma3" and float(_field(reader, f"{a}.rope.scaling.factor", 1.0)) != 1.0:
        raise ValueError("gemma3 GGUF with rope scaling (Gemma 3 4B and larger) is not supported yet")
    if a == "llama" and (
        _field(reader, f"{a}.rope.scaling.type") == "llama3" or _field(reader, f"{a}.rope.scaling.factor")
    ):
        scaling = RopeScaling(
            factor=float(_field(reader, f"{a}.rope.scaling.factor", 8.0)),
            original_max_position_embeddings=int(_field(reader, f"{a}.rope.scaling.original_context_length", 8192)),
        )
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    vocab = _field(reader, f"{a}.vocab_size") or len(meta.tokens) or (int(embed.shape[-1]) if embed else 0)
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    head_dim = int(_field(reader, f"{a}.attention.key_length", 0) or _field(reader, f"{a}.rope.dimension_count", 0))
    head_dim = head_dim or hidden // heads
    window = _field(reader, f"{a}.attention.sliding_window")  # Mistral-style llama files window every layer
    arch_fields = {"sliding_window": int(window) if window else None}
    if a == "gemma3":
        arch_fields.update(
            arch="gemma3",
            sliding_window_pattern=GEMMA3_SLIDING_WINDOW_PATTERN,
            rope_local_theta=GEMMA3_ROPE_LOCAL_THETA,
            query_pre_attn_scalar=float(head_dim),  # HF's default 256 = head_dim for the 270M..12B models
        )
    return ModelConfig(
        name=str(meta.name),
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{a}.feed_forward_length")),
        num_layers=int(_field(reader, f"{a}.block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{a}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(_field(reader, f"{a}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rms_norm_eps=float(_field(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(_field(reader, f"{a}.context_length", 4096)),
        tie_word_embeddings=tied,
        attention_bias=any(t.name.endswith("attn_q.bias") for t in reader.tensors),
        bos_token_id=meta.bos_token_id,
        eos_token_ids=eos_token_ids,
        **arch_fields,
    )


def unpermute_rope_rows(w_out_in: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's `permute()` of Q/K rows (interleaved pairs -> rotate-half halves).

    llama.cpp stores head h's rows as [x0, x_{d/2}, x1, x_{d/2+1}, ...]; HF keeps [x0..x_{d/2-1}, x_{d/2}..]:
            ggml rows  (head, d/2, 2) --swap--> (head, 2, d/2)  HF rows
    Works for weights [out, in] and biases [out].
    """
    out = w_out_in.shape[0]
    head_dim = out // num_heads
    rest = w_out_in.shape[1:]
    w = w_out_in.reshape(num_heads, head_dim // 2, 2, *rest)
    return np.swapaxes(w, 1, 2).reshape(w_out_in.shape)


def _canonical_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name.startswith("blk."):
        _, layer, rest = gguf_name.split(".", 2)
        if rest in _LAYER_NAMES:
            return f"layers.{int(layer)}.{_LAYER_NAMES[rest]}"
    return None


def _dequantize(tensor) -> np.ndarray:
    from gguf import quants

    try:
        data = quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise ValueError(f"tensor {tensor.name}: ggml type {tensor.tensor_type.name} is not supported") from e
    return np.asarray(data, dtype=np.float32)


def _load_tensor(tensor, name: str, config: ModelConfig) -> np.ndarray:
    """One GGUF tensor as a canonical float32 host array ([in, out] for linears, HF row order for q/k)."""
    w = _dequantize(tensor)
    leaf = name.rsplit(".", 1)[-1]
    if config.is_gemma:
        if leaf in _NORM_LEAVES:
            w = w - np.float32(config.norm_offset)  # llama.cpp stored (1 + w)
    elif leaf in ("wq", "bq"):
        w = unpermute_rope_rows(w, config.num_heads)
    elif leaf in ("wk", "bk"):
        w = unpermute_rope_rows(w, config.num_kv_heads)
    if w.ndim == 2 and name != "embed":
        w = np.ascontiguousarray(w.T)  # ggml [out, in] -> [in, out]
    return w


_LINEAR_LEAVES = frozenset(("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head"))


def _load_quantized(tensor, name: str, config: ModelConfig):
    """One Q8_0 / Q4_0 / Q4_1 linear weight as a QuantizedArray [in, out], codes kept (checkpoints/gguf_quant.py)."""
    from checkpoints.gguf_quant import to_quantized

    leaf = name.rsplit(".", 1)[-1]
    heads = {"wq": config.num_heads, "wk": config.num_kv_heads}.get(leaf) if not config.is_gemma else None
    permute = None if heads is None else functools.partial(unpermute_rope_rows, num_heads=heads)
    ne = tuple(int(n) for n in tensor.shape)
    return to_quantized(tensor.data, tensor.tensor_type.name, ne, permute)


def _keeps_quantized(tensor, name: str) -> bool:
    from checkpoints.gguf_quant import QUANTIZED_TYPES

    leaf = name.rsplit(".", 1)[-1]
    return tensor.tensor_type.name in QUANTIZED_TYPES and leaf in _LINEAR_LEAVES and len(tensor.shape) == 2


def _canonical_shape(tensor, name: str) -> tuple[int, ...]:
    """The canonical shape of a tensor from its ggml dims (ne0 = row length first), without reading data."""
    ne = tuple(int(n) for n in tensor.shape)
    return ne if len(ne) == 2 and name != "embed" else ne[::-1]


def lazy_params(
    reader, config: ModelConfig, progress: Callable[[int, int, str], None] | None = None, *, quantized: bool = False
) -> LazyParams:
    """The canonical params as a LazyParams: each tensor is dequantised only when read; shapes checked up front.
    `quantized`: Q8_0 / Q4_0 / Q4_1 linear weights come as QuantizedArray (int8 / int4 group 32), not dequantised."""
    loaders, shapes = {}, {}
    for tensor in reader.tensors:
        name = _canonical_name(tensor.name)
        if name is None:
            continue  # rope_freqs and other derived tensors are recomputed.
        load = _load_quantized if quantized and _keeps_quantized(tensor, name) else _load_tensor
        loaders[name] = functools.partial(load, tensor, name, config)
        shapes[name] = _canonical_shape(tensor, name)
    params = LazyParams(loaders, shapes, progress)
    check_params(params, config)
    return params


def load_params(
    reader, config: ModelConfig, progress: Callable[[int, int, str], None] | None = None
) -> dict[str, np.ndarray]:
    """Dequantises every tensor into the canonical flat dict (float32, [in, out] linears)."""
    return dict(lazy_params(reader, config, progress))


def check_params(params: Mapping[str, Any], config: ModelConfig) -> None:
    """Raises ValueError naming every missing or mis-shaped canonical tensor (reads no data of LazyParams)."""
    expected = expected_shapes(config)
    problems = [f"missing {k}" for k in expected if k not in params]
    problems += [
        f"{k}: shape {shape_of(params, k)}, expected {s}"
        for k, s in expected.items()
        if k in params and shape_of(params, k) != s
    ]
    if problems:
        raise ValueError("checkpoint does not match its config: " + "; ".join(problems[:8]))


def _moe_shapes(shapes: dict[str, tuple[int, ...]], p: str, config: ModelConfig) -> None:
    """Replaces layer prefix `p`'s dense MLP shapes with the MoE ones (canonical names of model/transformer.py)."""
    d, e, f = config.hidden_size, config.num_experts, config.moe_intermediate_size
    fs = config.shared_expert_intermediate_size
    for k in ("w_gate", "w_up", "w_down"):
        del shapes[p + k]
    shapes.update({p + "w_router": (d, e), p + "w_gate_up": (e, d, 2 * f), p + "w_experts_down": (e, f, d)})
    if fs:
        shapes.update({p + "shared_gate": (d, 1), p + "shared_w_gate": (d, fs), p + "shared_w_up": (d, fs)})
        shapes[p + "shared_w_down"] = (fs, d)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape for a config (docs/ARCHITECTURE.md)."""
    d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"embed": (v, d), "final_norm": (d,)}
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (d, v)
    for i in range(config.num_layers):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "attn_norm": (d,),
                p + "wq": (d, config.q_size),
                p + "wk": (d, config.kv_size),
                p + "wv": (d, config.kv_size),
                p + "wo": (config.q_size, d),
                p + "mlp_norm": (d,),
                p + "w_gate": (d, f),
                p + "w_up": (d, f),
                p + "w_down": (f, d),
            }
        )
        if config.is_moe:  # model/moe.py: routed experts (and a shared expert) instead of the dense MLP
            _moe_shapes(shapes, p, config)
        if config.attention_bias:
            shapes.update({p + "bq": (config.q_size,), p + "bk": (config.kv_size,), p + "bv": (config.kv_size,)})
        if config.is_gemma:
            hd = config.head_dim
            shapes.update(
                {p + "q_norm": (hd,), p + "k_norm": (hd,), p + "post_attn_norm": (d,), p + "post_mlp_norm": (d,)}
            )
    return shapes


def eos_ids_from_vocab(meta: GGUFMetadata) -> tuple[int, ...]:
    """EOS ids: the GGUF's eos plus ChatML's <|im_end|> when the vocabulary has it.

    SmolLM2-Instruct's GGUF names <|im_end|> (the end of a chat turn) as eos; a plain-text continuation ends with
    <|endoftext|> instead, so generation stops on either, as on Llama-3's <|eot_id|> / <|end_of_text|>.
    """
    ids = [] if meta.eos_token_id is None else [int(meta.eos_token_id)]
    for special in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>"):
        if special in meta.tokens:
            idx = meta.tokens.index(special)
            if idx not in ids:
                ids.append(idx)
    return tuple(ids)


def load_gguf(
    path: str, progress: Callable[[int, int, str], None] | None = None, *, lazy: bool = False, quantized: bool = False
) -> tuple[ModelConfig, Mapping[str, np.ndarray], GGUFMetadata]:
    """Loads a GGUF file.

    Args:
        path: the .gguf file.
        progress: optional callback (done, total, tensor_name) for long loads.
        lazy: return a LazyParams (each tensor dequantised when read, the file stays memory-mapped) instead of
            a dict holding every tensor in float32.
        quantized: keep Q8_0 / Q4_0 / Q4_1 linear weights quantised (QuantizedArray; checkpoints/gguf_quant.py).

    Returns:
        (config, canonical float32 params, metadata for the tokenizer).

    Raises:
        FileNotFoundError: no such file.
        ValueError: not GGUF, an unsupported architecture or tensor type, or tensors that do not match the config.
    """
    reader = _open(path)
    meta = read_metadata(reader)
    config = config_from_metadata(reader, meta, eos_ids_from_vocab(meta))
    params = lazy_params(reader, config, progress, quantized=quantized)
    return config, (params if lazy else dict(params)), meta
