"""Tests of the MLA latent-cache kernels (decode and ragged) against their float32 references.

One shared base per op runs in Pallas interpret mode on CPU and through Triton on a GPU. The latent pool is
shuffled; pages outside every block table and slots past each sequence's length hold NaN, and padding
block-table entries point at NaN pages, so any unmasked read shows up. In interpret mode Pallas starts every
output buffer as NaN, so an unwritten tile fails rel_err's finiteness check.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import mla_paged_attention as mpa
from pallas_kernels import mla_ragged_attention as mra

HAS_GPU = any(d.platform == "gpu" for d in jax.devices())
SCALE = 0.11


def build_latent_pool(rng, kv_lens, *, rank, rope_dim, page_size, dtype, spare_pages=2):
    """Shuffled latent pool [P, ps, R + Dr] for sequences of `kv_lens` tokens, NaN outside them."""
    needed = [math.ceil(n / page_size) for n in kv_lens]
    num_pages = sum(needed) + spare_pages
    perm = rng.permutation(num_pages)
    spare = perm[sum(needed) :]
    block_tables = rng.choice(spare, size=(len(kv_lens), max(needed + [0]) + 1)).astype(np.int32)
    pool = rng.standard_normal((num_pages, page_size, rank + rope_dim)).astype(np.float32)
    poison = np.ones((num_pages, page_size), bool)
    used = 0
    for s, (n, p) in enumerate(zip(kv_lens, needed)):
        block_tables[s, :p] = perm[used : used + p]
        poison[perm[used : used + p]] = (np.arange(p * page_size) >= n).reshape(p, page_size)
        used += p
    pool[poison] = np.nan
    return jnp.asarray(pool, dtype), jnp.asarray(block_tables)


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all(), "non-finite output"
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def queries(rng, n, heads, rank, rope_dim, dtype):
    return (
        jnp.asarray(rng.standard_normal((n, heads, rank)), dtype),
        jnp.asarray(rng.standard_normal((n, heads, rope_dim)), dtype),
    )


class MlaDecodeTestBase:
    backend: str = "interpret"

    def run_case(self, lengths, *, heads, rank=32, rope_dim=16, page_size=16, dtype=jnp.float32, config, seed=0):
        rng = np.random.default_rng(seed)
        pool, tables = build_latent_pool(rng, lengths, rank=rank, rope_dim=rope_dim, page_size=page_size, dtype=dtype)
        q_lat, q_rope = queries(rng, len(lengths), heads, rank, rope_dim, dtype)
        args = (q_lat, q_rope, pool, tables, jnp.asarray(lengths, jnp.int32))
        out = mpa.mla_paged_attention(*args, sm_scale=SCALE, backend=self.backend, config=config)
        ref = mpa.reference(*args, sm_scale=SCALE)
        assert out.shape == q_lat.shape and out.dtype == q_lat.dtype
        np.testing.assert_array_equal(np.asarray(out, np.float32)[np.asarray(lengths) == 0], 0.0)
        return out, ref

    @pytest.mark.parametrize(
        "heads,page_size,block_tokens,num_splits",
        [(1, 16, 16, 1), (5, 8, 32, 3), (16, 32, 16, None), (20, 16, 16, 2)],
    )
    def test_lengths_f32(self, heads, page_size, block_tokens, num_splits):
        config = mpa.MlaDecodeConfig(block_tokens=block_tokens, num_splits=num_splits)
        out, ref = self.run_case([0, 1, 3, 13, 100], heads=heads, page_size=page_size, config=config)
        assert rel_err(out, ref) < 1e-5

    def test_bf16(self):
        config = mpa.MlaDecodeConfig(num_splits=2)
        out, ref = self.run_case([1, 13, 130], heads=3, rank=64, dtype=jnp.bfloat16, config=config)
        assert rel_err(out, ref) < 2e-2


class MlaRaggedTestBase:
    backend: str = "interpret"

    def run_case(self, seqs, *, heads, rank=32, rope_dim=16, page_size=16, dtype=jnp.float32, config, pad=(2, 3)):
        """seqs [(q_len, kv_len)] plus pad[0] unused sequence slots and pad[1] padding token rows."""
        rng = np.random.default_rng(1)
        kv_lens = [kv for _, kv in seqs] + [0] * pad[0]
        pool, tables = build_latent_pool(rng, kv_lens, rank=rank, rope_dim=rope_dim, page_size=page_size, dtype=dtype)
        cu = np.concatenate([[0], np.cumsum([q for q, _ in seqs] + [0] * pad[0])]).astype(np.int32)
        q_lat, q_rope = queries(rng, int(cu[-1]) + pad[1], heads, rank, rope_dim, dtype)
        args = (q_lat, q_rope, pool, tables, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(cu), jnp.int32(len(seqs)))
        out = mra.mla_ragged_attention(*args, sm_scale=SCALE, backend=self.backend, config=config)
        ref = mra.reference(*args, sm_scale=SCALE)
        assert out.shape == q_lat.shape and out.dtype == q_lat.dtype
        np.testing.assert_array_equal(np.asarray(out, np.float32)[int(cu[len(seqs)]) :], 0.0)
        return out, ref

    @pytest.mark.parametrize(
        "heads,page_size,rows,small_rows,schedule",
        [(1, 16, 64, 16, "prefill_first"), (5, 8, 32, 0, "interleave"), (20, 64, 64, 16, "interleave")],
    )
    def test_mixed_f32(self, heads, page_size, rows, small_rows, schedule):
        # chunk with prior context, decode, fresh prefill, idle, decode at 1, verify of 3, long decode
        seqs = [(5, 25), (1, 100), (13, 13), (0, 7), (1, 1), (3, 103)]
        config = mra.MlaRaggedConfig(block_q_rows=rows, small_q_rows=small_rows, block_tokens=32, schedule=schedule)
        out, ref = self.run_case(seqs, heads=heads, page_size=page_size, config=config)
        assert rel_err(out, ref) < 1e-5

    def test_bf16(self):
        out, ref = self.run_case([(3, 40), (1, 13)], heads=3, rank=64, dtype=jnp.bfloat16, config=mra.MlaRaggedConfig())
        assert rel_err(out, ref) < 2e-2


class TestMlaDecodeInterpret(MlaDecodeTestBase):
    backend = "interpret"


class TestMlaRaggedInterpret(MlaRaggedTestBase):
    backend = "interpret"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
class TestMlaDecodeGpu(MlaDecodeTestBase):
    backend = "triton"

    def test_deepseek_shape(self):
        lengths = list(np.random.default_rng(2).integers(0, 2049, size=16))
        config = mpa.MlaDecodeConfig()
        out, ref = self.run_case(lengths, heads=128, rank=512, rope_dim=64, dtype=jnp.bfloat16, config=config)
        assert rel_err(out, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
class TestMlaRaggedGpu(MlaRaggedTestBase):
    backend = "triton"

    def test_deepseek_shape(self):
        seqs = [(200, 300), (1, 1500), (64, 64)] + [(1, 700)] * 8
        config = mra.MlaRaggedConfig()
        out, ref = self.run_case(seqs, heads=16, rank=512, rope_dim=64, page_size=64, dtype=jnp.bfloat16, config=config)
        assert rel_err(out, ref) < 1e-2


def test_decode_reference_matches_numpy():
    rng = np.random.default_rng(3)
    pool, tables = build_latent_pool(rng, [37], rank=16, rope_dim=16, page_size=16, dtype=jnp.float32)
    q_lat, q_rope = queries(rng, 1, 2, 16, 16, jnp.float32)
    out = mpa.reference(q_lat, q_rope, pool, tables, jnp.asarray([37], jnp.int32), sm_scale=SCALE)
    rows = np.asarray(pool)[np.asarray(tables)[0, :3]].reshape(-1, 32)[:37]
    logits = (np.asarray(q_lat[0]) @ rows[:, :16].T + np.asarray(q_rope[0]) @ rows[:, 16:].T) * SCALE
    p = np.exp(logits - logits.max(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(out[0]), (p / p.sum(-1, keepdims=True)) @ rows[:, :16], rtol=1e-5, atol=1e-6)


def test_ragged_reference_decode_rows_match_decode_reference():
    rng = np.random.default_rng(4)
    pool, tables = build_latent_pool(rng, [9, 40], rank=16, rope_dim=16, page_size=8, dtype=jnp.float32)
    q_lat, q_rope = queries(rng, 2, 3, 16, 16, jnp.float32)
    lens = jnp.asarray([9, 40], jnp.int32)
    dec = mpa.reference(q_lat, q_rope, pool, tables, lens, sm_scale=SCALE)
    rag = mra.reference(
        q_lat, q_rope, pool, tables, lens, jnp.asarray([0, 1, 2], jnp.int32), jnp.int32(2), sm_scale=SCALE
    )
    np.testing.assert_allclose(np.asarray(rag), np.asarray(dec), rtol=1e-6, atol=1e-6)


def test_xla_backends_are_references():
    rng = np.random.default_rng(5)
    pool, tables = build_latent_pool(rng, [5], rank=16, rope_dim=16, page_size=8, dtype=jnp.float32)
    q_lat, q_rope = queries(rng, 1, 2, 16, 16, jnp.float32)
    args = (q_lat, q_rope, pool, tables, jnp.asarray([5], jnp.int32))
    np.testing.assert_array_equal(
        mpa.mla_paged_attention(*args, sm_scale=SCALE, backend="xla"), mpa.reference(*args, sm_scale=SCALE)
    )
    rargs = args + (jnp.asarray([0, 1], jnp.int32), jnp.int32(1))
    np.testing.assert_array_equal(
        mra.mla_ragged_attention(*rargs, sm_scale=SCALE, backend="xla"), mra.reference(*rargs, sm_scale=SCALE)
    )


def _decode_args(**change):
    args = dict(
        q_latent=jnp.zeros((2, 4, 32)),
        q_rope=jnp.zeros((2, 4, 16)),
        latent_pages=jnp.zeros((4, 16, 48)),
        block_tables=jnp.zeros((2, 2), jnp.int32),
        lengths=jnp.ones((2,), jnp.int32),
        sm_scale=0.1,
    )
    return args | change


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(q_rope=jnp.zeros((2, 3, 16))), "disagree"),
        (dict(latent_pages=jnp.zeros((4, 16, 40))), "row width"),
        (dict(latent_pages=jnp.zeros((4, 12, 48))), "power of 2"),
        (dict(latent_pages=jnp.zeros((4, 16, 48), jnp.int8)), "dtype"),
        (dict(sm_scale=None), "sm_scale"),
        (dict(sm_scale=-1.0), "sm_scale"),
        (dict(block_tables=jnp.zeros((3, 2), jnp.int32)), "block_tables"),
        (dict(lengths=jnp.ones((2,), jnp.float32)), "lengths"),
        (dict(q_latent=jnp.zeros((2, 4, 24)), latent_pages=jnp.zeros((4, 16, 40))), "kv_lora_rank"),
        (dict(q_rope=jnp.zeros((2, 4, 8)), latent_pages=jnp.zeros((4, 16, 40))), "rope dim"),
    ],
)
def test_decode_validation_errors(change, match):
    with pytest.raises(ValueError, match=match):
        mpa.mla_paged_attention(**_decode_args(**change), backend="interpret")


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(kv_lens=jnp.ones((3,), jnp.int32)), "kv_lens"),
        (dict(cu_q_lens=jnp.zeros((2,), jnp.int32)), "cu_q_lens"),
        (dict(num_seqs=jnp.ones((2,), jnp.int32)), "num_seqs"),
        (dict(sm_scale=None), "sm_scale"),
    ],
)
def test_ragged_validation_errors(change, match):
    args = _decode_args()
    del args["lengths"]
    args |= dict(kv_lens=jnp.ones((2,), jnp.int32), cu_q_lens=jnp.arange(3, dtype=jnp.int32), num_seqs=jnp.int32(2))
    with pytest.raises(ValueError, match=match):
        mra.mla_ragged_attention(**(args | change), backend="interpret")


@pytest.mark.parametrize(
    "cls,kwargs",
    [
        (mpa.MlaDecodeConfig, dict(block_heads=8)),
        (mpa.MlaDecodeConfig, dict(block_tokens=24)),
        (mpa.MlaDecodeConfig, dict(num_splits=0)),
        (mpa.MlaDecodeConfig, dict(num_warps=3)),
        (mra.MlaRaggedConfig, dict(block_q_rows=48)),
        (mra.MlaRaggedConfig, dict(small_q_rows=8)),
        (mra.MlaRaggedConfig, dict(schedule="paired")),
        (mra.MlaRaggedConfig, dict(num_stages=0)),
    ],
)
def test_config_validation(cls, kwargs):
    with pytest.raises(ValueError):
        cls(**kwargs)


def test_benchmark_smoke(monkeypatch, tmp_path):
    """benchmarks/kernels_mla.py end to end through the interpreter: both kinds timed and matching XLA."""
    import json
    import sys

    from benchmarks import kernels_mla

    out = tmp_path / "mla.json"
    monkeypatch.setattr(sys, "argv", ["kernels_mla", "--smoke", "--out", str(out)])
    kernels_mla.main()
    rows = json.loads(out.read_text())["rows"]
    assert [r["kind"] for r in rows] == ["decode", "ragged"]
    assert all(r["pallas_us"] > 0 and r["xla_us"] > 0 and r["rel_err"] < 1e-2 for r in rows)
