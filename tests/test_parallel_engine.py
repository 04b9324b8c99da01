"""Tensor and expert parallel serving on forced CPU devices: the engine on a mesh must generate exactly what it
generates on one device.

Each test runs SCRIPT in a fresh process with XLA_FLAGS=--xla_force_host_platform_device_count=8 (the device count
is fixed at JAX start-up). The script builds the same random float32 model once per mesh, serves the same greedy
requests through LLMEngine with the XLA reference kernels (chunked prefill: a 21-token prompt over a 16-token
budget; 4-step decode loops; prefix caching: a second batch shares a cached prompt's blocks) and checks, per mesh:

  * the generated token ids equal the one-device engine's, request by request;
  * the KV pages are really split: each device holds 1/tp of the (possibly repeated) KV heads, read from the
    arrays' shardings; the routed experts are split over expert x tensor as sharding/rules.py says;
  * the prefix cache was hit in the second batch, and (MoE) the router statistics count every real token k times.
"""

from __future__ import annotations

import json

import pytest

from tests.script_run import run_script

SCRIPT = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from checkpoints.tokenizer import NullTokenizer
from model.config import ModelConfig
from flax import nnx
from model.transformer import _param_slots as param_slots, random_model
from serving.config import EngineConfig
from serving.engine.engine import LLMEngine
from sharding.rules import kv_cache_heads

family, meshes = sys.argv[1], json.loads(sys.argv[2])
cfg = {
    "dense": ModelConfig.tiny(num_heads=8, num_kv_heads=2),
    "smollm2": ModelConfig.smollm2_135m().replace(num_layers=2, vocab_size=1024, max_position_embeddings=256),
    "moe": ModelConfig.tiny_moe(num_experts=8, num_heads=8, num_kv_heads=2),
}[family]
rng = np.random.default_rng(0)
a, c = rng.integers(3, 500, 21).tolist(), rng.integers(3, 500, 3).tolist()
b = a[:12] + rng.integers(3, 500, 5).tolist()  # shares a's first 3 blocks of 4 tokens
options = dict(attention_backend="xla", max_num_seqs=4, max_num_batched_tokens=16, block_size=4, num_kv_blocks=48,
               decode_steps=4, enable_prefix_caching=True, max_model_len=64, warmup=False,
               compilation_cache_dir="")  # off: a stored one-device executable reloads wrongly in a multi-device process
results = {}
for degrees in [{}] + meshes:
    engine = LLMEngine(random_model(cfg, jnp.float32, seed=7), NullTokenizer(),
                       EngineConfig.from_kwargs(**options, **degrees))
    first = engine.generate([None] * 2, [a, c], max_tokens=9, temperature=0.0, ignore_eos=True)
    hits = engine.scheduler.prefix_hit_tokens
    second = engine.generate([None] * 2, [b, a], max_tokens=6, temperature=0.0, ignore_eos=True)
    assert engine.scheduler.prefix_hit_tokens >= hits + 12, (hits, engine.scheduler.prefix_hit_tokens)
    runner, tp = engine.runner, degrees.get("tensor_parallel_size", 1)
    for k_pages, v_pages in runner.kv_cache:
        heads = kv_cache_heads(cfg.num_kv_heads, runner.mesh)
        assert k_pages.shape[0] == heads and heads % tp == 0, (k_pages.shape, tp)
        for pages in (k_pages, v_pages):
            assert pages.sharding.shard_shape(pages.shape)[0] == heads // tp, pages.sharding
            assert len(pages.sharding.device_set) == runner.mesh.size
    if cfg.is_moe:
        w = param_slots(nnx.merge(runner.graphdef, runner.params))["layers.0.w_gate_up"][...]
        n = degrees.get("expert_parallel_size", 1) * tp
        split = n if cfg.num_experts % n == 0 else degrees.get("expert_parallel_size", 1)
        assert w.sharding.shard_shape(w.shape)[0] == cfg.num_experts // split, w.sharding
        routed = np.asarray(runner.router_tokens)
        assert routed.shape == (cfg.num_layers, cfg.num_experts) and len(set(routed.sum(1))) == 1, routed
    results[json.dumps(degrees)] = [list(o.token_ids) for o in first + second]
base = results.pop("{}")
for key, got in results.items():
    assert got == base, (key, got, base)
print("ok", json.dumps({"tokens": base, "meshes": list(results)}))
"""


def _run(family: str, meshes: list[dict]) -> dict:
    return run_script(SCRIPT, family, json.dumps(meshes), devices=8, timeout=900)


def _tp(n: int) -> dict:
    return {"tensor_parallel_size": n}


@pytest.mark.slow
def test_tensor_parallel_dense_2_4_8():
    """GQA 8/2: KV heads split at tp=2, repeated to one per device at tp=4 and 8."""
    out = _run("dense", [_tp(2), _tp(4), _tp(8)])
    assert len(out["meshes"]) == 3 and all(len(t) in (9, 6) for t in out["tokens"])


@pytest.mark.slow
def test_tensor_parallel_smollm2_shape():
    """SmolLM2-135M's attention and MLP shapes (9 query / 3 KV heads, so tp=3: the only degree dividing 9 on 8
    devices), two layers and a small vocabulary; the refusal of tp=2 is in test_invalid_meshes_are_refused."""
    _run("smollm2", [_tp(3)])


@pytest.mark.slow
def test_expert_parallel_2_4_8_and_composed_with_tensor_parallel():
    """EP alone at 2, 4 and 8; TP alone (the 8 experts spread over the tensor axis); TP x EP (over both: 2 experts
    per device at 2 x 2, one at 2 x 4). One process and one one-device reference for all six meshes (each engine
    compiles its own steps; a second process would only repeat the JAX start-up and the reference); a mismatch
    names its mesh."""
    meshes = [{"expert_parallel_size": n} for n in (2, 4, 8)] + [
        _tp(2),
        {"tensor_parallel_size": 2, "expert_parallel_size": 2},
        {"tensor_parallel_size": 2, "expert_parallel_size": 4},
    ]
    out = _run("moe", meshes)
    assert out["meshes"] == [json.dumps(m) for m in meshes]


def test_invalid_meshes_are_refused():
    """check_parallel (what the engine runs before building its mesh) names the number that is wrong."""
    from model.config import ModelConfig
    from serving.config import EngineConfig
    from sharding.config import ParallelConfig, check_parallel

    smol, moe = ModelConfig.smollm2_135m(), ModelConfig.tiny_moe()
    cases = [
        (ParallelConfig(tp=4, ep=4), moe, "needs 16 devices; only 8 exist"),
        (ParallelConfig(tp=2), smol, "tensor_parallel_size=2 does not divide num_heads=9"),
        (ParallelConfig(tp=3), smol.replace(num_heads=12, num_kv_heads=2), "num_kv_heads=2 of smollm2_135m: one must"),
        (ParallelConfig(ep=2), smol, "expert_parallel_size=2 needs an MoE model"),
        (ParallelConfig(ep=4), moe, "expert_parallel_size=4 does not divide num_experts=6"),
        (ParallelConfig(pp=8), smol.replace(num_layers=4), "pipeline_parallel_size=8 exceeds num_layers=4"),
    ]
    for parallel, cfg, message in cases:
        with pytest.raises(ValueError, match=message):
            check_parallel(parallel, cfg, 8)
    check_parallel(ParallelConfig(tp=3), smol, 8)
    check_parallel(ParallelConfig(tp=2, ep=3), moe, 8)
    assert EngineConfig.from_kwargs(tensor_parallel_size=4, expert_parallel_size=2).parallel == ParallelConfig(
        tp=4, ep=2
    )
    assert EngineConfig.from_kwargs(data_parallel_size=2).parallel == ParallelConfig(dp=2)  # test_parallel_data.py
    with pytest.raises(ValueError, match="data_parallel_size=2 x tensor_parallel_size=8 x .* needs 16 devices"):
        check_parallel(ParallelConfig(dp=2, tp=8), ModelConfig.tiny(num_heads=8), 8)
