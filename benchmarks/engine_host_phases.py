"""Host milliseconds per engine step, per phase, and decode tokens/s: one step per token against multi-step loops.

    PYTHONPATH=. python benchmarks/engine_host_phases.py --model default --batches 1,16      # CPU host, SmolLM2
    PYTHONPATH=. python benchmarks/engine_host_phases.py --preset llama3_8b --batches 1,64,256   # GPU, random weights
    PYTHONPATH=. python benchmarks/engine_host_phases.py --preset llama3_8b --num_layers 4 --batches 2 \
        --modes sync1,async1 --attention_backends mosaic_gpu,triton,xla        # does a Pallas kernel block?

For each batch and each mode (`sync1`: decode_steps 1, async scheduling off, the host between every step and the
next; `async1`: one step per token, each launched from the previous step's tokens on the device, the host reading
them one step late; `asyncK` / `syncK`: K-step decode loops), `batch` requests decode `--output_len` tokens
(ignore_eos) from `--input_len`-token prompts. The window: from the first step at which every request has its
first token to the first finish. Over it, each phase's host wall time (the engine's parts wrapped with timers),
divided by the engine steps:

    schedule   Scheduler.schedule
    launch     DecodeLoops.limits / launch / chain: a loop's rows, block reservations, sampling tensors, dispatch
    dispatch   (inside launch) ModelRunner.decode_loop: the loop's input arrays and the executable's call
    feed       (inside dispatch) the chained loop's token gather (runner.chain_tokens)
    forward    ModelRunner.forward: a single step's input arrays and dispatch (the paths that sample on the host)
    sample     Sampler.sample after a single step (includes waiting for that step's logits)
    wait       LoopHandle.fetch: the host waiting for a loop's tokens (device time the host did not overlap)
    collect    DecodeLoops.collect less its wait: the step's per-row result
    update     Scheduler.update: tokens appended, token stops, blocks
    emit       OutputProcessor.process: detokenisation, text stops, deltas

`host_ms` is the sum of every phase but wait (and, for single steps, sample); `step_ms` the window's wall time per
step; tok/s the window's output tokens per second. With --attention_backends, each (batch, mode) runs once per
attention backend (the row names it); under `xla` a bf16 step of two or more rows runs no Pallas kernel (one row
takes the bf16 GEMV kernel, model/quant.py). Prints one JSON line per row and writes them to --out.
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from checkpoints.tokenizer import NullTokenizer
from model.config import ModelConfig
from model.transformer import random_model
from serving.config import ATTENTION_BACKENDS, EngineConfig
from serving.core.request import SamplingParams
from serving.engine import runner as runner_module
from serving.engine.engine import LLMEngine
from serving.engine.llm import enable_compilation_cache

PHASES = ("schedule", "launch", "dispatch", "feed", "forward", "sample", "wait", "collect", "update", "emit")
NESTED = ("dispatch", "feed")  # already inside launch


class Timers:
    """Wall seconds per phase; `wrap` times an object's method in place (the benchmark's own engines only)."""

    def __init__(self):
        self.seconds = collections.defaultdict(float)
        self.on = False

    def wrap(self, obj, name: str, phase: str) -> None:
        fn = getattr(obj, name)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.on:
                    self.seconds[phase] += time.perf_counter() - t0

        setattr(obj, name, timed)


def instrument(engine: LLMEngine, timers: Timers) -> None:
    timers.wrap(engine.scheduler, "schedule", "schedule")
    for name in ("limits", "launch", "chain"):
        timers.wrap(engine.loops, name, "launch")
    timers.wrap(engine.loops, "collect", "collect")
    timers.wrap(engine.runner, "forward", "forward")
    timers.wrap(engine.runner, "decode_loop", "dispatch")
    timers.wrap(engine.sampler, "sample", "sample")
    timers.wrap(engine.scheduler, "update", "update")
    timers.wrap(engine.outputs, "process", "emit")


def run_window(engine: LLMEngine, timers: Timers, a, batch: int, vocab: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(rng.integers(100, vocab, a.input_len).tolist(), params) for _ in range(batch)]
    started, steps, tokens, t0 = set(), 0, 0, None
    while engine.has_unfinished():
        outs = engine.step()
        if t0 is not None:
            steps += 1
            tokens += sum(len(o.new_token_ids) for o in outs)
            if any(o.finished for o in outs):
                break
        started.update(o.request_id for o in outs if o.new_token_ids)
        if t0 is None and len(started) == batch:
            timers.seconds.clear()
            timers.on, t0 = True, time.perf_counter()
    wall = time.perf_counter() - (t0 or time.perf_counter())
    timers.on = False
    for r in rids:
        engine.abort(r)
    while engine.has_unfinished():
        engine.step()
    engine.step()  # a loop still in flight
    return dict(steps=steps, tokens=tokens, wall_s=wall)


def measure(make_engine, a, batch: int, mode: str, vocab: int, backend: str | None = None) -> dict:
    k, overlap = int(mode.removeprefix("async").removeprefix("sync")), mode.startswith("async")
    engine = make_engine(batch, k, overlap, backend)
    timers = Timers()
    instrument(engine, timers)
    fetch = runner_module.LoopHandle.fetch

    def timed_fetch(handle):
        t0 = time.perf_counter()
        try:
            return fetch(handle)
        finally:
            if timers.on:
                timers.seconds["wait"] += time.perf_counter() - t0

    runner_module.LoopHandle.fetch = timed_fetch
    chain = runner_module.chain_tokens

    def timed_chain(*args):
        t0 = time.perf_counter()
        try:
            return chain(*args)
        finally:
            if timers.on:
                timers.seconds["feed"] += time.perf_counter() - t0

    runner_module.chain_tokens = timed_chain
    try:
        run_window(engine, timers, a, batch, vocab, seed=1)  # compiles what the window meets
        w = run_window(engine, timers, a, batch, vocab, seed=2)
    finally:
        runner_module.LoopHandle.fetch = fetch
        runner_module.chain_tokens = chain
    sec = dict(timers.seconds)
    sec["collect"] = sec.get("collect", 0.0) - sec.get("wait", 0.0)
    n = max(w["steps"], 1)
    ms = {p: round(sec.get(p, 0.0) / n * 1e3, 3) for p in PHASES}
    host = sum(v for p, v in ms.items() if p not in ("wait", "sample", *NESTED))
    return dict(
        bench="engine_host_phases",
        device=jax.devices()[0].device_kind,
        num_layers=engine.runner.cfg.num_layers,
        attention_backend=backend or "default",
        batch=batch,
        mode=mode,
        decode_steps=k,
        async_scheduling=overlap,
        steps=w["steps"],
        tokens=w["tokens"],
        step_ms=round(w["wall_s"] / n * 1e3, 3),
        host_ms=round(host, 3),
        tok_s=round(w["tokens"] / w["wall_s"], 1) if w["wall_s"] else 0.0,
        phases_ms=ms,
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="", help="'default': the default checkpoint (SmolLM2) with its tokenizer")
    p.add_argument("--preset", default="llama3_8b", help="random weights at this preset's shape (without --model)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num_layers", type=int, default=0, help="with --preset: this many layers (0: the preset's)")
    p.add_argument("--attention_backends", default="", help="comma list of attention backends ('': the default)")
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--modes", default="sync1,async1,async8")
    p.add_argument("--input_len", type=int, default=64)
    p.add_argument("--output_len", type=int, default=96)
    p.add_argument("--block_size", type=int, default=16)
    p.add_argument("--max_num_batched_tokens", type=int, default=2048, help="prompts are prefilled in such chunks")
    p.add_argument("--out", default="engine_host_phases.jsonl")
    p.add_argument("--compilation_cache_dir", default="", help="JAX's persistent cache: engines share compilations")
    a = p.parse_args(argv)
    if a.num_layers and a.model:
        p.error("--num_layers applies to --preset's random weights, not to --model")
    unknown = set(a.attention_backends.split(",")) - set(ATTENTION_BACKENDS) if a.attention_backends else set()
    if unknown:
        p.error(f"--attention_backends: {sorted(unknown)} not among {ATTENTION_BACKENDS}")
    enable_compilation_cache(a.compilation_cache_dir)
    if a.model:
        from serving.engine.llm import LLM

        llm = LLM(max_model_len=64, warmup=False, compilation_cache_dir="")  # only the weights and tokenizer
        model, tok = llm.model, llm.tokenizer
    else:
        cfg = ModelConfig.preset(a.preset)
        cfg = cfg.replace(num_layers=a.num_layers) if a.num_layers else cfg
        model, tok = random_model(cfg, jnp.dtype(a.dtype)), NullTokenizer()
    max_len = -(-(a.input_len + a.output_len + 16) // a.block_size) * a.block_size

    def make_engine(batch: int, k: int, overlap: bool, backend: str | None) -> LLMEngine:
        config = EngineConfig.from_kwargs(
            max_model_len=max_len,
            max_num_seqs=batch,
            max_num_batched_tokens=a.max_num_batched_tokens,
            block_size=a.block_size,
            num_kv_blocks=1 + batch * (max_len // a.block_size),
            decode_steps=k,
            async_scheduling=overlap,
            enable_prefix_caching=False,
            warmup=False,
            attention_backend=backend,
            compilation_cache_dir=a.compilation_cache_dir,  # the engines of a batch share their executables
        )
        return LLMEngine(model, tok, config)

    with open(a.out, "a") as f:
        for batch in [int(b) for b in a.batches.split(",")]:
            for backend in a.attention_backends.split(",") if a.attention_backends else [None]:
                for mode in a.modes.split(","):
                    row = measure(make_engine, a, batch, mode, model.cfg.vocab_size, backend)
                    gc.collect()  # the mode's engine and its KV pool go before the next one's
                    print(json.dumps(row), flush=True)
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
