"""LLMEngine.warmup compiles the sampler exactly as serving calls it: no sampler compile after the first request.

The sampler's jit keys on the placement of its logits (a step's rows come out of `take_rows`) and on whether
num_logprobs is passed; a warm-up that called it otherwise left every row bucket to compile on first use, in the
middle of serving (found on the H200 by benchmarks/engine_latency.py).
"""

import jax.numpy as jnp

from checkpoints.tokenizer import NullTokenizer
from model.config import ModelConfig
from model.transformer import random_model
from serving.config import EngineConfig
from serving.core.request import SamplingParams
from serving.engine import sampler
from serving.engine.engine import LLMEngine


def test_no_sampler_compile_after_warmup():
    cfg = ModelConfig.preset("tiny")
    config = EngineConfig.from_kwargs(
        max_model_len=128, max_num_seqs=4, decode_steps=1, warmup=False, compilation_cache_dir=""
    )
    engine = LLMEngine(random_model(cfg, jnp.float32), NullTokenizer(), config)
    engine.warmup()
    compiled = sampler.sample_rows._cache_size()
    for i in range(3):  # rows of every count up to 3: buckets 1, 2 and 4 (greedy and random share one executable)
        engine.add_request(list(range(5, 15 + i)), SamplingParams(max_tokens=4, temperature=0.7 * (i % 2), seed=i))
    while engine.has_unfinished():
        engine.step()
    assert sampler.sample_rows._cache_size() == compiled
