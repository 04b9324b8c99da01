"""The engine's latency figures that no other script measures: where a decode step's time goes on the device, time
to first token on an idle engine, long-context prefill, and inter-token latency under load.

    PYTHONPATH=. python benchmarks/engine_latency.py --what profile,ttft,itl_load --compilation_cache_dir /tmp/jax_cc
    PYTHONPATH=. python benchmarks/engine_latency.py --what long --compilation_cache_dir /tmp/jax_cc
    PYTHONPATH=. python benchmarks/engine_latency.py --what profile,ttft,long,itl_load --preset tiny   # CPU, seconds

Random weights at --preset shape (Llama-3-8B by default), bf16. The modes given together share the model and one
engine (max_num_seqs 256, max_num_batched_tokens 8192 at 8B), warmed up front with the host jits its warm-up misses
(prime_host_jits), so no mode compiles while timed (each mode's `compiles_during_mode` row says so):

- profile: for each batch in --batches, that many requests decode (ignore_eos); once every row is inside the
  multi-step decode loop, a JAX profiler trace covers --profile_loops loops. The device's kernels
  (benchmarks/engine_core.py device_spans) are summarised per decode step into attention (Pallas paged / ragged),
  matmul (cuBLAS / XLA gemm / our Pallas matmuls), elementwise (XLA fusions: norms, RoPE, sampling), copy
  (copies, memsets, the KV page scatters), other, and host gap (device idle inside the traced span): ms per step
  and % of the span, and the top kernels. Steps are counted from the trace (attention launches / layers).
- ttft: one request at a time on an idle warm engine, a --prompt_len prompt, max_tokens 1: time from add_request
  to the step that returns its token, median of --reps after --warmups, with the Pallas kernels and with
  attention_backend xla (a second engine); beside it the runner's forward of the prompt alone (one step, no
  scheduling, no sampling), so the engine's overhead is the difference.
- long: a prompt of each --long_lengths prefilled with max_tokens 1 through the engine's Pallas ragged kernel,
  chunked as the engine schedules it (max_num_batched_tokens --long_chunk) and in one piece (the token budget
  holding the whole prompt), next to the XLA attention path: the model over a contiguous KV cache with plain
  masked attention (model/kv.py ContiguousMeta: the [T, T] scores are materialised: the baseline), where
  running out of device memory is reported as "OOM". --long_backends xla_paged adds the engine's own XLA backend
  (the ragged kernel's float32 reference, gathering every query chunk's pages: slow at 32k). The mode's engines
  (max_num_seqs 1, a pool of one longest sequence) and forwards are compiled up front, in parallel threads.
- itl_load: peak output tokens/s of a closed burst of max_num_seqs requests (--input_len / --output_len), or --peak;
  then Poisson arrivals at --load x peak / output_len requests/s for --duration s, driven by the engine's own step
  loop in this process (no HTTP); and one request alone (idle). Per request, every delivery's time and token count:
  ITL per delivery (the gap between deliveries) and per token (the gap / the tokens it carried, counted once per
  token). A multi-step loop delivers decode_steps tokens at once; the goal (p99 at load < 2x idle) is read on the
  per-token figure, the spacing of tokens a streaming client receives. Only deliveries from --ramp_fraction x
  --duration s (the load has built up) to --duration s (the last arrival) count.

Every mode has a wall-clock bound (--time_limit per mode); a row is printed (one `engine_latency ...` summary line, then
the JSON) and appended to --out (JSON lines) as soon as it ends.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.engine_core import device_spans, timeline
from checkpoints.tokenizer import NullTokenizer
from model import kv as kv_module
from model.config import ModelConfig
from model.transformer import random_model
from serving.config import EngineConfig
from serving.core.request import SamplingParams
from serving.engine.engine import LLMEngine
from serving.engine.llm import enable_compilation_cache
from serving.engine.runner import RowInput

MODES = ("profile", "ttft", "long", "itl_load")
SMALL_PRESETS = ("tiny", "tiny_moe", "smollm2_135m", "gemma3_270m")

# Sizes per preset family: the serving figures' at real shapes, and a few tokens for the CPU test presets. Flags override.
SIZES = {
    "full": dict(
        batches="1,64,256",
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        profile_input=512,
        profile_loops=6,
        prompt_len=1000,
        warmups=3,
        reps=20,
        long_lengths="8192,16384,32768",
        long_chunk=8192,
        long_reps=2,
        input_len=512,
        output_len=256,
        duration=20.0,
        time_limit=150.0,
    ),
    "small": dict(
        batches="1,4",
        max_num_seqs=8,
        max_num_batched_tokens=128,
        profile_input=16,
        profile_loops=2,
        prompt_len=40,
        warmups=1,
        reps=3,
        long_lengths="64,128",
        long_chunk=64,
        long_reps=1,
        input_len=16,
        output_len=24,  # above decode_steps: the multi-step loop runs
        duration=1.5,
        time_limit=60.0,
    ),
}

# Kernel name -> category, first match wins (lower-cased substrings). Our Pallas kernels are named in their
# pallas_call (pallas_kernels/*.py: paged_decode_*, ragged_paged_*, flash_attention_*, qmm_*); XLA's are named
# after their fusion (gemm_fusion_* is a Triton GEMM, so matmul is tried before the fusions); cuBLAS kernels
# carry gemm / gemv / nvjet / xmma / cutlass.
CATEGORIES = (
    ("rope_kv", ("rope_kv_write",)),  # pallas_kernels/rope_kv_write.py: RoPE + the KV-page write in one kernel
    ("attention", ("paged_decode", "ragged_paged", "flash_attention", "attention", "fmha", "flash_fwd")),
    # Mosaic GPU's pallas_call drops the kernel's name: in a decode step its only kernels are the streaming and
    # W8A8 matmuls (pallas_kernels/stream_matmul_mgpu.py, w8a8_matmul.py), seen as anonymous_mosaic_gpu_kernel.
    (
        "matmul",
        ("gemm", "gemv", "nvjet", "cublas", "cutlass", "xmma", "matmul", "qmm_", "w8a8", "splitk", "dot", "mosaic_gpu"),
    ),
    ("elementwise", ("act_quant", "fake_quant")),  # pallas_kernels/act_quant.py: W8A8 activation (fake) quantiser
    ("copy", ("memcpy", "memset", "copy", "dynamic_update_slice", "dynamic-update-slice", "scatter", "transpose")),
    (
        "elementwise",
        tuple(
            "fusion reduce convert broadcast sort select iota concatenate slice gather softmax topk "
            "argmax exp rsqrt add multiply compare pad".split()
        ),
    ),
)
STEP_KERNELS = ("paged_decode", "ragged_paged")  # launched once per layer per step: they count the steps


def category(name: str) -> str:
    """The CATEGORIES bucket of a device event's name ("other" when none matches)."""
    low = name.lower()
    return next((cat for cat, keys in CATEGORIES if any(k in low for k in keys)), "other")


def step_profile(path: str, spans: list, num_layers: int, engine_steps: int, top: int = 10) -> dict:
    """Per decode step: device ms and % of the traced span per category, the host gap, and the top kernels.

    Steps are the trace's own (STEP_KERNELS launches / num_layers) when it has them, else `engine_steps`. Category
    times sum event durations (events on concurrent streams each count); the host gap is the span minus the union
    of all events, so categories + host gap exceed 100% only where streams overlap.
    """
    t = timeline(path, spans, top=3)
    if not spans:
        return t | dict(steps=engine_steps, steps_from="engine", per_step_ms={}, pct_of_span={}, top_kernels=[])
    launches = sum(1 for _, _, n in spans if n.lower().startswith(STEP_KERNELS))
    steps, source = (launches / num_layers, "trace") if launches >= num_layers else (engine_steps, "engine")
    steps = max(steps, 1)
    span_us = t["span_ms"] * 1e3
    per_cat: dict[str, float] = {c: 0.0 for c, _ in CATEGORIES} | {"other": 0.0}
    per_name: dict[str, list] = {}
    for s, e, n in spans:
        per_cat[category(n)] += e - s
        entry = per_name.setdefault(n[:100], [0.0, 0])
        entry[0] += e - s
        entry[1] += 1
    per_cat["host_gap"] = span_us - t["busy_ms"] * 1e3
    kernels = sorted(per_name.items(), key=lambda x: -x[1][0])[:top]
    return t | dict(
        steps=round(steps, 2),
        steps_from=source,
        step_ms=round(span_us / 1e3 / steps, 4),
        per_step_ms={c: round(v / 1e3 / steps, 4) for c, v in per_cat.items()},
        pct_of_span={c: round(100 * v / span_us, 2) for c, v in per_cat.items()},
        top_kernels=[
            dict(
                name=n,
                category=category(n),
                ms_per_step=round(v / 1e3 / steps, 4),
                launches_per_step=round(k / steps, 2),
                pct_of_span=round(100 * v / span_us, 2),
            )
            for n, (v, k) in kernels
        ],
    )


# Engines ---------------------------------------------------------------------------------------------------------


def _max_len(a) -> int:
    """The shared engine's max_model_len: the longest request of the modes it serves, in whole blocks."""
    need = max(a.profile_input + a.profile_output, a.input_len + a.output_len, a.prompt_len + 1)
    return -(-(need + a.block_size) // a.block_size) * a.block_size


def _engine(model, a, **overrides) -> LLMEngine:
    max_len = _max_len(a)
    opts = dict(
        max_model_len=max_len,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        block_size=a.block_size,
        num_kv_blocks=1 + a.max_num_seqs * (max_len // a.block_size),  # every row at its longest: no preemption
        decode_steps=a.decode_steps,
        max_prefill_tokens_while_decoding=a.max_prefill_tokens_while_decoding,
        enable_prefix_caching=False,  # repeated prompts must be computed again, not found in the cache
        warmup=False,
        compilation_cache_dir=a.compilation_cache_dir,
        async_scheduling=a.async_scheduling == "on",
        quantization=a.quantization or None,
        kv_cache_dtype=a.kv_cache_dtype,
        quantized_stream_layout=a.stream_layout,
    )
    opts.update(overrides)
    return LLMEngine(model, NullTokenizer(), EngineConfig.from_kwargs(**opts))


def prime_host_jits(engine: LLMEngine) -> None:
    """Compiles the small host-dispatched jits of a step or loop that LLMEngine.warmup leaves for first use.

    warmup() calls the sampler with uncommitted zeros and without num_logprobs, while a step passes `take_rows`'s
    mesh-placed logits and num_logprobs=0: another jit signature, so each row bucket's 128k-vocabulary sampler
    compiles again the first time serving meets it, in the middle of a timed run. The runner's `chain_tokens`
    compiles per (previous loop's rows, next loop's rows) bucket pair at the first such chain; a CPU's warm-up
    skips `take_rows`. Here each runs once per bucket (pair) as serving calls it: on the logits of real steps
    (a decode step per row bucket, one mixed step) and the tokens of real loops, on free pages of the idle engine.
    """
    from model.sampling import SamplingTensors
    from serving.core.request import Request
    from serving.engine import runner as runner_module

    runner, k, buckets = engine.runner, engine.config.decode_steps, engine.runner.decode_buckets
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, seed=0)
    reqs = [Request(f"prime-{i}", [1], params, eos_token_ids=engine.eos_token_ids) for i in range(buckets[-1])]
    steps = [[RowInput([7], 0, [1 + i]) for i in range(b)] for b in buckets] + [[RowInput([7, 8], 0, [1])]]
    for rows in steps:  # decode-only steps return [rows, V] logits, a mixed step [max_num_seqs, V]
        logits = runner.forward(rows)
        for s in (s for s in buckets if s <= logits.shape[0]):
            engine.sampler.sample(logits, reqs[:s])  # take_rows (logits shape, s) and the sampler of bucket s
    for b in buckets:
        rows = [RowInput([7], 0, [1 + i]) for i in range(b)]
        loop = runner.decode_loop(rows, k, SamplingTensors.from_rows([{}] * b), np.full((k, b, 1), -1, np.int32))
        for s in (s for s in buckets if s <= b):  # a chain keeps the rows still running: at most as many
            zeros = np.zeros(s, np.int32)
            runner_module.chain_tokens(loop.tokens, jnp.asarray(zeros - 1), jnp.asarray(zeros), zeros)
        loop.fetch()


def _prompt(rng, vocab: int, n: int) -> list[int]:
    return rng.integers(100, vocab, n).tolist()


def _drain(engine: LLMEngine, rids) -> None:
    for r in rids:
        engine.abort(r)
    engine.step()  # applies a loop still in flight
    if engine.has_unfinished():
        raise RuntimeError("the engine still has requests after aborting all of them")


# profile ---------------------------------------------------------------------------------------------------------


def profile(engine: LLMEngine, model, a, emit) -> None:
    for b in a.batch_list:
        emit(_profile_batch(engine, model, a, b))


def _profile_batch(engine: LLMEngine, model, a, batch: int) -> dict:
    rng = np.random.default_rng(batch)
    params = SamplingParams(max_tokens=a.profile_output, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(_prompt(rng, model.cfg.vocab_size, a.profile_input), params) for _ in range(batch)]
    seen = {r: 0 for r in rids}
    trace_dir = f"{a.trace_dir}/batch{batch}"
    traced, t0, loops0, deadline = False, 0.0, 0, time.perf_counter() + a.time_limit
    while engine.has_unfinished() and time.perf_counter() < deadline:
        for o in engine.step():
            seen[o.request_id] += bool(o.new_token_ids)
        if not traced and min(seen.values()) >= 2:  # every row decodes inside the loop now
            if not a.no_trace:
                jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
            traced, t0, loops0 = True, time.perf_counter(), engine.num_decode_loops
        if traced and engine.num_decode_loops - loops0 >= a.profile_loops:
            break
    loops = engine.num_decode_loops - loops0 if traced else 0
    wall = 0.0
    if traced:
        jax.block_until_ready(engine.runner.kv_cache)  # the loop in flight ends inside the trace
        wall = time.perf_counter() - t0
        if not a.no_trace:
            jax.profiler.stop_trace()
    _drain(engine, rids)
    row = dict(what="profile", batch=batch, input_len=a.profile_input, decode_steps=a.decode_steps, loops=loops)
    if not traced:
        return row | dict(error=f"the rows never all reached the decode loop within {a.time_limit} s")
    row |= dict(wall_ms_per_step=1e3 * wall / max(1, loops * a.decode_steps), traced=not a.no_trace)
    row |= dict(async_scheduling=a.async_scheduling, chained_loops=engine.loops.num_chained)
    if a.no_trace:
        return row
    return row | step_profile(*device_spans(trace_dir), model.cfg.num_layers, loops * a.decode_steps)


# ttft ------------------------------------------------------------------------------------------------------------


def ttft(engine: LLMEngine, model, a, emit) -> None:
    for backend in a.ttft_backend_list:
        if backend == "pallas":
            emit(_ttft(engine, model, a, "pallas"))
            continue
        # A second engine: only the prompt's one step compiles (lazily); a small pool beside the first one's.
        other = _engine(model, a, attention_backend=backend, num_kv_blocks=2 + _max_len(a) // a.block_size)
        emit(_ttft(other, model, a, backend))
        del other
        gc.collect()


def _ttft(engine: LLMEngine, model, a, backend: str) -> dict:
    rng = np.random.default_rng(7)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times, deadline = [], time.perf_counter() + a.time_limit
    for i in range(a.warmups + a.reps):
        if time.perf_counter() > deadline:
            break
        prompt = _prompt(rng, model.cfg.vocab_size, a.prompt_len)
        t0 = time.perf_counter()
        rid = engine.add_request(prompt, params)
        got = False
        while not got and engine.has_unfinished():
            got = any(o.request_id == rid and o.new_token_ids for o in engine.step())
        if i >= a.warmups:
            times.append(time.perf_counter() - t0)
        _drain(engine, [rid])
    # The forward alone: the runner's one step over the prompt at pages 1.., on the idle engine's free pool.
    runner = engine.runner
    row = RowInput(
        _prompt(rng, model.cfg.vocab_size, a.prompt_len), 0, list(range(1, 1 + -(-a.prompt_len // runner.block_size)))
    )
    fwd = []
    for i in range(a.warmups + a.reps):
        t0 = time.perf_counter()
        jax.block_until_ready(runner.forward([row]))
        if i >= a.warmups:
            fwd.append(time.perf_counter() - t0)
    out = dict(what="ttft", backend=backend, prompt_len=a.prompt_len, reps=len(times))
    if not times:
        return out | dict(error=f"no timed request within {a.time_limit} s")
    p50, f50 = float(np.median(times)), float(np.median(fwd))
    return out | dict(
        ttft_p50_ms=1e3 * p50,
        ttft_min_ms=1e3 * min(times),
        ttft_p90_ms=1e3 * float(np.percentile(times, 90)),
        runner_prefill_p50_ms=1e3 * f50,
        runner_prefill_min_ms=1e3 * min(fwd),
        engine_overhead_ms=1e3 * (p50 - f50),
        prefill_tflops=2 * model.cfg.num_params() * a.prompt_len / f50 / 1e12,  # 2 x params x tokens: no attention
        goal_ms=30.0,
    )


# long ------------------------------------------------------------------------------------------------------------


def _is_oom(e: Exception) -> bool:
    msg = str(e)
    return "RESOURCE_EXHAUSTED" in msg or any(k in msg.lower() for k in ("out of memory", "resource exhausted"))


def _engine_prefill_ms(engine: LLMEngine, prompt: list[int], reps: int) -> tuple[float, int]:
    """(median milliseconds from add_request to the prompt's first token over `reps` requests of max_tokens 1,
    engine steps the prefill took)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    out, steps = [], 0
    for _ in range(reps):
        t0 = time.perf_counter()
        rid = engine.add_request(prompt, params)
        steps0, got = engine.num_steps, False
        while not got and engine.has_unfinished():
            got = any(o.request_id == rid and o.new_token_ids for o in engine.step())
        out.append(1e3 * (time.perf_counter() - t0))
        steps = engine.num_steps - steps0
        _drain(engine, [rid])
    return float(np.median(out)), steps


def _contiguous_prefill(model, length: int):
    """The XLA attention path: (lowered forward of `length` tokens over a zeroed contiguous KV cache with plain
    masked attention, model/kv.py ContiguousMeta, logits at the last token only; the state it takes)."""
    from flax import nnx

    from model.kv import ContiguousMeta, init_contiguous_cache

    cfg = model.cfg
    graphdef, state = nnx.split(model)

    def run(state, tokens_bt):
        m = nnx.merge(graphdef, state)
        caches = init_contiguous_cache(cfg.num_layers, 1, length, cfg.num_kv_heads, cfg.head_dim, m.dtype)
        positions = jnp.arange(length, dtype=jnp.int32)[None]
        logits, _ = m(tokens_bt, positions, caches, ContiguousMeta(), jnp.full((1, 1), length - 1, jnp.int32))
        return logits

    return jax.jit(run).lower(state, jax.ShapeDtypeStruct((1, length), jnp.int32)), state


def _compile_all(jobs: dict) -> dict:
    """{tag: () -> jax Lowered} -> {tag: compiled executable, or the exception lowering or compiling raised}:
    lowered one by one (tracing holds the GIL), compiled in parallel threads as ModelRunner.warmup does; lazily
    the 8B steps would compile one after another."""
    import concurrent.futures

    lowered, out = {}, {}
    for tag, lower in jobs.items():
        try:
            lowered[tag] = lower()
        except Exception as e:  # noqa: BLE001 - the caller reports it (an OOM) or raises it
            out[tag] = e
    threads = max(1, min(len(lowered), (os.cpu_count() or 2) // 2))
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        futures = {pool.submit(low.compile): tag for tag, low in lowered.items()}
        for f in concurrent.futures.as_completed(futures):
            try:
                out[futures[f]] = f.result()
            except Exception as e:  # noqa: BLE001
                out[futures[f]] = e
    return out


def _prefill_jobs(engine: LLMEngine, lengths, budget: int) -> dict:
    """{step key: lowering} of the ragged steps the engine's prefill of each length takes (chunks of `budget`)."""
    runner, bs = engine.runner, engine.config.block_size
    chunks = {(min(budget, n - i), i) for n in lengths for i in range(0, n, budget)}  # (tokens, start)
    keys = {
        (
            "step",
            next(b for b in runner.token_buckets if b >= size),
            runner.max_num_seqs,
            next(w for w in runner.width_buckets if w * bs >= start + size),  # the table covers the chunk's end
        )
        for size, start in chunks
    }
    plan = runner.warmup_plan(widths=sorted({k[3] for k in keys}))
    return {k: (lambda b=b, args=args: b().lower(*args)) for k, b, args in plan if k[:4] in keys and not k[4]}


def long(model, a, emit) -> None:
    rng = np.random.default_rng(11)
    lengths = a.long_length_list
    max_len = -(-(max(lengths) + a.block_size) // a.block_size) * a.block_size
    pool = 2 + max_len // a.block_size  # one sequence at the longest, and the null page
    kw = dict(max_model_len=max_len, max_num_seqs=1, num_kv_blocks=pool)
    prompts = {n: _prompt(rng, model.cfg.vocab_size, n) for n in lengths}
    table: dict[int, dict] = {n: dict(length=n) for n in lengths}

    def record(n: int, path: str, result, **extra) -> None:
        table[n][path] = result
        emit(dict(what="long", length=n, path=path, ms=result) | extra)

    deadline = time.perf_counter() + a.time_limit
    engines, jobs, states = {}, {}, {}
    if "pallas" in a.long_backend_list:  # one piece: only lengths past one chunk (a chunk is one piece already)
        for name, budget, todo in (
            ("pallas_chunked", a.long_chunk, lengths),
            ("pallas_one_piece", max(lengths), [n for n in lengths if n > a.long_chunk]),
        ):
            if todo:
                engines[name] = (_engine(model, a, max_num_batched_tokens=budget, **kw), budget, todo)
                jobs |= {(name, k): low for k, low in _prefill_jobs(engines[name][0], todo, budget).items()}
    if "xla_contiguous" in a.long_backend_list:
        for n in lengths:
            jobs[("xla_contiguous", n)] = lambda n=n: states.setdefault(n, _contiguous_prefill(model, n))[0]
    t0 = time.perf_counter()
    compiled = _compile_all(jobs)
    emit(dict(what="long_compile", executables=len(jobs), wall_s=time.perf_counter() - t0))
    for (name, key), exe in compiled.items():
        if name in engines and not isinstance(exe, Exception):
            engines[name][0].runner.keep(key, exe)  # ModelRunner.warmup's bookkeeping, for these buckets only
    for name, (engine, budget, todo) in engines.items():
        broken = False
        for n in todo:
            if broken or time.perf_counter() > deadline:
                record(n, name, "skipped after OOM" if broken else "time limit")
                continue
            try:
                first, _ = _engine_prefill_ms(engine, prompts[n], 1)  # whatever compiling is left happens here
                ms, steps = _engine_prefill_ms(engine, prompts[n], a.long_reps)
            except Exception as e:  # noqa: BLE001 - an OOM is the figure; anything else is raised
                if not _is_oom(e):
                    raise
                record(n, name, "OOM", error=str(e).splitlines()[0][:200])
                broken = True  # the failed step had the KV pool donated: this engine is done
                continue
            speed = n / ms * 1e3
            record(n, name, ms, first_call_ms=first, engine_steps=steps, prompt_tokens_per_s=speed, budget=budget)
    engines.clear()
    gc.collect()
    if "xla_paged" in a.long_backend_list:  # the engine's own XLA backend (the ragged kernel's reference), lazily
        engine, broken = _engine(model, a, max_num_batched_tokens=a.long_chunk, attention_backend="xla", **kw), False
        for n in lengths:
            if broken or time.perf_counter() > deadline:
                record(n, "xla_paged_chunked", "skipped after OOM" if broken else "time limit")
                continue
            try:
                _engine_prefill_ms(engine, prompts[n], 1)
                ms, steps = _engine_prefill_ms(engine, prompts[n], a.long_reps)
                record(n, "xla_paged_chunked", ms, engine_steps=steps)
            except Exception as e:  # noqa: BLE001
                if not _is_oom(e):
                    raise
                record(n, "xla_paged_chunked", "OOM", error=str(e).splitlines()[0][:200])
                broken = True
        del engine
        gc.collect()
    for n in lengths if "xla_contiguous" in a.long_backend_list else ():  # longest last: an OOM keeps the rest
        exe = compiled[("xla_contiguous", n)]
        if time.perf_counter() > deadline:
            record(n, "xla_contiguous", "time limit")
            continue
        try:
            if isinstance(exe, Exception):
                raise exe
            state, tokens = states[n][1], jnp.asarray([prompts[n]], jnp.int32)
            t0 = time.perf_counter()
            jax.block_until_ready(exe(state, tokens))
            first = 1e3 * (time.perf_counter() - t0)
            times = []
            for _ in range(a.long_reps):
                t0 = time.perf_counter()
                jax.block_until_ready(exe(state, tokens))
                times.append(1e3 * (time.perf_counter() - t0))
        except Exception as e:  # noqa: BLE001
            if not _is_oom(e):
                raise
            record(n, "xla_contiguous", "OOM", error=str(e).splitlines()[0][:200])
            gc.collect()
            continue
        record(n, "xla_contiguous", float(np.median(times)), first_call_ms=first)
    for n in lengths:
        t = table[n]
        best = t.get("pallas_one_piece", t.get("pallas_chunked"))
        xla = t.get("xla_contiguous")
        if isinstance(best, float) and isinstance(xla, float):
            t["pallas_vs_xla_time"] = best / xla  # a "-56%" prefill time is 1 - this
    emit(dict(what="long_summary", chunk=a.long_chunk, rows=list(table.values())))


# itl_load --------------------------------------------------------------------------------------------------------


def _drive(engine: LLMEngine, arrivals, params: SamplingParams, limit: float):
    """Adds each (offset s, prompt) once its time has come, between engine steps, until every request ends or
    `limit` s pass. Returns ({rid: (arrival offset, [(delivery offset, tokens)])}, wall s, cut, mean running)."""
    pending, recs, running = deque(arrivals), {}, []
    start, cut = time.perf_counter(), False
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        if now > limit:
            cut = True
            break
        while pending and pending[0][0] <= now:
            at, prompt = pending.popleft()
            recs[engine.add_request(prompt, params)] = (at, [])
        if not engine.has_unfinished():
            time.sleep(min(max(0.0, pending[0][0] - now), 0.01))
            continue
        running.append(len(engine.scheduler.running))
        outs = engine.step()
        t = time.perf_counter() - start
        for o in outs:
            if o.new_token_ids and o.request_id in recs:
                recs[o.request_id][1].append((t, len(o.new_token_ids)))
    wall = time.perf_counter() - start
    _drain(engine, list(recs))
    return recs, wall, cut, float(np.mean(running)) if running else 0.0


def _itl_stats(recs: dict, lo: float, hi: float) -> dict:
    """ITL per delivery and per token (each token of a delivery gets gap / its tokens) over the deliveries made in
    [lo, hi] s (the load's window), and the time to first token (from the scheduled arrival) of the requests that
    arrived in it."""
    gaps, per_token, ttft_s, sizes = [], [], [], []
    n_req = 0
    for at, d in recs.values():
        if lo <= at <= hi:
            n_req += 1
            if d:
                ttft_s.append(d[0][0] - at)
        for (t0, _), (t1, n) in zip(d, d[1:]):
            if not lo <= t1 <= hi:
                continue
            gaps.append(t1 - t0)
            per_token += [(t1 - t0) / n] * n
            sizes.append(n)
    if not gaps:
        return dict(requests=n_req, deliveries=0)
    pct = lambda x, q: 1e3 * float(np.percentile(x, q))  # noqa: E731
    return dict(
        requests=n_req,
        deliveries=len(gaps),
        tokens_per_delivery=float(np.mean(sizes)),
        itl_delivery_p50_ms=pct(gaps, 50),
        itl_delivery_p99_ms=pct(gaps, 99),
        itl_token_p50_ms=pct(per_token, 50),
        itl_token_p99_ms=pct(per_token, 99),
        ttft_p50_ms=pct(ttft_s, 50) if ttft_s else None,
        ttft_p99_ms=pct(ttft_s, 99) if ttft_s else None,
    )


def itl_load(engine: LLMEngine, model, a, emit) -> None:
    rng = np.random.default_rng(3)
    vocab = model.cfg.vocab_size
    params = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True)
    limit = a.duration + a.time_limit
    idle_recs = {}
    for i in range(1 + a.idle_requests):  # one request alone, one after another; the first is not counted
        recs, _, _, _ = _drive(engine, [(0.0, _prompt(rng, vocab, a.input_len))], params, a.time_limit)
        idle_recs.update(recs if i else {})
    idle = _itl_stats(idle_recs, 0.0, float("inf"))
    emit(dict(what="itl_idle", input_len=a.input_len, output_len=a.output_len) | idle)
    peak, burst = a.peak, {}
    if not peak:  # a closed burst: max_num_seqs requests at once, output tokens over the wall time
        arrivals = [(0.0, _prompt(rng, vocab, a.input_len)) for _ in range(a.max_num_seqs)]
        if not a.warmed:  # the buckets the burst needs compile in an untimed burst first
            _drive(engine, arrivals, params, a.time_limit)
        recs, wall, cut, running = _drive(engine, arrivals, params, a.time_limit)
        tokens = sum(n for _, d in recs.values() for _, n in d)
        peak = tokens / wall
        burst = dict(burst_requests=len(arrivals), burst_wall_s=wall, burst_cut=cut, burst_mean_running=running)
        emit(dict(what="itl_peak", peak_output_tokens_per_s=peak) | burst)
    rate = a.load * peak / a.output_len
    offsets, t = [], float(rng.exponential(1 / rate))
    while t < a.duration:
        offsets.append(t)
        t += float(rng.exponential(1 / rate))
    arrivals = [(t, _prompt(rng, vocab, a.input_len)) for t in offsets]
    recs, wall, cut, running = _drive(engine, arrivals, params, limit)
    lo = a.ramp_fraction * a.duration
    load = _itl_stats(recs, lo, a.duration)
    delivered = sum(n for _, d in recs.values() for t, n in d if lo <= t <= a.duration)
    ratio = {}
    for key in ("itl_token_p99_ms", "itl_delivery_p99_ms", "itl_token_p50_ms"):
        if load.get(key) and idle.get(key):
            ratio[key.replace("_ms", "_load_over_idle")] = load[key] / idle[key]
    emit(
        dict(
            what="itl_load",
            input_len=a.input_len,
            output_len=a.output_len,
            decode_steps=a.decode_steps,
            max_prefill_tokens_while_decoding=a.max_prefill_tokens_while_decoding,
            load=a.load,
            peak_output_tokens_per_s=peak,
            arrival_rate_rps=rate,
            arrivals=len(arrivals),
            duration_s=a.duration,
            wall_s=wall,
            cut=cut,
            mean_running=running,
            output_tokens_per_s_in_window=delivered / max(a.duration - lo, 1e-9),
            window_s=[lo, a.duration],
            load_stats=load,
            idle_stats=idle,
            goal_metric="itl_token_p99_load_over_idle < 2 (per token: delivery gap / tokens it carried)",
        )
        | ratio
    )


# main ------------------------------------------------------------------------------------------------------------


def _summary(r: dict) -> str:
    w = r["what"]
    if w == "profile" and not r.get("traced", True):
        return (
            f"profile batch {r['batch']} untraced: {r['wall_ms_per_step']:.3f} ms/step (async {r['async_scheduling']})"
        )
    if w == "profile" and r.get("per_step_ms"):
        cats = " ".join(f"{c} {v:.3f} ({r['pct_of_span'][c]:.0f}%)" for c, v in r["per_step_ms"].items())
        return f"profile batch {r['batch']}: {r['step_ms']:.3f} ms/step ({r['steps']} steps traced): {cats}"
    if w == "ttft" and "ttft_p50_ms" in r:
        head = f"ttft {r['backend']} {r['prompt_len']} tokens: p50 {r['ttft_p50_ms']:.1f} ms"
        return f"{head} (runner prefill {r['runner_prefill_p50_ms']:.1f} ms, overhead {r['engine_overhead_ms']:.1f} ms)"
    if w == "long":
        ms = r["ms"]
        return f"long {r['length']} {r['path']}: " + (f"{ms:.1f} ms" if isinstance(ms, float) else ms)
    if w == "long_summary":
        cell = lambda v: f"{v:.1f}" if isinstance(v, float) else str(v)  # noqa: E731
        paths = ("pallas_chunked", "pallas_one_piece", "xla_contiguous", "xla_paged_chunked")
        return "long ms: " + "; ".join(
            f"{t['length']}: " + ", ".join(f"{k} {cell(t[k])}" for k in paths if k in t) for t in r["rows"]
        )
    if w == "itl_load":
        s, i = r["load_stats"], r["idle_stats"]
        ratio = r.get("itl_token_p99_load_over_idle", float("nan"))
        tok = f"per-token p99 {s.get('itl_token_p99_ms', 0):.2f} ms vs idle {i.get('itl_token_p99_ms', 0):.2f}"
        dlv = f"per-delivery p99 {s.get('itl_delivery_p99_ms', 0):.1f} vs {i.get('itl_delivery_p99_ms', 0):.1f} ms"
        return f"itl_load at {r['load']}x peak {r['peak_output_tokens_per_s']:.0f} tok/s: {tok} (x{ratio:.2f}); {dlv}"
    return f"{w}: " + json.dumps({k: v for k, v in r.items() if not isinstance(v, (list, dict))})[:300]


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--what", required=True, help=f"comma-separated, from {', '.join(MODES)}; run in that order")
    p.add_argument("--preset", default="llama3_8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", default="engine_latency.jsonl", help="JSON lines, appended as each row ends")
    p.add_argument("--compilation_cache_dir", default="", help="persistent compilation cache ('' disables it)")
    p.add_argument("--warmup", choices=("auto", "on", "off"), default="auto", help="auto: on unless on a CPU")
    p.add_argument("--block_size", type=int, default=16)
    p.add_argument("--decode_steps", type=int, default=8)
    p.add_argument("--trace_dir", default="/tmp/engine_latency_trace")
    p.add_argument("--ttft_backends", default="pallas,xla", help="pallas (the engine's default kernels) and/or xla")
    p.add_argument("--long_backends", default="pallas,xla_contiguous", help="pallas, xla_contiguous, xla_paged")
    p.add_argument("--idle_requests", type=int, default=2)
    p.add_argument("--load", type=float, default=0.8, help="arrival rate as a fraction of peak output tokens/s")
    p.add_argument("--peak", type=float, default=0.0, help="peak output tokens/s (0: measure it with a burst)")
    p.add_argument("--ramp_fraction", type=float, default=0.25)
    p.add_argument(
        "--no_trace",
        action="store_true",
        help="profile: time the same loops without the profiler (its host overhead lengthens the gaps it measures)",
    )
    p.add_argument("--async_scheduling", choices=("on", "off"), default="on", help="the engine's chained loops")
    p.add_argument("--quantization", default="", help="a weight format of serving/engine/quantize.py ('' = none)")
    p.add_argument("--kv_cache_dtype", default="auto", help="auto, int8 or fp8")
    p.add_argument("--stream_layout", action="store_true", help="quantised weights also in the streaming layout")
    p.add_argument(
        "--fused_rope", choices=("on", "off"), default="on", help="RoPE + KV write as one kernel (model.kv) or XLA ops"
    )
    p.add_argument(
        "--max_prefill_tokens_while_decoding", type=int, default=0, help="the scheduler's cap (0: off, the default)"
    )
    for name, value in SIZES["full"].items():  # defaults by preset family (see SIZES)
        p.add_argument(f"--{name}", type=type(value), default=None)
    a = p.parse_args(argv)
    family = SIZES["small" if a.preset in SMALL_PRESETS else "full"]
    for name, value in family.items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    a.modes = [m.strip() for m in a.what.split(",") if m.strip()]
    bad = [m for m in a.modes if m not in MODES]
    if bad or not a.modes:
        p.error(f"--what: unknown mode(s) {bad}; choose from {', '.join(MODES)}")
    if a.no_trace and "profile" not in a.modes:
        p.error("--no_trace applies to --what profile only")
    a.batch_list = [int(x) for x in a.batches.split(",") if x]
    a.long_length_list = sorted(int(x) for x in a.long_lengths.split(",") if x)
    a.ttft_backend_list = [x for x in a.ttft_backends.split(",") if x]
    a.long_backend_list = [x for x in a.long_backends.split(",") if x]
    known = {"ttft_backends": ("pallas", "xla"), "long_backends": ("pallas", "xla_contiguous", "xla_paged")}
    for opt, values in (("ttft_backends", a.ttft_backend_list), ("long_backends", a.long_backend_list)):
        if not values or any(v not in known[opt] for v in values):
            p.error(f"--{opt}: {values} not all in {known[opt]}")
    if max(a.batch_list, default=1) > a.max_num_seqs:
        p.error(f"--batches {a.batches}: a batch above --max_num_seqs {a.max_num_seqs}")
    if not 0 < a.load <= 1.5 or not 0 <= a.ramp_fraction < 1:
        p.error("--load must be in (0, 1.5] and --ramp_fraction in [0, 1)")
    # Tokens a profiled request needs: two deliveries, the traced loops, one chained loop and margin, plus one per
    # prefill step after its own (rows prefilled first decode one token in each later mixed step).
    prefill_steps = -(-max(a.batch_list, default=1) * a.profile_input // a.max_num_batched_tokens)
    a.profile_output = (a.profile_loops + 6) * a.decode_steps + prefill_steps
    return a


def main(argv=None) -> None:
    a = _args(argv)
    kv_module.FUSE_ROPE_KV_WRITE = a.fused_rope == "on"
    enable_compilation_cache(a.compilation_cache_dir)
    cfg = ModelConfig.preset(a.preset)
    t0 = time.perf_counter()
    model = random_model(cfg, jnp.dtype(a.dtype))
    jax.block_until_ready(jax.tree.leaves(model)[0])
    common = dict(device=jax.devices()[0].device_kind, preset=a.preset, dtype=a.dtype, fused_rope=a.fused_rope)
    common |= dict(quantization=a.quantization or "none", kv_cache_dtype=a.kv_cache_dtype)

    def emit(row: dict) -> None:
        row = row | common
        print("engine_latency " + _summary(row), flush=True)
        print(json.dumps(row), flush=True)
        with open(a.out, "a") as f:
            f.write(json.dumps(row) + "\n")

    emit(dict(what="model", init_s=time.perf_counter() - t0, params=cfg.num_params()))
    engine = None
    if set(a.modes) - {"long"}:  # one engine for every mode but long (its context needs its own pool)
        t0 = time.perf_counter()
        engine = _engine(model, a)
        built, warmup_s, prime_s = time.perf_counter() - t0, None, None
        a.warmed = a.warmup == "on" or (a.warmup == "auto" and jax.default_backend() != "cpu")
        if a.warmed:
            t0 = time.perf_counter()
            engine.warmup()  # every bucket up front: no mode compiles while it is timed
            warmup_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            prime_host_jits(engine)  # without the warm-up everything compiles at first use anyway
            prime_s = time.perf_counter() - t0
        r = engine.runner
        sizes = dict(
            max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens, max_model_len=_max_len(a)
        )
        times = dict(build_s=built, warmup_s=warmup_s, prime_host_jits_s=prime_s)
        emit(dict(what="engine", executables=r.num_compiles, num_kv_blocks=r.num_blocks) | times | sizes)
    for mode in a.modes:
        t0 = time.perf_counter()
        compiles = engine.runner.num_compiles if engine is not None else 0
        try:
            if mode == "long":
                long(model, a, emit)
            else:
                {"profile": profile, "ttft": ttft, "itl_load": itl_load}[mode](engine, model, a, emit)
        except Exception as e:  # noqa: BLE001 - one mode's failure is recorded and the next mode still runs
            emit(dict(what=mode, error=f"{type(e).__name__}: {str(e)[:500]}"))
        extra = engine.runner.num_compiles - compiles if engine is not None else None
        emit(dict(what=f"{mode}_done", wall_s=time.perf_counter() - t0, compiles_during_mode=extra))


if __name__ == "__main__":
    main()
