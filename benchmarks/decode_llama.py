"""Decode throughput of the engine's runner at real shapes with random weights (GPU).

    PYTHONPATH=. python benchmarks/decode_llama.py --preset llama3_8b --batches 1,64 --ctx 1024 --steps 32

For each batch size: a ModelRunner over a paged KV pool, every row at context `ctx` (pages assigned, contents
random), timed `decode_loop` calls of `steps` on-device decode steps (model + sampling), reported as tokens/s,
ms/step and effective weight bandwidth (parameter bytes / step time). Also times a single-step call (one host
round trip per token) and the start-up compile. Prints a table and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from model.config import ModelConfig
from model.sampling import SamplingTensors
from model.transformer import random_model
from serving.config import DEFAULT_COMPILATION_CACHE_DIR, CacheConfig, RuntimeConfig
from serving.engine.llm import enable_compilation_cache
from serving.engine.runner import ModelRunner, RowInput


def bench(
    preset: str, batches: list[int], ctx: int, steps: int, block_size: int, backend: str | None, repeats: int
) -> dict:
    cfg = ModelConfig.preset(preset)
    t0 = time.perf_counter()
    model = random_model(cfg, jnp.bfloat16)
    jax.block_until_ready(jax.tree.leaves(nnx_state(model)))
    init_s = time.perf_counter() - t0
    weight_bytes = cfg.num_params() * 2
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
    )
    results = {
        "preset": preset,
        "ctx": ctx,
        "steps_per_call": steps,
        "weight_bytes": weight_bytes,
        "init_s": init_s,
        "device": str(jax.devices()[0].device_kind),
        "rows": [],
    }
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
        # One host round trip per token (the engine's fallback path).
        runner.forward(rows)
        single = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(runner.forward(rows))
            single.append(time.perf_counter() - t0)
        single_s = float(np.median(single))
        row = {
            "batch": b,
            "compile_s": compile_s,
            "ms_per_step_loop": 1e3 * loop_s / steps,
            "tokens_per_s_loop": b * steps / loop_s,
            "ms_per_step_single": 1e3 * single_s,
            "tokens_per_s_single": b / single_s,
            "weight_TBps_loop": weight_bytes / (loop_s / steps) / 1e12,
        }
        results["rows"].append(row)
        print(
            f"{preset} B={b:3d} ctx={ctx}: loop {row['ms_per_step_loop']:.2f} ms/step "
            f"{row['tokens_per_s_loop']:.0f} tok/s ({row['weight_TBps_loop']:.2f} TB/s weights); "
            f"single-step {row['ms_per_step_single']:.2f} ms ({row['tokens_per_s_single']:.0f} tok/s); "
            f"compile {compile_s:.1f}s",
            flush=True,
        )
    return results


def nnx_state(model):
    from flax import nnx

    return nnx.state(model)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="llama3_8b")
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
    p.add_argument("--out", default="decode_llama.json")
    p.add_argument("--compilation_cache_dir", default=DEFAULT_COMPILATION_CACHE_DIR, help="'' disables it")
    a = p.parse_args()
    CacheConfig(block_size=a.block_size)  # the engine's checks of these options (ValueError names the option)
    RuntimeConfig(attention_backend=a.backend, compilation_cache_dir=a.compilation_cache_dir)
    enable_compilation_cache(a.compilation_cache_dir)
    if a.no_attention:
        from model import kv

        def attend_without_kernel(self, q, k, v, positions, cache):
            return q, (
                kv.write_pages(cache[0], k[0], self.slot_mapping),
                kv.write_pages(cache[1], v[0], self.slot_mapping),
            )

        kv.PagedMeta.attend = attend_without_kernel
    res = bench(a.preset, [int(x) for x in a.batches.split(",")], a.ctx, a.steps, a.block_size, a.backend, a.repeats)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
