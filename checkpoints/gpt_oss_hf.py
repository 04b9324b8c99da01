"""gpt-oss (GptOssForCausalLM) experts for checkpoints/hf.py: whole [E, ...] tensors, plain or MXFP4.

A gpt-oss layer stores its routed experts as single tensors, already [in, out]:

    mlp.experts.gate_up_proj       [E, D, 2F]   gate and up interleaved along the columns (gate 0::2, up 1::2)
    mlp.experts.gate_up_proj_bias  [E, 2F]      (the same interleave)
    mlp.experts.down_proj          [E, F, D]
    mlp.experts.down_proj_bias     [E, D]

or, as OpenAI publishes them, the two weights in MXFP4 (the layout transformers' gpt-oss conversion reads):

    <proj>_blocks  [E, N, K / 32, 16] uint8   32 E2M1 codes per block, two per byte, low nibble first
    <proj>_scales  [E, N, K / 32] uint8       one E8M0 scale per block: 2 ** (scale - 127)
    weight[e, n, k] = FP4_VALUES[code] * 2 ** (scale - 127)    ([E, N, K] = [E, out, in]; transposed to [in, out])

MXFP4 experts are dequantised at load: the engine's grouped expert matmul (model/moe.py) reads plain arrays.
Every MXFP4 value is exactly representable in bfloat16, so a bf16 model holds the released weights exactly (at 4x
their stored bytes). Gate / up columns are de-interleaved into our [gate | up] halves, biases alike, so the
canonical tensors are w_gate_up [E, D, 2F], b_gate_up [E, 2F], w_experts_down [E, F, D], b_experts_down [E, D].
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import numpy as np
from safetensors import safe_open

from model.config import ModelConfig

# E2M1 code -> value: sign bit 3, then exponent and mantissa (the OCP microscaling format's FP4).
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32
)
_EXPERT_RE = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?")
_CANONICAL = {("gate_up_proj", ""): "w_gate_up", ("gate_up_proj", "_bias"): "b_gate_up"}
_CANONICAL |= {("down_proj", ""): "w_experts_down", ("down_proj", "_bias"): "b_experts_down"}


def expert_tensor(hf_name: str) -> tuple[int, str, str] | None:
    """(layer, "gate_up_proj" | "down_proj", "" | "_bias" | "_blocks" | "_scales") of a gpt-oss expert tensor."""
    match = _EXPERT_RE.fullmatch(hf_name)
    return None if match is None else (int(match.group(1)), match.group(2), match.group(3) or "")


def canonical_names(files: dict[str, Any]) -> set[str]:
    """The canonical expert tensors the checkpoint's gpt-oss expert tensors (by HF name) provide."""
    out = set()
    for name in files:
        part = expert_tensor(name)
        if part is not None:
            kind = "_bias" if part[2] == "_bias" else ""
            out.add(f"layers.{part[0]}.{_CANONICAL[part[1], kind]}")
    return out


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 blocks [..., G, 16] uint8 and scales [..., G] uint8 -> float32 [..., G * 32] (module docstring)."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {blocks.shape} {blocks.dtype} and scales {scales.shape} {scales.dtype} do not match "
            "([..., G, 16] and [..., G] uint8)"
        )
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # [..., G, B, 2]: low nibble first
    values = FP4_VALUES[codes].reshape(*blocks.shape[:-1], -1)  # [..., G, 2B]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return values.reshape(*blocks.shape[:-2], -1)


def deinterleave(x: np.ndarray) -> np.ndarray:
    """Columns gate0, up0, gate1, up1, ... -> [gate | up] along the last axis."""
    return np.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def _read(fn: str, name: str) -> np.ndarray:
    with safe_open(fn, framework="numpy") as f:
        return f.get_tensor(name)


def _shape(fn: str, name: str) -> tuple[int, ...]:
    with safe_open(fn, framework="numpy") as f:
        return tuple(f.get_slice(name).get_shape())


def _load(files: dict[str, str], base: str, kind: str, fused: bool, dtype: Any) -> np.ndarray:
    """One canonical expert tensor from HF `base` (+ "_bias", or "_blocks" / "_scales" when MXFP4)."""
    if kind == "_bias":
        x = _read(files[base + "_bias"], base + "_bias")
    elif base in files:
        x = _read(files[base], base)
    else:  # MXFP4 [E, out, in] -> [E, in, out]
        x = dequantize_mxfp4(
            _read(files[base + "_blocks"], base + "_blocks"), _read(files[base + "_scales"], base + "_scales")
        )
        x = np.swapaxes(x, -1, -2)
    x = deinterleave(x) if fused else x
    return np.ascontiguousarray(x if dtype is None else x.astype(dtype, copy=False))


def expert_loaders(
    path: str, config: ModelConfig, files: dict[str, str], dtype: Any
) -> dict[str, tuple[Callable[[], np.ndarray], tuple[int, ...]]]:
    """Canonical expert tensor -> (loader, shape) for every layer; stored shapes are checked against the config.

    Raises:
        ValueError: a layer lacks a tensor (or both its plain and MXFP4 forms), or a stored shape is wrong.
    """
    e, d, f = config.num_experts, config.hidden_size, config.moe_intermediate_size
    want = {  # (projection, kind) -> (canonical, stored shape(s): plain, or (blocks, scales))
        ("gate_up_proj", ""): ((e, d, 2 * f), ((e, 2 * f, d // 32, 16), (e, 2 * f, d // 32))),
        ("gate_up_proj", "_bias"): ((e, 2 * f), None),
        ("down_proj", ""): ((e, f, d), ((e, d, f // 32, 16), (e, d, f // 32))),
        ("down_proj", "_bias"): ((e, d), None),
    }
    out = {}
    for i in range(config.num_layers):
        for (proj, kind), (shape, mx_shapes) in want.items():
            base = f"model.layers.{i}.mlp.experts.{proj}"
            name = f"layers.{i}.{_CANONICAL[proj, kind]}"
            if kind == "_bias" or base in files:
                stored = {base + kind: shape}
            elif mx_shapes is not None and base + "_blocks" in files and base + "_scales" in files:
                if d % 32 or f % 32:
                    raise ValueError(f"{path}: MXFP4 experts need hidden / intermediate sizes divisible by 32")
                stored = {base + "_blocks": mx_shapes[0], base + "_scales": mx_shapes[1]}
            else:
                raise ValueError(f"checkpoint {path} lacks {base + kind} (nor has its MXFP4 _blocks / _scales)")
            for hf_name, want_shape in stored.items():
                if hf_name not in files:
                    raise ValueError(f"checkpoint {path} lacks {hf_name}")
                got = _shape(files[hf_name], hf_name)
                if got != want_shape:
                    raise ValueError(f"tensor {hf_name} has shape {got}; expected {want_shape} for {name}")
            loader = functools.partial(_load, files, base, kind, proj == "gate_up_proj", dtype)
            out[name] = (loader, shape)
    return out
