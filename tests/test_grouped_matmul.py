"""The Hopper grouped matmul (pallas_kernels/grouped_matmul.py) against `jax.lax.ragged_dot`.

One test base, two runs: `TestInterpreted` drives the kernel through the Mosaic GPU interpreter on CPU (the TMA
ring, barriers, dynamic work list and ladder stores are the GPU code), `TestGpu` compiles it for an H200. Inputs
are fresh random bf16 draws; the interpreter fills uninitialised memory with NaN, so a tile the kernel forgets to
write fails the finiteness check. Errors are norm-relative against the f32 ragged_dot (HIGHEST).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import grouped_matmul as gm


def _has_hopper() -> bool:
    device = jax.devices()[0]
    return device.platform == "gpu" and float(getattr(device, "compute_capability", "0")) >= 9.0


def _inputs(m, k, n, g, seed):
    k1, k2 = jax.random.split(jax.random.key(seed))
    lhs = jax.random.normal(k1, (m, k), jnp.bfloat16)
    rhs = (jax.random.normal(k2, (g, k, n), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
    return lhs, rhs


def _check(out, lhs, rhs, group_sizes):
    ref = jax.lax.ragged_dot(
        lhs.astype(jnp.float32),
        rhs.astype(jnp.float32),
        jnp.asarray(group_sizes, jnp.int32),
        precision=jax.lax.Precision.HIGHEST,
    )
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert out.shape == ref.shape
    assert np.isfinite(out).all(), "unwritten or NaN output rows"
    covered = int(np.sum(group_sizes))
    assert not out[covered:].any(), "rows past sum(group_sizes) must be zero"
    rel = np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)
    assert rel < 1e-2, f"norm-relative error {rel:.3g}"
    # Per-row check too: one wrong row (a boundary tile stored into the wrong group) hides in a global norm.
    row_rel = np.linalg.norm(out - ref, axis=1) / np.maximum(np.linalg.norm(ref, axis=1), 1e-3)
    assert row_rel.max() < 2e-2, f"worst row {int(row_rel.argmax())} has relative error {row_rel.max():.3g}"


SMALL = gm.GroupedMatmulConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2)

# (M, K, N, group_sizes, config): M and the group sizes break 64-row tiles on purpose.
CASES = [
    pytest.param(200, 128, 256, [70, 0, 130], SMALL, id="empty_middle_group"),
    pytest.param(301, 128, 128, [0, 301, 0], SMALL, id="one_group_holds_all_M301"),
    pytest.param(150, 192, 128, [1, 64, 3, 0, 63, 19], SMALL, id="six_small_groups_K192"),
    pytest.param(200, 128, 256, [50, 60, 40], SMALL, id="tail_rows_zero"),
    pytest.param(
        330, 128, 256, [129, 0, 201], gm.GroupedMatmulConfig(tile_m=128, max_concurrent_steps=2), id="tile128"
    ),
    pytest.param(
        97,
        256,
        256,
        [33, 64],
        gm.GroupedMatmulConfig(tile_m=64, tile_n=64, max_concurrent_steps=3, delay_release=0, grid_minor_m=False),
        id="ring3_no_delay_n_minor",
    ),
    pytest.param(1, 64, 128, [0, 1], SMALL, id="single_row"),
    # K = tile_k: a one-step K loop over many work items per SM (delay_release must drop to 0: one_step_safe).
    pytest.param(333, 64, 512, [200, 133], SMALL, id="one_k_step_many_items"),
]


class GroupedMatmulBase:
    backend: str

    @pytest.mark.parametrize("m,k,n,group_sizes,cfg", CASES)
    def test_matches_ragged_dot(self, m, k, n, group_sizes, cfg):
        lhs, rhs = _inputs(m, k, n, len(group_sizes), seed=m + k + n)
        sizes = jnp.asarray(group_sizes, jnp.int32)
        out = gm.grouped_matmul(lhs, rhs, sizes, config=cfg, backend=self.backend)
        assert out.dtype == lhs.dtype
        _check(out, lhs, rhs, group_sizes)

    def test_same_compile_other_group_sizes(self):
        """group_sizes are traced: one compiled kernel serves any split of the rows."""
        lhs, rhs = _inputs(200, 128, 128, 4, seed=3)
        for sizes in ([200, 0, 0, 0], [0, 0, 0, 200], [17, 83, 64, 36]):
            out = gm.grouped_matmul(lhs, rhs, jnp.asarray(sizes, jnp.int32), config=SMALL, backend=self.backend)
            _check(out, lhs, rhs, sizes)


class TestInterpreted(GroupedMatmulBase):
    backend = "interpret"


@pytest.mark.gpu
@pytest.mark.skipif(not _has_hopper(), reason="needs a Hopper GPU")
class TestGpu(GroupedMatmulBase):
    backend = "mosaic_gpu"

    @pytest.mark.parametrize("skewed", [False, True])
    def test_default_config_mixtral_like(self, skewed):
        lhs, rhs = _inputs(2048, 1024, 1792 * 2, 8, seed=5)
        sizes = [1024, 0, 512, 3, 1, 300, 200, 8] if skewed else [256] * 8
        _check(gm.grouped_matmul(lhs, rhs, jnp.asarray(sizes, jnp.int32)), lhs, rhs, sizes)


def test_empty_lhs_and_reference_backend():
    lhs, rhs = _inputs(0, 64, 128, 2, seed=0)
    assert gm.grouped_matmul(lhs, rhs, jnp.zeros(2, jnp.int32), backend="interpret").shape == (0, 128)
    lhs, rhs = _inputs(40, 64, 128, 2, seed=1)
    _check(gm.grouped_matmul(lhs, rhs, jnp.asarray([10, 30], jnp.int32), backend="xla"), lhs, rhs, [10, 30])


def test_rejects_bad_inputs_and_configs():
    lhs, rhs = _inputs(64, 128, 256, 2, seed=0)
    sizes = jnp.asarray([32, 32], jnp.int32)
    with pytest.raises(ValueError, match="does not match rhs K"):
        gm.grouped_matmul(lhs[:, :64], rhs, sizes, backend="interpret")
    with pytest.raises(ValueError, match="group_sizes has 3 entries"):
        gm.grouped_matmul(lhs, rhs, jnp.zeros(3, jnp.int32), backend="interpret")
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        gm.grouped_matmul(lhs.astype(jnp.float32), rhs, sizes, backend="interpret")
    with pytest.raises(ValueError, match="not a multiple of 2 \\* config.tile_n"):
        gm.grouped_matmul(lhs, rhs[:, :, :192], sizes, config=SMALL, backend="interpret")
    with pytest.raises(ValueError, match="config.tile_k"):
        gm.grouped_matmul(lhs, rhs, sizes, config=dataclasses.replace(SMALL, tile_k=192), backend="interpret")
    with pytest.raises(ValueError, match="'triton' is not implemented"):
        gm.grouped_matmul(lhs, rhs, sizes, backend="triton")
    with pytest.raises(ValueError, match="tile_m must be 64 or 128"):
        gm.GroupedMatmulConfig(tile_m=96)
    with pytest.raises(ValueError, match="bytes of SMEM"):
        gm.GroupedMatmulConfig(tile_n=256, max_concurrent_steps=4)
    with pytest.raises(ValueError, match="max_concurrent_steps"):
        gm.GroupedMatmulConfig(max_concurrent_steps=1, delay_release=1)


@pytest.mark.parametrize(
    "m,k,n,g,cfg",
    [
        pytest.param(8192, 4096, 14336, 8, gm.GroupedMatmulConfig(), id="mixtral_w1"),
        pytest.param(16384, 2048, 2816, 60, gm.GroupedMatmulConfig.for_shape(2816), id="qwen_moe_gate_up"),
        pytest.param(301, 128, 256, 3, SMALL, id="odd_M"),
    ],
)
def test_lowers_for_cuda_on_cpu(m, k, n, g, cfg):
    """The Mosaic GPU lowering (layouts, TMA descriptors, tiling of odd M) runs without a GPU."""
    args = (
        jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
        jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16),
        jax.ShapeDtypeStruct((g,), jnp.int32),
    )
    fn = jax.jit(lambda a, b, c: gm._grouped_matmul_call(a, b, c, cfg, None, 132))  # pylint: disable=protected-access
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_tile_metadata_work_list():
    """The example of the module docstring: tile_m 128, group_sizes [96, 204], M 300."""
    num_tiles, meta = gm._tile_metadata(jnp.asarray([96, 204], jnp.int32), 300, 128)  # pylint: disable=protected-access
    assert int(num_tiles[0]) == 4
    np.testing.assert_array_equal(
        np.asarray(meta)[:, :4], [[0, 0, 1, 2], [0, 1, 1, 1], [0, 96, 0, 0], [96, 32, 128, 44]]
    )
    num_tiles, meta = gm._tile_metadata(jnp.asarray([10, 0], jnp.int32), 70, 64)  # pylint: disable=protected-access
    assert int(num_tiles[0]) == 3  # rows 10..70 are the zero pseudo-group (G = 2), in blocks 0 and 1
    np.testing.assert_array_equal(np.asarray(meta)[:, :3], [[0, 0, 1], [0, 2, 2], [0, 10, 0], [10, 54, 6]])
    assert (np.asarray(meta)[3, 3:] == 0).all()  # tiles past the count store nothing
