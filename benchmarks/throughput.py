"""Offline throughput of the whole engine (scheduler + runner + kernels) at real shapes with random weights.

    PYTHONPATH=. python benchmarks/throughput.py --preset llama3_8b --num_requests 1000 --input_len 1000 \
        --output_len 1000 --max_num_seqs 256 --max_num_batched_tokens 8192

All requests arrive at t=0 with random prompt ids and `ignore_eos`, so every one produces exactly output_len
tokens (as vLLM's and TensorRT-LLM's throughput benchmarks do). Reports output tokens/s, total tokens/s, time to
first token (p50/p99), model init, KV pool size, the up-front warm-up (LLMEngine.warmup) and any compile time left
while running, and writes JSON to --out. `--time_limit` stops early and reports what finished, so a device call always returns figures.
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
from model.transformer import random_model
from serving.config import DEFAULT_COMPILATION_CACHE_DIR, EngineConfig
from serving.core.request import SamplingParams
from serving.engine.engine import LLMEngine
from serving.engine.llm import enable_compilation_cache


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="llama3_8b")
    p.add_argument("--num_requests", type=int, default=1000)
    p.add_argument("--input_len", type=int, default=1000)
    p.add_argument("--output_len", type=int, default=1000)
    p.add_argument("--max_num_seqs", type=int, default=256)
    p.add_argument("--max_num_batched_tokens", type=int, default=8192)
    p.add_argument("--block_size", type=int, default=16)
    p.add_argument("--decode_steps", type=int, default=8)
    p.add_argument("--memory_fraction", type=float, default=0.85)
    p.add_argument("--num_kv_blocks", type=int, default=0, help="a KV pool of this many blocks (0: sized from memory)")
    p.add_argument(
        "--loop_while_blocked",
        choices=("on", "off"),
        default="on",
        help="off: decode loops only while no request waits or every slot is taken (the earlier rule: "
        "not while waiting requests lack KV blocks), for A/B runs",
    )
    p.add_argument("--time_limit", type=float, default=400.0)
    p.add_argument("--out", default="throughput.json")
    p.add_argument("--quantization", default="", help="a weight format of serving/engine/quantize.py ('' = bf16)")
    p.add_argument("--kv_cache_dtype", default="auto", help="auto, int8 or fp8")
    p.add_argument("--stream_layout", action="store_true", help="quantized_stream_layout (Hopper streaming kernel)")
    p.add_argument("--compilation_cache_dir", default=DEFAULT_COMPILATION_CACHE_DIR, help="'' disables it")
    a = p.parse_args()
    enable_compilation_cache(a.compilation_cache_dir)

    if a.loop_while_blocked == "off":
        from serving.engine.decode_loop import DecodeLoops

        def old_room(self):
            return self.k > 1 and (not self.scheduler.num_waiting or self.scheduler.num_running >= self.max_num_seqs)

        DecodeLoops._room = old_room
    cfg = ModelConfig.preset(a.preset)
    t0 = time.perf_counter()
    model = random_model(cfg, jnp.bfloat16)
    jax.block_until_ready(model.embed.weight[...])
    init_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    config = EngineConfig.from_kwargs(
        max_model_len=a.input_len + a.output_len + a.block_size,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        block_size=a.block_size,
        kv_cache_memory_fraction=a.memory_fraction,
        num_kv_blocks=a.num_kv_blocks or None,
        decode_steps=a.decode_steps,
        enable_prefix_caching=False,
        warmup=False,
        compilation_cache_dir=a.compilation_cache_dir,
        quantization=a.quantization or None,
        kv_cache_dtype=a.kv_cache_dtype,
        quantized_stream_layout=a.stream_layout,
    )
    engine = LLMEngine(model, NullTokenizer(), config)
    engine_s = time.perf_counter() - t0
    print(f"throughput: model {init_s:.1f} s, engine (quantise, KV pool) {engine_s:.1f} s; warming up", flush=True)
    t0 = time.perf_counter()
    engine.warmup()  # every step bucket, the decode loop and the sampler, timed apart from the run
    warmup_s = time.perf_counter() - t0
    print(f"throughput: warm-up {warmup_s:.1f} s; running", flush=True)
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    rids = [
        engine.add_request(rng.integers(100, cfg.vocab_size, a.input_len).tolist(), params)
        for _ in range(a.num_requests)
    ]
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    out_tokens = 0
    compile_s = 0.0
    steps = 0
    while engine.has_unfinished() and time.perf_counter() - start < a.time_limit:
        before = engine.runner.num_compiles
        t_step = time.perf_counter()
        outs = engine.step()
        if engine.runner.num_compiles != before:
            compile_s += time.perf_counter() - t_step
        steps += 1
        now = time.perf_counter()
        for o in outs:
            out_tokens += len(o.new_token_ids)
            first.setdefault(o.request_id, now)
            if o.finished:
                done[o.request_id] = now
    wall = time.perf_counter() - start
    ttft = np.array([first[r] - start for r in rids if r in first])
    res = {
        "device": str(jax.devices()[0].device_kind),
        "preset": a.preset,
        "num_requests": a.num_requests,
        "input_len": a.input_len,
        "output_len": a.output_len,
        "max_num_seqs": a.max_num_seqs,
        "max_num_batched_tokens": a.max_num_batched_tokens,
        "decode_steps": a.decode_steps,
        "quantization": a.quantization or "bf16",
        "kv_cache_dtype": a.kv_cache_dtype,
        "stream_layout": a.stream_layout,
        "finished": len(done),
        "wall_s": wall,
        "compile_s_during_run": compile_s,
        "executables": engine.runner.num_compiles,
        "steps": steps,
        "decode_loops": engine.num_decode_loops,
        "loop_while_blocked": a.loop_while_blocked,
        "num_kv_blocks": engine.runner.num_blocks,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall,
        "output_tokens_per_s_excl_compile": out_tokens / max(wall - compile_s, 1e-9),
        "total_tokens_per_s_excl_compile": (out_tokens + len(first) * a.input_len) / max(wall - compile_s, 1e-9),
        "ttft_p50_s": float(np.percentile(ttft, 50)) if len(ttft) else None,
        "ttft_p99_s": float(np.percentile(ttft, 99)) if len(ttft) else None,
        "model_init_s": init_s,
        "engine_init_s": engine_s,
        "warmup_s": warmup_s,
        "preemptions": engine.scheduler.num_preemptions,
    }
    print(json.dumps(res, indent=1), flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
