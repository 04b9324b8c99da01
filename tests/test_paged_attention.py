"""Tests of the paged decode attention kernel against its float32 reference.

One shared base (`PagedAttentionTestBase`) runs in Pallas interpret mode on CPU and through Triton on a GPU.
Every case shuffles the page pool, fills pages outside every block table (and slots past each sequence's
length) with NaN, and points padding block-table entries at NaN pages, so any unmasked read shows up.
In interpret mode Pallas starts every output buffer as NaN, so an unwritten tile fails rel_err's finiteness check.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_attention as pa

HAS_GPU = any(d.platform == "gpu" for d in jax.devices())
QUANT_MAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}


def build_pool(rng, seq_lens, *, num_kv_heads, head_dim, page_size, dtype, spare_pages=3, dead_before=None):
    """Random shuffled page pool for sequences of `seq_lens` tokens, poisoned outside them.

    `dead_before` [S] (sliding windows): keys below it are outside every query's window, so they are poisoned
    too, and table entries of pages wholly below it point at a poisoned spare page, as after the engine freed
    them.

    Returns:
        dict with k_pages, v_pages [Hkv, P, ps, D] in `dtype`, k_scales / v_scales [Hkv, P, ps] (or None),
        block_tables [S, max_blocks] int32.
    """
    needed = [math.ceil(n / page_size) for n in seq_lens]
    num_pages = sum(needed) + spare_pages
    perm = rng.permutation(num_pages)
    spare = perm[sum(needed) :]
    max_blocks = max(needed + [0]) + 1  # at least one padding column
    block_tables = rng.choice(spare, size=(len(seq_lens), max_blocks)).astype(np.int32)
    poison = np.ones((num_pages, page_size), bool)  # [P, ps] slots no sequence owns
    used = 0
    for s, (n, p) in enumerate(zip(seq_lens, needed)):
        block_tables[s, :p] = perm[used : used + p]
        slot = np.arange(p * page_size)
        dead = 0 if dead_before is None else dead_before[s]
        poison[perm[used : used + p]] = ((slot >= n) | (slot < dead)).reshape(p, page_size)
        used += p
        freed = max(0, min(p, dead // page_size))  # pages wholly before the window
        block_tables[s, :freed] = spare[0]
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    out = {"block_tables": block_tables}
    for name in ("k", "v"):
        x = rng.standard_normal(shape).astype(np.float32)
        pages, scales = quantize(x, poison, dtype)
        out[f"{name}_pages"], out[f"{name}_scales"] = pages, scales
    return out


def quantize(x, poison, dtype):
    """Per-token-per-head symmetric quantisation; NaN in poisoned slots (values and scales)."""
    dtype = jnp.dtype(dtype)
    if dtype not in QUANT_MAX:
        x = x.copy()
        x[:, poison] = np.nan
        return jnp.asarray(x, dtype), None
    scales = np.abs(x).max(-1) / QUANT_MAX[dtype]  # [Hkv, P, ps]
    vals = x / scales[..., None]
    if dtype == jnp.int8:
        pages = np.clip(np.round(vals), -127, 127).astype(np.int8)
    else:
        pages = vals.astype(dtype)  # ml_dtypes float8 cast in numpy
        pages[:, poison] = np.nan
    scales[:, poison] = np.nan
    return jnp.asarray(pages), jnp.asarray(scales, jnp.float32)


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all(), "non-finite output"
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


class PagedAttentionTestBase:
    backend: str = "interpret"

    def run_case(
        self,
        *,
        lengths,
        group,
        num_kv_heads=2,
        head_dim=64,
        page_size=16,
        dtype=jnp.float32,
        q_dtype=None,
        config=pa.PagedAttentionConfig(),
        seed=0,
        window=None,
    ):
        rng = np.random.default_rng(seed)
        dead = None if window is None else [max(n - window, 0) for n in lengths]
        pool = build_pool(
            rng,
            lengths,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            page_size=page_size,
            dtype=dtype,
            dead_before=dead,
        )
        q_dtype = q_dtype or (dtype if jnp.dtype(dtype) not in QUANT_MAX else jnp.bfloat16)
        q = jnp.asarray(rng.standard_normal((len(lengths), num_kv_heads * group, head_dim)), q_dtype)
        args = (q, pool["k_pages"], pool["v_pages"], jnp.asarray(pool["block_tables"]), jnp.asarray(lengths, jnp.int32))
        scales = dict(k_scales=pool["k_scales"], v_scales=pool["v_scales"])
        out = pa.paged_attention(*args, **scales, backend=self.backend, config=config, window=window)
        ref = pa.reference(*args, **scales, window=window)
        assert out.shape == q.shape and out.dtype == q.dtype
        zero = np.asarray(lengths) == 0
        np.testing.assert_array_equal(np.asarray(out, np.float32)[zero], 0.0)
        return out, ref

    @pytest.mark.parametrize(
        "group,head_dim,page_size,num_splits",
        [
            (1, 64, 16, 1),
            (3, 64, 32, 4),
            (4, 128, 16, 2),
            (8, 64, 128, 1),
            (4, 64, 16, 8),
            (8, 128, 32, None),
            (2, 256, 64, 2),
        ],
    )
    def test_lengths_f32(self, group, head_dim, page_size, num_splits):
        config = pa.PagedAttentionConfig(block_tokens=32, num_splits=num_splits)
        out, ref = self.run_case(
            lengths=[0, 1, 3, 127, 513], group=group, head_dim=head_dim, page_size=page_size, config=config
        )
        assert rel_err(out, ref) < 1e-4

    def test_long_split_vs_unsplit(self):
        lengths = [1023, 640, 17]
        one, ref = self.run_case(lengths=lengths, group=4, config=pa.PagedAttentionConfig(num_splits=1))
        many, _ = self.run_case(lengths=lengths, group=4, config=pa.PagedAttentionConfig(num_splits=4))
        assert rel_err(one, ref) < 1e-4 and rel_err(many, ref) < 1e-4
        np.testing.assert_allclose(np.asarray(one), np.asarray(many), atol=1e-5, rtol=1e-4)

    @pytest.mark.parametrize("group,page_size", [(4, 16), (3, 128)])
    def test_bf16_bounds(self, group, page_size):
        out, ref = self.run_case(
            lengths=[1, 3, 127, 513],
            group=group,
            page_size=page_size,
            dtype=jnp.bfloat16,
            config=pa.PagedAttentionConfig(num_splits=2),
        )
        assert rel_err(out, ref) < 1e-2

    def test_f32_query_bf16_pages(self):
        out, ref = self.run_case(lengths=[5, 200], group=2, dtype=jnp.bfloat16, q_dtype=jnp.float32)
        assert out.dtype == jnp.float32 and rel_err(out, ref) < 1e-2

    @pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn])
    @pytest.mark.parametrize("num_splits", [1, 4])
    def test_quantised_pages(self, dtype, num_splits):
        out, ref = self.run_case(
            lengths=[0, 1, 3, 127, 513],
            group=4,
            page_size=32,
            dtype=dtype,
            config=pa.PagedAttentionConfig(num_splits=num_splits),
        )
        assert rel_err(out, ref) < 2e-2

    @pytest.mark.parametrize(
        "window,page_size,block_tokens,num_splits",
        [(1, 16, 32, 1), (40, 16, 32, 1), (40, 16, 64, 4), (100, 32, 32, 2), (512, 16, 32, None), (7, 64, 64, 1)],
    )
    def test_sliding_window(self, window, page_size, block_tokens, num_splits):
        """Keys before each window are NaN and their freed pages point at a NaN page: only the window is read."""
        config = pa.PagedAttentionConfig(block_tokens=block_tokens, num_splits=num_splits)
        lengths = [0, 1, 3, 39, 41, 127, 513, 700]
        out, ref = self.run_case(lengths=lengths, group=4, page_size=page_size, config=config, window=window)
        assert rel_err(out, ref) < 1e-4

    def test_sliding_window_quantised_pages(self):
        config = pa.PagedAttentionConfig(block_tokens=32, num_splits=2)
        out, ref = self.run_case(lengths=[1, 40, 300], group=4, page_size=16, dtype=jnp.int8, config=config, window=33)
        assert rel_err(out, ref) < 2e-2


class TestPagedAttentionInterpret(PagedAttentionTestBase):
    backend = "interpret"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
class TestPagedAttentionGpu(PagedAttentionTestBase):
    backend = "triton"

    def test_large_batch_default_config(self):
        lengths = list(np.random.default_rng(1).integers(0, 4097, size=24))
        out, ref = self.run_case(lengths=lengths, group=4, num_kv_heads=8, head_dim=128, dtype=jnp.bfloat16)
        assert rel_err(out, ref) < 1e-2


def _small_inputs(q_heads=4, kv_heads=2, head_dim=16, dtype=jnp.float32):
    q = jnp.zeros((2, q_heads, head_dim), jnp.float32)
    pages = jnp.zeros((kv_heads, 4, 16, head_dim), dtype)
    return q, pages, pages, jnp.zeros((2, 2), jnp.int32), jnp.ones((2,), jnp.int32)


def test_reference_matches_dense_softmax():
    rng = np.random.default_rng(3)
    pool = build_pool(rng, [37], num_kv_heads=1, head_dim=16, page_size=16, dtype=jnp.float32)
    q = rng.standard_normal((1, 2, 16)).astype(np.float32)
    out = pa.reference(
        jnp.asarray(q),
        pool["k_pages"],
        pool["v_pages"],
        jnp.asarray(pool["block_tables"]),
        jnp.asarray([37], jnp.int32),
    )
    pages = pool["block_tables"][0, :3]
    k = np.asarray(pool["k_pages"])[0, pages].reshape(-1, 16)[:37]
    v = np.asarray(pool["v_pages"])[0, pages].reshape(-1, 16)[:37]
    logits = q[0] @ k.T / 4.0
    p = np.exp(logits - logits.max(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(out[0]), (p / p.sum(-1, keepdims=True)) @ v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window", [1, 5, 36, 37, 100])
def test_reference_window_matches_dense_softmax(window):
    rng = np.random.default_rng(4)
    pool = build_pool(rng, [37], num_kv_heads=1, head_dim=16, page_size=16, dtype=jnp.float32)
    q = rng.standard_normal((1, 2, 16)).astype(np.float32)
    args = (jnp.asarray(q), pool["k_pages"], pool["v_pages"], jnp.asarray(pool["block_tables"]))
    out = pa.reference(*args, jnp.asarray([37], jnp.int32), window=window)
    pages = pool["block_tables"][0, :3]
    k = np.asarray(pool["k_pages"])[0, pages].reshape(-1, 16)[:37][-window:]
    v = np.asarray(pool["v_pages"])[0, pages].reshape(-1, 16)[:37][-window:]
    logits = q[0] @ k.T / 4.0
    p = np.exp(logits - logits.max(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(out[0]), (p / p.sum(-1, keepdims=True)) @ v, rtol=1e-5, atol=1e-6)


class _XlaCase(PagedAttentionTestBase):
    backend = "xla"


def test_xla_backend_is_reference():
    out, ref = _XlaCase().run_case(lengths=[0, 9], group=2)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-6, atol=1e-6)


def test_choose_num_splits():
    config = pa.PagedAttentionConfig()
    assert pa.choose_num_splits(pa.PagedAttentionConfig(num_splits=4), 1, 1, 2) == 2  # capped by blocks
    assert pa.choose_num_splits(config, 512, 8, 256) == 1  # plenty of programs already
    assert pa.choose_num_splits(config, 1, 1, 4) == 1  # too short to split
    assert pa.choose_num_splits(config, 8, 8, 64) > 1


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda a: a.update(q=jnp.zeros((2, 3, 16))), "multiple of Hkv"),
        (lambda a: a.update(q=jnp.zeros((2, 4, 32))), "head_dim"),
        (lambda a: a.update(q=jnp.zeros((2, 4, 16, 1))), r"\[B, Hq, D\]"),
        (lambda a: a.update(k_pages=jnp.zeros((2, 4, 16)), v_pages=jnp.zeros((2, 4, 16))), "Hkv, num_pages"),
        (lambda a: a.update(v_pages=jnp.zeros((2, 5, 16, 16))), "differ"),
        (lambda a: a.update(k_scales=jnp.ones((2, 4, 16))), "scales given"),
        (lambda a: a.update(k_pages=a["k_pages"].astype(jnp.int8), v_pages=a["v_pages"].astype(jnp.int8)), "need both"),
        (
            lambda a: a.update(
                k_pages=a["k_pages"].astype(jnp.int8),
                v_pages=a["v_pages"].astype(jnp.int8),
                k_scales=jnp.ones((2, 4, 16)),
                v_scales=jnp.ones((2, 4, 8)),
            ),
            "v_scales",
        ),
        (lambda a: a.update(block_tables=jnp.zeros((3, 2), jnp.int32)), "block_tables"),
        (lambda a: a.update(block_tables=jnp.zeros((2, 2), jnp.float32)), "block_tables"),
        (lambda a: a.update(lengths=jnp.ones((3,), jnp.int32)), "lengths"),
        (lambda a: a.update(k_pages=jnp.zeros((2, 4, 12, 16)), v_pages=jnp.zeros((2, 4, 12, 16))), "power of 2"),
        (lambda a: a.update(window=0), "window"),
        (lambda a: a.update(window=True), "window"),
    ],
)
def test_validation_errors(mutate, match):
    q, k, v, bt, lengths = _small_inputs()
    args = dict(q=q, k_pages=k, v_pages=v, block_tables=bt, lengths=lengths, k_scales=None, v_scales=None)
    mutate(args)
    with pytest.raises(ValueError, match=match):
        pa.paged_attention(
            args.pop("q"),
            args.pop("k_pages"),
            args.pop("v_pages"),
            args.pop("block_tables"),
            args.pop("lengths"),
            backend="interpret",
            **args,
        )


@pytest.mark.parametrize(
    "kwargs", [dict(block_tokens=24), dict(block_tokens=8), dict(num_splits=0), dict(num_warps=3), dict(num_stages=0)]
)
def test_config_validation(kwargs):
    with pytest.raises(ValueError):
        pa.PagedAttentionConfig(**kwargs)
