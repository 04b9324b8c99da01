"""Attention logit soft-capping (Gemma 2: scaled scores s -> cap * tanh(s / cap)) in the paged decode and ragged
kernels, in Pallas interpret mode, against their references and against plain attention on soft-capped scores.

Scores are scaled up (q * 4) so that the cap bends them: without the cap the outputs differ by far more than the
tolerance, so a kernel that ignored the option fails."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_ragged_paged_attention import MIXED, make_batch, rel_err

from pallas_kernels import paged_attention as pa
from pallas_kernels import ragged_paged_attention as rpa

CAP = 3.0


def _capped_by_hand(q, k_pages, v_pages, block_tables, lengths, cap):
    """Decode attention over each sequence's own keys, written out directly (no shared helper)."""
    hkv, _, ps, d = k_pages.shape
    out = []
    for b in range(q.shape[0]):
        keys = np.concatenate([np.asarray(k_pages[:, p], np.float32) for p in block_tables[b]], axis=1)
        vals = np.concatenate([np.asarray(v_pages[:, p], np.float32) for p in block_tables[b]], axis=1)
        keys, vals = keys[:, : lengths[b]], vals[:, : lengths[b]]
        qb = np.asarray(q[b], np.float32).reshape(hkv, -1, d)
        s = np.einsum("hgd,hld->hgl", qb, keys) / math.sqrt(d)
        s = cap * np.tanh(s / cap)
        p = np.exp(s - s.max(-1, keepdims=True))
        out.append(np.einsum("hgl,hld->hgd", p / p.sum(-1, keepdims=True), vals).reshape(-1, d))
    return np.stack(out)


@pytest.mark.parametrize("window", [None, 7])
def test_paged_decode_softcap(window):
    from test_paged_attention import build_pool

    rng = np.random.default_rng(0)
    lengths = [1, 19, 40]
    pool = build_pool(rng, lengths, num_kv_heads=2, head_dim=32, page_size=8, dtype=jnp.float32)
    q = jnp.asarray(4 * rng.standard_normal((3, 6, 32)), jnp.float32)
    args = (q, pool["k_pages"], pool["v_pages"], jnp.asarray(pool["block_tables"]), jnp.asarray(lengths, jnp.int32))
    kw = dict(window=window, logit_softcap=CAP)
    out = pa.paged_attention(*args, backend="interpret", **kw)
    ref = pa.reference(*args, **kw)
    assert rel_err(out, ref) < 1e-5
    assert rel_err(pa.paged_attention(*args, backend="xla", **kw), ref) < 1e-6
    if window is None:
        by_hand = _capped_by_hand(*args[:3], pool["block_tables"], lengths, CAP)
        assert rel_err(out, by_hand) < 1e-5
    uncapped = pa.reference(*args, window=window)
    assert rel_err(uncapped, ref) > 1e-2, "the cap was meant to change the output"


@pytest.mark.parametrize("window", [None, 9])
def test_ragged_softcap(window):
    args, scales = make_batch(np.random.default_rng(1), MIXED[:3], window=window, head_dim=32, page_size=16)
    args = (4 * args[0], *args[1:])
    kw = dict(window=window, logit_softcap=CAP, **scales)
    out = rpa.ragged_paged_attention(*args, backend="interpret", config=rpa.RaggedConfig(block_tokens=16), **kw)
    ref = rpa.reference(*args, **kw)
    assert rel_err(out, ref) < 1e-5
    assert rel_err(rpa.reference(*args, window=window, **scales), ref) > 1e-2


@pytest.mark.parametrize("cap", [0.0, -1.0, True, "3"])
def test_bad_softcap_is_refused(cap):
    q = jnp.zeros((1, 2, 16), jnp.float32)
    pages = jnp.zeros((1, 2, 4, 16), jnp.float32)
    tables, lengths = jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32)
    with pytest.raises(ValueError, match="logit_softcap"):
        pa.paged_attention(q, pages, pages, tables, lengths, logit_softcap=cap, backend="xla")
    cu = jnp.asarray([0, 1], jnp.int32)
    with pytest.raises(ValueError, match="logit_softcap"):
        rpa.ragged_paged_attention(q, pages, pages, tables, lengths, cu, jnp.int32(1), logit_softcap=cap, backend="xla")


def test_masked_attention_softcap_matches_kernel_reference():
    from model.kv import masked_attention

    rng = np.random.default_rng(2)
    q = jnp.asarray(4 * rng.standard_normal((1, 5, 4, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 5, 2, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((1, 5, 2, 16)), jnp.float32)
    mask = jnp.tril(jnp.ones((5, 5), bool))[None]
    got = masked_attention(q, k, v, mask, None, CAP)
    s = jnp.einsum("tkgd,skd->kgts", q[0].reshape(5, 2, 2, 16), k[0], precision=jax.lax.Precision.HIGHEST) / 4.0
    s = jnp.where(mask[0], CAP * jnp.tanh(s / CAP), -jnp.inf)
    want = jnp.einsum("kgts,skd->tkgd", jax.nn.softmax(s, -1), v[0], precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want).reshape(1, 5, 4, 16), atol=1e-5)
