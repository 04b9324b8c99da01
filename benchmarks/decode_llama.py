"""Decode throughput of the engine's runner at real shapes with random weights (GPU).

    PYTHONPATH=. python benchmarks/decode_llama.py --preset llama3_8b --batches 1,64 --ctx 1024 --steps 32
    ... --formats bf16,int8,fp8,int4_rtn --kv_cache_dtypes auto,int8    (the per-format table)

For each (weight format, KV dtype) and batch size: a ModelRunner over a paged KV pool, every row at context `ctx`
(pages assigned, contents random), timed `decode_loop` calls of `steps` on-device decode steps (model + sampling), reported as tokens/s,
ms/step and effective weight bandwidth (stored parameter bytes / step time). Also times a single-step call (one
host round trip per token) and the start-up compile. Per format it also reports the stored weight bytes and how many
sequences of `--concurrency_context` tokens the device's memory holds beside them (KV pool sized as the engine sizes
it: serving/engine/runner.py size_kv_pool at memory_fraction 0.9). Weight formats are serving/engine/quantize.py's
methods applied to the random bf16 model (calibrated ones on its built-in text). Writes JSON to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.shapes import model_config
from model import kv as kv_module
from model import quant
from model.config import ModelConfig
from model.sampling import SamplingTensors
from model.transformer import random_model
from serving.config import DEFAULT_COMPILATION_CACHE_DIR, CacheConfig, RuntimeConfig
from serving.engine.llm import enable_compilation_cache
from serving.engine.runner import ModelRunner, RowInput


def stored_bytes(model) -> int:
    """Bytes of every parameter as stored (QuantizedArray values + scales + zero points)."""
    return sum(int(x.nbytes) for x in jax.tree.leaves(nnx_state(model)) if hasattr(x, "nbytes"))


def read_bytes(cfg: ModelConfig, weight_bytes: int, batch: int) -> float:
    """Weight bytes one decode step must read at `batch` rows: all of a dense model; for an MoE model the shared
    parameters plus the routed experts that uniform top-k routing touches in expectation, E * (1 - (1 - k/E)^batch)
    (batch 1: the k active experts, the bandwidth floor of the active parameters)."""
    if not cfg.num_experts:
        return float(weight_bytes)
    total, active = cfg.num_params(), cfg.num_params(active=True)
    per_expert = (total - active) / (cfg.num_experts - cfg.num_experts_per_tok)
    shared = total - cfg.num_experts * per_expert
    touched = cfg.num_experts * (1 - (1 - cfg.num_experts_per_tok / cfg.num_experts) ** batch)
    return weight_bytes * (shared + touched * per_expert) / total


def bench(
    preset: str,
    batches: list[int],
    ctx: int,
    steps: int,
    block_size: int,
    backend: str | None,
    repeats: int,
    fmt: str = "bf16",
    kv_cache_dtype: str = "auto",
    concurrency_context: int = 8192,
    stream_layout: bool = False,
    trace_dir: str = "",
    path: str = "default",
) -> dict:
    from serving.engine.quantize import kv_cache_dtype as kv_dtype_of
    from serving.engine.quantize import quantize_model
    from serving.engine.runner import kv_bytes_per_block, size_kv_pool

    cfg = model_config(preset)
    t0 = time.perf_counter()
    model = random_model(cfg, jnp.bfloat16)
    if fmt != "bf16":
        quantize_model(model, fmt)
    quant.set_options(model, set_path(model, path))
    weight_bytes = stored_bytes(model)  # one copy: the stream layout's second copy is not read twice a step
    if stream_layout:  # the Mosaic GPU streaming kernel's weight copy (the engine's quantized_stream_layout)
        from serving.engine.quantize import add_stream_layout

        add_stream_layout(model, ("int8", "fp8", "int4"))
    jax.block_until_ready(jax.tree.leaves(nnx_state(model)))
    init_s = time.perf_counter() - t0
    kv_dtype = kv_dtype_of(kv_cache_dtype, jnp.bfloat16)
    blocks_8k = -(-concurrency_context // block_size)
    pool_blocks = size_kv_pool(model, block_size, kv_dtype, 0.9, 1 << 30)
    concurrency = pool_blocks // blocks_8k
    print(
        f"{preset} {fmt} kv={kv_cache_dtype} path={path}: "
        f"weights {weight_bytes / 2**30:.2f} GiB, {pool_blocks} KV blocks "
        f"({kv_bytes_per_block(model, block_size, kv_dtype) / 2**20:.2f} MiB each) = {concurrency} sequences of "
        f"{concurrency_context} tokens; init+quantise {init_s:.1f}s",
        flush=True,
    )
    results = {
        "preset": preset,
        "format": fmt,
        "stream_layout": stream_layout,
        "kv_cache_dtype": kv_cache_dtype,
        "kv_pool_blocks_at_0.9": pool_blocks,
        "concurrency_context": concurrency_context,
        "concurrent_sequences": concurrency,
        "weight_bytes": weight_bytes,
        "init_s": init_s,
        "device": str(jax.devices()[0].device_kind),
        "rows": [],
    }
    if not batches:  # --batches "": memory and concurrency only
        return results
    max_b = max(batches)
    blocks_per_row = -(-(ctx + steps * (repeats + 2)) // block_size)
    runner = ModelRunner(
        model,
        num_blocks=max_b * blocks_per_row + 1,
        block_size=block_size,
        max_num_seqs=max_b,
        max_num_batched_tokens=max(256, max_b),
        max_model_len=blocks_per_row * block_size,
        attention_backend=backend,
        kv_dtype=kv_dtype,
    )
    results |= {"ctx": ctx, "steps_per_call": steps}
    rng = np.random.default_rng(0)
    for b in batches:
        rows = [
            RowInput(
                [int(rng.integers(cfg.vocab_size))],
                ctx,
                list(range(1 + i * blocks_per_row, 1 + (i + 1) * blocks_per_row)),
            )
            for i in range(b)
        ]
        st = SamplingTensors.from_rows([{}] * b)
        banned = np.full((steps, b, 1), -1, np.int32)
        t0 = time.perf_counter()
        runner.decode_loop(rows, steps, st, banned)  # compile + first run
        compile_s = time.perf_counter() - t0
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            runner.decode_loop(rows, steps, st, banned)
            times.append(time.perf_counter() - t0)
        loop_s = float(np.median(times))
        profile = (
            trace_loop(runner, rows, steps, st, banned, cfg, f"{trace_dir}/{fmt}_{kv_cache_dtype}_b{b}")
            if trace_dir
            else {}
        )
        # One host round trip per token (the engine's fallback path).
        runner.forward(rows)
        single = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(runner.forward(rows))
            single.append(time.perf_counter() - t0)
        single_s = float(np.median(single))
        read = read_bytes(cfg, weight_bytes, b)
        row = {
            "batch": b,
            "expected_weight_bytes_read": read,
            "read_TBps_loop": read / (loop_s / steps) / 1e12,
            "compile_s": compile_s,
            "ms_per_step_loop": 1e3 * loop_s / steps,
            "tokens_per_s_loop": b * steps / loop_s,
            "ms_per_step_single": 1e3 * single_s,
            "tokens_per_s_single": b / single_s,
            "weight_TBps_loop": weight_bytes / (loop_s / steps) / 1e12,
        } | ({"profile": profile} if profile else {})
        results["rows"].append(row)
        print(
            f"{preset} {fmt} {path} kv={kv_cache_dtype} B={b:3d} ctx={ctx}: loop {row['ms_per_step_loop']:.2f} ms/step "
            f"{row['tokens_per_s_loop']:.0f} tok/s ({row['weight_TBps_loop']:.2f} TB/s all weights, "
            f"{row['read_TBps_loop']:.2f} TB/s of the {read / 1e9:.1f} GB a step reads); "
            f"single-step {row['ms_per_step_single']:.2f} ms ({row['tokens_per_s_single']:.0f} tok/s); "
            f"compile {compile_s:.1f}s",
            flush=True,
        )
    return results


# --paths: the quantised weights' matmul paths (model.quant.MatmulOptions, carried by each weight). Plain bf16 weights
# always take DEFAULT_OPTIONS (the one-row GEMV, XLA's dot above).
PATHS = {
    "default": quant.DEFAULT_OPTIONS,  # one layout per weight (quant.decode_layout) and the measured crossovers
    "legacy": quant.LEGACY_OPTIONS,  # 8-bit weights [K, N]: Triton kernel to 16 / 64 rows, XLA dequantise above
    "no_gemv": dataclasses.replace(quant.DEFAULT_OPTIONS, gemv_max_rows=()),  # default, one-row calls included
    # default, with [N, K] int8 / fp8 one-row calls on the K-contiguous GEMV (pallas_kernels/gemv_nk.py)
    "gemv_nk": dataclasses.replace(
        quant.DEFAULT_OPTIONS, gemv_max_rows=quant.DEFAULT_OPTIONS.gemv_max_rows + (("int8_nk", 1), ("fp8_nk", 1))
    ),
}


def set_path(model, path: str):
    """The MatmulOptions of `path`; "legacy" also moves [N, K] weight-only 8-bit weights back to [K, N]."""
    if path == "legacy":
        from flax import nnx

        def kn(w):
            if isinstance(w, quant.QuantizedArray) and not w.act_fmt and w.stream is None:
                return quant.to_layout(w, "kn")
            return w

        state = nnx.state(model)
        nnx.update(model, jax.tree.map(kn, state, is_leaf=lambda w: isinstance(w, quant.QuantizedArray)))
    return PATHS[path]


def trace_loop(runner, rows, steps, st, banned, cfg, trace_dir: str) -> dict:
    """One more decode_loop call under the JAX profiler: ms per step per kernel category (engine_latency's step_profile:
    attention, matmul incl. our GEMV, elementwise fusions, copies, host gap) and the top kernels, printed."""
    from benchmarks.engine_core import device_spans
    from benchmarks.engine_latency import step_profile

    jax.profiler.start_trace(trace_dir)
    jax.block_until_ready(runner.decode_loop(rows, steps, st, banned))
    jax.profiler.stop_trace()
    prof = step_profile(*device_spans(trace_dir), cfg.num_layers, steps, top=12)
    if not prof.get("per_step_ms"):
        print(f"  profile: no device kernels in {prof['trace']} (a CPU run)")
        return prof
    cats = "  ".join(f"{c} {v:.3f}" for c, v in prof["per_step_ms"].items())
    print(f"  profile: {prof['step_ms']:.3f} ms/step over {prof['steps']} steps ({prof['steps_from']}): {cats}")
    for k in prof["top_kernels"]:
        print(f"    {k['ms_per_step']:.4f} ms/step x{k['launches_per_step']:g}  {k['category']:11s} {k['name'][:90]}")
    return prof


def nnx_state(model):
    from flax import nnx

    return nnx.state(model)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="llama3_8b", help="a shape of benchmarks/shapes.py (random weights)")
    p.add_argument("--formats", default="bf16", help="comma list: bf16 and serving/engine/quantize.py's methods")
    p.add_argument("--kv_cache_dtypes", default="auto", help="comma list of auto, int8, fp8")
    p.add_argument("--concurrency_context", type=int, default=8192)
    p.add_argument(
        "--stream_layout",
        action="store_true",
        help="quantised weights also in the Mosaic GPU streaming kernel's layout",
    )
    p.add_argument(
        "--paths",
        default="default",
        help=f"comma list of {', '.join(PATHS)}: the quantised weights' matmul paths (model.quant.MatmulOptions), "
        "each a run of its own in this process",
    )
    p.add_argument(
        "--gemv_configs",
        default="",
        help="a benchmarks/gemv.py --sweep JSON: its best config per format replaces model.quant.GEMV_CONFIGS",
    )
    p.add_argument("--batches", default="1,64")
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--block_size", type=int, default=16)
    p.add_argument("--backend", default=None)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--no_attention",
        action="store_true",
        help="profiling aid: skip the attention kernels (KV still written) to isolate their cost",
    )
    p.add_argument("--trace_dir", default="", help="also trace one loop call per batch: per-step kernel breakdown")
    p.add_argument("--out", default="decode_llama.json")
    p.add_argument("--compilation_cache_dir", default=DEFAULT_COMPILATION_CACHE_DIR, help="'' disables it")
    a = p.parse_args()
    CacheConfig(block_size=a.block_size)  # the engine's checks of these options (ValueError names the option)
    RuntimeConfig(attention_backend=a.backend, compilation_cache_dir=a.compilation_cache_dir)
    enable_compilation_cache(a.compilation_cache_dir)
    if a.no_attention:  # both the fused and the unfused path still write the KV; only the kernel is skipped
        kv_module.PagedMeta._attend = lambda self, q, *pages, **kw: q
    batches = [int(x) for x in a.batches.split(",") if x]
    runs = []
    if a.gemv_configs:
        with open(a.gemv_configs) as f:
            quant.GEMV_CONFIGS.update(json.load(f)["best"])
        print(f"GEMV configs: {quant.GEMV_CONFIGS}", flush=True)
    if unknown := set(a.paths.split(",")) - set(PATHS):
        raise SystemExit(f"--paths: unknown {sorted(unknown)}; choose from {', '.join(PATHS)}")
    for fmt, kv, path in itertools.product(a.formats.split(","), a.kv_cache_dtypes.split(","), a.paths.split(",")):
        if fmt == "bf16" and path != a.paths.split(",")[0]:
            continue  # bf16 weights take the same paths under every option
        args = (a.preset, batches, a.ctx, a.steps, a.block_size, a.backend, a.repeats)
        kw = dict(fmt=fmt, kv_cache_dtype=kv, concurrency_context=a.concurrency_context, stream_layout=a.stream_layout)
        kw["trace_dir"] = a.trace_dir and f"{a.trace_dir}/{fmt}_{kv}_{path}"
        try:
            runs.append(bench(*args, **kw, path=path) | {"path": path})
        except Exception as e:  # noqa: BLE001 (recorded and printed: the other formats and paths still run)
            print(f"{a.preset} {fmt} {path} kv={kv}: Error {type(e).__name__}: {str(e)[:400]}", flush=True)
            runs.append({"format": fmt, "path": path, "kv_cache_dtype": kv, "error": f"{type(e).__name__}: {e}"[:2000]})
        with open(a.out, "w") as f:  # rewritten after each run: a run cut short keeps what it finished
            json.dump(runs[0] if len(runs) == 1 else {"runs": runs}, f, indent=2)


if __name__ == "__main__":
    main()
