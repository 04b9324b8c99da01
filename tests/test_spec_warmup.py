"""Speculation compiles nothing while serving: SpecDecoder.warmup covers every verify shape a step can reach."""

from __future__ import annotations

import numpy as np

from model.config import ModelConfig
from model.transformer import random_model
from serving.engine.llm import LLM
from serving.spec.verify import _verify_rows


def _prompts(seed: int, n: int) -> list[list[int]]:
    """n prompts with a repeated 8-token pattern (the n-gram proposer drafts from it) after a random head."""
    r = np.random.default_rng(seed)
    pat = r.integers(3, 512, 8).tolist()
    return [r.integers(3, 512, int(r.integers(10, 40))).tolist() + pat * 4 for _ in range(n)]


def test_verify_shapes_are_warmed():
    model = random_model(ModelConfig.tiny(vocab_size=512))
    llm = LLM.from_model(
        model,
        attention_backend="xla",
        max_num_seqs=4,
        max_num_batched_tokens=256,
        block_size=16,
        num_kv_blocks=200,
        decode_steps=4,
        max_model_len=256,
        speculative_method="ngram",
        num_speculative_tokens=4,
        warmup=False,
    )
    spec = llm.engine.spec
    spec.warmup()
    warmed = _verify_rows._cache_size()
    # logits buckets 4, 8, 16, 20 (S = 4 rows, up to 5 logits each) x drafting rows 1, 2, 4
    assert warmed >= len(llm.engine.runner.logit_buckets) * 3
    for n in (1, 2, 3, 4):
        llm.generate(_prompts(n, n), max_tokens=24, temperature=0.0, ignore_eos=True)
    assert spec.counters.passes > 0  # the verify path ran
    assert _verify_rows._cache_size() == warmed, "a verify shape compiled while serving"
