"""Tests of the weight-streaming quantised matmul against its plain-jnp reference.

One shared base runs in Pallas interpret mode on CPU and through Triton on a GPU. Shapes break the tiles on
purpose (M = 1, 3, 17; K and N not multiples of the tile; K split across programs), and the interpreter starts
every output as NaN, so an unwritten tile fails the finiteness check in rel_err.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import quant
from pallas_kernels import quantized_matmul as qmm

HAS_GPU = any(d.platform == "gpu" for d in jax.devices())
SMALL = qmm.QuantizedMatmulConfig(block_m=16, block_n=32, block_k=32, num_splits=3)

# (name, fmt, K, N, group_size, asymmetric, per-tensor scale)
CASES = (
    ("bf16_k100_n33", "bf16", 100, 33, 0, False, False),
    ("int8_k100_n33", "int8", 100, 33, 0, False, False),
    ("int8_k96_n80", "int8", 96, 80, 0, False, False),
    ("fp8_channel_k100_n33", "fp8", 100, 33, 0, False, False),
    ("fp8_tensor_k96_n80", "fp8", 96, 80, 0, False, True),
    ("int4_g32_asym_k128_n33", "int4", 128, 33, 32, True, False),
    ("int4_g64_sym_k256_n48", "int4", 256, 48, 64, False, False),
    ("int4_g128_asym_k256_n20", "int4", 256, 20, 128, True, False),
)


def make_weight(rng, fmt, k, n, g, asym, per_tensor):
    """Random stored weight (values, scales, zeros) in model/quant.py's layout."""
    if fmt == "bf16":
        return jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16), None, None
    if fmt == "int8":
        return jnp.asarray(rng.integers(-127, 128, (k, n)), jnp.int8), jnp.asarray(rng.uniform(0.1, 1, n)), None
    if fmt == "fp8":
        scale = jnp.float32(0.37) if per_tensor else jnp.asarray(rng.uniform(0.1, 1, n), jnp.float32)
        return jnp.asarray(rng.standard_normal((k, n)) * 4, jnp.float8_e4m3fn), scale, None
    values = jnp.asarray(rng.integers(0, 256, (k // 2, n)), jnp.uint8)
    scales = jnp.asarray(rng.uniform(0.1, 1, (k // g, n)), jnp.float32)
    zeros = jnp.asarray(rng.integers(0, 16, (k // g, n)), jnp.float32) if asym else None
    return values, scales, zeros


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all(), "non-finite output (unwritten tile?)"
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


class QuantizedMatmulTestBase:
    backend = "interpret"
    config = SMALL

    @pytest.mark.parametrize("m", [1, 3, 17])
    @pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
    def test_matches_reference(self, case, m):
        _, fmt, k, n, g, asym, per_tensor = case
        rng = np.random.default_rng(hash((case[0], m)) % 2**32)
        w = make_weight(rng, fmt, k, n, g, asym, per_tensor)
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        got = qmm.quantized_matmul(x, *w, fmt=fmt, group_size=g, config=self.config, backend=self.backend)
        want = qmm.reference(x, *w, fmt=fmt, group_size=g)
        assert got.shape == (m, n) and got.dtype == x.dtype
        assert rel_err(got, want) < 1e-2

    def test_leading_axes_and_door(self):
        rng = np.random.default_rng(7)
        values, scales, zeros = make_weight(rng, "int4", 128, 40, 32, True, False)
        w = quant.QuantizedArray(values, scales, zeros, fmt="int4", group_size=32)
        x = jnp.asarray(rng.standard_normal((2, 3, 128)), jnp.bfloat16)
        got = qmm.quantized_matmul(x, values, scales, zeros, fmt="int4", group_size=32, backend=self.backend)
        assert got.shape == (2, 3, 40)
        assert rel_err(got, quant.reference_matmul(x, w)) < 1e-2


class TestInterpret(QuantizedMatmulTestBase):
    pass


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_prefetch_matches_reference(case):
    """The register double buffer (config.prefetch) on splits of uneven length (5 or 9 steps over 3 splits)."""
    _, fmt, k, n, g, asym, per_tensor = case
    rng = np.random.default_rng(11)
    w = make_weight(rng, fmt, k, n, g, asym, per_tensor)
    x = jnp.asarray(rng.standard_normal((3, k)), jnp.bfloat16)
    config = dataclasses.replace(SMALL, block_k=16, prefetch=True)
    got = qmm.quantized_matmul(x, *w, fmt=fmt, group_size=g, config=config, backend="interpret")
    assert rel_err(got, qmm.reference(x, *w, fmt=fmt, group_size=g)) < 1e-2


@pytest.mark.parametrize("m", [1, 17])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bit_convert_matches_reference(case, m):
    """int8 / int4 codes to bf16 by bit tricks (int4 with its zero point out of the inner loop, float zero points
    included); the other formats ignore the flag."""
    _, fmt, k, n, g, asym, per_tensor = case
    rng = np.random.default_rng(13 + m)
    values, scales, zeros = make_weight(rng, fmt, k, n, g, asym, per_tensor)
    if zeros is not None:
        zeros = zeros + jnp.asarray(rng.uniform(-0.5, 0.5, zeros.shape), jnp.float32)  # GGUF Q4_1's are floats
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    config = dataclasses.replace(SMALL, bit_convert=True)
    got = qmm.quantized_matmul(x, values, scales, zeros, fmt=fmt, group_size=g, config=config, backend="interpret")
    assert rel_err(got, qmm.reference(x, values, scales, zeros, fmt=fmt, group_size=g)) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
class TestTriton(QuantizedMatmulTestBase):
    backend = "triton"
    config = qmm.QuantizedMatmulConfig()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
class TestTritonBitConvert(QuantizedMatmulTestBase):
    backend = "triton"
    config = qmm.QuantizedMatmulConfig(bit_convert=True)


def test_config_validates():
    with pytest.raises(ValueError, match="block_n"):
        qmm.QuantizedMatmulConfig(block_n=48)
    with pytest.raises(ValueError, match="num_splits"):
        qmm.QuantizedMatmulConfig(num_splits=-1)


def test_bad_inputs_raise():
    x = jnp.ones((2, 64), jnp.bfloat16)
    w8 = jnp.ones((64, 16), jnp.int8)
    with pytest.raises(ValueError, match="last axis"):
        qmm.quantized_matmul(x, jnp.ones((32, 16), jnp.int8), jnp.ones(16), fmt="int8", backend="interpret")
    with pytest.raises(ValueError, match="stores values as int8"):
        qmm.quantized_matmul(x, w8.astype(jnp.int32), jnp.ones(16), fmt="int8", backend="interpret")
    with pytest.raises(ValueError, match="scales"):
        qmm.quantized_matmul(x, w8, jnp.ones(15), fmt="int8", backend="interpret")
    with pytest.raises(ValueError, match="group_size"):
        qmm.quantized_matmul(x, jnp.ones((32, 16), jnp.uint8), jnp.ones((1, 16)), fmt="int4", group_size=48)
    with pytest.raises(ValueError, match="multiple of group_size"):
        x96 = jnp.ones((2, 96), jnp.bfloat16)
        qmm.quantized_matmul(x96, jnp.ones((48, 16), jnp.uint8), jnp.ones((1, 16)), fmt="int4", group_size=64)
    with pytest.raises(ValueError, match="unknown fmt"):
        qmm.quantized_matmul(x, w8, fmt="int2", backend="interpret")
    with pytest.raises(ValueError, match="bit_convert builds int4 codes as bfloat16"):
        config = qmm.QuantizedMatmulConfig(bit_convert=True)
        x16 = jnp.ones((2, 64), jnp.float16)
        qmm.quantized_matmul(
            x16,
            jnp.ones((32, 16), jnp.uint8),
            jnp.ones((2, 16)),
            fmt="int4",
            group_size=32,
            config=config,
            backend="interpret",
        )
    with pytest.raises(ValueError, match="float32 x needs backend='xla'"):
        qmm.quantized_matmul(x.astype(jnp.float32), w8, jnp.ones(16), fmt="int8", backend="interpret")


def test_xla_backend_is_the_reference():
    rng = np.random.default_rng(3)
    w = make_weight(rng, "int8", 64, 24, 0, False, False)
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.float32)
    got = qmm.quantized_matmul(x, *w, fmt="int8", backend="xla")
    np.testing.assert_allclose(got, qmm.reference(x, *w, fmt="int8"), rtol=1e-6)


@pytest.fixture
def fake_hopper(monkeypatch):
    """Lets the Triton lowering run on a CPU host: it only asks the GPU for its compute capability (9.0 here)."""
    import types

    from jax._src.pallas.triton import pallas_call_registration as registration

    monkeypatch.setattr(registration.gpu_info_lib, "get_gpu_info", lambda: types.SimpleNamespace(compute_capability=90))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_lowers_to_triton_on_cpu(fake_hopper, case):
    """Every format lowers through Pallas' Triton rules, partial tiles included (fp8 masked loads once failed here)."""
    _, fmt, k, n, g, asym, per_tensor = case
    w = make_weight(np.random.default_rng(0), fmt, k, n, g, asym, per_tensor)
    x = jax.ShapeDtypeStruct((3, k), jnp.bfloat16)
    configs = (qmm.QuantizedMatmulConfig(), SMALL, qmm.QuantizedMatmulConfig(prefetch=True))
    for config in (*configs, qmm.QuantizedMatmulConfig(bit_convert=True)):

        def f(x, v, s, z, config=config):
            return qmm._kernel_jit(x, v, s, z, fmt=fmt, group_size=g, config=config, interpret=False)

        text = jax.jit(f).trace(x, *w).lower(lowering_platforms=("cuda",)).as_text()
        assert "triton" in text
