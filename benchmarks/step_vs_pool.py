"""A decode step's cost against the size of the KV pool: it must follow the step's work, not the pool.

    PYTHONPATH=. python benchmarks/step_vs_pool.py --out_dir bench_out              # SmolLM2 shape, this device
    PYTHONPATH=. python benchmarks/step_vs_pool.py --preset llama3_8b --dtype bfloat16 --pools 256,4096

Times one single-row decode step (`ModelRunner.forward`) and one 8-step on-device decode loop with pools of
each size, random weights, the default kernels of the device. Goal: the 4,096-block figure within
1.2x of the 256-block one. Writes step_vs_pool_<device>.json.
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from model.config import ModelConfig
from model.sampling import SamplingTensors
from model.transformer import random_model
from serving.engine.runner import ModelRunner, RowInput

FLAGS = flags.FLAGS
flags.DEFINE_string("preset", "smollm2_135m", "model shape (random weights)")
flags.DEFINE_string("dtype", "float32", "float32 or bfloat16")
flags.DEFINE_string("pools", "256,4096", "pool sizes in blocks")
flags.DEFINE_integer("repeats", 5, "timed repetitions")
flags.DEFINE_string("out_dir", "bench_out", "where the JSON goes")


def _time(fn, repeats: int) -> float:
    fn()
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def main(argv):
    del argv
    cfg = ModelConfig.preset(FLAGS.preset)
    model = random_model(cfg, jnp.dtype(FLAGS.dtype))
    rows = [RowInput([5], 40, [1, 2, 3])]
    st = SamplingTensors.from_rows([{}])
    banned = np.full((8, 1, 1), -1, np.int32)
    results = []
    for blocks in [int(b) for b in FLAGS.pools.split(",")]:
        runner = ModelRunner(
            model, num_blocks=blocks, block_size=16, max_num_seqs=16, max_num_batched_tokens=256, max_model_len=2048
        )
        step = _time(lambda r=runner: jax.block_until_ready(r.forward(rows)), FLAGS.repeats)
        loop = _time(lambda r=runner: r.decode_loop(rows, 8, st, banned).fetch(), FLAGS.repeats)
        results.append(dict(num_blocks=blocks, step_ms=step * 1e3, loop8_ms=loop * 1e3))
        print(f"{blocks:6d} blocks: decode step {step * 1e3:8.2f} ms, 8-step loop {loop * 1e3:8.2f} ms", flush=True)
        del runner
    first, last = results[0], results[-1]
    summary = dict(
        device=jax.devices()[0].device_kind,
        preset=FLAGS.preset,
        dtype=FLAGS.dtype,
        results=results,
        step_ratio=last["step_ms"] / first["step_ms"],
        loop_ratio=last["loop8_ms"] / first["loop8_ms"],
    )
    print(
        f"ratio {last['num_blocks']} / {first['num_blocks']}: step {summary['step_ratio']:.2f}x, "
        f"loop {summary['loop_ratio']:.2f}x"
    )
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    name = summary["device"].replace(" ", "_")
    with open(os.path.join(FLAGS.out_dir, f"step_vs_pool_{name}.json"), "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    app.run(main)
