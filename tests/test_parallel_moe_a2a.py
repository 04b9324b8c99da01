"""Expert parallelism by all-to-all (model/moe.py), on forced CPU devices (a fresh process each, 8 devices).

* Numerics: the MoE block on a mesh gives the one-device block's output (float32, jitted) and router counts, for EP
  2/4/8, TP x EP (experts over both axes), TP only (experts over the tensor axis) and 6 experts on TP 4 x EP 2
  (split over the expert axis only); with token counts that do not divide the devices (padding rows that route
  nowhere) and a router that sends every token to the first device's experts (the dropless worst case: one
  destination receives every assignment).
* The compiled engine step: per MoE layer three all-to-alls (rows, their expert ids, the results) and one
  all-gather back into the replicated residual stream, and no other collective inside the expert shard_map (the
  former path's psum, an all-reduce of [T, D] per layer, is gone); an EP-only mesh has no all-reduce at all.
The engine-level checks (greedy tokens equal to one device through chunked prefill, decode loops and prefix
caching, for EP 2/4/8 and TP x EP) are tests/test_parallel_engine.py's.
"""

from __future__ import annotations

from tests.script_run import run_script

BLOCK_SCRIPT = r"""
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from model import moe
from model.config import ModelConfig
from sharding.mesh import ParallelConfig, make_mesh

cases = [
    (8, ParallelConfig(ep=2)), (8, ParallelConfig(ep=4)), (8, ParallelConfig(ep=8)), (8, ParallelConfig(tp=2, ep=2)),
    (8, ParallelConfig(tp=2, ep=4)), (8, ParallelConfig(tp=2)), (6, ParallelConfig(tp=4, ep=2)),
    (6, ParallelConfig(tp=2, ep=3)),
]
# The one-device reference, jitted: unjitted, every new (experts, tokens) shape compiled each op of the block again,
# which was half of this script's time.
reference = nnx.jit(lambda block, x: block(x))
for num_experts, par in cases:
    cfg = ModelConfig.tiny_moe(num_experts=num_experts)
    block = moe.MoEMLP(cfg, jnp.float32, nnx.Rngs(params=num_experts))
    mesh = make_mesh(par, devices=jax.devices()[:par.num_devices])
    assert block._expert_axes(mesh), par
    sharded = nnx.jit(lambda block, x: block(x, mesh=mesh))
    for skewed in (False, True):
        if skewed:  # every token to experts 0 and 1: all on the first device
            router = np.zeros((cfg.hidden_size, num_experts), np.float32)
            router[:, 0], router[:, 1] = 5.0, 4.0
            block.w_router[...] = jnp.asarray(router)
        for t in (1, 13):
            x = jax.random.normal(jax.random.key(t), (t, cfg.hidden_size), jnp.float32)
            x = jnp.abs(x) if skewed else x
            (want, want_counts), (got, got_counts) = reference(block, x), sharded(block, x)
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5, err_msg=str(par))
            np.testing.assert_array_equal(np.asarray(got_counts), np.asarray(want_counts))
            if skewed:
                assert int(want_counts[0]) == int(want_counts[1]) == t, want_counts
print("ok")
"""

HLO_SCRIPT = r"""
import re
import jax
from model.config import ModelConfig
from model.transformer import random_model
from serving.engine.runner import ModelRunner
from sharding.mesh import ParallelConfig, make_mesh

COLLECTIVE = re.compile(r" (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")
for layers in (2, 3):
    cfg = ModelConfig.tiny_moe(num_experts=8, num_heads=8, num_kv_heads=2, num_layers=layers)
    for par in (ParallelConfig(ep=4), ParallelConfig(ep=8), ParallelConfig(tp=2, ep=2)):
        mesh = make_mesh(par, devices=jax.devices()[:par.num_devices])
        runner = ModelRunner(random_model(cfg), num_blocks=16, block_size=4, max_num_seqs=2,
                             max_num_batched_tokens=16, max_model_len=32, attention_backend="xla", mesh=mesh)
        for decode_only, t in ((False, 16), (True, 2)):
            lines = runner._get_step(t, 2, runner.width_buckets[0], decode_only, 2).as_text().splitlines()
            ops = [(m.group(1), line) for line in lines if (m := COLLECTIVE.search(line))]
            inside = [k for k, line in ops if 'op_name="jit(step)/shard_map' in line]
            where = (layers, par, decode_only, [line[:200] for _, line in ops])
            assert sorted(inside) == sorted((["all-to-all"] * 3 + ["all-gather"]) * layers), where
            assert sum(k == "all-to-all" for k, _ in ops) == 3 * layers, where
            if par.tp == 1:
                assert sorted({k for k, _ in ops}) == ["all-gather", "all-to-all"], where
print("ok")
"""


def _run(script: str) -> None:
    run_script(script, devices=8, timeout=900)


def test_expert_parallel_block_matches_one_device():
    _run(BLOCK_SCRIPT)


def test_all_to_all_dispatch_in_compiled_step():
    _run(HLO_SCRIPT)
