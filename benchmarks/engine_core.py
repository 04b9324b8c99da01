"""Engine-core figures: start-up cold and warm, GPU idle between steps, and stream smoothness.

    PYTHONPATH=. python benchmarks/engine_core.py --what startup --cache_dir /tmp/xla_cache   # run twice: cold, warm
    PYTHONPATH=. python benchmarks/engine_core.py --what idle       # batch-64 decode, async scheduling off / on
    PYTHONPATH=. python benchmarks/engine_core.py --what itl        # inter-token delivery vs decode_steps
    PYTHONPATH=. python benchmarks/engine_core.py --what host --preset smollm2_135m   # host work per decode loop
    PYTHONPATH=. python benchmarks/engine_core.py --what trace      # idle from a profiler trace's device timeline

Random weights at --preset shape (Llama-3-8B by default), bf16. Idle: every request decodes (ignore_eos), the
window starts once all rows are in the decode loop; the device time of one loop is measured afterwards by
dispatching the same loop back to back, so idle = 1 - loops * loop_time / window wall time. ITL: the time
between consecutive deliveries of a request's tokens as `step()` hands them out (what a streaming client sees),
and output tokens/s, for each decode_steps. Host: cProfile over the idle run's window (async scheduling on): the host
seconds per decode loop that are not waits on the device, and the functions that take them. Prints JSON lines and
writes them to --out.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from checkpoints.tokenizer import NullTokenizer
from model.config import ModelConfig
from model.sampling import SamplingTensors
from model.transformer import random_model
from serving.config import EngineConfig
from serving.core.request import SamplingParams
from serving.engine.engine import LLMEngine
from serving.engine.llm import enable_compilation_cache
from serving.engine.runner import RowInput


def _engine(model, a, **overrides) -> LLMEngine:
    opts = dict(
        max_model_len=a.input_len + a.output_len + 64,
        max_num_seqs=a.batch,
        max_num_batched_tokens=max(a.batch * a.input_len, 256),
        enable_prefix_caching=False,
        warmup=False,
        compilation_cache_dir=a.cache_dir,
        num_kv_blocks=a.num_kv_blocks,
    )
    opts.update(overrides)
    return LLMEngine(model, NullTokenizer(), EngineConfig.from_kwargs(**opts))


def _run(engine: LLMEngine, a, vocab: int, seed: int = 0, trace_dir: str = ""):
    """Runs a.batch requests to the end; returns (deliveries per request, window start, window end, loops, the
    rows' mean context over the window)."""
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(rng.integers(100, vocab, a.input_len).tolist(), params) for _ in range(a.batch)]
    deliveries = {r: [] for r in rids}
    window = None
    loops0, done_start = 0, 0.0
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.new_token_ids:
                deliveries[o.request_id].append((now, len(o.new_token_ids)))
        if window is None and all(len(d) >= 2 for d in deliveries.values()):
            window, loops0 = now, engine.num_decode_loops
            done_start = np.mean([sum(n for _, n in d) for d in deliveries.values()])
            if trace_dir:
                jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
        if window is not None and any(
            len(d) and sum(n for _, n in d) >= a.output_len - 16 for d in deliveries.values()
        ):
            break  # the window ends before the first request nears its end (rows leaving would skew it)
    end, loops = time.perf_counter(), engine.num_decode_loops - loops0
    if trace_dir and window is not None:
        jax.profiler.stop_trace()
    done_end = np.mean([sum(n for _, n in d) for d in deliveries.values()])
    for r in rids:
        engine.abort(r)
    engine.step()  # drains a loop still in flight
    # The rows' mean context over the window: the isolated loop of _loop_time runs at it (attention grows with it).
    context = a.input_len + (done_start + done_end) / 2
    return deliveries, window, end, loops, int(context)


def _loop_time(engine: LLMEngine, a, context: int) -> float:
    """Device time of one decode loop over a.batch rows at `context` tokens each (dispatched back to back, one
    sync). The context must be the run's mean: the attention part of a step grows with it."""
    k = engine.config.decode_steps
    # Distinct pages per row, as in the run (rows sharing pages would hit L2 and understate the loop's time).
    width = -(-(context + k) // engine.runner.block_size)
    if 1 + a.batch * width > engine.runner.num_blocks:
        raise ValueError(f"the pool ({engine.runner.num_blocks} blocks) cannot give {a.batch} rows {width} pages")
    rows = [RowInput([7], context, list(range(1 + i * width, 1 + (i + 1) * width))) for i in range(a.batch)]
    st = SamplingTensors.from_rows([{}] * a.batch)
    banned = np.full((k, a.batch, 1), -1, np.int32)
    engine.runner.decode_loop(rows, k, st, banned).fetch()
    t0 = time.perf_counter()
    for _ in range(5):
        h = engine.runner.decode_loop(rows, k, st, banned)
    h.fetch()
    return (time.perf_counter() - t0) / 5


def startup(a, model) -> dict:
    t0 = time.perf_counter()
    engine = _engine(model, a, max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=2048)
    init = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.warmup()
    return dict(
        what="startup",
        engine_init_s=init,
        warmup_s=time.perf_counter() - t0,
        executables=engine.runner.num_compiles,
        cache_dir=a.cache_dir,
    )


def idle(a, model) -> list[dict]:
    out = []
    for overlap in (False, True):
        engine = _engine(model, a, async_scheduling=overlap)
        _run(engine, a, model.cfg.vocab_size)  # compiles what the run needs
        deliveries, start, end, loops, context = _run(engine, a, model.cfg.vocab_size, seed=1)
        t_loop = _loop_time(engine, a, context)
        busy = loops * t_loop
        out.append(
            dict(
                what="idle",
                async_scheduling=overlap,
                window_s=end - start,
                loops=loops,
                loop_device_s=t_loop,
                loop_context=context,
                gpu_idle_fraction=max(0.0, 1 - busy / (end - start)),
                chained=engine.loops.num_chained,
            )
        )
        del engine
    return out


_WAITS = ("numpy.asarray", "_value", "block_until_ready", "fetch", "acquire", "wait")


def host(a, model) -> list[dict]:
    """Host work per decode loop at batch a.batch: cProfile over a second run (the first compiles)."""
    import cProfile
    import pstats

    engine = _engine(model, a, async_scheduling=True)
    _run(engine, a, model.cfg.vocab_size)
    prof = cProfile.Profile()
    t0, loops0 = time.perf_counter(), engine.num_decode_loops
    prof.enable()
    _run(engine, a, model.cfg.vocab_size, seed=1)
    prof.disable()
    wall, loops = time.perf_counter() - t0, max(1, engine.num_decode_loops - loops0)
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
    own = sorted(((v[2], f"{k[0].split('/')[-1]}:{k[1]}({k[2]})") for k, v in stats.items()), reverse=True)
    waits = sum(t for t, name in own if any(w in name for w in _WAITS))
    total = sum(t for t, _ in own)
    top = [dict(fn=name, ms_per_loop=round(1e3 * t / loops, 3)) for t, name in own[:25]]
    return [
        dict(
            what="host",
            wall_s=wall,
            loops=loops,
            host_ms_per_loop=1e3 * (total - waits) / loops,
            wait_ms_per_loop=1e3 * waits / loops,
            top_own_time=top,
        )
    ]


# Lines of a device's process that xprof derives from the kernels (one event spans a whole module or HLO op, gaps
# included), not kernels themselves: counting them would hide the device's idle time.
DERIVED_LINES = ("XLA Modules", "XLA Ops", "Steps", "Framework", "Source", "TensorFlow", "XLA TraceMe", "Launch Stats")


def device_spans(trace_dir: str) -> tuple[str, list[tuple[float, float, str]]]:
    """(trace file, sorted (start us, end us, kernel name) of the device's kernel, copy and memset events) from the
    newest perfetto trace under trace_dir. Kernels are the events of a GPU process's stream lines; lines xprof
    derives from them (DERIVED_LINES) are left out."""
    import glob
    import gzip

    path = sorted(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True))[-1]
    with gzip.open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    gpu = {
        e["pid"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name" and "GPU" in e["args"].get("name", "")
    }
    derived = {
        (e["pid"], e.get("tid"))
        for e in events
        if e.get("ph") == "M"
        and e.get("name") == "thread_name"
        and e["pid"] in gpu
        and any(d in e["args"].get("name", "") for d in DERIVED_LINES)
    }
    spans = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0), e.get("name", ""))
        for e in events
        if e.get("ph") == "X" and e["pid"] in gpu and (e["pid"], e.get("tid")) not in derived
    )
    return path, spans


def device_timeline(trace_dir: str, top: int = 8) -> dict:
    """GPU busy time from a perfetto trace: the union of the device streams' events over their span, and the
    largest gaps with the events on either side (what the device waited between)."""
    return timeline(*device_spans(trace_dir), top=top)


def timeline(path: str, spans: list[tuple[float, float, str]], top: int = 8) -> dict:
    """device_timeline's figures from device_spans' events."""
    if not spans:
        return dict(trace=path, device_events=0)
    busy, gaps, (cur_s, cur_e, cur_n) = 0.0, [], spans[0]
    for s, e, n in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append((s - cur_e, cur_n, n))
            cur_s, cur_e, cur_n = s, e, n
        elif e > cur_e:
            cur_e, cur_n = e, n
    busy += cur_e - cur_s
    span = cur_e - spans[0][0]  # to the latest end (the last event to start may end before another)
    gaps.sort(reverse=True)
    by_name: dict[str, float] = {}
    for s, e, n in spans:  # device time per kernel name (stream overlap counted in each)
        by_name[n[:80]] = by_name.get(n[:80], 0.0) + e - s
    return dict(
        trace=path,
        device_events=len(spans),
        span_ms=span / 1e3,
        busy_ms=busy / 1e3,
        gpu_idle_fraction=1 - busy / span,
        gaps=len(gaps),
        gap_ms_total=sum(g for g, _, _ in gaps) / 1e3,
        largest_gaps=[dict(ms=round(g / 1e3, 3), after=b[:80], before=n[:80]) for g, b, n in gaps[:top]],
        top_kernels=[dict(name=n, ms=round(t / 1e3, 3)) for n, t in sorted(by_name.items(), key=lambda x: -x[1])[:top]],
    )


def trace(a, model) -> list[dict]:
    """The idle run (async on) with a profiler trace over its window; the device timeline says the idle."""
    engine = _engine(model, a, async_scheduling=True)
    _run(engine, a, model.cfg.vocab_size)
    trace_dir = a.trace_dir or "/tmp/engine_core_trace"
    _, start, end, loops, context = _run(engine, a, model.cfg.vocab_size, seed=1, trace_dir=trace_dir)
    return [dict(what="trace", window_s=end - start, loops=loops, loop_context=context) | device_timeline(trace_dir)]


def itl(a, model) -> list[dict]:
    out = []
    for k in (1, 2, 4, 8):
        engine = _engine(model, a, decode_steps=k)
        _run(engine, a, model.cfg.vocab_size)
        deliveries, start, end, _, _ = _run(engine, a, model.cfg.vocab_size, seed=1)
        gaps, per = [], []
        for d in deliveries.values():
            d = [x for x in d if start <= x[0] <= end]
            gaps += [t1 - t0 for (t0, _), (t1, _) in zip(d, d[1:])]
            per += [n for _, n in d]
        tokens = sum(per)
        out.append(
            dict(
                what="itl",
                decode_steps=k,
                tokens_per_delivery=float(np.mean(per)),
                delivery_gap_p50_ms=1e3 * float(np.percentile(gaps, 50)),
                delivery_gap_p99_ms=1e3 * float(np.percentile(gaps, 99)),
                itl_ms=1e3 * (end - start) * a.batch / max(tokens, 1),
                output_tokens_per_s=tokens / (end - start),
            )
        )
        del engine
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--what", choices=["startup", "idle", "itl", "host", "trace"], required=True)
    p.add_argument("--preset", default="llama3_8b")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--input_len", type=int, default=64)
    p.add_argument("--output_len", type=int, default=256)
    p.add_argument("--num_kv_blocks", type=int, default=None)
    p.add_argument("--cache_dir", default="", help="persistent compilation cache ('' disables it)")
    p.add_argument("--trace_dir", default="", help="--what trace: where the profiler trace goes")
    p.add_argument("--out", default="engine_core.jsonl")
    a = p.parse_args()
    enable_compilation_cache(a.cache_dir)
    cfg = ModelConfig.preset(a.preset)
    t0 = time.perf_counter()
    model = random_model(cfg, jnp.bfloat16)
    jax.block_until_ready(jax.tree.leaves(model)[0])
    init_s = time.perf_counter() - t0
    rows = {
        "startup": lambda: [startup(a, model)],
        "idle": lambda: idle(a, model),
        "itl": lambda: itl(a, model),
        "host": lambda: host(a, model),
        "trace": lambda: trace(a, model),
    }
    results = rows[a.what]()
    with open(a.out, "a") as f:
        for r in results:
            r |= dict(device=jax.devices()[0].device_kind, preset=a.preset, model_init_s=init_s)
            print(json.dumps(r), flush=True)
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
