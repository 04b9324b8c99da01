"""Attention sinks (gpt-oss: a learned logit per query head in every softmax denominator, with no value) in the
paged decode and ragged kernels (Pallas interpret mode; Triton on a GPU), their references, and the plain-jnp
attention of the scoring / contiguous paths (model/kv.py masked_attention), against attention written out by hand.

The sinks are drawn near the scores' scale, so they take a real share of each row: a kernel that ignored them
differs from the reference by far more than the tolerance (checked). GQA groups of 3 (not a power of 2), lengths
0 and 1, sliding windows and split-K decode are the awkward cases.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_ragged_paged_attention import make_batch, rel_err

from pallas_kernels import paged_attention as pa
from pallas_kernels import ragged_paged_attention as rpa

HAS_GPU = any(d.platform == "gpu" for d in jax.devices())
# (q_len, kv_len): a chunk with context, decode, a fresh prefill, an idle slot, decode at 1 (MIXED, shorter).
SEQS = [(5, 25), (1, 40), (17, 17), (0, 9), (1, 1)]


def _sinks(rng, heads):
    return jnp.asarray(1.5 * rng.standard_normal(heads) + 1.0, jnp.float32)


def _decode_by_hand(q, k_pages, v_pages, block_tables, lengths, sinks):
    """Decode attention over each sequence's keys plus a value-less sink column (numpy, no shared helper)."""
    hkv, _, _, d = k_pages.shape
    out = []
    for b in range(q.shape[0]):
        keys = np.concatenate([np.asarray(k_pages[:, p], np.float64) for p in block_tables[b]], axis=1)
        vals = np.concatenate([np.asarray(v_pages[:, p], np.float64) for p in block_tables[b]], axis=1)
        keys, vals = keys[:, : lengths[b]], vals[:, : lengths[b]]
        qb = np.asarray(q[b], np.float64).reshape(hkv, -1, d)
        s = np.einsum("hgd,hld->hgl", qb, keys) / math.sqrt(d)
        s = np.concatenate([s, np.asarray(sinks, np.float64).reshape(hkv, -1, 1)], axis=-1)
        p = np.exp(s - s.max(-1, keepdims=True))
        p = (p / p.sum(-1, keepdims=True))[..., :-1]
        out.append(np.einsum("hgl,hld->hgd", p, vals).reshape(-1, d))
    return np.stack(out)


class SinksTestBase:
    backend = "interpret"

    @pytest.mark.parametrize("window,num_splits", [(None, 1), (None, 4), (7, 2)])
    def test_paged_decode_sinks(self, window, num_splits):
        from test_paged_attention import build_pool

        rng = np.random.default_rng(0)
        lengths = [0, 1, 19, 70]
        dead = None if window is None else [max(n - window, 0) for n in lengths]
        pool = build_pool(rng, lengths, num_kv_heads=2, head_dim=32, page_size=8, dtype=jnp.float32, dead_before=dead)
        q = jnp.asarray(rng.standard_normal((4, 6, 32)), jnp.float32)  # G = 3
        sinks = _sinks(rng, 6)
        args = (q, pool["k_pages"], pool["v_pages"], jnp.asarray(pool["block_tables"]), jnp.asarray(lengths, jnp.int32))
        config = pa.PagedAttentionConfig(block_tokens=16, num_splits=num_splits)
        out = pa.paged_attention(*args, backend=self.backend, config=config, window=window, sinks=sinks)
        ref = pa.reference(*args, window=window, sinks=sinks)
        assert rel_err(out, ref) < 1e-5
        np.testing.assert_array_equal(np.asarray(out)[0], 0.0)  # no keys: the sink takes the whole row
        if window is None:
            assert rel_err(out, _decode_by_hand(*args[:3], pool["block_tables"], lengths, sinks)) < 1e-5
        assert rel_err(pa.reference(*args, window=window), ref) > 1e-2, "the sinks were meant to change the output"

    @pytest.mark.parametrize("window", [None, 9])
    def test_ragged_sinks(self, window):
        rng = np.random.default_rng(1)
        args, scales = make_batch(rng, SEQS, window=window, group=3, head_dim=32, page_size=16)
        sinks = _sinks(rng, 6)
        kw = dict(window=window, sinks=sinks, **scales)
        config = rpa.RaggedConfig(block_tokens=16)
        out = rpa.ragged_paged_attention(*args, backend=self.backend, config=config, **kw)
        ref = rpa.reference(*args, **kw)
        assert rel_err(out, ref) < 1e-5
        live = int(args[5][int(args[6])])
        np.testing.assert_array_equal(np.asarray(out)[live:], 0.0)
        assert rel_err(rpa.reference(*args, window=window, **scales), ref) > 1e-2

    def test_ragged_decode_rows_match_paged_with_sinks(self):
        rng = np.random.default_rng(4)
        args, scales = make_batch(rng, [(1, 33), (1, 5), (1, 18)], pad_slots=0, pad_tokens=0, head_dim=32)
        sinks = _sinks(rng, 4)
        ragged = rpa.ragged_paged_attention(*args, backend=self.backend, sinks=sinks)
        decode = pa.paged_attention(*args[:4], args[4], backend=self.backend, sinks=sinks)
        np.testing.assert_allclose(np.asarray(ragged), np.asarray(decode), rtol=1e-4, atol=1e-5)


class TestSinksInterpret(SinksTestBase):
    backend = "interpret"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
class TestSinksGpu(SinksTestBase):
    backend = "triton"

    def test_bf16_gpt_oss_shape(self):
        """gpt-oss-20b's attention shape: 64 query heads over 8 KV heads of width 64, long mixed rows."""
        rng = np.random.default_rng(5)
        seqs = [(256, 1024), (1, 4000), (1, 77)] + [(1, int(n)) for n in rng.integers(1, 2049, size=8)]
        args, scales = make_batch(rng, seqs, group=8, num_kv_heads=8, head_dim=64, dtype=jnp.bfloat16, window=128)
        sinks = _sinks(rng, 64)
        out = rpa.ragged_paged_attention(*args, backend="triton", window=128, sinks=sinks)
        assert rel_err(out, rpa.reference(*args, window=128, sinks=sinks)) < 1e-2


def test_very_negative_sinks_change_nothing():
    args, scales = make_batch(np.random.default_rng(2), SEQS[:3], head_dim=32)
    none = jnp.full((4,), -1e30, jnp.float32)
    out = rpa.ragged_paged_attention(*args, backend="interpret", sinks=none)
    base = rpa.ragged_paged_attention(*args, backend="interpret")
    np.testing.assert_allclose(np.asarray(out), np.asarray(base), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("sinks", [np.zeros(3, np.float32), np.zeros((2, 2), np.float32), np.zeros(4, np.int32)])
def test_bad_sinks_are_refused(sinks):
    q = jnp.zeros((1, 4, 16), jnp.float32)
    pages = jnp.zeros((2, 2, 4, 16), jnp.float32)
    tables, lengths = jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32)
    with pytest.raises(ValueError, match="sinks"):
        pa.paged_attention(q, pages, pages, tables, lengths, sinks=jnp.asarray(sinks), backend="xla")
    cu = jnp.asarray([0, 1], jnp.int32)
    with pytest.raises(ValueError, match="sinks"):
        rpa.ragged_paged_attention(q, pages, pages, tables, lengths, cu, jnp.int32(1), sinks=jnp.asarray(sinks))


def test_xla_backend_matches_the_reference():
    """The "xla" backends (pallas_kernels/paged_attention_xla.py, the CPU host's serving path) take sinks too."""
    rng = np.random.default_rng(3)
    args, scales = make_batch(rng, SEQS, head_dim=32, window=5)
    sinks = _sinks(rng, 4)
    got = rpa.ragged_paged_attention(*args, backend="xla", window=5, sinks=sinks)
    assert rel_err(got, rpa.reference(*args, window=5, sinks=sinks)) < 1e-5
    args, _ = make_batch(rng, [(1, 33), (1, 5), (1, 18)], pad_slots=0, pad_tokens=0, head_dim=32)
    decode = pa.paged_attention(*args[:5], backend="xla", window=5, sinks=sinks)
    assert rel_err(decode, pa.reference(*args[:5], window=5, sinks=sinks)) < 1e-5


def test_masked_attention_sinks_match_by_hand():
    from model.kv import masked_attention

    rng = np.random.default_rng(6)
    q = jnp.asarray(rng.standard_normal((1, 5, 6, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 5, 2, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((1, 5, 2, 16)), jnp.float32)
    mask = jnp.tril(jnp.ones((5, 5), bool))[None] & ~jnp.eye(5, dtype=bool)[None]  # row 0 sees nothing
    sinks = _sinks(rng, 6)
    got = np.asarray(masked_attention(q, k, v, mask, None, None, sinks))
    qn, kn, vn = (np.asarray(x, np.float64)[0] for x in (q, k, v))
    for t in range(5):
        for h in range(6):
            s = [qn[t, h] @ kn[j, h // 3] / 4.0 for j in range(t)] + [float(sinks[h])]
            p = np.exp(np.asarray(s) - max(s))
            p = p[:-1] / p.sum()
            want = p @ vn[:t, h // 3] if t else np.zeros(16)
            np.testing.assert_allclose(got[0, t, h], want, atol=1e-5)
