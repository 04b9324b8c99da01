"""Host-side cost of the engine's apply of decode loops (CPU, tiny model): cProfile of a batch of requests run to
completion, printing wall time per output token and the functions with the most own time.

    PYTHONPATH=. python benchmarks/host_apply_profile.py --batch 256

On CPU the model's own time shows as `numpy.asarray` (the wait for a loop's tokens); the rest is the host's
scheduling, apply and output work, which on a GPU host must fit inside one loop's device time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import jax.numpy as jnp
import numpy as np

from checkpoints.tokenizer import NullTokenizer
from model.config import ModelConfig
from model.transformer import random_model
from serving.config import EngineConfig
from serving.core.request import SamplingParams
from serving.engine.engine import LLMEngine


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt_len", type=int, default=32)
    p.add_argument("--output_len", type=int, default=200)
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args()
    cfg = ModelConfig.preset("tiny")
    config = EngineConfig.from_kwargs(
        max_model_len=a.prompt_len + a.output_len + 16,
        max_num_seqs=a.batch,
        max_num_batched_tokens=8192,
        decode_steps=8,
        enable_prefix_caching=False,
        warmup=False,
        compilation_cache_dir="",
    )
    engine = LLMEngine(random_model(cfg, jnp.float32), NullTokenizer(), config)
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True)

    def run():
        for _ in range(a.batch):
            engine.add_request(rng.integers(100, cfg.vocab_size, a.prompt_len).tolist(), params)
        while engine.has_unfinished():
            engine.step()

    run()  # compiles every step shape once
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    run()
    prof.disable()
    wall = time.perf_counter() - t0
    n = a.batch * a.output_len
    print(f"host_apply_profile batch {a.batch}: {wall:.3f} s for {n} tokens = {wall / n * 1e6:.1f} us/token")
    pstats.Stats(prof).sort_stats("tottime").print_stats(a.top)


if __name__ == "__main__":
    main()
