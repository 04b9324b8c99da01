"""FlashAttention kernel tests: one shared base, run through the Pallas interpreter on CPU and on a GPU.

Every case compares against `reference()` (float32, HIGHEST precision) on fresh random inputs, row by row, so
an unwritten tile or a wrong mask shows up as a mismatch or a non-finite value.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import flash_attention as flash_module
from pallas_kernels import flash_attention_mgpu_bwd, shapes
from pallas_kernels import flash_attention_mgpu_bwd_kernels as mgpu_bwd_kernels
from pallas_kernels.flash_attention import BlockSizes, flash_attention, reference
from pallas_kernels.flash_attention_common import KernelStatic

# Small tiles so short test sequences still span several query and key blocks (diagonal + full + tail).
SMALL_TILES = BlockSizes(
    block_q=32, block_k=16, block_q_dq=16, block_k_dq=32, block_q_dkv=32, block_k_dkv=16, num_warps=4, num_stages=2
)


def _has_gpu() -> bool:
    return any(d.platform == "gpu" for d in jax.devices())


def _rel_err(x, ref) -> float:
    x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def _inputs(q_shape, kv_shape, dtype, seed):
    kq, kk, kv, kd = jax.random.split(jax.random.key(seed), 4)
    return (
        jax.random.normal(kq, q_shape, dtype),
        jax.random.normal(kk, kv_shape, dtype),
        jax.random.normal(kv, kv_shape, dtype),
        jax.random.normal(kd, q_shape, jnp.float32),
    )


class FlashAttentionTestBase:
    """Shared cases; subclasses set `backend` (and may tighten or loosen `fp32_tol`)."""

    backend: str | None = "interpret"
    fp32_tol = 2e-5

    def _check_forward(self, shape: shapes.AttentionShape, dtype=jnp.float32, seed=0, tol=None, **kw):
        q, k, v, _ = _inputs(shape.q_shape, shape.kv_shape, dtype, seed)
        o, lse = flash_attention(q, k, v, backend=self.backend, return_lse=True, **kw)
        ref_o, ref_lse = reference(
            q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), return_lse=True, **kw
        )
        assert o.shape == q.shape and o.dtype == q.dtype
        assert lse.shape == (shape.batch, shape.num_q_heads, shape.q_len)
        finite_rows = np.isfinite(np.asarray(ref_lse))
        assert np.isfinite(np.asarray(o, np.float32)).all(), "non-finite output: an unwritten or poisoned tile"
        np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite_rows)
        tol = tol or (self.fp32_tol if dtype == jnp.float32 else 1e-2)
        assert _rel_err(o, ref_o) < tol
        # Row by row, so one bad row cannot hide inside a global norm.
        row_err = np.abs(np.asarray(o, np.float32) - np.asarray(ref_o)).max(axis=-1)
        assert row_err.max() < (50 * tol if dtype == jnp.float32 else 0.1), row_err.max()
        np.testing.assert_allclose(
            np.where(finite_rows, lse, 0), np.where(finite_rows, ref_lse, 0), atol=50 * tol, rtol=0
        )
        return o

    def _check_grads(self, shape: shapes.AttentionShape, seed=0, with_lse=False, **kw):
        q, k, v, do = _inputs(shape.q_shape, shape.kv_shape, jnp.float32, seed)
        dlse = jax.random.normal(jax.random.key(seed + 1), (shape.batch, shape.num_q_heads, shape.q_len))

        def loss(fn, q, k, v):
            if not with_lse:
                return jnp.sum(fn(q, k, v, **kw) * do)
            o, lse = fn(q, k, v, return_lse=True, **kw)
            return jnp.sum(o * do) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * dlse)

        ours = jax.grad(
            lambda *a: loss(lambda *b, **c: flash_attention(*b, backend=self.backend, **c), *a), argnums=(0, 1, 2)
        )(q, k, v)
        ref = jax.grad(lambda *a: loss(reference, *a), argnums=(0, 1, 2))(q, k, v)
        for name, g, r in zip("qkv", ours, ref):
            assert np.isfinite(np.asarray(g)).all(), f"d{name} not finite"
            assert _rel_err(g, r) < 20 * self.fp32_tol, (name, _rel_err(g, r))

    # ---- forward sweeps ----

    @pytest.mark.parametrize("name", [s.name for s in shapes.TEST_FLASH if s.q_len == s.kv_len])
    def test_causal_lengths_and_gqa(self, name):
        self._check_forward(shapes.BY_NAME[name], causal=True)

    def test_non_causal_tail(self):
        self._check_forward(shapes.BY_NAME["len513_gqa4"], causal=False, block_sizes=SMALL_TILES)

    def test_diagonal_blocks_small_tiles(self):
        self._check_forward(shapes.BY_NAME["len127_mha"], causal=True, block_sizes=SMALL_TILES, seed=3)

    @pytest.mark.parametrize("q_offset", [160, "traced"])
    def test_q_offset_chunk_at_end(self, q_offset):
        shape = shapes.BY_NAME["chunk_q40_kv200"]
        off = jnp.int32(160) if q_offset == "traced" else q_offset
        self._check_forward(shape, causal=True, q_offset=off, block_sizes=SMALL_TILES)

    def test_bf16_error_bound(self):
        self._check_forward(shapes.BY_NAME["len513_gqa4"], dtype=jnp.bfloat16, causal=True, seed=1)

    def test_fp16(self):
        self._check_forward(shapes.BY_NAME["len127_mha"], dtype=jnp.float16, causal=True, seed=2)

    def test_segment_ids_packed(self):
        shape = shapes.BY_NAME["len127_mha"]
        seg = jnp.asarray(np.repeat([[0, 1, 2]], [50, 40, 37], axis=1).repeat(shape.batch, 0), jnp.int32)
        self._check_forward(shape, causal=True, segment_ids=seg, block_sizes=SMALL_TILES)

    def test_segment_pair_with_empty_rows(self):
        shape = shapes.BY_NAME["chunk_q40_kv200"]
        q_seg = jnp.asarray(np.repeat([[1, 2, 7]], [10, 20, 10], axis=1).repeat(2, 0), jnp.int32)  # 7: no keys
        kv_seg = jnp.asarray(np.repeat([[1, 2]], [120, 80], axis=1).repeat(2, 0), jnp.int32)
        o = self._check_forward(shape, causal=False, segment_ids=(q_seg, kv_seg), block_sizes=SMALL_TILES)
        assert np.all(np.asarray(o)[:, 30:] == 0.0)

    def test_sliding_window_skips_blocks(self):
        self._check_forward(shapes.BY_NAME["len513_gqa4"], causal=True, sliding_window=100, block_sizes=SMALL_TILES)

    def test_soft_cap(self):
        self._check_forward(shapes.BY_NAME["len127_mha"], causal=True, logits_soft_cap=3.0, sm_scale=0.5)

    # ---- backward ----

    def test_grads_causal_gqa(self):
        self._check_grads(shapes.BY_NAME["len127_gqa8_d256"], causal=True)

    def test_grads_chunk_tail_small_tiles(self):
        self._check_grads(shapes.BY_NAME["chunk_q40_kv200"], causal=True, q_offset=160, block_sizes=SMALL_TILES)

    def test_grads_window_cap_segments_lse(self):
        shape = shapes.BY_NAME["len127_mha"]
        seg = jnp.asarray(np.repeat([[0, 1]], [70, 57], axis=1), jnp.int32)
        self._check_grads(
            shape,
            with_lse=True,
            causal=True,
            sliding_window=33,
            logits_soft_cap=4.0,
            segment_ids=seg,
            block_sizes=SMALL_TILES,
        )

    def test_grads_non_causal(self):
        self._check_grads(shapes.BY_NAME["len3_gqa3"], causal=False)

    # ---- validation ----

    @pytest.mark.parametrize(
        "case",
        [
            "rank",
            "kv_mismatch",
            "heads",
            "dtype",
            "head_dim",
            "segments",
            "window_non_causal",
            "q_offset",
            "cap",
            "backend",
        ],
    )
    def test_value_errors(self, case):
        q = jnp.zeros((1, 8, 4, 64), jnp.float32)
        k = v = jnp.zeros((1, 8, 2, 64), jnp.float32)
        kw = dict(backend=self.backend)
        if case == "rank":
            q = q[0]
        elif case == "kv_mismatch":
            v = jnp.zeros((1, 9, 2, 64), jnp.float32)
        elif case == "heads":
            k = v = jnp.zeros((1, 8, 3, 64), jnp.float32)
        elif case == "dtype":
            k = k.astype(jnp.bfloat16)
        elif case == "head_dim":
            q, k, v = (jnp.zeros(x.shape[:3] + (512,), jnp.float32) for x in (q, k, v))
        elif case == "segments":
            kw["segment_ids"] = jnp.zeros((1, 7), jnp.int32)
        elif case == "window_non_causal":
            kw.update(causal=False, sliding_window=4)
        elif case == "q_offset":
            kw["q_offset"] = -1
        elif case == "cap":
            kw["logits_soft_cap"] = 0.0
        else:
            kw["backend"] = "cuda_magic"
        with pytest.raises(ValueError):
            flash_attention(q, k, v, **kw)


class TestInterpret(FlashAttentionTestBase):
    backend = "interpret"

    def test_gpu_backends_rejected_on_cpu(self):
        if _has_gpu():
            pytest.skip("this device can run GPU backends")
        q = k = v = jnp.zeros((1, 8, 2, 64), jnp.float32)
        for name in ("triton", "mosaic_gpu"):
            with pytest.raises(ValueError, match="cannot run"):
                flash_attention(q, k, v, backend=name)

    def test_default_backend_on_cpu_is_reference(self):
        shape = shapes.BY_NAME["len3_gqa3"]
        q, k, v, _ = _inputs(shape.q_shape, shape.kv_shape, jnp.float32, 0)
        backend = None if not _has_gpu() else "xla"
        np.testing.assert_allclose(flash_attention(q, k, v, backend=backend), reference(q, k, v), atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="needs a CUDA GPU")
class TestGpuTriton(FlashAttentionTestBase):
    backend = "triton"

    def test_bench_shape_bf16(self):
        shape = shapes.AttentionShape("mid", 2, 1024, 1024, 8, 2, 128)
        self._check_forward(shape, dtype=jnp.bfloat16, causal=True)
        self._check_forward(shape, dtype=jnp.bfloat16, causal=False)


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="needs a CUDA GPU")
class TestGpuDefault(TestGpuTriton):
    backend = None


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="needs a CUDA GPU")
class TestGpuMosaic(TestGpuTriton):
    """fp32 and the features the Hopper kernel lacks fall back to Triton; bf16/fp16 cases below hit Mosaic GPU."""

    backend = "mosaic_gpu"

    @pytest.mark.parametrize("causal", [True, False])
    @pytest.mark.parametrize("name", [s.name for s in shapes.TEST_FLASH])
    def test_mosaic_bf16(self, name, causal):
        shape = shapes.BY_NAME[name]
        q_offset = shape.kv_len - shape.q_len
        self._check_forward(shape, dtype=jnp.bfloat16, causal=causal, q_offset=q_offset)

    def test_mosaic_fp16_long(self):
        self._check_forward(shapes.AttentionShape("long", 1, 2048 + 77, 2048 + 77, 4, 4, 128), dtype=jnp.float16)

    def test_mosaic_forward_bf16_grads(self):
        shape = shapes.AttentionShape("g", 1, 300, 300, 4, 2, 128)
        q, k, v, do = _inputs(shape.q_shape, shape.kv_shape, jnp.bfloat16, 0)
        ours = jax.grad(
            lambda *a: jnp.sum(flash_attention(*a, backend=self.backend).astype(jnp.float32) * do), argnums=(0, 1, 2)
        )(q, k, v)
        ref = jax.grad(lambda *a: jnp.sum(reference(*a).astype(jnp.float32) * do), argnums=(0, 1, 2))(
            *(x.astype(jnp.float32) for x in (q, k, v))
        )
        for g, r in zip(ours, ref):
            assert _rel_err(g, r) < 2e-2


# ---- Mosaic GPU backward (flash_attention_mgpu_bwd.py, kernel bodies in flash_attention_mgpu_bwd_kernels.py) ----
# On CPU the unfused kernels run in the Mosaic GPU interpreter (backward(..., interpret=True)): jax 0.11.2's
# interpreter has no rule for pl.run_state (jaxpr_interpret.py: "TODO(jburnim): Handle run_state_p"; the
# error is "Cannot lower jaxpr with effects: {_WGMMAPipelineEffect, ...}"), reads wgmma's A only from SMEM and
# has no TMA reduce-add (gpu_callbacks.copy_smem_to_gmem: "reduction_op not supported"), so in interpret mode
# each product stages A through SMEM into a fresh accumulator and the fused variant is refused. Masks, block
# ranges, GQA loops and barriers are the GPU kernels' own. The GPU path is also lowered for CUDA on the CPU.

MGPU_BWD_CASES = {  # name: (B, Tq, Tk, Hq, Hkv, causal, q_offset)
    "len300_causal_mha": (1, 300, 300, 4, 4, True, 0),
    "len300_full_gqa4": (1, 300, 300, 4, 1, False, 0),
    "len1023_causal_gqa4": (1, 1023, 1023, 8, 2, True, 0),
    "len1023_full_mha": (2, 1023, 1023, 2, 2, False, 0),
    "chunk_q200_kv1000_gqa4": (2, 200, 1000, 4, 1, True, 800),
}


def _mgpu_static(q_len, kv_len, causal, q_off):
    return KernelStatic(
        causal=causal,
        sm_scale=1 / math.sqrt(128),
        sliding_window=None,
        logits_soft_cap=None,
        q_len=q_len,
        kv_len=kv_len,
        has_segments=False,
        blocks=BlockSizes(),
        interpret=False,
        static_q_offset=q_off,
    )


@pytest.mark.parametrize(
    "q_len,kv_len,causal,q_off",
    [(300, 300, True, 0), (1023, 1023, False, 0), (200, 1000, True, 800), (64, 384, True, 100), (513, 130, True, 0)],
)
def test_mgpu_bwd_block_ranges(q_len, kv_len, causal, q_off):
    """dk/dv kernel: every visible (query, key) pair lies in a visited block; unmasked ones are all visible."""
    bq, bk = mgpu_bwd_kernels.BLOCK, mgpu_bwd_kernels.KV_PER_CTA  # dk/dv kernel tiles
    tk_pad = -(-kv_len // bk) * bk
    dims = mgpu_bwd_kernels.Dims(
        head_dim=128,
        group=1,
        steps=2,
        num_q_blocks=-(-q_len // bq),
        q_off=q_off if causal else 0,
        causal=causal,
        kv_len=kv_len,
        dtype=jnp.bfloat16,
    )
    qpos = (q_off if causal else 0) + np.arange(q_len)[:, None]
    kpos = np.arange(tk_pad)[None, :]
    seen = (kpos < kv_len) & ((kpos <= qpos) if causal else True)
    for tile in range(tk_pad // bk):
        lo, full_lo, hi = (int(x) for x in mgpu_bwd_kernels.block_range(jnp.int32(tile * bk), dims))
        assert 0 <= lo <= full_lo <= hi == -(-q_len // bq)
        tile_seen = seen[:, tile * bk : (tile + 1) * bk]
        rows = np.nonzero(tile_seen.any(axis=1))[0]
        assert rows.size == 0 or (lo * bq <= rows.min() and rows.max() < hi * bq)
        full_rows = tile_seen[full_lo * bq : hi * bq]
        assert full_rows.all(), (tile, lo, full_lo, hi)


@pytest.mark.parametrize("case", ["chunk_q200_kv1000_gqa4", "len100"])
def test_mgpu_bwd_lowers_for_cuda_on_cpu(case):
    """jax.grad through backend='mosaic_gpu' lowers to three Mosaic GPU kernels (fwd, dk/dv, dq), no Triton."""
    b, tq, tk, hq, hkv, causal, off = MGPU_BWD_CASES.get(case, (1, 100, 100, 2, 1, True, 0))
    q = jax.ShapeDtypeStruct((b, tq, hq, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, tk, hkv, 128), jnp.bfloat16)

    def loss(q, k, v):
        o = flash_module._flash_attention_pallas(
            q,
            k,
            v,
            jnp.int32(off),
            None,
            None,
            causal=causal,
            sm_scale=1 / math.sqrt(128),
            sliding_window=None,
            logits_soft_cap=None,
            return_lse=False,
            backend="mosaic_gpu",
            block_sizes=BlockSizes(),
            static_q_offset=off,
        )
        return jnp.sum(o.astype(jnp.float32))

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu_v2") == 3
    assert "triton" not in text


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("with_lse", [False, True])
@pytest.mark.parametrize("case", list(MGPU_BWD_CASES))
def test_mgpu_bwd_grads(case, with_lse):
    """bf16 gradients through the Mosaic GPU forward + backward kernels against the fp32 reference."""
    b, tq, tk, hq, hkv, causal, off = MGPU_BWD_CASES[case]
    if with_lse and case != "len1023_causal_gqa4":
        pytest.skip("the lse cotangent is checked on one shape")
    q, k, v, do = _inputs((b, tq, hq, 128), (b, tk, hkv, 128), jnp.bfloat16, seed=len(case))
    dlse = jax.random.normal(jax.random.key(5), (b, hq, tq))

    def loss(fn, q, k, v):
        o, lse = fn(q, k, v, causal=causal, q_offset=off, return_lse=True)
        total = jnp.sum(o.astype(jnp.float32) * do)
        return total + jnp.sum(lse * dlse) if with_lse else total

    mosaic = lambda *a, **kw: flash_attention(*a, backend="mosaic_gpu", **kw)  # noqa: E731
    grad = jax.jit(jax.grad(lambda *a: loss(mosaic, *a), argnums=(0, 1, 2)))
    hlo = grad.lower(q, k, v).as_text()
    assert hlo.count("mosaic_gpu") >= 3 and "triton" not in hlo, "the Mosaic GPU backward did not run"
    ours = grad(q, k, v)
    ref = jax.grad(lambda *a: loss(reference, *a), argnums=(0, 1, 2))(*(x.astype(jnp.float32) for x in (q, k, v)))
    for name, g, r in zip("qkv", ours, ref):
        g = np.asarray(g, np.float32)
        assert g.shape == r.shape and np.isfinite(g).all(), f"d{name}: non-finite or wrong shape"
        assert _rel_err(g, r) < 2e-2, (name, _rel_err(g, r))
        # Row by row (over the sequence), so one wrong tile cannot hide in a global norm.
        row_err = np.linalg.norm(g - np.asarray(r), axis=-1) / (np.linalg.norm(np.asarray(r), axis=-1) + 1e-3)
        assert row_err.max() < 0.1, (name, float(row_err.max()), np.unravel_index(row_err.argmax(), row_err.shape))


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "cfg",
    [
        flash_attention_mgpu_bwd.MgpuBwdConfig(fused=True),
        flash_attention_mgpu_bwd.MgpuBwdConfig(max_concurrent_steps=4, dq_block_kv=128, dq_steps=2),
    ],
)
def test_mgpu_bwd_configs(cfg):
    """The selectable variants (fused dq reduction; deeper rings, 128-key dq steps) on tile-multiple lengths."""
    from pallas_kernels import flash_attention_mgpu  # noqa: PLC0415

    b, t, hq, hkv = 1, 384, 4, 2
    q, k, v, do = _inputs((b, t, hq, 128), (b, t, hkv, 128), jnp.bfloat16, seed=11)
    st = _mgpu_static(t, t, True, 0)
    o, lse = flash_attention_mgpu.forward(q, k, v, st)
    grads = jax.jit(lambda *a: flash_attention_mgpu_bwd.backward(*a, st, cfg))(
        q, k, v, o, lse, do.astype(q.dtype), jnp.zeros_like(lse)
    )
    ref = jax.grad(
        lambda *a: jnp.sum(reference(*a, causal=True) * do.astype(q.dtype).astype(jnp.float32)), argnums=(0, 1, 2)
    )(*(x.astype(jnp.float32) for x in (q, k, v)))
    for name, g, r in zip("qkv", grads, ref):
        assert _rel_err(g, r) < 2e-2, (name, _rel_err(g, r))


@pytest.mark.parametrize(
    "b,tq,tk,hq,hkv,causal,off,with_lse",
    [
        (1, 128, 128, 1, 1, True, 0, False),  # one CTA; fewer key blocks than the dq ring's depth
        (1, 300, 300, 2, 1, True, 0, True),  # GQA 2, diagonal + tail masks, lse cotangent
        (1, 200, 130, 2, 2, False, 0, False),  # Tq != Tk, padded keys in the last dk/dv CTA
        (1, 60, 250, 4, 1, True, 190, False),  # GQA 4, a chunk at the end of the keys (q_offset)
    ],
)
def test_mgpu_bwd_interpret(b, tq, tk, hq, hkv, causal, off, with_lse):
    """The Mosaic GPU backward kernels in the Mosaic GPU interpreter against the fp32 reference's gradients."""
    tq_pad, tk_pad = (-(-n // 128) * 128 for n in (tq, tk))
    q, k, v, do = _inputs((b, tq, hq, 128), (b, tk, hkv, 128), jnp.bfloat16, seed=tq + tk)
    do = do.astype(jnp.bfloat16)
    dlse = jax.random.normal(jax.random.key(3), (b, hq, tq)) if with_lse else jnp.zeros((b, hq, tq))
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731

    def loss(q, k, v):
        o, lse = reference(q, k, v, causal=causal, q_offset=off, return_lse=True)
        return jnp.sum(o * f32(do)) + jnp.sum(lse * dlse)

    o, lse = reference(f32(q), f32(k), f32(v), causal=causal, q_offset=off, return_lse=True)
    ref = jax.grad(loss, argnums=(0, 1, 2))(f32(q), f32(k), f32(v))
    pad_t = lambda x, n: jnp.pad(x, [(0, 0), (0, n - x.shape[1]), (0, 0), (0, 0)])  # noqa: E731
    pad_r = lambda x: jnp.pad(x, [(0, 0), (0, 0), (0, tq_pad - tq)])  # noqa: E731
    st = _mgpu_static(tq, tk, causal, off)
    dq, dk, dv = jax.jit(lambda *a: flash_attention_mgpu_bwd.backward(*a, st, interpret=True))(
        pad_t(q, tq_pad),
        pad_t(k, tk_pad),
        pad_t(v, tk_pad),
        pad_t(o.astype(q.dtype), tq_pad),
        pad_r(lse),
        pad_t(do, tq_pad),
        pad_r(dlse),
    )
    for name, g, r in zip("qkv", (dq[:, :tq], dk[:, :tk], dv[:, :tk]), ref):
        g = np.asarray(g, np.float32)
        assert np.isfinite(g).all(), f"d{name} not finite"
        assert _rel_err(g, r) < 1e-2, (name, _rel_err(g, r))
        row_err = np.linalg.norm(g - np.asarray(r), axis=-1) / (np.linalg.norm(np.asarray(r), axis=-1) + 1e-3)
        assert row_err.max() < 0.1, (name, float(row_err.max()))
