"""max_num_seqs and max_num_batched_tokens chosen from device memory and the model when the user sets none
(serving/engine/kv_pool.py), with fake memory figures: the KV pool's tokens at 2,048 a sequence, rounded and
clipped; a CPU host keeps 16 / 256; options the user set are kept."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from model.config import ModelConfig
from model.transformer import abstract_model, random_model
from serving.config import EngineConfig
from serving.engine import kv_pool

GB = 10**9
BF16_8B = 2 * 32 * 8 * 128 * 2  # Llama-3-8B KV bytes per token, bf16 pages
INT8_8B = 2 * 32 * 8 * (128 + 4)  # int8 pages and their float32 scale per token and head


@pytest.mark.parametrize(
    "device,weights,per_token,max_len,want",
    [
        (80 * GB, 16 * GB, BF16_8B, 8192, 192),  # 415k tokens / 2,048 = 202 -> a multiple of 64
        (80 * GB, 8.5 * GB, INT8_8B, 8192, 384),  # fp8 weights, int8 pages: 899k tokens -> 439 -> 384
        (141 * GB, 16 * GB, BF16_8B, 8192, 384),  # an H200: 811k tokens -> 396 -> 384
        (80 * GB, 16 * GB, BF16_8B, 256, 1024),  # short sequences: capped
        (24 * GB, 15 * GB, BF16_8B, 8192, 16),  # little room: clipped up (the scheduler preempts)
        (80 * GB, 70 * GB, BF16_8B, 8192, 16),
        (80 * GB, 60 * GB, BF16_8B, 8192, 32),  # 130k tokens -> 63 -> the power of two below, under 128
        (None, 16 * GB, BF16_8B, 8192, 16),  # a CPU host
    ],
)
def test_default_max_num_seqs(device, weights, per_token, max_len, want):
    assert kv_pool.default_max_num_seqs(device, weights, per_token, 0.85, max_len) == want


def test_default_batched_tokens():
    assert kv_pool.default_max_num_batched_tokens(16, accelerator=False) == 256
    assert kv_pool.default_max_num_batched_tokens(384, accelerator=True) == 2048
    assert kv_pool.default_max_num_batched_tokens(4096, accelerator=True) == 4096


def test_batch_defaults_from_the_model(monkeypatch):
    cfg = ModelConfig.preset("llama3_8b")
    model = abstract_model(cfg, jnp.bfloat16)  # shapes only: 8.0e9 parameters, 16.1 GB of bf16
    config = EngineConfig.from_kwargs(warmup=False)
    kv = jnp.bfloat16
    assert (
        kv_pool.batch_defaults(config, model, kv).to_kwargs()
        == config.replace(max_num_seqs=16, max_num_batched_tokens=256).to_kwargs()
    )  # this CPU: memory not measured per device
    monkeypatch.setattr(kv_pool, "_device_bytes", lambda devices: devices * 80 * GB)
    c = kv_pool.batch_defaults(config, model, kv)
    assert (c.max_num_seqs, c.max_num_batched_tokens) == (192, 2048)
    c = kv_pool.batch_defaults(config.replace(kv_cache_dtype="int8"), model, jnp.int8)
    assert c.max_num_seqs == 384  # int8 pages, twice the tokens: 804k -> 392 -> 384
    kept = kv_pool.batch_defaults(config.replace(max_num_seqs=40), model, kv)
    assert (kept.max_num_seqs, kept.max_num_batched_tokens) == (40, 2048)
    capped = kv_pool.batch_defaults(config.replace(max_num_batched_tokens=100), model, kv)
    assert (capped.max_num_seqs, capped.max_num_batched_tokens) == (100, 100)
    both = config.replace(max_num_seqs=8, max_num_batched_tokens=64)
    assert kv_pool.batch_defaults(both, model, kv) is both


def test_engine_resolves_unset_limits():
    from serving.engine.llm import LLM  # noqa: PLC0415

    model = random_model(ModelConfig.tiny(), jnp.float32, seed=0)
    llm = LLM.from_model(model, None, max_model_len=64, num_kv_blocks=16, warmup=False)
    c = llm.engine.config
    assert (c.max_num_seqs, c.max_num_batched_tokens) == (16, 256)
    assert llm.engine.runner.max_num_seqs == 16 and "16 sequences" in llm.kv_pool_summary()
    assert llm.generate([[5, 17, 29]], max_tokens=3, temperature=0.0)[0].token_ids
