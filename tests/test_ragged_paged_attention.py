"""Tests of the ragged (mixed prefill + decode) paged attention kernel against its float32 reference.

Batches mix prefill chunks with prior context, decode rows, speculative-verify rows, a sequence with no
query tokens this step, padded sequence slots and padding token rows. Pages outside every block table and
slots past each sequence's kv_len hold NaN (see test_paged_attention.build_pool). In interpret mode Pallas
starts every output buffer as NaN, so a live row that no tile writes fails the finiteness check of rel_err.
Both work-list schedules ("interleave", "prefill_first") run in the sweep.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_attention as pa
from pallas_kernels import ragged_paged_attention as rpa

HAS_GPU = any(d.platform == "gpu" for d in jax.devices())
QUANT_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))

# (q_len, kv_len) per live sequence: chunk with prior context, decode, fresh prefill, idle, decode at 1,
# speculative verify of 3 tokens, long decode.
MIXED = [(5, 25), (1, 513), (17, 17), (0, 40), (1, 1), (3, 127), (1, 1023)]


def _build_pool(rng, kv_lens, **kwargs):
    from test_paged_attention import build_pool  # shared page-pool builder (tests/ is on sys.path)

    return build_pool(rng, kv_lens, **kwargs)


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all(), "non-finite output"
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def make_batch(
    rng,
    seqs,
    *,
    pad_slots=2,
    pad_tokens=3,
    group=2,
    num_kv_heads=2,
    head_dim=64,
    page_size=16,
    dtype=jnp.float32,
    q_dtype=None,
    window=None,
):
    """Inputs for `seqs` [(q_len, kv_len)] plus `pad_slots` unused sequence slots and `pad_tokens` rows.

    With a `window`, keys before every query row's window are poisoned and their wholly-dead pages freed."""
    kv_lens = [kv for _, kv in seqs] + [0] * pad_slots
    # The first query row of a sequence sits at kv - q and sees keys > kv - q - window.
    dead = None if window is None else [max(kv - q - window + 1, 0) for q, kv in seqs] + [0] * pad_slots
    pool = _build_pool(
        rng,
        kv_lens,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        dtype=dtype,
        dead_before=dead,
    )
    cu = np.concatenate([[0], np.cumsum([q for q, _ in seqs] + [0] * pad_slots)]).astype(np.int32)
    num_tokens = int(cu[-1]) + pad_tokens
    q_dtype = q_dtype or (dtype if jnp.dtype(dtype) not in QUANT_DTYPES else jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((num_tokens, num_kv_heads * group, head_dim)), q_dtype)
    args = (
        q,
        pool["k_pages"],
        pool["v_pages"],
        jnp.asarray(pool["block_tables"]),
        jnp.asarray(kv_lens, jnp.int32),
        jnp.asarray(cu),
        jnp.int32(len(seqs)),
    )
    return args, dict(k_scales=pool["k_scales"], v_scales=pool["v_scales"])


class RaggedAttentionTestBase:
    backend: str = "interpret"

    def run_case(self, seqs, *, config=rpa.RaggedConfig(), seed=0, window=None, **kwargs):
        args, scales = make_batch(np.random.default_rng(seed), seqs, window=window, **kwargs)
        out = rpa.ragged_paged_attention(*args, **scales, backend=self.backend, config=config, window=window)
        ref = rpa.reference(*args, **scales, window=window)
        assert out.shape == args[0].shape and out.dtype == args[0].dtype
        live = int(args[5][int(args[6])])
        np.testing.assert_array_equal(np.asarray(out, np.float32)[live:], 0.0)  # padding rows
        return out, ref

    @pytest.mark.parametrize(
        "group,head_dim,page_size,rows,small_rows,block_tokens,schedule",
        [
            (1, 64, 16, 16, 0, 16, "interleave"),
            (3, 64, 32, 64, 16, 64, "interleave"),
            (4, 128, 16, 32, 16, 32, "interleave"),
            (8, 64, 128, 64, 16, 64, "interleave"),
            (2, 64, 16, 64, 0, 128, "prefill_first"),
            (2, 64, 32, 64, 32, 32, "prefill_first"),
            (4, 256, 64, 64, 16, 64, "interleave"),
            (3, 64, 16, 64, 16, 32, "prefill_first"),
        ],
    )
    def test_mixed_f32(self, group, head_dim, page_size, rows, small_rows, block_tokens, schedule):
        config = rpa.RaggedConfig(
            block_q_rows=rows, small_q_rows=small_rows, block_tokens=block_tokens, schedule=schedule
        )
        out, ref = self.run_case(MIXED, group=group, head_dim=head_dim, page_size=page_size, config=config)
        assert rel_err(out, ref) < 1e-4

    def test_prefill_chunks_only(self):
        seqs = [(40, 40), (33, 100), (64, 64 + 513)]
        out, ref = self.run_case(
            seqs, group=4, pad_slots=0, pad_tokens=0, config=rpa.RaggedConfig(block_q_rows=32, block_tokens=32)
        )
        assert rel_err(out, ref) < 1e-4

    def test_bf16_bounds(self):
        out, ref = self.run_case(MIXED, group=4, dtype=jnp.bfloat16)
        assert rel_err(out, ref) < 1e-2

    @pytest.mark.parametrize("block_tokens,small_block_tokens,page_size", [(32, 128, 16), (64, 16, 32)])
    def test_small_block_tokens(self, block_tokens, small_block_tokens, page_size):
        config = rpa.RaggedConfig(block_q_rows=32, block_tokens=block_tokens, small_block_tokens=small_block_tokens)
        out, ref = self.run_case(MIXED, group=4, page_size=page_size, config=config)
        assert rel_err(out, ref) < 1e-4

    def test_schedules_agree(self):
        seqs = [(40, 100), (1, 300), (1, 7), (2, 64), (1, 1)]  # 5 prefill tiles and 4 small tiles
        kwargs = dict(block_q_rows=32, block_tokens=32)
        mixed, ref = self.run_case(seqs, group=4, config=rpa.RaggedConfig(schedule="interleave", **kwargs))
        first, _ = self.run_case(seqs, group=4, config=rpa.RaggedConfig(schedule="prefill_first", **kwargs))
        assert rel_err(mixed, ref) < 1e-4
        np.testing.assert_allclose(np.asarray(mixed), np.asarray(first), rtol=1e-5, atol=1e-6)

    @pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn])
    def test_quantised_pages(self, dtype):
        out, ref = self.run_case(MIXED, group=4, page_size=32, dtype=dtype)
        assert rel_err(out, ref) < 2e-2

    @pytest.mark.parametrize(
        "window,page_size,rows,block_tokens", [(1, 16, 32, 32), (20, 16, 32, 32), (64, 32, 64, 64), (100, 16, 16, 16)]
    )
    def test_sliding_window(self, window, page_size, rows, block_tokens):
        """Prefill chunks crossing the window edge and decode rows; keys before each window are NaN."""
        seqs = MIXED + [(70, 300), (40, 40)]
        config = rpa.RaggedConfig(block_q_rows=rows, block_tokens=block_tokens)
        out, ref = self.run_case(seqs, group=4, page_size=page_size, config=config, window=window)
        assert rel_err(out, ref) < 1e-4

    def test_window_decode_rows_match_paged_kernel(self):
        seqs = [(1, n) for n in (1, 3, 127, 513)]
        args, _ = make_batch(np.random.default_rng(6), seqs, group=4, pad_slots=0, pad_tokens=0, window=50)
        ragged = rpa.ragged_paged_attention(*args, backend=self.backend, window=50)
        decode = pa.paged_attention(*args[:5], backend=self.backend, window=50)
        np.testing.assert_allclose(np.asarray(ragged), np.asarray(decode), rtol=1e-4, atol=1e-5)

    def test_decode_rows_match_paged_kernel(self):
        seqs = [(1, n) for n in (1, 3, 127, 513)]
        args, _ = make_batch(np.random.default_rng(5), seqs, group=4, pad_slots=0, pad_tokens=0)
        q, k, v, bt, kv_lens = args[:5]
        ragged = rpa.ragged_paged_attention(*args, backend=self.backend)
        decode = pa.paged_attention(q, k, v, bt, kv_lens, backend=self.backend)
        np.testing.assert_allclose(np.asarray(ragged), np.asarray(decode), rtol=1e-4, atol=1e-5)


class TestRaggedAttentionInterpret(RaggedAttentionTestBase):
    backend = "interpret"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
class TestRaggedAttentionGpu(RaggedAttentionTestBase):
    backend = "triton"

    def test_large_mixed_default_config(self):
        rng = np.random.default_rng(2)
        seqs = [(512, 2048)] * 2 + [(1, int(n)) for n in rng.integers(1, 2049, size=20)]
        out, ref = self.run_case(seqs, group=4, num_kv_heads=8, head_dim=128, dtype=jnp.bfloat16)
        assert rel_err(out, ref) < 1e-2


def test_tile_metadata_exact():
    cu = jnp.asarray([0, 5, 6, 23, 23, 26, 26], jnp.int32)  # q_lens 5, 1, 17, 0, 3 | padding slot
    kwargs = dict(block_q=8, small_block_q=4, max_tiles=10)
    p, s = rpa.PREFILL_TILE, rpa.SMALL_TILE
    tiles = np.asarray(rpa.tile_metadata(cu, jnp.int32(5), schedule="prefill_first", **kwargs))
    np.testing.assert_array_equal(
        tiles[:, :7], [[p, p, p, p, s, s, 0], [0, 2, 2, 2, 1, 4, 0], [0, 6, 14, 22, 5, 23, 0]]
    )
    np.testing.assert_array_equal(tiles[0, 6:], rpa.NO_TILE)
    # interleave: prefill keys (2i+1)*2 = 2, 6, 10, 14; small keys (2j+1)*4 = 4, 12 -> p0 s0 p1 p2 s1 p3
    tiles = np.asarray(rpa.tile_metadata(cu, jnp.int32(5), schedule="interleave", **kwargs))
    np.testing.assert_array_equal(
        tiles[:, :7], [[p, s, p, p, s, p, 0], [0, 1, 2, 2, 4, 2, 0], [0, 5, 6, 14, 23, 22, 0]]
    )
    tiles = np.asarray(rpa.tile_metadata(cu, jnp.int32(5), block_q=8, small_block_q=0, max_tiles=10))
    np.testing.assert_array_equal(tiles[:2, :7], [[p] * 6 + [0], [0, 1, 2, 2, 2, 4, 0]])  # all prefill
    tiles = np.asarray(rpa.tile_metadata(cu, jnp.int32(2), **kwargs))  # slots 2.. are padding
    np.testing.assert_array_equal(tiles[0, :3], [p, s, 0])


@pytest.mark.parametrize("num_big,num_small", [(0, 5), (5, 0), (64, 60), (3, 17), (17, 3)])
def test_interleave_is_a_permutation(num_big, num_small):
    q_lens = [8] * num_big + [1] * num_small  # one prefill tile per 8-token sequence
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    tiles = np.asarray(
        rpa.tile_metadata(
            cu,
            jnp.int32(len(q_lens)),
            block_q=8,
            small_block_q=4,
            max_tiles=num_big + num_small + 2,
            schedule="interleave",
        )
    )
    kinds = tiles[0, : num_big + num_small]
    assert (kinds == rpa.PREFILL_TILE).sum() == num_big and (kinds == rpa.SMALL_TILE).sum() == num_small
    assert sorted(tiles[1, : num_big + num_small]) == list(range(num_big + num_small))  # each sequence once
    if num_big and num_small:  # evenly spread: every run of one kind is at most ceil(ratio) + 1 long
        runs = np.diff(np.flatnonzero(np.diff(np.r_[-1, kinds, -1])))
        assert runs.max() <= -(-max(num_big, num_small) // min(num_big, num_small)) + 1


def test_reference_decode_rows_match_paged_reference():
    seqs = [(1, n) for n in (1, 7, 40)]
    args, _ = make_batch(np.random.default_rng(4), seqs, group=2, pad_slots=0, pad_tokens=0)
    ragged = rpa.reference(*args)
    decode = pa.reference(*args[:5])
    np.testing.assert_allclose(np.asarray(ragged), np.asarray(decode), rtol=1e-5, atol=1e-6)


def _valid_args():
    q = jnp.zeros((6, 4, 16), jnp.float32)
    pages = jnp.zeros((2, 4, 16, 16), jnp.float32)
    return dict(
        q=q,
        k_pages=pages,
        v_pages=pages,
        block_tables=jnp.zeros((2, 2), jnp.int32),
        kv_lens=jnp.ones((2,), jnp.int32),
        cu_q_lens=jnp.asarray([0, 1, 2], jnp.int32),
        num_seqs=jnp.int32(2),
    )


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(q=jnp.zeros((6, 3, 16))), "multiple of Hkv"),
        (dict(q=jnp.zeros((6, 4, 32))), "head_dim"),
        (dict(q=jnp.zeros((6, 4))), r"\[T, Hq, D\]"),
        (dict(v_pages=jnp.zeros((2, 4, 16, 16), jnp.bfloat16)), "differ"),
        (dict(k_scales=jnp.ones((2, 4, 16))), "scales given"),
        (dict(kv_lens=jnp.ones((3,), jnp.int32)), "kv_lens"),
        (dict(cu_q_lens=jnp.asarray([0, 1], jnp.int32)), "cu_q_lens"),
        (dict(num_seqs=jnp.ones((2,), jnp.int32)), "num_seqs"),
        (dict(block_tables=jnp.zeros((2,), jnp.int32)), "block_tables"),
        (dict(window=0), "window"),
        (dict(window=-3), "window"),
    ],
)
def test_validation_errors(change, match):
    args = _valid_args() | change
    with pytest.raises(ValueError, match=match):
        rpa.ragged_paged_attention(**args, backend="interpret")


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(block_q_rows=8),
        dict(block_q_rows=48),
        dict(block_tokens=100),
        dict(small_q_rows=8),
        dict(small_q_rows=24),
        dict(num_warps=5),
        dict(num_stages=0),
        dict(schedule="paired"),
        dict(small_block_tokens=8),
        dict(small_block_tokens=48),
    ],
)
def test_config_validation(kwargs):
    with pytest.raises(ValueError):
        rpa.RaggedConfig(**kwargs)
