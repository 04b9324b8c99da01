"""MoE router load statistics: counted on device by the runner (padding excluded, prefill steps and decode loops
alike), read without blocking, exposed on /metrics as per-layer, per-expert counters and an imbalance gauge."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from model.config import ModelConfig
from model.sampling import SamplingTensors
from model.transformer import random_model
from serving.api.async_engine import EngineStats
from serving.api.metrics import ServerMetrics
from serving.engine.runner import ModelRunner, RowInput


def test_runner_counts_real_tokens_top_k_times():
    cfg = ModelConfig.tiny_moe()
    runner = ModelRunner(
        random_model(cfg, jnp.float32, seed=1),
        num_blocks=16,
        block_size=4,
        max_num_seqs=2,
        max_num_batched_tokens=16,
        max_model_len=32,
        attention_backend="xla",
        executable_cache_dir=None,
    )
    assert runner.router_load().shape == (cfg.num_layers, cfg.num_experts) and runner.router_load().sum() == 0
    runner.forward([RowInput(list(range(3, 10)), 0, [1, 2]), RowInput([4, 5], 0, [3])])  # 9 real of 16 tokens
    load = runner.router_load()
    assert load.tolist() == np.asarray(runner.router_tokens).tolist()
    assert (load.sum(axis=1) == 9 * cfg.num_experts_per_tok).all(), load
    st = SamplingTensors.from_rows([{}, {}])
    banned = np.full((3, 2, 1), -1, np.int32)
    handle = runner.decode_loop([RowInput([7], 7, [1, 2]), RowInput([8], 2, [3])], 3, st, banned, np.array([3, 1]))
    handle.fetch()
    load = np.asarray(runner.router_tokens)
    assert (load.sum(axis=1) == (9 + 3 + 1) * cfg.num_experts_per_tok).all(), load  # a row past its limit: 0


def test_metrics_render_router_load():
    stats = EngineStats(router_tokens=np.array([[6, 2, 0, 0], [2, 2, 2, 2]]))
    text = ServerMetrics(lambda: stats).render().decode()
    assert 'pallas_serve_moe_routed_tokens_total{expert="0",layer="0"} 6.0' in text
    assert 'pallas_serve_moe_expert_load_imbalance{layer="0"} 3.0' in text
    assert 'pallas_serve_moe_expert_load_imbalance{layer="1"} 1.0' in text
    dense = ServerMetrics(lambda: EngineStats()).render().decode()
    assert "moe_" not in dense
