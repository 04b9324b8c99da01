"""Serving benchmarks of the paged engine: JSON and PNG plots into --out_dir.

    python -m benchmarks.bench --mode static_vs_continuous                 # CPU, SmolLM2 (small sizes via flags)
    python -m benchmarks.bench --mode prefix_cache
    python -m benchmarks.bench --mode latency --model_preset llama3_8b --random_weights --dtype bfloat16   # GPU

Modes:
  static_vs_continuous: a synthetic offline workload (all requests arrive at t=0; prompts uniform in
    [--prompt_len_min, --prompt_len_max], output lengths log-normal and clipped to --output_len_max, ignore_eos
    so every length is exact). Continuous batching is the paged engine with max_num_seqs = --batch_size.
    Static batching is simulated over the same engine and compiled steps: requests go in fixed batches of
    --batch_size, a batch is admitted only when the engine is empty, and every request in it runs to the batch's
    longest output length (its max_tokens is raised to that), as a padded static batch computes every row until
    the longest finishes. A static request's useful output is its own length and its latency is the time its
    own last token was produced (generous to static: a real static server returns the batch at its end). Its KV
    is a contiguous reservation of max_len = longest prompt + longest output of the workload per row, the
    [batch, max_len] cache a static server allocates; waste = reserved - used, where used counts each row's
    useful tokens. Paged waste = allocated block slots - computed tokens of running requests. Both are averaged
    over forward passes (a multi-step decode loop counts as decode_steps passes).
  prefix_cache: a multi-turn chat (each turn's prompt = the conversation so far, including the model's earlier
    replies, + a new user message; turns run round by round) and a few-shot workload (one long shared prefix +
    short distinct questions), each with enable_prefix_caching on and off: hit rate (prompt tokens served from
    the cache / prompt tokens), wall time and throughput.
  latency: prefill time to first token and decode tokens/s at a given context for batch 1 and --batch_size,
    plus start-up (model build) and compile (warm-up of every bucket) times.
  serving: online serving over HTTP, as vLLM's benchmark_serving (benchmarks/bench_serving.py): streaming
    /v1/completions requests at --request_rate (Poisson; inf = all at once) or at most --max_concurrency in
    flight, against --base_url or a server this binary starts on a free loopback port (the engine flags here,
    then any flags after `--`). Lengths: --dataset sharegpt (log-normal input and output lengths, clipped),
    fixed (--input_len, --output_len) or jsonl (--dataset_path). Reports request / output / total token
    throughput, TTFT, TPOT, ITL and end-to-end latency percentiles, goodput under --slo_ttft_ms/--slo_tpot_ms.
    Stops by itself after --num_requests or --duration_s. Only loopback URLs are accepted.

    python -m benchmarks.bench --mode serving --num_requests 40 --request_rate 2 --attention_backend xla \
        --max_num_batched_tokens 64 --slo_ttft_ms 2000 --slo_tpot_ms 200

Every engine mode compiles all buckets first (`ModelRunner.warmup`), so no run includes compilation. Runs of one mode
share one engine and give it a fresh Scheduler (an empty pool, cache and counters) per run.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time

import numpy as np
from absl import app, flags

from serving import flags as engine_flags  # the engine flags (--model, --dtype, --block_size, ...), shared

FLAGS = flags.FLAGS
_MAX_NUM_BATCHED_TOKENS = 512  # this binary's default (the engine's is 256)
flags.DEFINE_enum(
    "mode",
    "static_vs_continuous",
    ["static_vs_continuous", "prefix_cache", "latency", "serving"],
    "which benchmark to run",
)
flags.DEFINE_string("out_dir", "bench_out", "directory for the JSON results and PNG plots")
flags.DEFINE_string("model_preset", None, "ModelConfig preset (with --random_weights), e.g. llama3_8b")
flags.DEFINE_bool("random_weights", False, "random weights at the preset's shapes (no checkpoint, no tokenizer)")
flags.DEFINE_integer("seed", 0, "workload seed")
flags.DEFINE_integer("batch_size", 16, "static batch size = the continuous engine's max_num_seqs", lower_bound=1)
# static_vs_continuous
flags.DEFINE_integer("num_requests", 64, "requests in the workload", lower_bound=1)
flags.DEFINE_integer("prompt_len_min", 32, "shortest prompt", lower_bound=1)
flags.DEFINE_integer("prompt_len_max", 128, "longest prompt", lower_bound=1)
flags.DEFINE_integer("output_len_median", 64, "median output length (log-normal)", lower_bound=1)
flags.DEFINE_float("output_len_sigma", 1.0, "sigma of log(output length): the tail weight", lower_bound=0.0)
flags.DEFINE_integer("output_len_max", 512, "longest output (the log-normal is clipped here)", lower_bound=1)
# prefix_cache
flags.DEFINE_integer("conversations", 8, "multi-turn chat: conversations", lower_bound=1)
flags.DEFINE_integer("turns", 4, "multi-turn chat: turns per conversation", lower_bound=1)
flags.DEFINE_integer("system_len", 64, "multi-turn chat: system prompt tokens", lower_bound=1)
flags.DEFINE_integer("turn_tokens", 32, "multi-turn chat: user message and reply tokens per turn", lower_bound=1)
flags.DEFINE_integer("fewshot_prefix_len", 512, "few-shot: shared prefix tokens", lower_bound=1)
flags.DEFINE_integer("fewshot_requests", 32, "few-shot: questions", lower_bound=1)
flags.DEFINE_integer("fewshot_max_tokens", 16, "few-shot: answer tokens", lower_bound=1)
# latency
flags.DEFINE_integer("context", 1024, "latency: prompt tokens", lower_bound=1)
flags.DEFINE_integer("latency_tokens", 128, "latency: tokens decoded per request", lower_bound=2)
# serving
flags.DEFINE_string(
    "base_url",
    None,
    "serving: a running server on loopback, e.g. http://127.0.0.1:8000 (default: "
    "start one on a free loopback port with the engine flags above and any flags after `--`)",
)
flags.DEFINE_float(
    "request_rate", float("inf"), "serving: mean requests/s, Poisson arrivals (inf: all at once)", lower_bound=0.0
)
flags.DEFINE_integer("max_concurrency", None, "serving: most requests in flight (default: no limit)", lower_bound=1)
flags.DEFINE_enum("dataset", "sharegpt", ["sharegpt", "fixed", "jsonl"], "serving: request lengths")
flags.DEFINE_string("dataset_path", None, 'serving: JSONL of {"prompt": str, "max_tokens": int} per line')
flags.DEFINE_integer("input_len_median", 128, "serving, sharegpt: median prompt length (log-normal)", lower_bound=1)
flags.DEFINE_float("input_len_sigma", 1.0, "serving, sharegpt: sigma of log(prompt length)", lower_bound=0.0)
flags.DEFINE_integer("input_len_max", 1024, "serving, sharegpt: longest prompt (clipped here)", lower_bound=1)
flags.DEFINE_integer("input_len", 128, "serving, fixed: prompt tokens", lower_bound=1)
flags.DEFINE_integer(
    "output_len", 64, "serving, fixed: output tokens (jsonl: when a line has no max_tokens)", lower_bound=1
)
flags.DEFINE_bool("ignore_eos", True, "serving: ask for exactly max_tokens tokens (the ignore_eos extension)")
flags.DEFINE_float("slo_ttft_ms", None, "serving: goodput SLO on time to first token", lower_bound=0.0)
flags.DEFINE_float("slo_tpot_ms", None, "serving: goodput SLO on time per output token", lower_bound=0.0)
flags.DEFINE_float(
    "duration_s", 600.0, "serving: cap on the run; requests still in flight then are cut", lower_bound=1.0
)
flags.DEFINE_float("startup_timeout_s", 1800.0, "serving: how long a self-started server may take to be healthy")


# Workloads ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Item:
    prompt: list[int]
    max_tokens: int


def random_tokens(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(min(100, vocab // 2), min(vocab, 40000), n).tolist()


def variable_workload(rng: np.random.Generator, vocab: int) -> list[Item]:
    """Prompts uniform in [min, max]; outputs log-normal around the median, clipped to [1, output_len_max]."""
    lens = rng.integers(FLAGS.prompt_len_min, FLAGS.prompt_len_max + 1, FLAGS.num_requests)
    out = np.exp(rng.normal(np.log(FLAGS.output_len_median), FLAGS.output_len_sigma, FLAGS.num_requests))
    out = np.clip(np.round(out), 1, FLAGS.output_len_max).astype(int)
    return [Item(random_tokens(rng, int(n), vocab), int(m)) for n, m in zip(lens, out)]


# Engine ------------------------------------------------------------------------------------------------------------


def load_model():
    """(model, tokenizer, seconds) from --model or --model_preset --random_weights."""
    from serving.engine.llm import LLM, parse_dtype

    t0 = time.perf_counter()
    if FLAGS.random_weights:
        from checkpoints.tokenizer import NullTokenizer
        from serving.engine.llm import enable_compilation_cache

        enable_compilation_cache(FLAGS.compilation_cache_dir)
        from model.config import ModelConfig
        from model.transformer import random_model

        model = random_model(ModelConfig.preset(FLAGS.model_preset or "smollm2_135m"), parse_dtype(FLAGS.dtype))
        return model, NullTokenizer(), time.perf_counter() - t0
    if FLAGS.model_preset:
        raise app.UsageError("--model_preset needs --random_weights (a checkpoint brings its own config)")
    llm = LLM.from_config(engine_flags.engine_config_from_flags())
    return llm.model, llm.tokenizer, time.perf_counter() - t0


_LEADING: list = []  # engines this process leads in a multi-host job (their followers are released at the end)


def make_engine(model, tokenizer, max_model_len: int, num_seqs: int):
    """An engine whose KV pool holds num_seqs sequences of max_model_len (the static reservation), all buckets
    compiled. Returns (engine, compile seconds)."""
    import jax

    from serving.engine.engine import LLMEngine
    from sharding import multihost
    from sharding.config import check_parallel

    bs = FLAGS.block_size
    max_model_len = -(-max_model_len // bs) * bs
    backend = FLAGS.attention_backend or ("xla" if jax.default_backend() == "cpu" else None)
    config = engine_flags.engine_config_from_flags(
        max_model_len=max_model_len,
        max_num_seqs=num_seqs,
        num_kv_blocks=num_seqs * (max_model_len // bs) + 1,
        attention_backend=backend,
        warmup=False,  # warmed up below, inside the timing
    )
    check_parallel(config.parallel, model.cfg, jax.device_count())  # the wrong number named before anything else
    if config.data_parallel_size > 1:
        raise app.UsageError(
            f"--data_parallel_size={config.data_parallel_size}: the offline modes time one engine; --mode serving "
            "benchmarks the replicas behind a server"
        )
    engine = LLMEngine(model, tokenizer, config)
    if not multihost.lead_or_follow(engine):  # a follower of a multi-host job: replayed process 0's run
        sys.exit(0)
    _LEADING.append(engine)
    t0 = time.perf_counter()
    engine.warmup()
    warm_sampler(engine)
    return engine, time.perf_counter() - t0


def warm_sampler(engine) -> None:
    """Compiles what `warmup` does not (the jitted sampler per row bucket, the small eager gathers and pads of
    the sampled rows per row count) with b tiny requests for every b, so that no measured run pays a compile."""
    from serving.core.request import SamplingParams

    for b in range(1, engine.config.max_num_seqs + 1):
        reset(engine, enable_prefix_caching=False)
        for i in range(b):
            engine.add_request([100 + i] * 4, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()


def reset(engine, enable_prefix_caching: bool) -> None:
    """A fresh scheduler over the engine's runner: empty pool and cache, zeroed counters."""
    from serving.core.scheduler import Scheduler

    assert not engine.has_unfinished()
    c = engine.config
    engine.scheduler = Scheduler(
        engine.runner.num_blocks,
        c.block_size,
        c.max_num_seqs,
        c.max_num_batched_tokens,
        engine.max_model_len,
        enable_prefix_caching=enable_prefix_caching,
    )


def forward_passes(engine) -> int:
    return engine.num_steps + engine.num_decode_loops * (engine.config.decode_steps - 1)


@dataclasses.dataclass
class RunLog:
    """What one drive of the engine recorded."""

    seconds: float = 0.0
    passes: int = 0
    first_token_s: dict = dataclasses.field(default_factory=dict)  # request id -> seconds from t0
    done_s: dict = dataclasses.field(default_factory=dict)  # request id -> seconds its useful tokens were all out
    kv: list = dataclasses.field(default_factory=list)  # per step: (passes, allocated/reserved, used)
    steps: list = dataclasses.field(default_factory=list)  # per step: (seconds from t0, passes, tokens out)


def drive(engine, t0: float, want: dict, log: RunLog, reserved: int | None = None, lengths: dict | None = None):
    """Steps the engine until it is empty, logging token times and KV occupancy after each step.

    want: request id -> useful output tokens (its time is logged when that many exist).
    reserved: static reservation in token slots (None: paged, allocated block slots are measured).
    lengths: request id -> prompt + useful output tokens (caps 'used' for static rows padded past their end).
    """
    sched, bs = engine.scheduler, engine.config.block_size
    counts = {rid: 0 for rid in want}
    while engine.has_unfinished():
        before = forward_passes(engine)
        outputs = engine.step()
        now = time.perf_counter() - t0
        log.steps.append((now, forward_passes(engine) - before, sum(len(o.new_token_ids) for o in outputs)))
        for o in outputs:
            if o.request_id not in counts:
                continue
            if counts[o.request_id] == 0 and o.new_token_ids:
                log.first_token_s[o.request_id] = now
            counts[o.request_id] += len(o.new_token_ids)
            if counts[o.request_id] >= want[o.request_id] and o.request_id not in log.done_s:
                log.done_s[o.request_id] = now
        running = sched.running
        used = sum(min(r.num_computed_tokens, (lengths or {}).get(r.request_id, 1 << 30)) for r in running)
        slots = reserved if reserved is not None else sum(len(r.block_ids) for r in running) * bs
        if running:
            log.kv.append((forward_passes(engine) - before, slots, used))
    log.seconds = time.perf_counter() - t0


# Mode: static vs continuous ----------------------------------------------------------------------------------------


def summarize(items: list[Item], ids: list[str], log: RunLog) -> dict:
    useful = sum(it.max_tokens for it in items)
    latency = np.array([log.done_s[r] for r in ids])
    ttft = np.array([log.first_token_s[r] for r in ids])
    weights = np.array([k for k, _, _ in log.kv], float)
    slots = np.array([s for _, s, _ in log.kv], float)
    used = np.array([u for _, _, u in log.kv], float)
    waste = float(np.sum(weights * (slots - used)) / np.sum(weights * slots))
    return dict(
        output_tokens=useful,
        seconds=log.seconds,
        throughput_tok_s=useful / log.seconds,
        forward_passes=log.passes,
        tokens_per_pass=useful / max(log.passes, 1),
        latency_p50_s=float(np.percentile(latency, 50)),
        latency_p99_s=float(np.percentile(latency, 99)),
        ttft_p50_s=float(np.percentile(ttft, 50)),
        kv_waste_fraction=waste,
        kv_slots_mean=float(np.average(slots, weights=weights)),
        kv_used_mean=float(np.average(used, weights=weights)),
        kv_trace=[(int(p), int(s), int(u)) for p, s, u in zip(np.cumsum(weights), slots, used)],
    )


def run_continuous(engine, items: list[Item]) -> dict:
    from serving.core.request import SamplingParams

    reset(engine, enable_prefix_caching=False)
    p0 = forward_passes(engine)
    log = RunLog()
    t0 = time.perf_counter()
    ids = [
        engine.add_request(it.prompt, SamplingParams(max_tokens=it.max_tokens, temperature=0.0, ignore_eos=True))
        for it in items
    ]
    drive(engine, t0, dict(zip(ids, (it.max_tokens for it in items))), log)
    log.passes = forward_passes(engine) - p0
    return summarize(items, ids, log)


def run_static(engine, items: list[Item], n: int, max_len: int) -> dict:
    from serving.core.request import SamplingParams

    reset(engine, enable_prefix_caching=False)
    p0 = forward_passes(engine)
    log = RunLog()
    ids: list[str] = []
    t0 = time.perf_counter()
    for start in range(0, len(items), n):
        batch = items[start : start + n]
        longest = max(it.max_tokens for it in batch)
        params = SamplingParams(max_tokens=longest, temperature=0.0, ignore_eos=True)
        batch_ids = [engine.add_request(it.prompt, params) for it in batch]
        ids += batch_ids
        drive(
            engine,
            t0,
            dict(zip(batch_ids, (it.max_tokens for it in batch))),
            log,
            reserved=n * max_len,
            lengths={r: len(it.prompt) + it.max_tokens for r, it in zip(batch_ids, batch)},
        )
    log.passes = forward_passes(engine) - p0
    return summarize(items, ids, log)


def mode_static_vs_continuous(model, tokenizer, vocab: int) -> dict:
    items = variable_workload(np.random.default_rng(FLAGS.seed), vocab)
    max_len = max(len(it.prompt) for it in items) + max(it.max_tokens for it in items)
    engine, compile_s = make_engine(model, tokenizer, max_len, FLAGS.batch_size)
    static = run_static(engine, items, FLAGS.batch_size, max_len)
    continuous = run_continuous(engine, items)
    lens = [it.max_tokens for it in items]
    return dict(
        compile_s=compile_s,
        max_len=max_len,
        output_lengths=dict(mean=float(np.mean(lens)), p50=float(np.median(lens)), max=int(max(lens))),
        static=static,
        continuous=continuous,
        speedup=continuous["throughput_tok_s"] / static["throughput_tok_s"],
    )


# Mode: prefix cache ------------------------------------------------------------------------------------------------


def run_rounds(engine, rounds, caching: bool) -> dict:
    """rounds: callables (previous outputs) -> list[Item]; each round's requests run together."""
    from serving.core.request import SamplingParams

    reset(engine, enable_prefix_caching=caching)
    t0 = time.perf_counter()
    outputs: list[list[int]] = []
    out_tokens = prompt_tokens = 0
    ttfts = []
    for make_items in rounds:
        items = make_items(outputs)
        rids = [
            engine.add_request(it.prompt, SamplingParams(max_tokens=it.max_tokens, temperature=0.0, ignore_eos=True))
            for it in items
        ]
        log = RunLog()
        t_round = time.perf_counter()
        drive(engine, t_round, {r: it.max_tokens for r, it in zip(rids, items)}, log)
        ttfts += list(log.first_token_s.values())
        outputs = [engine.pop_finished(r).request.output_token_ids for r in rids]
        out_tokens += sum(len(o) for o in outputs)
        prompt_tokens += sum(len(it.prompt) for it in items)
    seconds = time.perf_counter() - t0
    s = engine.scheduler
    return dict(
        seconds=seconds,
        output_tokens=out_tokens,
        prompt_tokens=prompt_tokens,
        throughput_tok_s=out_tokens / seconds,
        prompt_tok_s=prompt_tokens / seconds,
        ttft_mean_s=float(np.mean(ttfts)),
        hit_rate=s.prefix_hit_tokens / max(s.prefix_queried_tokens, 1),
        hit_tokens=s.prefix_hit_tokens,
        queried_tokens=s.prefix_queried_tokens,
    )


def chat_rounds(seed: int, vocab: int):
    """Multi-turn chat: round t asks every conversation its t-th question; the prompt is the whole history."""
    rng = np.random.default_rng(seed)
    c, k = FLAGS.conversations, FLAGS.turn_tokens
    system = random_tokens(rng, FLAGS.system_len, vocab)
    users = [[random_tokens(rng, k, vocab) for _ in range(c)] for _ in range(FLAGS.turns)]
    history = [list(system) for _ in range(c)]

    def round_fn(turn):
        def make(prev_outputs):
            for i in range(c):
                if prev_outputs:
                    history[i] += prev_outputs[i]  # the model's reply joins the conversation
                history[i] += users[turn][i]
            return [Item(list(h), k) for h in history]

        return make

    return [round_fn(t) for t in range(FLAGS.turns)]


def fewshot_rounds(seed: int, vocab: int):
    """One round: a long shared prefix + a short distinct question per request."""
    rng = np.random.default_rng(seed)
    prefix = random_tokens(rng, FLAGS.fewshot_prefix_len, vocab)
    items = [
        Item(prefix + random_tokens(rng, int(rng.integers(8, 25)), vocab), FLAGS.fewshot_max_tokens)
        for _ in range(FLAGS.fewshot_requests)
    ]
    return [lambda _: items]


def mode_prefix_cache(model, tokenizer, vocab: int) -> dict:
    chat_len = FLAGS.system_len + 2 * FLAGS.turn_tokens * FLAGS.turns
    fewshot_len = FLAGS.fewshot_prefix_len + 24 + FLAGS.fewshot_max_tokens
    engine, compile_s = make_engine(model, tokenizer, max(chat_len, fewshot_len), FLAGS.batch_size)
    results = dict(compile_s=compile_s)
    for name, rounds in (("multi_turn_chat", chat_rounds), ("few_shot", fewshot_rounds)):
        # Greedy replies are the same with and without the cache, so both runs see the same prompts.
        off = run_rounds(engine, rounds(FLAGS.seed, vocab), caching=False)
        on = run_rounds(engine, rounds(FLAGS.seed, vocab), caching=True)
        results[name] = dict(off=off, on=on, speedup=off["seconds"] / on["seconds"])
    return results


# Mode: latency -----------------------------------------------------------------------------------------------------


def mode_latency(model, tokenizer, vocab: int) -> dict:
    from serving.core.request import SamplingParams

    rng = np.random.default_rng(FLAGS.seed)
    engine, compile_s = make_engine(model, tokenizer, FLAGS.context + FLAGS.latency_tokens, FLAGS.batch_size)
    results = dict(compile_s=compile_s, context=FLAGS.context, tokens=FLAGS.latency_tokens)
    for batch in sorted({1, FLAGS.batch_size}):
        reset(engine, enable_prefix_caching=False)
        params = SamplingParams(max_tokens=FLAGS.latency_tokens, temperature=0.0, ignore_eos=True)
        rids = [engine.add_request(random_tokens(rng, FLAGS.context, vocab), params) for _ in range(batch)]
        log = RunLog()
        t0 = time.perf_counter()
        drive(engine, t0, {r: FLAGS.latency_tokens for r in rids}, log)
        # Steady batch-N decode: the window from the last request's first token (every prefill done) to the first
        # request's last token (nobody has left yet).
        start, end = max(log.first_token_s.values()), min(log.done_s.values())
        window = [(p, n) for t, p, n in log.steps if start < t <= end]
        if not window:
            raise app.UsageError("--latency_tokens is too small to leave a decode window after the prefills")
        passes, tokens = map(sum, zip(*window))
        results[f"batch_{batch}"] = dict(
            ttft_s=min(log.first_token_s.values()),
            ttft_last_s=start,
            seconds=log.seconds,
            decode_window_s=end - start,
            decode_tok_s=tokens / (end - start),
            decode_tok_s_per_seq=tokens / batch / (end - start),
            ms_per_step=1e3 * (end - start) / passes,
        )
    return results


# Mode: serving (over HTTP) -----------------------------------------------------------------------------------------


def serving_workload():
    from benchmarks import bench_serving as bs

    n = FLAGS.num_requests
    if FLAGS.dataset == "jsonl":
        if not FLAGS.dataset_path:
            raise ValueError("--dataset jsonl needs --dataset_path")
        return bs.read_jsonl(FLAGS.dataset_path, n, FLAGS.output_len)
    if FLAGS.dataset == "fixed":
        return bs.fixed_lengths(n, FLAGS.seed, FLAGS.input_len, FLAGS.output_len)
    return bs.sharegpt_like(
        n,
        FLAGS.seed,
        FLAGS.input_len_median,
        FLAGS.input_len_sigma,
        FLAGS.input_len_max,
        FLAGS.output_len_median,
        FLAGS.output_len_sigma,
        FLAGS.output_len_max,
    )


def server_flags(requests, extra: list[str]) -> list[str]:
    """Flags of a self-started server: this binary's engine flags, then the ones after `--` (which win)."""
    args = [f"--max_num_seqs={FLAGS.batch_size}", f"--max_num_batched_tokens={FLAGS.max_num_batched_tokens}"]
    args += engine_flags.changed_engine_flags()
    max_len = FLAGS.max_model_len
    if max_len is None and all(isinstance(r.prompt, list) for r in requests):
        max_len = max(len(r.prompt) + r.max_tokens for r in requests)
    return args + (["--max_model_len", str(max_len)] if max_len else []) + list(extra)


def mode_serving(extra: list[str]) -> dict:
    """The serving mode; a bad setting or an unusable server ends it with one line on stderr (status 2 / 1)."""
    import logging

    import httpx

    from benchmarks import bench_serving as bs

    logging.getLogger("httpx").setLevel(logging.WARNING)  # absl logs every request at INFO otherwise
    try:
        if FLAGS.random_weights or FLAGS.model_preset:
            raise ValueError("--mode serving benchmarks a server: --random_weights/--model_preset do not apply")
        if FLAGS.base_url and extra:
            raise ValueError(f"flags after `--` configure a self-started server, not --base_url: {' '.join(extra)}")
        cfg = bs.ServingBenchConfig(
            FLAGS.base_url,
            FLAGS.num_requests,
            FLAGS.request_rate,
            FLAGS.max_concurrency,
            FLAGS.duration_s,
            FLAGS.ignore_eos,
            FLAGS.slo_ttft_ms,
            FLAGS.slo_tpot_ms,
            request_timeout_s=FLAGS.duration_s + 60,
            seed=FLAGS.seed,
            api_key=os.environ.get("PALLAS_SERVE_API_KEY"),
        )
        requests = serving_workload()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        return bs.bench(cfg, requests, server_flags(requests, extra), FLAGS.startup_timeout_s)
    except (RuntimeError, httpx.HTTPError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


# Output ------------------------------------------------------------------------------------------------------------


def plot(mode: str, results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if mode == "static_vs_continuous":
        fig, ax = plt.subplots(1, 3, figsize=(15, 4))
        names = ["static", "continuous"]
        ax[0].bar(names, [results[n]["throughput_tok_s"] for n in names], color=["grey", "tab:blue"])
        ax[0].set_ylabel("output tokens / s")
        ax[0].set_title(f"throughput ({results['speedup']:.2f}x)")
        ax[1].bar(names, [100 * results[n]["kv_waste_fraction"] for n in names], color=["grey", "tab:blue"])
        ax[1].set_ylabel("KV slots reserved but unused (%)")
        ax[1].set_title("KV memory waste")
        for n, color, held in zip(names, ["grey", "tab:blue"], ["reserved", "allocated"]):
            trace = np.array(results[n]["kv_trace"], float)
            ax[2].plot(trace[:, 0], trace[:, 1], color=color, ls="--", label=f"{n}: {held}")
            ax[2].plot(trace[:, 0], trace[:, 2], color=color, label=f"{n}: used")
        ax[2].set_xlabel("forward pass")
        ax[2].set_ylabel("KV token slots")
        ax[2].legend(fontsize=7)
    elif mode == "prefix_cache":
        fig, ax = plt.subplots(1, 2, figsize=(10, 4))
        work = ["multi_turn_chat", "few_shot"]
        x = np.arange(len(work))
        for i, state in enumerate(["off", "on"]):
            ax[0].bar(x + 0.35 * i, [results[w][state]["seconds"] for w in work], 0.35, label=f"caching {state}")
        ax[0].set_xticks(x + 0.175, work)
        ax[0].set_ylabel("wall seconds")
        ax[0].legend()
        ax[1].bar(work, [100 * results[w]["on"]["hit_rate"] for w in work], color="tab:green")
        ax[1].set_ylabel("prefix hit rate (%)")
    else:
        fig, ax = plt.subplots(1, 1, figsize=(5, 4))
        keys = [k for k in results if k.startswith("batch_")]
        ax.bar(keys, [results[k]["decode_tok_s"] for k in keys])
        ax.set_ylabel("decode tokens / s")
        ax.set_title(f"context {results['context']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def git_commit() -> str | None:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                cwd=os.path.dirname(os.path.abspath(__file__)),
            ).stdout.strip()
            or None
        )
    except OSError:
        return None


def main(argv) -> None:
    if not FLAGS["max_num_batched_tokens"].present:
        FLAGS.max_num_batched_tokens = _MAX_NUM_BATCHED_TOKENS
    if FLAGS.mode != "serving" and len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if FLAGS.prompt_len_min > FLAGS.prompt_len_max:
        raise app.UsageError("--prompt_len_min must be <= --prompt_len_max")
    try:
        multihost = engine_flags.initialize_multihost_from_flags()  # before anything touches a device
        if multihost and FLAGS.mode == "serving":
            raise ValueError(
                "--num_processes > 1 with --mode serving: start the server's processes (python -m serving.server "
                "... --num_processes N --process_id i) and pass --base_url"
            )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if FLAGS.mode == "serving":
        results = mode_serving(argv[1:])
        from benchmarks.bench_serving import host_device

        name, device = results["served_model"], host_device()
    else:
        import jax

        model, tokenizer, load_s = load_model()
        run_mode = {
            "static_vs_continuous": mode_static_vs_continuous,
            "prefix_cache": mode_prefix_cache,
            "latency": mode_latency,
        }[FLAGS.mode]
        try:
            results = run_mode(model, tokenizer, model.cfg.vocab_size)
        except ValueError as e:  # an engine that cannot start (a mesh the devices or the model do not fit)
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        finally:
            from sharding import multihost as multihost_lib

            for engine in _LEADING:
                multihost_lib.stop_followers(engine)
        results["load_s"] = load_s
        dev = jax.devices()[0]
        name = model.cfg.name
        device = f"{dev.platform}: {dev.device_kind} x{jax.device_count()} ({os.cpu_count()} CPU cores)"
    record = dict(
        mode=FLAGS.mode,
        date=datetime.date.today().isoformat(),
        commit=git_commit(),
        command="python -m benchmarks.bench " + " ".join(sys.argv[1:]),
        device=device,
        model=name,
        dtype=FLAGS.dtype,
        flags={f.name: f.value for m in (sys.modules[__name__], engine_flags) for f in FLAGS.get_flags_for_module(m)},
        results=results,
    )
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    slug = "".join(ch if ch.isalnum() else "_" for ch in name.lower()).strip("_")
    stem = os.path.join(FLAGS.out_dir, f"{FLAGS.mode}_{slug}")
    with open(stem + ".json", "w") as f:
        json.dump(record, f, indent=1)
    if FLAGS.mode == "serving":
        from benchmarks.bench_serving import plot as plot_serving

        plot_serving(results, stem + ".png")
    else:
        plot(FLAGS.mode, results, stem + ".png")
    print(json.dumps(_headline(FLAGS.mode, results), indent=1))
    print(f"wrote {stem}.json and {stem}.png")


def _headline(mode: str, r: dict) -> dict:
    """The figures worth a line in BENCHMARKS.md."""
    drop = {"kv_trace", "per_request"}
    strip = lambda d: {k: v for k, v in d.items() if k not in drop}  # noqa: E731
    return {k: (strip(v) if isinstance(v, dict) else v) for k, v in r.items() if k not in drop}


if __name__ == "__main__":
    app.run(main)
