"""Quantisation at load: the `quantization` and `kv_cache_dtype` options of the engine (serving/config.py).

    quantize_model(model, "int4_awq", tokenizer, calibration_file=None)   # in place; returns the names quantised

Every linear projection of every layer (the weights passed through `model.quant.matmul` as projections: q, k, v,
o, gate, up, down; not the embedding, nor the LM head, which asks for float32 logits) becomes a QuantizedArray
(model/quant.py) made by model/quant_methods.py:

    int8       W8A16 int8, round to nearest per output channel        (no calibration)
    fp8        W8A16 fp8 e4m3 per output channel, scales searched     (calibrated: fp8_calibrated)
    w8a8_fp8   GPTQ e4m3 weights, fp8 activations with per-token scales (calibrated)
    w8a8_fp8_rtn  e4m3 weights per channel (amax / 448), fp8 activations per token: no calibration, loads in
               seconds (vLLM's and TensorRT-LLM's dynamic fp8); prefill on the fp8 tensor cores as w8a8_fp8
    w8a8_int8  SmoothQuant (alpha 0.5), int8 activations per token   (calibrated)
    int4_rtn   int4 asymmetric per group, round to nearest           (no calibration)
    int4_awq   AWQ scale + clip search, int4 asymmetric per group    (calibrated)
    int4_gptq  GPTQ with act-order, clip-searched static groups      (calibrated)

int4 zero points are float (a group's [min, max], as GGUF Q4_1), not integer codes (BENCHMARKS.md: lower error).
W8A8 weights are stored transposed, [N, K] (QuantizedArray.layout "nk"): what Hopper's 8-bit wgmma reads, so
prefill never transposes them per call and decode's streaming kernel reads the same buffer.

int4 groups are 128 input rows, or the largest of 64 / 32 that divides the layer's input size. Calibration runs
the float model eagerly on `calibration_file` (or the short built-in text below) and records each projection's
inputs. Weights that are already QuantizedArrays (a quantised checkpoint) are kept as they are: no re-quantising.
"""

from __future__ import annotations

import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from model import layers, quant, transformer
from model import quant_methods as qm
from model.kv import NoCache
from model.quant import QuantizedArray
from serving.config import CALIBRATED_QUANTIZATIONS, QUANTIZATIONS, STREAM_LAYOUT_METHODS

log = logging.getLogger(__name__)

KV_DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
CALIBRATED = frozenset(CALIBRATED_QUANTIZATIONS)
CALIBRATION_TOKENS = 512  # most calibration tokens used (sequences of CALIBRATION_SEQ_LEN)
CALIBRATION_SEQ_LEN = 256

# A short, mixed built-in calibration text (prose, a list, numbers and code), used when no calibration_file is given.
BUILTIN_CALIBRATION_TEXT = """\
The river rose slowly through the night, and by morning the lower fields were under water. Farmers moved their
animals to the hill pastures, while the town council met in the old school to decide whether the bridge should be
closed. Nobody remembered a flood this early in the year; the records kept at the library went back to 1887.

Questions people asked the council: How long will the road stay closed? Who pays for the repairs? Is the drinking
water safe? The engineer answered that the bridge was sound, that the pumps at the treatment plant had their own
power, and that the road would open again once the level fell below 2.4 metres on the gauge at the mill.

def moving_average(values, window=3):
    \"\"\"Mean of each run of `window` consecutive values.\"\"\"
    if window <= 0:
        raise ValueError("window must be positive")
    total, out = 0.0, []
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out

Dear customer, thank you for your order of 12 items. Your parcel will be shipped within 3 working days; you can
follow it online with the tracking number in this message. If anything is missing, reply to this e-mail and our
support team will answer within 24 hours. Terms: returns are accepted for 30 days from delivery.

In mathematics, a prime number is a natural number greater than 1 that is not a product of two smaller natural
numbers. The first primes are 2, 3, 5, 7, 11 and 13; there are infinitely many of them, as Euclid proved.
"""


def kv_cache_dtype(option: str, model_dtype):
    """The KV page dtype of the `kv_cache_dtype` option: "auto" -> the model's, "int8", "fp8" (e4m3)."""
    if option == "auto":
        return model_dtype
    if option not in KV_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of auto, {', '.join(KV_DTYPES)}; got {option!r}")
    return KV_DTYPES[option]


def int4_group(k: int) -> int:
    """The int4 group size for an input size k: 128, 64 or 32, the largest that divides k."""
    for g in (128, 64, 32):
        if k % g == 0:
            return g
    raise ValueError(f"int4 quantisation needs an input size that is a multiple of 32, got {k}")


def quantize_weight(method: str, w_kn: jax.Array, x_tk: jax.Array | None) -> QuantizedArray:
    """One weight [K, N] quantised by `method` (x_tk: its calibration inputs [T, K], for calibrated methods)."""
    w = jnp.asarray(w_kn, jnp.float32)
    if method == "int8":
        return qm.rtn(w, method)
    if method == "fp8":
        return qm.fp8_calibrated(w, x_tk)
    if method == "w8a8_fp8":  # stored [N, K]: the layout the W8A8 kernel (and decode's streaming kernel) reads
        return quant.to_layout(qm.fp8_w8a8(w, x_tk, weights="gptq"), "nk")
    if method == "w8a8_fp8_rtn":
        return quant.to_layout(qm.fp8_w8a8(w), "nk")
    if method == "w8a8_int8":
        return quant.to_layout(qm.smoothquant(w, x_tk, alpha=0.5), "nk")
    group = dict(group_size=int4_group(w.shape[0]), asymmetric=True, zero_point="float")
    if method == "int4_rtn":
        return qm.rtn(w, "int4", **group)
    if method == "int4_awq":
        return qm.awq(w, x_tk, grid=10, **group)
    if method == "int4_gptq":
        return qm.gptq(w, x_tk, act_order=True, **group)
    raise ValueError(f"quantization: unknown method {method!r}")


def calibration_tokens(tokenizer, vocab_size: int, calibration_file: str | None) -> np.ndarray:
    """Token sequences [n, L] of the calibration text (at most CALIBRATION_TOKENS tokens in all)."""
    if calibration_file is not None:
        try:
            with open(calibration_file, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError as e:
            raise ValueError(f"calibration_file {calibration_file!r} cannot be read: {e}") from None
    else:
        text = BUILTIN_CALIBRATION_TEXT
    encode = getattr(tokenizer, "encode", None)
    if not callable(encode) and calibration_file is not None:
        raise ValueError(f"calibration_file {calibration_file!r} needs a tokenizer (the model has none)")
    ids = list(encode(text)) if callable(encode) else []
    if not ids:  # no tokenizer (token-id models): deterministic pseudo-random ids
        ids = np.random.default_rng(0).integers(0, vocab_size, CALIBRATION_TOKENS).tolist()
    ids = [i for i in ids if 0 <= i < vocab_size][:CALIBRATION_TOKENS]
    if len(ids) < 16:
        raise ValueError(f"calibration_file {calibration_file!r}: {len(ids)} tokens, need at least 16")
    seq = min(CALIBRATION_SEQ_LEN, len(ids))
    return np.asarray(ids[: len(ids) // seq * seq], np.int32).reshape(-1, seq)


def projection_inputs(model: transformer.Transformer, tokens_bt: np.ndarray) -> dict[str, np.ndarray]:
    """{storage name: inputs [T, K] float32} of every float projection (a fused q|k|v or gate|up is one),
    recorded from eager forwards."""
    slots = transformer._storage_slots(model)
    by_id = {id(s.get_value()): n for n, s in slots.items() if not isinstance(s.get_value(), QuantizedArray)}
    recorded: dict[str, list[np.ndarray]] = {}
    # Projections sharing an input convert it once per call; x is kept alive with its conversion, so a later
    # temporary cannot reuse its id and be taken for it (an MLP's down input for its gate|up input).
    seen: dict[int, tuple] = {}

    def door(x, w, out_dtype=None):
        name = by_id.get(id(w))
        if name is not None and out_dtype is None and getattr(w, "ndim", 0) == 2:
            if id(x) not in seen or seen[id(x)][0] is not x:
                seen[id(x)] = (x, np.asarray(x, np.float32).reshape(-1, x.shape[-1]))
            recorded.setdefault(name, []).append(seen[id(x)][1])
        return quant.matmul(x, w, out_dtype)

    saved = layers.matmul, transformer.matmul
    layers.matmul = transformer.matmul = door
    try:
        for row in tokens_bt:
            t = row.shape[0]
            seen.clear()
            model(jnp.asarray(row[None]), jnp.arange(t)[None], None, NoCache(jnp.array([t])))
    finally:
        layers.matmul, transformer.matmul = saved
    return {n: np.concatenate(xs) for n, xs in recorded.items()}


# QuantizedArray formats of the STREAM_LAYOUT_METHODS (every int4_* method stores "int4"; so do a checkpoint's kept
# GGUF Q4_0 / Q4_1 weights, which quantize_model leaves as they are).
STREAM_LAYOUT_FORMATS = tuple(dict.fromkeys(m.split("_")[0] for m in STREAM_LAYOUT_METHODS))


def add_stream_layout(model, formats: tuple[str, ...] = STREAM_LAYOUT_FORMATS) -> int:
    """Every weight-only projection of `formats` (QuantizedArray.fmt) also stored in the Hopper streaming kernel's
    layout (`quant.with_stream_layout`, which leaves grouped int8 as it is; the `quantized_stream_layout` option:
    int8 / fp8 / int4, the formats measured faster than XLA); returns how many."""
    n = 0
    for slot in transformer._storage_slots(model).values():
        w = slot.get_value()
        if isinstance(w, QuantizedArray) and w.fmt in formats and not (w.act_fmt or w.stream):
            streamed = quant.with_stream_layout(w)
            if streamed is not w:
                slot.set_value(streamed)
                n += 1
    log.info("quantized_stream_layout: %d projections also in the streaming kernel's layout", n)
    return n


def quantize_model(model, method: str, tokenizer=None, *, calibration_file: str | None = None) -> list[str]:
    """Replaces the model's float projections by QuantizedArrays of `method`, in place; returns their names.

    Projections already quantised (a quantised checkpoint) are left alone. The model keeps its dtype; each
    QuantizedArray's scales are float32 and the matmul door computes in the activations' dtype.
    """
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {method!r}")
    if calibration_file is not None and method not in CALIBRATED:
        raise ValueError(f"calibration_file is for the calibrated methods ({', '.join(CALIBRATED)}), not {method!r}")
    t0 = time.perf_counter()
    cfg = model.cfg
    if method in CALIBRATED:
        tokens = calibration_tokens(tokenizer, cfg.vocab_size, calibration_file)
    else:  # one short forward finds the projections
        tokens = np.arange(8, dtype=np.int32)[None] % cfg.vocab_size
    inputs = projection_inputs(model, tokens)
    slots = transformer._storage_slots(model)
    for name, x in inputs.items():  # a fused slot is quantised whole: its parts share pre_scale (AWQ, SmoothQuant)
        slot = slots[name]
        w = slot.get_value()
        q = quantize_weight(method, w, jnp.asarray(x) if method in CALIBRATED else None)
        slot.set_value(q)  # the runner places it (serving/engine/runner.py _place)
    log.info("quantization=%s: %d projections in %.1f s", method, len(inputs), time.perf_counter() - t0)
    canonical = transformer._param_slots(model)  # fused names -> the canonical parts they hold
    return sorted(n for n, s in canonical.items() if id(getattr(s, "param", s)) in {id(slots[m]) for m in inputs})
