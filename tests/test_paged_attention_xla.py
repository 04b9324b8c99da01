"""The XLA paged attention (the CPU host's serving path) against the float32 references, and its cost against
the block-table width: a step's work follows the keys its rows attend, so a wider table changes neither the
output nor the step's temporary memory (the references gather whole table rows and grow with it).

Batches come from tests/test_ragged_paged_attention.py: prefill chunks with prior context, decode and verify
rows, an idle sequence, padded slots and token rows, non-divisible lengths (25, 127, 513, 1023), NaN in every
slot no sequence owns.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_ragged_paged_attention import MIXED, make_batch, rel_err

from pallas_kernels import paged_attention as pa
from pallas_kernels import paged_attention_xla as px
from pallas_kernels import ragged_paged_attention as rpa


def _run(args, scales=None, **kw):
    return px.ragged_attention(*args, **(scales or {}), sm_scale=1 / math.sqrt(args[0].shape[-1]), **kw)


@pytest.mark.parametrize(
    "seqs,batch_kw,tiles",
    [
        (MIXED, dict(group=3, page_size=16), {}),
        (MIXED, dict(group=4, page_size=32), dict(q_tile=7, kv_tile=48)),  # tiles that divide nothing
        ([(40, 40), (33, 100), (64, 577)], dict(group=2, pad_slots=0, pad_tokens=0), dict(q_tile=16, kv_tile=16)),
        (MIXED + [(70, 300)], dict(group=4, window=20), {}),
        (MIXED, dict(group=4, page_size=32, dtype=jnp.int8), {}),
    ],
)
def test_matches_ragged_reference(seqs, batch_kw, tiles):
    window = batch_kw.get("window")
    args, scales = make_batch(np.random.default_rng(0), seqs, **batch_kw)
    out = _run(args, scales, window=window, **tiles)
    ref = rpa.reference(*args, **scales, window=window)
    assert out.shape == args[0].shape and out.dtype == jnp.float32
    assert rel_err(out, ref) < 1e-5
    live = int(args[5][int(args[6])])
    np.testing.assert_array_equal(np.asarray(out)[live:], 0.0)


@pytest.mark.parametrize("window", [None, 50])
def test_decode_matches_paged_reference(window):
    seqs = [(1, n) for n in (1, 3, 127, 513)]
    args, _ = make_batch(np.random.default_rng(6), seqs, group=4, pad_slots=0, pad_tokens=0, window=window)
    lengths = args[4].at[0].set(0)  # a padding row: zeros
    out = px.decode_attention(*args[:4], lengths, sm_scale=0.125, window=window)
    ref = pa.reference(*args[:4], lengths, sm_scale=0.125, window=window)
    assert rel_err(out, ref) < 1e-5
    np.testing.assert_array_equal(np.asarray(out[0]), 0.0)


def test_sinks_match_dense_softmax():
    seqs = [(5, 25), (1, 130), (0, 9), (17, 17)]
    args, _ = make_batch(np.random.default_rng(3), seqs, group=2, pad_slots=1, pad_tokens=2)
    q, k_pages, v_pages, tables, kv_lens, cu, _ = (np.asarray(a) for a in args)
    sinks = np.random.default_rng(4).standard_normal(q.shape[1]).astype(np.float32)
    out = np.asarray(_run(args, sinks=jnp.asarray(sinks), q_tile=4, kv_tile=32))
    expected = np.zeros_like(q)
    for s, (q_len, kv_len) in enumerate(seqs):
        k = k_pages[:, tables[s]].reshape(k_pages.shape[0], -1, q.shape[2])[:, :kv_len]  # [Hkv, L, D]
        v = v_pages[:, tables[s]].reshape(k_pages.shape[0], -1, q.shape[2])[:, :kv_len]
        for j in range(q_len):
            t, pos = cu[s] + j, kv_len - q_len + j
            for h in range(q.shape[1]):
                logits = k[h // 2, : pos + 1] @ q[t, h] / math.sqrt(q.shape[2])
                m = max(logits.max(), sinks[h])
                p = np.exp(logits - m)
                expected[t, h] = p @ v[h // 2, : pos + 1] / (p.sum() + np.exp(sinks[h] - m))
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)


def test_wider_table_same_output():
    """Extra table columns (a wider width bucket) hold pages the loop never reaches: bit-identical output."""
    args, scales = make_batch(np.random.default_rng(1), MIXED, group=3)
    wide = list(args)
    wide[3] = jnp.pad(args[3], ((0, 0), (0, 1000)), constant_values=np.iinfo(np.int32).max)  # not even valid ids
    np.testing.assert_array_equal(np.asarray(_run(args, scales)), np.asarray(_run(wide, scales)))


def _temp_bytes(fn, width: int) -> int:
    """Temporary memory XLA plans for one step: 256 query tokens, 16 sequence slots, SmolLM2's heads."""
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    pages = f32(3, 600, 16, 64)
    lowered = jax.jit(fn).lower(f32(256, 9, 64), pages, pages, i32(16, width), i32(16), i32(17), i32())
    return lowered.compile().memory_analysis().temp_size_in_bytes


def test_step_memory_does_not_grow_with_table_width():
    narrow = _temp_bytes(lambda *a: px.ragged_attention(*a, sm_scale=0.125), 16)
    wide = _temp_bytes(lambda *a: px.ragged_attention(*a, sm_scale=0.125), 512)
    assert wide <= 1.1 * narrow + (1 << 16), (narrow, wide)
    # The reference gathers whole table rows: the same check fails there (its temporaries grow ~32x).
    assert _temp_bytes(rpa.reference, 512) > 10 * _temp_bytes(rpa.reference, 16)


def test_xla_backend_runs_this_path():
    args, _ = make_batch(np.random.default_rng(2), MIXED, group=3)
    out = rpa.ragged_paged_attention(*args, backend="xla")
    np.testing.assert_array_equal(np.asarray(out), np.asarray(_run(args)))
    args, _ = make_batch(np.random.default_rng(5), [(1, n) for n in (1, 127, 513)], pad_slots=0, pad_tokens=0)
    decode = pa.paged_attention(*args[:5], backend="xla")
    direct = px.decode_attention(*args[:5], sm_scale=1 / 8)
    np.testing.assert_array_equal(np.asarray(decode), np.asarray(direct))
