"""Tensor parallelism in the compiled program, on forced CPU devices (a fresh process each, 8 devices).

* Communication: the compiled HLO of a model step has exactly 2 all-reduces per layer (Megatron: column-parallel
  q/k/v and gate/up, row-parallel wo and down, each row-parallel matmul then all-reduced), plus the one of the
  vocab-parallel embedding lookup, and no other collective: the LM head's logits stay vocab-sharded. Counted at
  2 and 3 layers and tp = 2 and 4, so a per-layer extra or a missing all-reduce both fail.
* The Pallas kernels (interpreter) inside shard_map over the tensor axis give the one-device logits, for the
  ragged (prefill) and paged (decode) kernels, with KV heads split (tp=2) and repeated (tp=4 over 2 KV heads).
"""

from __future__ import annotations

from tests.script_run import run_script

HLO_SCRIPT = r"""
import re
import jax
from model.config import ModelConfig
from model.transformer import random_model
from serving.engine.runner import ModelRunner
from sharding.mesh import ParallelConfig, make_mesh

COLLECTIVE = re.compile(r"= \S+ (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")
for layers in (2, 3):
    for tp in (2, 4):
        cfg = ModelConfig.tiny(num_heads=8, num_kv_heads=2, num_layers=layers)
        mesh = make_mesh(ParallelConfig(tp=tp), devices=jax.devices()[:tp])
        runner = ModelRunner(random_model(cfg), num_blocks=16, block_size=4, max_num_seqs=2,
                             max_num_batched_tokens=16, max_model_len=32, attention_backend="xla", mesh=mesh)
        for decode_only, t in ((False, 16), (True, 2)):
            lines = runner._get_step(t, 2, runner.width_buckets[0], decode_only, 2).as_text().splitlines()
            ops = [(m.group(1), line) for line in lines if (m := COLLECTIVE.search(line))]
            kinds = sorted({k for k, _ in ops})
            layer_ars = [line for k, line in ops if k == "all-reduce" and "dot_general" in line]
            embed_ars = [line for k, line in ops if k == "all-reduce" and "gather" in line]
            assert kinds == ["all-reduce"], (layers, tp, kinds)
            assert len(layer_ars) == 2 * layers and len(embed_ars) == 1 and len(ops) == 2 * layers + 1, (
                layers, tp, decode_only, [line[:160] for _, line in ops])
print("ok")
"""

KERNEL_SCRIPT = r"""
import jax, jax.numpy as jnp, numpy as np
from model.config import ModelConfig
from model.transformer import random_model
from serving.engine.runner import ModelRunner, RowInput
from sharding.mesh import ParallelConfig, make_mesh

cfg = ModelConfig.tiny(num_heads=8, num_kv_heads=2, num_layers=1, vocab_size=128)
rng = np.random.default_rng(1)
prompt, other = rng.integers(3, 120, 13).tolist(), rng.integers(3, 120, 6).tolist()
out = {}
for tp in (1, 2, 4):
    mesh = make_mesh(ParallelConfig(tp=tp), devices=jax.devices()[:tp])
    runner = ModelRunner(random_model(cfg, seed=5), num_blocks=12, block_size=8, max_num_seqs=2,
                         max_num_batched_tokens=32, max_model_len=32, attention_backend="interpret", mesh=mesh)
    prefill = runner.forward([RowInput(prompt, 0, [1, 2]), RowInput(other, 0, [3])])
    decode = runner.forward([RowInput([5], 13, [1, 2]), RowInput([9], 6, [3])])
    pages = runner.kv_cache[0][0]
    assert pages.sharding.shard_shape(pages.shape)[0] == pages.shape[0] // tp, pages.sharding
    out[tp] = np.asarray(prefill)[:2], np.asarray(decode)[:2]
for tp in (2, 4):
    for got, want in zip(out[tp], out[1]):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
print("ok")
"""


def _run(script: str) -> None:
    run_script(script, devices=8)


def test_two_all_reduces_per_layer_per_step():
    _run(HLO_SCRIPT)


def test_pallas_kernels_inside_shard_map_match_one_device():
    _run(KERNEL_SCRIPT)
