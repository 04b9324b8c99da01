"""ModelRunner seams: verify rows (logits at every query token), mesh placement, chained decode loops.

The tiny model runs in float32 with the XLA reference kernels, so the paged runner must reproduce full-sequence
scoring (no cache) to float rounding.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.config import ModelConfig
from model.sampling import SamplingTensors
from model.transformer import random_model
from serving.engine.runner import ModelRunner, RowInput
from tests.script_run import run_script

BS = 4


def _runner(model, **kw):
    args = dict(num_blocks=64, block_size=BS, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    args.update(kw)
    return ModelRunner(model, attention_backend="xla", **args)


def _scores(model, ids, pad_to: int = 16):
    """Full-sequence logits [len(ids), V], from one jitted forward padded to `pad_to` tokens (causal: the padding
    changes no row kept; unjitted, every new length compiled each op of the model again)."""
    from serving.engine.llm import _score

    padded = list(ids) + [0] * (pad_to - len(ids))
    return np.asarray(_score(model, jnp.asarray([padded], jnp.int32))[0, : len(ids)])


@pytest.fixture(scope="module")
def model():
    return random_model(ModelConfig.tiny(), jnp.float32, seed=3)


def _table(first: int, n_tokens: int) -> list[int]:
    return list(range(first, first + -(-n_tokens // BS)))


def test_verify_rows_return_logits_at_every_query_token(model):
    """Row A: a prompt prefilled, then k+1 = 4 tokens verified at once; row B: a plain decode row (k = 0);
    row C: a whole prompt with logits everywhere. Each logit equals full-sequence scoring at that position."""
    rng = np.random.default_rng(0)
    a = rng.integers(3, 500, 11).tolist()
    b = rng.integers(3, 500, 6).tolist()
    c = rng.integers(3, 500, 5).tolist()
    runner = _runner(model, max_logits_per_row=5)
    ta, tb, tc = _table(1, len(a)), _table(10, len(b)), _table(20, len(c))
    runner.forward([RowInput(a[:7], 0, ta), RowInput(b[:5], 0, tb)])  # prefill the first parts
    logits = np.asarray(
        runner.forward([RowInput(a[7:], 7, ta, num_logits=4), RowInput(b[5:], 5, tb), RowInput(c, 0, tc, 5)])
    )
    assert logits.shape[0] == 16  # the L bucket holding 4 + 1 + 5 logits (S=4 doubling: 4, 8, 16, 20)
    np.testing.assert_allclose(logits[0:4], _scores(model, a)[7:11], atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(logits[4], _scores(model, b)[5], atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(logits[5:10], _scores(model, c), atol=2e-5, rtol=2e-5)


def test_num_logits_out_of_range_is_refused(model):
    runner = _runner(model, max_logits_per_row=2)
    with pytest.raises(ValueError, match="num_logits"):
        runner.prepare([RowInput([5, 6], 0, [1], num_logits=3)])
    with pytest.raises(ValueError, match="max_logits_per_row"):
        runner.prepare([RowInput([5, 6, 7], 0, [1], num_logits=3)] * 4)


def test_params_and_pages_live_on_the_mesh(model):
    runner = _runner(model)
    leaves = jax.tree.leaves(runner.params) + [a for kv in runner.kv_cache for a in kv]
    for leaf in leaves:
        assert isinstance(leaf.sharding, jax.sharding.NamedSharding)
        assert leaf.sharding.mesh.shape == runner.mesh.shape
    assert runner.mesh.devices.size == 1  # one device is a mesh of one


def test_chained_decode_loop_equals_two_loops(model):
    """A loop whose input tokens come from the previous loop's device output equals feeding them from the host."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 500, n).tolist() for n in (5, 9)]
    k = 3

    def prefill(runner):
        tables = [_table(1, 32), _table(12, 32)]
        logits = np.asarray(runner.forward([RowInput(p, 0, t) for p, t in zip(prompts, tables)]))
        first = logits[:2].argmax(-1)
        return tables, first

    def loop(runner, tables, tok, start, chain=None):
        rows = [RowInput([int(t)], s, tb) for t, s, tb in zip(tok, start, tables)]
        st = SamplingTensors.from_rows([{}] * 2)
        return runner.decode_loop(rows, k, st, np.full((k, 2, 1), -1, np.int32), chain=chain)

    r1 = _runner(model)
    tables, first = prefill(r1)
    starts = [len(p) for p in prompts]
    h1 = loop(r1, tables, first, starts)
    tok1, _ = h1.fetch()
    h2 = loop(r1, tables, tok1[-1], [s + k for s in starts])
    host_fed = h2.fetch()[0]

    r2 = _runner(model)
    tables, first = prefill(r2)
    g1 = loop(r2, tables, first, starts)
    g2 = loop(r2, tables, [0, 0], [s + k for s in starts], chain=(g1, [0, 1]))  # tokens stay on the device
    np.testing.assert_array_equal(g2.fetch()[0], host_fed)
    np.testing.assert_array_equal(g1.fetch()[0], tok1)


TP_SCRIPT = r"""
import jax, jax.numpy as jnp, numpy as np
from model.config import ModelConfig
from model.transformer import random_model
from serving.engine.runner import ModelRunner, RowInput
from sharding.mesh import ParallelConfig, make_mesh

cfg = ModelConfig.tiny()
ids = [5, 17, 230, 41, 9, 77, 301]
out = {}
for tp in (1, 2):
    mesh = make_mesh(ParallelConfig(tp=tp), devices=jax.devices()[:tp])
    runner = ModelRunner(random_model(cfg, jnp.float32, seed=3), num_blocks=16, block_size=4, max_num_seqs=2,
                         max_num_batched_tokens=16, max_model_len=32, attention_backend="xla", mesh=mesh)
    wq = runner.params["layers"][0]["attn"]["wqkv"][...]  # fused q|k|v, split per shard
    pages = runner.kv_cache[0][0]
    if tp == 2:
        assert wq.sharding.shard_shape(wq.shape)[1] == wq.shape[1] // 2, wq.sharding
        assert pages.sharding.shard_shape(pages.shape)[0] == pages.shape[0] // 2, pages.sharding
    out[tp] = np.asarray(runner.forward([RowInput(ids, 0, [1, 2])]))
np.testing.assert_allclose(out[2][0], out[1][0], atol=1e-5, rtol=1e-5)
print("ok")
"""


def test_tensor_parallel_mesh_places_shards_and_matches_one_device():
    """tp=2 on forced CPU devices: weights split by heads / MLP width, KV pages by KV head, same logits."""
    run_script(TP_SCRIPT, devices=8, timeout=300)


def test_executable_cache_loads_without_compiling(model, tmp_path):
    """A second runner with the same cache directory loads every warm-up executable (no trace, no compile) and
    computes the same logits; a corrupt entry is a miss, not a failure. Two rows and one 16-token bucket: 3
    executables, each compiled twice (the first and the third runner), rather than the module runner's 5."""
    rows = [RowInput([5, 6, 7], 0, [1]), RowInput([9], 4, [2, 3])]
    small = dict(max_num_seqs=2, max_num_batched_tokens=16, executable_cache_dir=str(tmp_path))
    first = _runner(model, **small)
    n = first.warmup()
    assert first.num_compiles == first._cache.misses == n > 1
    expected = np.asarray(first.forward(rows))
    second = _runner(model, **small)
    assert second.warmup() == n and second._cache.hits == n and second._cache.misses == 0
    np.testing.assert_array_equal(np.asarray(second.forward(rows)), expected)
    for f in tmp_path.iterdir():
        f.write_bytes(b"not an executable")
    third = _runner(model, **small)
    assert third.warmup() == n and third._cache.misses == n  # every entry unreadable: compiled again
    np.testing.assert_array_equal(np.asarray(third.forward(rows)), expected)


def test_executable_cache_key_follows_sources(model, monkeypatch):
    from serving.engine import executable_cache as ec

    runner = _runner(model)
    key, _, args = runner.warmup_plan()[0]
    before = ec.cache_key(key, args, runner.mesh)
    assert ec.cache_key(key, args, runner.mesh) == before
    monkeypatch.setattr(ec, "source_fingerprint", lambda: "edited kernel")
    assert ec.cache_key(key, args, runner.mesh) != before


def test_steps_never_copy_the_kv_pool(model):
    """A step's cost follows its work, not the pool: no compiled step, ragged step or decode loop copies a KV
    page array (XLA once fused the page scatter into the attention read and copied the donated pool per layer)."""
    runner = _runner(model, num_blocks=96)
    pool = f"f32[{model.cfg.num_kv_heads},96,{BS},{model.cfg.head_dim}]"
    w = runner.width_buckets[0]
    executables = {
        "decode": runner._get_step(1, 1, w, True, 1),
        "ragged": runner._get_step(16, runner.max_num_seqs, w, False, runner.max_num_seqs),
        "loop": runner._get_loop(4, 1, w),
    }
    for name, exe in executables.items():
        copies = [line for line in exe.as_text().splitlines() if " copy(" in line and pool in line]
        assert not copies, f"{name} copies the KV pool: {copies[:2]}"


def test_sampling_tensors_columns_match_the_per_row_dicts():
    """sampler.sampling_tensors builds columns from tuples; it must equal SamplingTensors.from_rows on the dicts."""
    from serving.core.request import Request, SamplingParams
    from serving.engine.sampler import sampling_tensors as _sampling_tensors

    params = [
        SamplingParams(max_tokens=4, temperature=0.0, seed=3),
        SamplingParams(max_tokens=4, temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, seed=2**33 + 7),
        SamplingParams(
            max_tokens=4,
            temperature=1.1,
            repetition_penalty=1.2,
            presence_penalty=0.5,
            frequency_penalty=-0.25,
            seed=11,
        ),
    ]
    reqs = [Request(str(i), [1, 2, 3], p) for i, p in enumerate(params)]
    reqs[1].output_token_ids.extend([5, 6])
    got = _sampling_tensors(reqs, [0, 2, 1])
    rows = [
        dict(
            temperature=p.temperature,
            top_k=p.top_k,
            top_p=p.top_p,
            min_p=p.min_p,
            repetition_penalty=p.repetition_penalty,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            seed=p.seed % 2**32,
            step=r.num_output_tokens + a,
        )
        for r, p, a in zip(reqs, params, [0, 2, 1])
    ]
    want = SamplingTensors.from_rows(rows)
    for field in dataclasses.fields(SamplingTensors):
        g, w = getattr(got, field.name), getattr(want, field.name)
        assert g.dtype == w.dtype and g.shape == (3,), field.name
        np.testing.assert_array_equal(g, w, err_msg=field.name)
    assert _sampling_tensors([], 0).temperature.shape == (0,)


def test_pad_sampling_pads_with_greedy_rows():
    from model.sampling import pad_sampling

    st = SamplingTensors.from_rows([dict(temperature=0.7, top_k=5, top_p=0.9, seed=3, step=2)] * 3)
    padded = pad_sampling(st, 8)
    for name in ("temperature", "top_k", "top_p", "min_p", "seed", "step", "repetition_penalty"):
        a, b = getattr(st, name), getattr(padded, name)
        assert b.shape == (8,) and b.dtype == a.dtype, name
        np.testing.assert_array_equal(b[:3], a)
        np.testing.assert_array_equal(b[3:], 0)  # temperature 0: the padding rows are greedy
    assert pad_sampling(st, 3).temperature.tolist() == st.temperature.tolist()
    with pytest.raises(ValueError):
        pad_sampling(st, 2)  # more rows than the bucket
