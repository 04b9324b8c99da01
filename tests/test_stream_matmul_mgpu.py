"""The Mosaic GPU streaming matmul (pallas_kernels/stream_matmul_mgpu.py) against quantized_matmul's reference.

One test base, two runs: `TestInterpreted` drives the kernel through the Mosaic GPU interpreter on CPU (TMA ring,
barriers, K splits, the epilogue; A reaches wgmma through SMEM there, the interpreter's wgmma reads refs only),
`TestGpu` compiles it for a Hopper GPU at real sizes with A in registers and through SMEM. Shapes break the tiles
on purpose (M = 1, 3, 17, 64; K and N not multiples of the tile), and the interpreter starts memory as NaN, so an
unwritten tile fails the finiteness check. `test_lowers_for_cuda_on_cpu` runs the whole Pallas -> Mosaic GPU
lowering (layout inference, wgmma emission) of every format at 8B sizes without a GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import quantized_matmul as qmm
from pallas_kernels import stream_matmul_mgpu as sm
from tests import test_quantized_matmul as qmm_tests

# (name, fmt, K, N, group_size, asymmetric, per-tensor scale): N and K break the 128-row CTA and the 256 K padding
CASES = (
    ("bf16_k300_n200", "bf16", 300, 200, 0, False, False),
    ("int8_k520_n130", "int8", 520, 130, 0, False, False),
    ("fp8_channel_k300_n72", "fp8", 300, 72, 0, False, False),
    ("fp8_tensor_k256_n136", "fp8", 256, 136, 0, False, True),
    ("int4_g32_asym_k288_n200", "int4", 288, 200, 32, True, False),
    ("int4_g64_sym_k256_n72", "int4", 256, 72, 64, False, False),
    ("int4_g128_asym_k384_n136", "int4", 384, 136, 128, True, False),
)
SMALL = sm.StreamConfig(tile_k=128, max_concurrent_steps=2)


def _has_hopper() -> bool:
    device = jax.devices()[0]
    return device.platform == "gpu" and float(getattr(device, "compute_capability", "0")) >= 9.0


def make_weight(rng, fmt, k, n, g, asym, per_tensor):
    """Random stored weight (values, scales, zeros) in quantized_matmul's layout (its tests' helper), bf16 scaled
    by k^-0.5 so that outputs stay O(1)."""
    values, scales, zeros = qmm_tests.make_weight(rng, fmt, k, n, g, asym, per_tensor)
    return (values * k**-0.5).astype(jnp.bfloat16) if fmt == "bf16" else values, scales, zeros


def errors(got, want):
    """(norm-relative error, worst per-row relative error): one wrong row hides in a global norm."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all(), "non-finite output (unwritten tile?)"
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    rows = np.linalg.norm(got - want, axis=-1) / np.maximum(np.linalg.norm(want, axis=-1), 1e-6)
    return float(rel), float(rows.max())


def bf16_weight_oracle(x, w):
    """x @ (the weight dequantised to bf16), f32 accumulation: the kernel's own numbers for int4 (one rounding)."""
    wd = qmm.dequantize(*w[:3], fmt=w[3], group_size=w[4]).astype(jnp.bfloat16).astype(jnp.float32)
    return jnp.einsum("mk,kn->mn", x.astype(jnp.float32), wd, precision=jax.lax.Precision.HIGHEST)


class StreamMatmulTestBase:
    backend = "interpret"
    configs = (SMALL,)
    m_values = (1, 3, 17, 64)
    cases = CASES

    @pytest.mark.parametrize("m_index", range(4))
    @pytest.mark.parametrize("case_index", range(len(CASES)))
    def test_matches_reference(self, case_index, m_index):
        name, fmt, k, n, g, asym, per_tensor = self.cases[case_index]
        m = self.m_values[m_index]
        rng = np.random.default_rng(hash((name, m)) % 2**32)
        values, scales, zeros = make_weight(rng, fmt, k, n, g, asym, per_tensor)
        w = sm.prepare(values, scales, zeros, fmt=fmt, group_size=g)
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        want = qmm.reference(x, values, scales, zeros, fmt=fmt, group_size=g)
        tight = bf16_weight_oracle(x, (values, scales, zeros, fmt, g))
        for config in self.configs:
            got = sm.stream_matmul(x, w, config=config, backend=self.backend)
            assert got.shape == (m, n) and got.dtype == x.dtype
            rel, row = errors(got, want)
            assert rel < 1e-2 and row < 2e-2, (config, rel, row)
            # Against the bf16-dequantised weight only the bf16 output rounding and the f32 sum order remain.
            rel, row = errors(got, tight)
            assert rel < 4e-3 and row < 8e-3, (config, rel, row)

    def test_leading_axes(self):
        rng = np.random.default_rng(5)
        values, scales, zeros = make_weight(rng, "int8", 256, 72, 0, False, False)
        w = sm.prepare(values, scales, fmt="int8")
        x = jnp.asarray(rng.standard_normal((2, 3, 256)), jnp.bfloat16)
        got = sm.stream_matmul(x, w, config=self.configs[0], backend=self.backend)
        assert got.shape == (2, 3, 72)
        assert errors(got, qmm.reference(x, values, scales, fmt="int8"))[0] < 1e-2


class TestInterpreted(StreamMatmulTestBase):
    pass


@pytest.mark.gpu
@pytest.mark.skipif(not _has_hopper(), reason="needs a Hopper GPU")
class TestGpu(StreamMatmulTestBase):
    backend = "mosaic_gpu"
    # A from registers (default; overlapped: int4 only, the same kernel elsewhere) and through SMEM with x multicast
    # to 2-CTA clusters and no K split (~70 compiles)
    configs = (
        sm.StreamConfig(),
        sm.StreamConfig(overlap=True),
        sm.StreamConfig(a_via_smem=True, cluster=2, num_splits=1),
    )
    m_values = (1, 7, 64, 256)
    cases = (
        ("bf16_4096x1024", "bf16", 4096, 1024, 0, False, False),
        ("int8_4096x14336", "int8", 4096, 14336, 0, False, False),
        ("fp8_14336x4096", "fp8", 14336, 4096, 0, False, False),
        ("fp8_tensor_4096x4096", "fp8", 4096, 4096, 0, False, True),
        ("int4_g32_asym_4096x1024", "int4", 4096, 1024, 32, True, False),
        ("int4_g64_sym_4096x4096", "int4", 4096, 4096, 64, False, False),
        ("int4_g128_asym_14336x4096", "int4", 14336, 4096, 128, True, False),
    )


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_prepare_keeps_the_logical_weight(case):
    """The kernel layout (transposed, padded, int4 as signed nibbles) dequantises to the same [K, N] weight."""
    _, fmt, k, n, g, asym, per_tensor = case
    values, scales, zeros = make_weight(np.random.default_rng(1), fmt, k, n, g, asym, per_tensor)
    w = sm.prepare(values, scales, zeros, fmt=fmt, group_size=g)
    assert w.shape == (k, n) and w.wt.shape[0] % sm.N_ALIGN == 0 and w.wt.shape[1] % sm.K_ALIGN == 0
    want = qmm.dequantize(values, scales, zeros, fmt=fmt, group_size=g)
    np.testing.assert_allclose(np.asarray(sm.dequantize(w)), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_xla_backend_is_the_reference():
    rng = np.random.default_rng(3)
    values, scales, zeros = make_weight(rng, "int4", 256, 40, 64, True, False)
    w = sm.prepare(values, scales, zeros, fmt="int4", group_size=64)
    x = jnp.asarray(rng.standard_normal((5, 256)), jnp.bfloat16)
    got = sm.stream_matmul(x, w, backend="xla")
    want = qmm.reference(x, values, scales, zeros, fmt="int4", group_size=64)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-2)


def test_config_validates():
    for bad, match in ((dict(tile_k=96), "tile_k"), (dict(max_concurrent_steps=1), "max_concurrent_steps")):
        with pytest.raises(ValueError, match=match):
            sm.StreamConfig(**bad)
    with pytest.raises(ValueError, match="num_splits"):
        sm.StreamConfig(num_splits=-2)


def test_bad_inputs_raise(monkeypatch):
    rng = np.random.default_rng(0)
    values, scales, _ = make_weight(rng, "int8", 256, 64, 0, False, False)
    w = sm.prepare(values, scales, fmt="int8")
    x = jnp.ones((2, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="StreamWeight"):
        sm.stream_matmul(x, values, backend="interpret")
    with pytest.raises(ValueError, match="last axis"):
        sm.stream_matmul(jnp.ones((2, 128), jnp.bfloat16), w, backend="interpret")
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        sm.stream_matmul(x.astype(jnp.float32), w, backend="interpret")
    with pytest.raises(ValueError, match="1..256 rows"):
        sm.stream_matmul(jnp.ones((257, 256), jnp.bfloat16), w, backend="interpret")
    wide = sm.prepare(jnp.ones((1024, 64), jnp.bfloat16))
    p = sm.plan(256, wide, sm.StreamConfig(tile_k=512), 132)  # x's [256, 512] bf16 block alone is 256 KB
    assert p.tk < 512 and p.smem <= sm.SMEM_BYTES, p
    with pytest.raises(ValueError, match="wg_rows"):
        sm.StreamConfig(wg_rows=96)
    with pytest.raises(ValueError, match="does not divide"):
        sm.stream_matmul(x, w, config=sm.StreamConfig(tile_k=512), backend="interpret")
    with pytest.raises(ValueError, match="'triton'"):
        sm.stream_matmul(x, w, backend="triton")
    with pytest.raises(ValueError, match="acc regs"):
        sm.stream_matmul(
            jnp.ones((256, 1024), jnp.bfloat16), wide, config=sm.StreamConfig(wg_rows=128), backend="interpret"
        )
    monkeypatch.setattr(sm, "SMEM_BYTES", 32 * 1024)
    with pytest.raises(ValueError, match="SMEM"):
        sm.stream_matmul(jnp.ones((64, 1024), jnp.bfloat16), wide, backend="interpret")
    with pytest.raises(ValueError, match="group_size"):
        sm.prepare(jnp.ones((64, 16), jnp.uint8), jnp.ones((1, 16)), fmt="int4", group_size=48)


LOWER_CASES = [
    pytest.param(fmt, m, k, n, g, asym, cfg, id=f"{fmt}{g or ''}{'_asym' if asym else ''}_m{m}_{k}x{n}_{i}")
    for i, (fmt, m, k, n, g, asym, cfg) in enumerate(
        (
            ("bf16", 1, 4096, 14336, 0, False, sm.StreamConfig()),
            ("int8", 64, 14336, 4096, 0, False, sm.StreamConfig()),
            ("fp8", 1, 4096, 1024, 0, False, sm.StreamConfig()),
            ("int4", 1, 4096, 4096, 128, False, sm.StreamConfig()),
            ("int4", 64, 4096, 4096, 32, True, sm.StreamConfig()),
            ("int4", 17, 4096, 1024, 64, True, sm.StreamConfig(a_via_smem=True)),
            ("int4", 256, 4096, 1024, 128, True, sm.StreamConfig()),
            ("bf16", 256, 4096, 1024, 0, False, sm.StreamConfig()),
            ("fp8", 128, 4096, 4096, 0, False, sm.StreamConfig()),
            ("int4", 64, 4096, 4096, 128, False, sm.StreamConfig(cluster=2)),
            ("int8", 64, 4096, 14336, 0, False, sm.StreamConfig(cluster=4, wg_rows=64)),
            ("int4", 1, 4096, 4096, 32, True, sm.StreamConfig(overlap=True)),
            ("int4", 64, 14336, 4096, 128, False, sm.StreamConfig(overlap=True, cluster=2)),
        )
    )
]


@pytest.mark.parametrize("fmt, m, k, n, g, asym, config", LOWER_CASES)
def test_lowers_for_cuda_on_cpu(fmt, m, k, n, g, asym, config):
    """Pallas -> Mosaic GPU lowering for an H200 (132 SMs) on a CPU host: layouts, conversions, wgmma operands,
    SMEM budget (the lowering counts the real allocation)."""
    values, scales, zeros = make_weight(np.random.default_rng(0), fmt, k, n, g, asym, False)
    w = sm.prepare(values, scales, zeros, fmt=fmt, group_size=g)
    x = jnp.ones((m, k), jnp.bfloat16)
    assert sm.plan(m, w, config, 132).cluster == config.cluster
    lowered = jax.jit(lambda x, w: sm._stream_call(x, w, config, None, 132)).trace(x, w)
    text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    assert "wgmma.mma_async" in text


def test_quant_door_takes_the_stream_layout(monkeypatch):
    """model.quant.matmul runs the kernel on a QuantizedArray carrying `stream` (here through the interpreter)."""
    from model import quant

    rng = np.random.default_rng(9)
    values, scales, zeros = make_weight(rng, "int4", 256, 72, 32, True, False)
    w = quant.with_stream_layout(quant.QuantizedArray(values, scales, zeros, fmt="int4", group_size=32))
    assert isinstance(w.stream, sm.StreamWeight)
    calls, kernel = [], sm.stream_matmul

    def interpreted(x, stream, backend=None):
        calls.append(backend)
        return kernel(x, stream, config=SMALL, backend="interpret")

    monkeypatch.setattr(quant, "_stream_ok", lambda *_: True)
    monkeypatch.setattr(sm, "stream_matmul", interpreted)
    x = jnp.asarray(rng.standard_normal((3, 256)), jnp.bfloat16)
    got = quant.matmul(x, w)
    assert calls == ["mosaic_gpu"]
    assert errors(got, quant.reference_matmul(x, w))[0] < 1e-2
    grouped8 = quant.QuantizedArray(jnp.ones((64, 8), jnp.int8), jnp.ones((2, 8)), fmt="int8", group_size=32)
    assert quant.with_stream_layout(grouped8).stream is None  # no grouped int8 kernel: unchanged


@pytest.mark.parametrize(
    "m, config",
    [
        pytest.param(128, SMALL, id="x_rows_equal_cta_rows"),  # Mp = 2 * wg_rows: x and weight blocks look alike
        pytest.param(64, sm.StreamConfig(tile_k=128, max_concurrent_steps=2, cluster=2), id="cluster2_multicast_x"),
        pytest.param(5, sm.StreamConfig(), id="default_config_auto_tile_k"),
    ],
)
def test_block_geometry(m, config):
    rng = np.random.default_rng(13)
    values, scales, zeros = make_weight(rng, "int4", 256, 500, 64, True, False)
    w = sm.prepare(values, scales, zeros, fmt="int4", group_size=64)
    x = jnp.asarray(rng.standard_normal((m, 256)), jnp.bfloat16)
    got = sm.stream_matmul(x, w, config=config, backend="interpret")
    want = qmm.reference(x, values, scales, zeros, fmt="int4", group_size=64)
    rel, row = errors(got, want)
    assert rel < 1e-2 and row < 2e-2


# int8 / fp8 conversion paths behind StreamConfig flags (off by default until measured): the A tile loaded 4 bytes a
# thread (WGMMA_UPCAST_2X) and moved to wgmma's layout by a shuffle, and steps cut into 64-column blocks so that the
# next block's conversion overlaps the running wgmma.
CONVERT_CONFIGS = [
    pytest.param(sm.StreamConfig(tile_k=128, max_concurrent_steps=2, upcast_load=True), id="upcast_load"),
    pytest.param(sm.StreamConfig(tile_k=256, max_concurrent_steps=2, overlap=True), id="overlap_64col_blocks"),
    pytest.param(sm.StreamConfig(tile_k=256, upcast_load=True, overlap=True, wg_rows=128), id="both_wg128"),
]


@pytest.mark.parametrize("config", CONVERT_CONFIGS)
@pytest.mark.parametrize("fmt, m", [("int8", 3), ("fp8", 17), ("int8", 64)])
def test_conversion_flags_match_reference(fmt, m, config):
    rng = np.random.default_rng(m)
    k, n = 520, 130
    values, scales, zeros = make_weight(rng, fmt, k, n, 0, False, False)
    w = sm.prepare(values, scales, zeros, fmt=fmt)
    p = sm.plan(m, w, config, sm.INTERPRET_SMS)
    assert p.kb == (64 if config.overlap else p.tk) and p.tk // p.kb == (4 if config.overlap else 1)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    got = sm.stream_matmul(x, w, config=config, backend="interpret")
    rel, row = errors(got, qmm.reference(x, values, scales, zeros, fmt=fmt, group_size=0))
    assert rel < 1e-2 and row < 2e-2


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_upcast_load_lowers_to_32_bit_loads(fmt):
    """upcast_load changes the emitted conversion: Mosaic GPU's int8 -> bf16 upcast of 4-element (32-bit) registers
    (its prmt selector 0x4342, decimal 17218, picks the high byte pair) appears only with the flag; by default the
    tile is read in wgmma's own layout, 2 bytes a register (only the 0x4140 pair). fp8 lowers either way."""
    values, scales, zeros = make_weight(np.random.default_rng(0), fmt, 4096, 4096, 0, False, False)
    w = sm.prepare(values, scales, zeros, fmt=fmt)
    x = jnp.ones((1, 4096), jnp.bfloat16)
    texts = {}
    for flag in (False, True):
        config = sm.StreamConfig(upcast_load=flag)
        lowered = jax.jit(lambda x, w, config=config: sm._stream_call(x, w, config, None, 132)).trace(x, w)  # pylint: disable=protected-access
        texts[flag] = lowered.lower(lowering_platforms=("cuda",)).as_text()
        assert "wgmma.mma_async" in texts[flag]
    if fmt == "int8":
        assert "prmt.b32 s0, $1, 0x43, 17218" not in texts[False]
        assert "prmt.b32 s0, $1, 0x43, 17218" in texts[True]


@pytest.mark.gpu
@pytest.mark.skipif(not _has_hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("config", CONVERT_CONFIGS)
@pytest.mark.parametrize("fmt, m", [("int8", 1), ("fp8", 64)])
def test_conversion_flags_on_gpu(fmt, m, config):
    rng = np.random.default_rng(m)
    values, scales, zeros = make_weight(rng, fmt, 4096, 14336, 0, False, False)
    w = sm.prepare(values, scales, zeros, fmt=fmt)
    x = jnp.asarray(rng.standard_normal((m, 4096)), jnp.bfloat16)
    got = sm.stream_matmul(x, w, config=config, backend="mosaic_gpu")
    rel, row = errors(got, qmm.reference(x, values, scales, zeros, fmt=fmt, group_size=0))
    assert rel < 1e-2 and row < 2e-2
