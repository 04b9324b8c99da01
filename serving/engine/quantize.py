"""Quantisation at load: the `quantization` and `kv_cache_dtype` options of the engine (serving/config.py).

The weights are quantised by model/quantize_model.py (`quantize_model`, re-exported here; its docstring lists
the methods); this module adds the KV page dtypes and the Hopper streaming kernel's extra weight layout.
"""

from __future__ import annotations

import logging

import jax.numpy as jnp

from model import quant, transformer
from model.quant import QuantizedArray
from model.quantize_model import (  # noqa: F401 - the engine's and the benchmarks' names for them
    CALIBRATED,
    CALIBRATION_SEQ_LEN,
    CALIBRATION_TOKENS,
    calibration_texts,
    calibration_tokens,
    int4_group,
    projection_inputs,
    quantize_model,
    quantize_weight,
)
from serving.config import STREAM_LAYOUT_METHODS

log = logging.getLogger(__name__)

KV_DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


def kv_cache_dtype(option: str, model_dtype):
    """The KV page dtype of the `kv_cache_dtype` option: "auto" -> the model's, "int8", "fp8" (e4m3)."""
    if option == "auto":
        return model_dtype
    if option not in KV_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of auto, {', '.join(KV_DTYPES)}; got {option!r}")
    return KV_DTYPES[option]


# QuantizedArray formats of the STREAM_LAYOUT_METHODS (every int4_* method stores "int4"; so do a checkpoint's kept
# GGUF Q4_0 / Q4_1 weights, which quantize_model leaves as they are).
STREAM_LAYOUT_FORMATS = tuple(dict.fromkeys(m.split("_")[0] for m in STREAM_LAYOUT_METHODS))


def add_stream_layout(model, formats: tuple[str, ...] = STREAM_LAYOUT_FORMATS) -> int:
    """Every weight-only projection of `formats` (QuantizedArray.fmt) also stored in the Hopper streaming kernel's
    layout (`quant.with_stream_layout`, which leaves grouped int8 as it is; the `quantized_stream_layout` option:
    int8 / fp8 / int4, the formats measured faster than XLA); returns how many. Quantised routed experts [E, K, N]
    are left out: they take XLA's ragged_dot (model/moe.py expert_matmul), which reads no streaming layout."""
    n = 0
    for slot in transformer._storage_slots(model).values():
        w = slot.get_value()
        if isinstance(w, QuantizedArray) and w.fmt in formats and not (w.act_fmt or w.stream) and w.values.ndim == 2:
            streamed = quant.with_stream_layout(w)
            if streamed is not w:
                slot.set_value(streamed)
                n += 1
    log.info("quantized_stream_layout: %d projections also in the streaming kernel's layout", n)
    return n
