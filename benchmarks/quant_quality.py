"""Quality of the weight quantisation methods on real text (CPU): perplexity per domain, KL and top-1 agreement.

    PYTHONPATH=. python3 benchmarks/quant_quality.py --path api --out benchmarks/results/quant_quality_api.json
    PYTHONPATH=. python3 benchmarks/quant_quality.py --out benchmarks/results/quant_quality.json   # --path research

--path api measures what a user gets: each method is `LLM(quantization=...)` (kv_* rows `LLM(kv_cache_dtype=...)`)
with its defaults, so the calibrated methods calibrate on the default text of model/calibration/; perplexity is
read through the public API (`LLM.score` logits for weight formats, `LLM.logprobs` through the paged engine for KV
formats) on the held-out "eval" files below, which no calibration text shares.

--path research (the default, below) quantises the parameters here with its own calibration split:

Model: the default checkpoint (checkpoints.loader.load_checkpoint(), SmolLM2) in float32; its float weights are the
baseline ("unquantised"). Text not written here: prose = licence texts in /usr/share/common-licenses, code = Python
standard-library sources. Calibration and evaluation use different files (held-out split). Every projection of
every layer (q, k, v, o, gate, up, down) is replaced by a QuantizedArray and runs through model.quant.matmul; the
embedding and LM head stay float. Calibration inputs of each projection are recorded from the float model
(not re-collected after earlier layers are quantised). Rows kv_int8 / kv_fp8 keep the float weights and quantise
K and V per token per head as the engine's int8 / fp8 pages do (model/kv.py quantize_kv; QuantizedKVNoCache).

    PYTHONPATH=. python3 benchmarks/quant_quality.py --methods kv_int8,kv_fp8 --out benchmarks/results/quant_quality_kv.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import sysconfig
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from checkpoints.loader import load_checkpoint
from model import fused, kv, layers, quant, transformer
from model import quant_methods as qm

LICENSES = "/usr/share/common-licenses"
# The quality figures in BENCHMARKS.md were read from this host's 3.11 standard library; elsewhere (the GPU hosts run
# 3.12) the running interpreter's own is used, whose files differ slightly: quality deltas compare within one host.
PY_LIB = next(
    p for p in ("/root/.pyenv/versions/3.11.7/lib/python3.11", sysconfig.get_paths()["stdlib"]) if os.path.isdir(p)
)
SPLITS = {
    "prose": dict(calib=["GPL-3", "Apache-2.0"], eval=["MPL-2.0", "Artistic", "GFDL-1.3", "LGPL-2.1"]),
    "code": dict(
        calib=["argparse.py", "dataclasses.py"], eval=["heapq.py", "fractions.py", "textwrap.py", "bisect.py"]
    ),
}
MODEL_NAME = "default checkpoint (checkpoints.loader.load_checkpoint())"
# The projection calls of a layer, in order: q|k|v and gate|up are one fused matmul each (model/fused.py).
PROJECTIONS = ("wqkv", "wo", "gate_up", "w_down")


def read(domain, name):
    root = LICENSES if domain == "prose" else PY_LIB
    with open(os.path.join(root, name), encoding="utf-8", errors="replace") as f:
        return f.read()


def sequences(tok, domain, split, seq_len, count):
    """`count` token sequences of `seq_len`, cut from the split's files in order."""
    ids = []
    for name in SPLITS[domain][split]:
        ids += tok.encode(read(domain, name))
    if len(ids) < seq_len * count:
        raise ValueError(f"{domain}/{split}: {len(ids)} tokens < {seq_len * count}")
    return np.asarray(ids[: seq_len * count], np.int32).reshape(count, seq_len)


def patch_door(recorder=None):
    """Layers call `model.quant.matmul` (imported by name); wrap it to record each projection's input, or restore."""

    def door(x, w, out_dtype=None):
        if out_dtype is None:  # the LM head (float32 logits) is not a projection we quantise
            recorder.append(np.asarray(x, np.float32).reshape(-1, x.shape[-1]))
        return quant.matmul(x, w, out_dtype)

    layers.matmul = transformer.matmul = quant.matmul if recorder is None else door


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuantizedKVNoCache(kv.NoCache):
    """Scoring with the engine's quantised KV numerics: each token's K and V are quantised per token per head
    exactly as model/kv.py writes them into int8 / fp8 pages (quantize_kv), and attention reads code * scale."""

    kv_dtype: str = dataclasses.field(default="int8", metadata=dict(static=True))

    def attend(self, q, k, v, positions, cache, *, window=None, sm_scale=None):
        dtype = KV_DTYPES[self.kv_dtype]
        q, k = kv.rotate_for_kv(q, k, dtype)  # as PagedMeta does before it quantises K

        def roundtrip(x):
            codes, scales = kv.quantize_kv(x[0], dtype)
            return (quant.codes_barrier(codes).astype(jnp.float32) * scales[..., None])[None].astype(x.dtype)

        return super().attend(q, roundtrip(k), roundtrip(v), positions, cache, window=window, sm_scale=sm_scale)


KV_DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
KV_METHODS = {"kv_int8": "int8", "kv_fp8": "fp8"}  # float weights, quantised KV


def forward(model, tokens_bt, kv_dtype=None):
    b, t = tokens_bt.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    valid = jnp.full((b,), t)
    meta = kv.NoCache(valid) if kv_dtype is None else QuantizedKVNoCache(valid, kv_dtype)
    logits, _ = model(jnp.asarray(tokens_bt), positions, None, meta)
    return logits


def calibration_inputs(model, calib_bt, num_layers):
    """{"layers.i.name": x [T, K]} recorded from the float model (call order: qkv, o, gate_up, down)."""
    calls = []
    patch_door(calls)
    for row in calib_bt:
        forward(model, row[None])
    patch_door(None)
    per_seq = len(PROJECTIONS) * num_layers
    if len(calls) != per_seq * len(calib_bt):
        raise RuntimeError(f"recorded {len(calls)} projection calls, expected {per_seq * len(calib_bt)}")
    out = {}
    for i in range(per_seq):
        name = f"layers.{i // len(PROJECTIONS)}.{PROJECTIONS[i % len(PROJECTIONS)]}"
        out[name] = np.concatenate(calls[i::per_seq], axis=0)
    return out


# int4 settings (--group_size, --zero_point), the same for RTN, AWQ and GPTQ so that their rows compare methods only
GROUP = dict(group_size=64, asymmetric=True, zero_point="float")
METHODS = {
    "int8": lambda w, x: qm.rtn(w, "int8"),
    "fp8_amax": lambda w, x: qm.rtn(w, "fp8"),  # scales amax / 448
    "fp8": lambda w, x: qm.fp8_calibrated(w, x),  # scales searched on the calibration inputs
    "int4_rtn": lambda w, x: qm.rtn(w, "int4", **GROUP),
    # alpha searched on 512 strided tokens (both domains), the clip search on all calibration tokens
    "int4_awq": lambda w, x: qm.awq(w, x, grid=20, search_tokens=512, **GROUP),
    "int4_gptq": lambda w, x: qm.gptq(w, x, act_order=True, **GROUP),  # static groups from the clip search
    "int4_gptq_in_order": lambda w, x: qm.gptq(w, x, clip=False, **GROUP),
    "w8a8_int8_smoothquant": lambda w, x: qm.smoothquant(w, x, alpha=0.5),
    "w8a8_fp8_dynamic_rtn": lambda w, x: qm.fp8_w8a8(w),  # amax / 448 weights
    "w8a8_fp8_dynamic": lambda w, x: qm.fp8_w8a8(w, x, weights="gptq"),  # GPTQ-compensated e4m3 weights
}
DEFAULT_METHODS = ("int8", "fp8", "int4_rtn", "int4_awq", "int4_gptq", "w8a8_int8_smoothquant", "w8a8_fp8_dynamic")


def quantised_params(params, calib, method):
    """Canonical params with every projection quantised; a fused group (q|k|v, gate|up) is quantised as one
    weight, as the engine does (its parts share AWQ's / SmoothQuant's per-input-channel scale), then split."""
    out = dict(params)
    for name, x in calib.items():
        prefix, leaf = name.rsplit(".", 1)
        names = [f"{prefix}.{n}" for n in fused.GROUPS.get(leaf, (leaf,))]
        parts = [fused.Part(n, params[n].shape[-1], params[n].shape[-1]) for n in names]
        w = np.concatenate([np.asarray(params[n], np.float32) for n in names], axis=-1)
        q = METHODS[method](jnp.asarray(w), jnp.asarray(x))
        out.update(zip(names, fused.split(q, parts)))
    return out


# "<method>_seq": the method on inputs re-recorded from the partly quantised model before each layer (GPTQ's
# sequential order: a layer's projections compensate the error of every layer quantised before it), not the float's.
SEQUENTIAL_SUFFIX = "_seq"


def sequential_params(config, params, calib_bt, method):
    """quantised_params with layer i's calibration inputs recorded from the model whose layers < i are already
    quantised (its four projections see the same quantised prefix); each recording runs the first i + 1 layers."""
    from serving.spec.draft_model import truncated_model

    out = dict(params)
    for i in range(config.num_layers):
        model = transformer.build_model(config, out, jnp.float32)
        prefix = truncated_model(model, i + 1) if i + 1 < config.num_layers else model
        x = calibration_inputs(prefix, calib_bt, i + 1)
        out = quantised_params(out, {n: v for n, v in x.items() if n.startswith(f"layers.{i}.")}, method)
        print(f"  sequential: layer {i} quantised", flush=True)
    return out


def score(model, eval_bt, base_logprobs=None, kv_dtype=None):
    """Mean NLL of next tokens, and (against base log-probs) mean KL(base || this) and top-1 agreement."""
    graphdef, state = nnx.split(model)
    jitted = jax.jit(
        lambda state, tokens: jax.nn.log_softmax(forward(nnx.merge(graphdef, state), tokens, kv_dtype), axis=-1)
    )

    def run(tokens):
        return jitted(state, tokens)

    nll, kl, agree, lps = [], [], [], []
    for i, row in enumerate(eval_bt):
        lp = run(row[None])[0, :-1]  # [T-1, V]
        nll.append(-np.asarray(jnp.take_along_axis(lp, jnp.asarray(row[1:, None]), axis=-1))[:, 0])
        if base_logprobs is None:
            lps.append(lp)
        else:
            base = base_logprobs[i]
            kl.append(np.asarray(jnp.sum(jnp.exp(base) * (base - lp), axis=-1)))
            agree.append(np.asarray(jnp.argmax(base, -1) == jnp.argmax(lp, -1)))
    nll = np.concatenate(nll)
    result = dict(ppl=float(np.exp(nll.mean())), tokens=int(nll.size))
    if base_logprobs is not None:
        result |= dict(kl=float(np.concatenate(kl).mean()), top1_agree=float(np.concatenate(agree).mean()))
    return result, lps


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results/quant_quality.json")
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--eval_seqs", type=int, default=4)
    parser.add_argument("--calib_seqs", type=int, default=2)
    parser.add_argument(
        "--methods",
        default=None,
        help=", ".join(METHODS) + f" (each also as <method>{SEQUENTIAL_SUFFIX})",
    )
    parser.add_argument("--path", default="research", choices=("research", "api"))
    parser.add_argument("--group_size", type=int, default=64)
    parser.add_argument("--zero_point", default="float", choices=qm.ZERO_POINTS)
    args = parser.parse_args(argv)
    args.methods_given = args.methods is not None
    args.methods = args.methods or ",".join([*DEFAULT_METHODS, *KV_METHODS])
    if args.path == "api":
        return api_main(args)
    GROUP.update(group_size=args.group_size, zero_point=args.zero_point)
    t0 = time.time()
    ckpt = load_checkpoint()
    model = transformer.build_model(ckpt.config, ckpt.params, jnp.float32)
    params = transformer.model_params(model)
    calib_bt = np.concatenate([sequences(ckpt.tokenizer, d, "calib", args.seq_len, args.calib_seqs) for d in SPLITS])
    evals = {d: sequences(ckpt.tokenizer, d, "eval", args.seq_len, args.eval_seqs) for d in SPLITS}
    calib = calibration_inputs(model, calib_bt, ckpt.config.num_layers)
    print(f"calibration: {calib_bt.size} tokens, {len(calib)} projections ({time.time() - t0:.0f}s)", flush=True)
    patch_door(None)
    result = dict(
        model=MODEL_NAME,
        int4=dict(GROUP),
        seq_len=args.seq_len,
        calib_tokens=int(calib_bt.size),
        splits=SPLITS,
        rows=[],
    )
    base = {}
    for domain, eval_bt in evals.items():
        r, base[domain] = score(model, eval_bt)
        result["rows"].append(dict(method="float", domain=domain, **r))
        print(f"float      {domain:6s} ppl {r['ppl']:.4f}", flush=True)
    for method in args.methods.split(","):
        start = time.time()
        kv_dtype = KV_METHODS.get(method)
        if method.endswith(SEQUENTIAL_SUFFIX):
            base_method = method.removesuffix(SEQUENTIAL_SUFFIX)
            qparams = sequential_params(ckpt.config, params, calib_bt, base_method)
            qmodel = transformer.build_model(ckpt.config, qparams, jnp.float32)
        elif kv_dtype is None:
            qmodel = transformer.build_model(ckpt.config, quantised_params(params, calib, method), jnp.float32)
        else:
            qmodel = model
        quant_s = time.time() - start
        for domain, eval_bt in evals.items():
            r, _ = score(qmodel, eval_bt, base[domain], kv_dtype)
            ref = next(x["ppl"] for x in result["rows"] if x["method"] == "float" and x["domain"] == domain)
            r |= dict(ppl_delta_pct=100.0 * (r["ppl"] / ref - 1.0), quantise_s=quant_s)
            result["rows"].append(dict(method=method, domain=domain, **r))
            print(
                f"{method:22s} {domain:6s} ppl {r['ppl']:.4f} ({r['ppl_delta_pct']:+.2f}%) KL {r['kl']:.4f} "
                f"top1 {r['top1_agree']:.4f}  (quantise {quant_s:.0f}s)",
                flush=True,
            )
        dump(args.out, result)
    result["elapsed_s"] = time.time() - t0
    dump(args.out, result)


API_METHODS = ("int8", "fp8", "w8a8_fp8", "w8a8_fp8_rtn", "int4_rtn", "int4_awq", "int4_gptq", "kv_int8", "kv_fp8")


def api_perplexity(llm, eval_bt, kv: bool) -> float:
    """exp(mean next-token NLL) over the sequences: `score` logits (weights) or paged `logprobs` (KV formats)."""
    nll = []
    for row in eval_bt.tolist():
        if kv:
            nll += [-x for x in llm.logprobs([row[:1]], [row[1:]])[0].token_logprobs]
        else:
            logp = jax.nn.log_softmax(jnp.asarray(llm.score(row)[:-1]), axis=-1)
            nll += (-np.asarray(jnp.take_along_axis(logp, jnp.asarray(row[1:])[:, None], axis=-1))[:, 0]).tolist()
    return float(np.exp(np.mean(nll)))


def api_main(args) -> int:
    """Every method through `LLM(...)` with its defaults on the held-out text (see the module docstring)."""
    from serving.engine.llm import LLM

    t0 = time.time()
    tokenizer = load_checkpoint().tokenizer
    evals = {d: sequences(tokenizer, d, "eval", args.seq_len, args.eval_seqs) for d in SPLITS}
    engine = dict(dtype="float32", max_num_seqs=2, max_num_batched_tokens=args.seq_len, max_model_len=args.seq_len)
    engine |= dict(num_kv_blocks=2 * args.seq_len // 16 + 2)
    result = dict(model=MODEL_NAME, path="api", seq_len=args.seq_len, eval_seqs=args.eval_seqs, rows=[])
    result["eval_files"] = {d: SPLITS[d]["eval"] for d in SPLITS}
    methods = [m for m in args.methods.split(",") if m] if args.methods_given else list(API_METHODS)
    base = {}
    for method in ["float", *methods]:
        start = time.time()
        kv = method.startswith("kv_")
        options = dict(kv_cache_dtype=method[3:]) if kv else ({} if method == "float" else dict(quantization=method))
        llm = LLM(**engine, **options)
        load_s = time.time() - start
        for domain, eval_bt in evals.items():
            ppl = api_perplexity(llm, eval_bt, kv)
            if method == "float":
                base[domain] = dict(score=ppl, engine=api_perplexity(llm, eval_bt, True))
            ref = base[domain]["engine" if kv else "score"]
            row = dict(method=method, domain=domain, ppl=ppl, ppl_delta_pct=100.0 * (ppl / ref - 1.0), load_s=load_s)
            result["rows"].append(row)
            print(
                f"{method:14s} {domain:6s} ppl {ppl:.4f} ({row['ppl_delta_pct']:+.2f}%)  load {load_s:.0f}s", flush=True
            )
        del llm
        dump(args.out, result)
    result["elapsed_s"] = time.time() - t0
    dump(args.out, result)
    return 0


def dump(path, result):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
