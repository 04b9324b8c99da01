"""Weight quantisation of a whole model, in place: what the engine's `quantization` option (serving/engine/quantize.py)
and the converter's --quantize (checkpoints/convert.py) both call.

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

Routed experts (MoE: w_gate_up [E, D, 2F] and w_experts_down [E, F, D], DeepSeek's too) are quantised as well, by
`quantize_experts`: round to nearest per expert, weight-only, into one stacked QuantizedArray that model/moe.py's
`expert_matmul` reads (per-channel int8 / fp8 scale the rows after XLA's ragged_dot; int4 is dequantised first).
The experts take each method's storage format, by round to nearest (EXPERT_FORMATS):

    int8, int4_rtn               the same quantisation as the projections
    fp8                          e4m3 per channel with amax / 448 scales (the scale search is not run per expert)
    w8a8_fp8, w8a8_fp8_rtn       e4m3 weights per channel, weight-only: the grouped matmul has no 8-bit-activation
    w8a8_int8                    kernel, so quantising the rows' activations would add error and save nothing;
                                 int8 weights per channel (no SmoothQuant scales)
    int4_awq, int4_gptq          int4 asymmetric groups by round to nearest (no per-expert calibration pass)

The log line counts the expert weights and names their form. Stacked experts are quantised a few experts at a
time (EXPERT_CHUNK_ELEMENTS), so the float32 copy is a slice, never the whole [E, K, N].

int4 groups are 128 input rows, or the largest of 64 / 32 that divides the layer's input size. Calibration runs
the float model eagerly on `calibration_file` (a .txt file, a JSONL file with a "text" field per line, or a
directory of .txt / .jsonl files) or, by default, on the mixed prose and code of model/calibration/ (its README
gives provenance and licences), and records each projection's inputs. Weights that are already QuantizedArrays
(a quantised checkpoint) are kept as they are: no re-quantising.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model import layers, quant, transformer
from model import quant_methods as qm
from model.kv import NoCache
from model.quant import QuantizedArray
from model.quant_formats import CALIBRATED_QUANTIZATIONS, QUANTIZATIONS

log = logging.getLogger(__name__)

CALIBRATED = frozenset(CALIBRATED_QUANTIZATIONS)
CALIBRATION_TOKENS = 4096  # most calibration tokens used (sequences of CALIBRATION_SEQ_LEN)
CALIBRATION_SEQ_LEN = 256
DEFAULT_CALIBRATION_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibration")
CALIBRATION_SUFFIXES = (".txt", ".jsonl")


def int4_group(k: int) -> int:
    """The int4 group size for an input size k: 128, 64 or 32, the largest that divides k."""
    for g in (128, 64, 32):
        if k % g == 0:
            return g
    raise ValueError(f"int4 quantisation needs an input size that is a multiple of 32, got {k}")


def quantize_weight(method: str, w_kn: jax.Array, x_tk: jax.Array | None) -> QuantizedArray:
    """One weight [K, N] quantised by `method` (x_tk: its calibration inputs [T, K], for calibrated methods)."""
    w = jnp.asarray(w_kn, jnp.float32)
    if method == "int8":  # [N, K] where the Hopper streaming kernel decodes (quant.decode_layout), else [K, N]
        return quant.decode_layout(qm.rtn(w, method))
    if method == "fp8":
        return quant.decode_layout(qm.fp8_calibrated(w, x_tk))
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


# The weight-only storage format the routed experts take under each method (module docstring).
EXPERT_FORMATS = {
    "int8": "int8",
    "fp8": "fp8",
    "w8a8_fp8": "fp8",
    "w8a8_fp8_rtn": "fp8",
    "w8a8_int8": "int8",
    "int4_rtn": "int4",
    "int4_awq": "int4",
    "int4_gptq": "int4",
}
EXPERT_LEAVES = ("w_gate_up", "w_experts_down")  # model/transformer.py storage names of the routed experts
EXPERT_CHUNK_ELEMENTS = 1 << 26  # experts quantised together: at most this many weights (256 MB in float32)


def expert_form(method: str) -> str:
    """How `method` leaves the routed experts, for the log line."""
    fmt = EXPERT_FORMATS[method]
    same = method in ("int8", "int4_rtn")
    return f"{fmt} round to nearest, weight-only" + ("" if same else f" (not {method}'s own scheme)")


def expert_int4_group(k: int) -> int:
    """The int4 group size of experts with input size k: `int4_group`'s, or one group of all k rows where none of
    128 / 64 / 32 divides k (narrow experts: DeepSeek's tiny test checkpoints have F = 16)."""
    if k % 32 == 0:
        return int4_group(k)
    if k % 2:
        raise ValueError(f"int4 expert quantisation needs an even input size, got {k}")
    return k


@functools.partial(jax.jit, static_argnames=("fmt", "group_size"))
def _rtn_chunk(w_ekn: jax.Array, fmt: str, group_size: int) -> QuantizedArray:
    """Round to nearest of each expert of w [e, K, N] (model/quant_methods.py `rtn`), stacked."""
    kw = dict(group_size=group_size, asymmetric=True, zero_point="float") if fmt == "int4" else {}
    return jax.vmap(lambda w: qm.rtn(w.astype(jnp.float32), fmt, **kw))(w_ekn)


def rtn_experts(w_ekn: jax.Array, fmt: str, group_size: int = 0) -> QuantizedArray:
    """Stacked experts [E, K, N] -> one QuantizedArray (every leaf leading with E): round to nearest per expert in
    `fmt` (int8 / fp8 per channel; int4 in asymmetric groups of `group_size` rows with float zero points), a few
    experts at a time (EXPERT_CHUNK_ELEMENTS). serving/engine/weights.py re-quantises updated experts with it."""
    e, k, n = w_ekn.shape
    chunk = max(1, min(e, EXPERT_CHUNK_ELEMENTS // (k * n)))
    parts = [_rtn_chunk(w_ekn[i : i + chunk], fmt, group_size) for i in range(0, e, chunk)]
    return parts[0] if len(parts) == 1 else jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts)


def quantize_expert_weight(method: str, w_ekn: jax.Array) -> QuantizedArray:
    """Stacked experts [E, K, N] in `method`'s expert format (EXPERT_FORMATS) by `rtn_experts`."""
    fmt = EXPERT_FORMATS[method]
    return rtn_experts(w_ekn, fmt, expert_int4_group(w_ekn.shape[1]) if fmt == "int4" else 0)


def quantize_experts(slots, method: str) -> list[str]:
    """The routed-expert weights `slots` ({name: nnx.Param} of [E, K, N] arrays) quantised in place by
    `quantize_expert_weight`; returns the names quantised (weights already quantised are kept)."""
    done = []
    for name, slot in slots.items():
        if not isinstance(slot.get_value(), QuantizedArray):
            slot.set_value(quantize_expert_weight(method, slot.get_value()))
            done.append(name)
    return done


def calibration_texts(path: str | None = None) -> list[str]:
    """The documents of a calibration source: a .txt file (one document), a .jsonl file (the "text" field of each
    line), or a directory of those (sorted by name; other files ignored). None: model/calibration/.

    Raises:
      ValueError: a missing or unreadable path, another file type, a JSONL line without a string "text", no text.
    """
    source = DEFAULT_CALIBRATION_DIR if path is None else path
    if os.path.isdir(source):
        names = sorted(n for n in os.listdir(source) if n.endswith(CALIBRATION_SUFFIXES))
        docs = [d for n in names for d in calibration_texts(os.path.join(source, n))]
    elif not os.path.isfile(source):
        raise ValueError(f"calibration_file {source!r} does not exist")
    elif not source.endswith(CALIBRATION_SUFFIXES):
        raise ValueError(
            f'calibration_file {source!r}: expected a .txt file, a .jsonl file with a "text" field per line, '
            "or a directory of them"
        )
    else:
        docs = _read_documents(source)
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise ValueError(f"calibration_file {source!r} holds no text")
    return docs


def _read_documents(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"calibration_file {path!r} cannot be read: {e}") from None
    if path.endswith(".txt"):
        return [text]
    docs = []
    for no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"calibration_file {path}:{no}: not valid JSON ({e.msg})") from None
        if not isinstance(item, dict) or not isinstance(item.get("text"), str):
            raise ValueError(f'calibration_file {path}:{no}: expected an object with a string "text" field')
        docs.append(item["text"])
    return docs


def calibration_tokens(
    tokenizer, vocab_size: int, calibration_file: str | None, max_tokens: int = CALIBRATION_TOKENS
) -> np.ndarray:
    """Token sequences [n, L] of the calibration text, at most `max_tokens` in all: each document cut into
    sequences of CALIBRATION_SEQ_LEN, taken from the documents in turn (prose and code both reach the budget)."""
    encode = getattr(tokenizer, "encode", None)
    if not callable(encode):
        if calibration_file is not None:
            raise ValueError(f"calibration_file {calibration_file!r} needs a tokenizer (the model has none)")
        n = min(512, max_tokens)  # token-id models (random weights): a few pseudo-random sequences
        return np.random.default_rng(0).integers(0, vocab_size, n).astype(np.int32).reshape(-1, min(256, n))
    docs = [[i for i in encode(d) if 0 <= i < vocab_size] for d in calibration_texts(calibration_file)]
    seq = min(CALIBRATION_SEQ_LEN, max(len(d) for d in docs))
    if seq < 16:
        raise ValueError(f"calibration_file {calibration_file!r}: {seq} tokens, need at least 16")
    chunks = [[d[i : i + seq] for i in range(0, len(d) - seq + 1, seq)] for d in docs]
    rows = [c[k] for k in range(max(map(len, chunks))) for c in chunks if k < len(c)]
    return np.asarray(rows[: max(1, max_tokens // seq)], np.int32)


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


def quantize_model(model, method: str, tokenizer=None, *, calibration_file: str | None = None) -> list[str]:
    """Replaces the model's float projections by QuantizedArrays of `method`, and its routed experts by their
    weight-only form (`quantize_experts`), in place; returns their names (canonical, or DeepSeek's slot paths).

    Projections already quantised (a quantised checkpoint) are left alone. The model keeps its dtype; each
    QuantizedArray's scales are float32 and the matmul door computes in the activations' dtype.
    """
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {method!r}")
    if calibration_file is not None and method not in CALIBRATED:
        raise ValueError(f"calibration_file is for the calibrated methods ({', '.join(CALIBRATED)}), not {method!r}")
    t0 = time.perf_counter()
    if hasattr(model, "quantize_projections"):  # a decoder that names its own projections (model/deepseek.py)
        names = model.quantize_projections(method)
        experts = _stacked_experts(model, names)
        _log_done(method, len(names) - experts, experts, t0)
        return names
    cfg = model.cfg
    inputs = projection_inputs(model, np.arange(8, dtype=np.int32)[None] % cfg.vocab_size)  # finds the projections
    if inputs and method in CALIBRATED:  # none: quantised already (a quantised checkpoint, or by the LLM)
        inputs = projection_inputs(model, calibration_tokens(tokenizer, cfg.vocab_size, calibration_file))
    slots = transformer._storage_slots(model)
    for name, x in inputs.items():  # a fused slot is quantised whole: its parts share pre_scale (AWQ, SmoothQuant)
        slot = slots[name]
        w = slot.get_value()
        q = quantize_weight(method, w, jnp.asarray(x) if method in CALIBRATED else None)
        slot.set_value(q)  # the runner places it (serving/engine/runner.py _place)
    experts = quantize_experts({n: s for n, s in slots.items() if n.rsplit(".", 1)[-1] in EXPERT_LEAVES}, method)
    _log_done(method, len(inputs), len(experts), t0)
    canonical = transformer._param_slots(model)  # fused names -> the canonical parts they hold
    done = {id(slots[m]) for m in (*inputs, *experts)}
    return sorted(n for n, s in canonical.items() if id(getattr(s, "param", s)) in done)


def _stacked_experts(model, names: list[str]) -> int:
    """How many of the slot paths `names` hold stacked expert QuantizedArrays [E, K, N]."""
    wanted, n = set(names), 0
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param) and ".".join(str(p) for p in path) in wanted:
            value = var.get_value()
            n += isinstance(value, QuantizedArray) and value.values.ndim == 3
    return n


def _log_done(method: str, projections: int, experts: int, t0: float) -> None:
    form = f" ({expert_form(method)})" if experts else ""
    took = time.perf_counter() - t0
    log.info(
        "quantization=%s: %d projections, %d routed expert weights%s in %.1f s",
        method,
        projections,
        experts,
        form,
        took,
    )
