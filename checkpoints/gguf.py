"""GGUF checkpoints -> ModelConfig + canonical parameters + tokenizer metadata.

Data flow: checkpoints/gguf_file.py memory-maps the file and parses its metadata; each tensor is dequantised to
float32, Q8_0 / Q4_0 / Q4_1 by checkpoints/gguf_quant.py, the others (F32, F16, BF16, Q4_K, Q6_K and the other ggml
types) by the `gguf` package; names are mapped to the canonical
flat dict of docs/ARCHITECTURE.md, linear weights transposed from ggml's [out, in] rows to our [in, out].
`lazy_params` does this per tensor on demand (checkpoints/lazy.py), so a model build holds one float32 tensor
at a time; `load_params` reads them all into a dict.

Architectures: llama, qwen2, qwen3, qwen3moe, gemma2, gemma3, phi3, gpt-oss, deepseek2. What differs between them
(config keys and defaults, Phi-3's fused qkv / gate_up rows, stacked experts and their biases) lives in
checkpoints/gguf_arch.py. A deepseek2 file builds model/deepseek.py's MLA decoder: its config is a DeepseekConfig
and its params the DeepseekModel slots of checkpoints/gguf_mla.py, as checkpoints/deepseek_hf.py gives for HF
directories, so `LLM(path)` builds it with `build_deepseek` either way.

RoPE: llama.cpp's converter permutes the rows of attn_q / attn_k of "llama" files so that its "normal"
(interleaved-pair) RoPE can be applied. We undo that permutation here and keep HF's rotate-half RoPE everywhere, so
GGUF and safetensors weights are laid out identically and one attention implementation serves both. The NeoX-RoPE
architectures (Qwen, Gemma, Phi-3) are stored unpermuted.

Gemma 2 / 3: llama.cpp stores every RMSNorm weight as (1 + w); HF (and our model, `ModelConfig.norm_offset`) keep
w and scale by (1 + w), so the loader subtracts 1 (as HF's GGUF loader does).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from checkpoints import gguf_arch
from checkpoints.lazy import LazyParams, shape_of
from model.config import ModelConfig

SUPPORTED_ARCHITECTURES = gguf_arch.SUPPORTED_ARCHITECTURES
# Architectures whose Q / K rows llama.cpp's converter permuted for its interleaved RoPE (the NeoX-RoPE ones,
# Gemma, Qwen and Phi-3, are stored in HF's order).
_PERMUTED_ROPE = ("llama",)

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
    **gguf_arch.ROUTER_NAMES,
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
    """The file's metadata and memory-mapped tensors (checkpoints/gguf_file.py: GGUFReader's interface, parsed in
    milliseconds instead of seconds)."""
    from checkpoints.gguf_file import GGUFFile

    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return GGUFFile(path)
    except Exception as e:  # The reader raises bare ValueError/struct errors on garbage.
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


_field = gguf_arch.field


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
    """Builds a ModelConfig from the `{arch}.*` keys (the per-architecture ones: checkpoints/gguf_arch.py)."""
    if meta.architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {meta.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    a = meta.architecture
    gguf_arch.require(reader, a, ("block_count", "embedding_length", "feed_forward_length", "attention.head_count"))
    hidden = int(_field(reader, f"{a}.embedding_length"))
    heads = int(_field(reader, f"{a}.attention.head_count"))
    layers = int(_field(reader, f"{a}.block_count"))
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    vocab = _field(reader, f"{a}.vocab_size") or len(meta.tokens) or (int(embed.shape[-1]) if embed else 0)
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    head_dim = gguf_arch.head_dim_of(reader, a, hidden, heads)
    common = dict(
        name=str(meta.name),
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{a}.feed_forward_length")),
        num_layers=layers,
        rms_norm_eps=float(_field(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(_field(reader, f"{a}.context_length", 4096)),
        tie_word_embeddings=tied,
        bos_token_id=meta.bos_token_id,
        eos_token_ids=eos_token_ids,
    )
    fields = gguf_arch.arch_fields(reader, a, hidden=hidden, heads=heads, head_dim=head_dim, layers=layers)
    if a in gguf_arch.MLA_ARCHITECTURES:
        from model.deepseek import DeepseekConfig

        return DeepseekConfig(**common, **fields)
    window = _field(reader, f"{a}.attention.sliding_window")  # Mistral-style llama files window every layer
    return ModelConfig(
        **common,
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{a}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(_field(reader, f"{a}.rope.freq_base", 10000.0)),
        attention_bias=any(t.name.endswith("attn_q.bias") for t in reader.tensors),
        **{"sliding_window": int(window) if window else None, **fields},
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


Rows = tuple[int, int] | None  # [first, end) rows of a fused ggml [out, in] tensor, or None for all of it


def _canonical_parts(gguf_name: str, arch: str, config: ModelConfig) -> list[tuple[str, Rows]]:
    """The canonical tensors one GGUF tensor holds: [(name, rows)] (several for a fused one), [] for none."""
    if gguf_name in _GLOBAL_NAMES:
        return [(_GLOBAL_NAMES[gguf_name], None)]
    if not gguf_name.startswith("blk."):
        return []  # rope_freqs, rope_factors_* and other derived tensors are recomputed or read as metadata.
    _, layer, rest = gguf_name.split(".", 2)
    prefix = f"layers.{int(layer)}."
    fused = gguf_arch.fused_rows(arch, rest, config)  # first: phi3's ffn_up is gate | up, not up
    if fused is not None:
        return [(prefix + leaf, (lo, hi)) for leaf, lo, hi in fused]
    names = {**_LAYER_NAMES, **gguf_arch.LAYER_RENAMES.get(arch, {})}
    return [(prefix + names[rest], None)] if rest in names else []


def _expert_slot(gguf_name: str) -> tuple[str, int] | None:
    """(canonical name, column block) of a stacked expert tensor (checkpoints/gguf_arch.py), else None."""
    if not gguf_name.startswith("blk."):
        return None
    _, layer, rest = gguf_name.split(".", 2)
    slot = gguf_arch.EXPERT_NAMES.get(rest)
    return None if slot is None else (f"layers.{int(layer)}.{slot[0]}", slot[1])


def _dequantize(tensor) -> np.ndarray:
    from checkpoints import gguf_quant

    return gguf_quant.dequantize_tensor(tensor)


def _load_tensor(tensor, name: str, config: ModelConfig, permuted: bool = True, rows: Rows = None) -> np.ndarray:
    """One GGUF tensor (or its [out, in] `rows` of a fused one) as a canonical float32 host array ([in, out] for
    linears, HF row order for q/k: `permuted` when the file's Q / K rows are in llama.cpp's interleaved order)."""
    w = _dequantize(tensor)
    if rows is not None:
        w = w[rows[0] : rows[1]]
    leaf = name.rsplit(".", 1)[-1]
    if config.is_gemma:
        if leaf in _NORM_LEAVES:
            w = w - np.float32(config.norm_offset)  # llama.cpp stored (1 + w)
    elif permuted and leaf in ("wq", "bq"):
        w = unpermute_rope_rows(w, config.num_heads)
    elif permuted and leaf in ("wk", "bk"):
        w = unpermute_rope_rows(w, config.num_kv_heads)
    if w.ndim == 2 and name != "embed":
        w = np.ascontiguousarray(w.T)  # ggml [out, in] -> [in, out]
    return w


_LINEAR_LEAVES = frozenset(("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head"))


def _load_quantized(tensor, name: str, config: ModelConfig, permuted: bool = True, rows: Rows = None):
    """One Q8_0 / Q4_0 / Q4_1 linear weight (or its `rows` of a fused one) as a QuantizedArray [in, out], codes
    kept (checkpoints/gguf_quant.py): rows are whole ggml blocks, so a fused tensor splits without requantising."""
    from checkpoints.gguf_quant import to_quantized

    leaf = name.rsplit(".", 1)[-1]
    heads = {"wq": config.num_heads, "wk": config.num_kv_heads}.get(leaf) if permuted else None
    permute = None if heads is None else functools.partial(unpermute_rope_rows, num_heads=heads)
    if rows is not None:
        permute = lambda a: a[rows[0] : rows[1]]  # noqa: E731 - fused tensors (phi3) are never rope-permuted
    ne = tuple(int(n) for n in tensor.shape)
    return to_quantized(tensor.data, tensor.tensor_type.name, ne, permute)


def _keeps_quantized(tensor, name: str) -> bool:
    from checkpoints.gguf_quant import QUANTIZED_TYPES

    leaf = name.rsplit(".", 1)[-1]
    return tensor.tensor_type.name in QUANTIZED_TYPES and leaf in _LINEAR_LEAVES and len(tensor.shape) == 2


def _canonical_shape(tensor, name: str, rows: Rows = None) -> tuple[int, ...]:
    """The canonical shape of a tensor (or of its `rows`) from its ggml dims (ne0 = row length first), without
    reading data."""
    ne = tuple(int(n) for n in tensor.shape)
    if rows is not None:
        ne = (ne[0], rows[1] - rows[0])
    return ne if len(ne) == 2 and name != "embed" else ne[::-1]


def _load_experts(tensors: list) -> np.ndarray:
    """Stacked ggml expert tensors [E, out, in] -> [E, in, sum of outs] (w_gate_up: gate | up columns); their
    biases [E, out] -> [E, sum of outs]."""
    parts = [_dequantize(t) for t in tensors]
    return np.concatenate([np.swapaxes(p, 1, 2) if p.ndim == 3 else p for p in parts], axis=-1)


def _experts_shape(tensors: list) -> tuple[int, ...]:
    ne = [tuple(int(n) for n in t.shape) for t in tensors]  # (in, out, E) each; (out, E) for biases
    if all(len(n) == 2 for n in ne):
        return (ne[0][1], sum(n[0] for n in ne))
    if any(len(n) != 3 for n in ne):
        return tuple(ne[0])[::-1]  # a malformed file: check_params names the mismatch
    return (ne[0][2], ne[0][0], sum(n[1] for n in ne))


def lazy_params(
    reader, config: ModelConfig, progress: Callable[[int, int, str], None] | None = None, *, quantized: bool = False
) -> LazyParams:
    """The canonical params as a LazyParams: each tensor is dequantised only when read; shapes checked up front.
    `quantized`: Q8_0 / Q4_0 / Q4_1 linear weights come as QuantizedArray (int8 / int4 group 32), not dequantised."""
    loaders, shapes = {}, {}
    arch = _field(reader, "general.architecture", "llama")
    permuted = arch in _PERMUTED_ROPE
    experts: dict[str, dict[int, Any]] = {}
    for tensor in reader.tensors:
        slot = _expert_slot(tensor.name)
        if slot is not None:
            experts.setdefault(slot[0], {})[slot[1]] = tensor
        for name, rows in _canonical_parts(tensor.name, arch, config):
            load = _load_quantized if quantized and _keeps_quantized(tensor, name) else _load_tensor
            loaders[name] = functools.partial(load, tensor, name, config, permuted, rows)
            shapes[name] = _canonical_shape(tensor, name, rows)
    for name, blocks in experts.items():  # experts load dequantised; `quantization` re-quantises them (model/moe.py)
        parts = [blocks[k] for k in sorted(blocks)]
        loaders[name] = functools.partial(_load_experts, parts)
        shapes[name] = _experts_shape(parts)
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
        if config.has_qk_norm:
            shapes.update({p + "q_norm": (config.head_dim,), p + "k_norm": (config.head_dim,)})
        if config.is_gemma:
            shapes.update({p + "post_attn_norm": (d,), p + "post_mlp_norm": (d,)})
        if config.attention_sinks:  # gpt-oss
            shapes[p + "sinks"] = (config.num_heads,)
        if config.attention_out_bias:
            shapes[p + "bo"] = (d,)
        if config.moe_bias:
            e, fe = config.num_experts, config.moe_intermediate_size
            shapes.update({p + "b_router": (e,), p + "b_gate_up": (e, 2 * fe), p + "b_experts_down": (e, d)})
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
    if meta.architecture in gguf_arch.MLA_ARCHITECTURES:  # model/deepseek.py's slots (checkpoints/gguf_mla.py)
        from checkpoints import gguf_mla

        if quantized:
            raise ValueError(f"{path}: keeping GGUF codes (quantization='gguf') is not supported for deepseek2 yet")
        params = gguf_mla.lazy_slots(reader, config, progress)
        gguf_mla.check_slots(params, config)
    else:
        params = lazy_params(reader, config, progress, quantized=quantized)
    return config, (params if lazy else dict(params)), meta
