"""Tests of the K-contiguous GEMV (pallas_kernels/gemv_nk.py) against its plain-jnp reference: the interpreter on a
CPU, Triton on a GPU. Shapes break the tiles (K and N not multiples of the tile, a last K chunk with fewer tiles,
M = 1..4); the interpreter starts every output as NaN, so an unwritten column fails the finiteness check."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gemv_nk as G
from tests.test_quantized_matmul import fake_hopper, make_weight, rel_err  # noqa: F401 (fixture)

HAS_GPU = any(d.platform == "gpu" for d in jax.devices())
SMALL = G.GemvNKConfig(block_n=16, block_k=32, steps=3)
PLAIN = G.GemvNKConfig(block_n=16, block_k=32, steps=2, bit_convert=False)

# (name, fmt, K, N, per-tensor scale)
CASES = (
    ("bf16_k100_n33", "bf16", 100, 33, False),
    ("int8_k100_n33", "int8", 100, 33, False),
    ("int8_k256_n64", "int8", 256, 64, False),
    ("fp8_channel_k200_n40", "fp8", 200, 40, False),
    ("fp8_tensor_k96_n80", "fp8", 96, 80, True),
)


def weight_nk(rng, fmt, k, n, per_tensor):
    """(values [N, K], scales): the model's [K, N] test weight, transposed (QuantizedArray layout "nk")."""
    values, scales, _ = make_weight(rng, fmt, k, n, 0, False, per_tensor)
    return values.T, scales


class GemvNKTestBase:
    backend = "interpret"
    config = SMALL

    @pytest.mark.parametrize("m", [1, 3])
    @pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
    def test_matches_reference(self, case, m):
        _, fmt, k, n, per_tensor = case
        rng = np.random.default_rng(abs(hash((case[0], m))) % 2**32)
        values, scales = weight_nk(rng, fmt, k, n, per_tensor)
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        got = G.gemv_nk(x, values, scales, fmt=fmt, config=self.config, backend=self.backend)
        want = G.reference(x, values, scales, fmt=fmt)
        assert got.shape == (m, n) and got.dtype == x.dtype
        assert rel_err(got, want) < 4e-3

    def test_f32_output_and_plain_casts(self):
        rng = np.random.default_rng(7)
        values, scales = weight_nk(rng, "int8", 160, 24, False)
        x = jnp.asarray(rng.standard_normal((1, 1, 160)), jnp.float32)
        want = G.reference(x, values, scales, fmt="int8", out_dtype=jnp.float32)
        for config in (self.config, PLAIN):
            got = G.gemv_nk(x, values, scales, fmt="int8", config=config, backend=self.backend, out_dtype=jnp.float32)
            assert got.shape == (1, 1, 24) and got.dtype == jnp.float32
            assert rel_err(got, want) < 1e-5


class TestInterpret(GemvNKTestBase):
    pass


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
class TestTriton(GemvNKTestBase):
    backend = "triton"
    config = G.GemvNKConfig()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
class TestTritonSmall(GemvNKTestBase):
    backend = "triton"


def test_lowers_to_triton_on_cpu(fake_hopper):  # noqa: F811
    """Every format (partial tiles included) lowers through Pallas' Triton rules."""
    for _, fmt, k, n, per_tensor in CASES:
        values, scales = weight_nk(np.random.default_rng(0), fmt, k, n, per_tensor)
        x = jax.ShapeDtypeStruct((2, k), jnp.bfloat16)
        for config in (G.GemvNKConfig(), SMALL, PLAIN):

            def f(x, v, s, config=config, fmt=fmt):
                return G._kernel_jit(x, v, s, fmt=fmt, config=config, interpret=False, out_dtype=jnp.bfloat16)

            assert "triton" in jax.jit(f).trace(x, values, scales).lower(lowering_platforms=("cuda",)).as_text()


def test_bad_inputs_raise():
    x = jnp.ones((2, 64), jnp.bfloat16)
    w8 = jnp.ones((16, 64), jnp.int8)
    with pytest.raises(ValueError, match="1 to 4"):
        G.gemv_nk(jnp.ones((5, 64), jnp.bfloat16), w8, jnp.ones(16), fmt="int8", backend="interpret")
    with pytest.raises(ValueError, match="last axis"):
        G.gemv_nk(x, jnp.ones((16, 32), jnp.int8), jnp.ones(16), fmt="int8", backend="interpret")
    with pytest.raises(ValueError, match="stores values as int8"):
        G.gemv_nk(x, w8.astype(jnp.int32), jnp.ones(16), fmt="int8", backend="interpret")
    with pytest.raises(ValueError, match="scales"):
        G.gemv_nk(x, w8, jnp.ones(15), fmt="int8", backend="interpret")
    with pytest.raises(ValueError, match="unknown fmt"):
        G.gemv_nk(x, w8, fmt="int4", backend="interpret")
    with pytest.raises(ValueError, match="block_k"):
        G.GemvNKConfig(block_k=48)


def test_xla_backend_is_the_reference():
    values, scales = weight_nk(np.random.default_rng(3), "fp8", 64, 24, False)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((2, 64)), jnp.float32)
    np.testing.assert_array_equal(
        G.gemv_nk(x, values, scales, fmt="fp8", backend="xla"), G.reference(x, values, scales, fmt="fp8")
    )


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_model_door_reads_nk_weights_through_it(fmt, monkeypatch):
    """model.quant.matmul sends one row of x @ an [N, K] int8 / fp8 weight through this GEMV (here its interpreter),
    f32 LM-head outputs too, and equals the door's XLA path; the option's "<fmt>_nk" row count turns it off."""
    from model import quant

    calls = []
    real = G.gemv_nk
    monkeypatch.setattr(G, "gemv_nk", lambda *a, **kw: calls.append(kw["fmt"]) or real(*a, **kw))
    values, scales = weight_nk(np.random.default_rng(8), fmt, 200, 40, False)
    w = quant.QuantizedArray(values, scales, fmt=fmt, layout="nk")
    x = jnp.asarray(np.random.default_rng(9).standard_normal((1, 1, 200)), jnp.bfloat16)
    off = quant.MatmulOptions(gemv_max_rows=(), gemv_backend="interpret")
    on = dataclasses.replace(quant.INTERPRET_OPTIONS, gemv_max_rows=((fmt + "_nk", 1),))
    for out_dtype in (None, jnp.float32):
        want = quant.matmul(x, w, out_dtype=out_dtype, options=off)
        got = quant.matmul(x, w, out_dtype=out_dtype, options=on)
        assert got.shape == (1, 1, 40) and got.dtype == (out_dtype or x.dtype)
        assert rel_err(got, want) < 4e-3
    assert calls == [fmt, fmt]


def test_model_door_takes_the_triton_kernel_for_int4_rows(monkeypatch):
    """Two to kernel_max_rows rows of x @ a [K, N] int4 weight take the dequantising kernel (its interpreter here)
    and equal the oracle; past the option's rows, XLA's dequantise-then-dot."""
    from model import quant
    from pallas_kernels import quantized_matmul as qmm

    calls = []
    real = qmm.quantized_matmul
    monkeypatch.setattr(qmm, "quantized_matmul", lambda *a, **kw: calls.append(kw["fmt"]) or real(*a, **kw))
    values, scales, zeros = make_weight(np.random.default_rng(10), "int4", 128, 24, 32, True, False)
    w = quant.QuantizedArray(values, scales, zeros, fmt="int4", group_size=32)
    x = jnp.asarray(np.random.default_rng(11).standard_normal((3, 128)), jnp.bfloat16)
    got = quant.matmul(x, w, options=quant.INTERPRET_OPTIONS)
    assert calls == ["int4"] and rel_err(got, quant.reference_matmul(x, w)) < 4e-3
    quant.matmul(x, w, options=dataclasses.replace(quant.INTERPRET_OPTIONS, kernel_max_rows=(("int4", 2),)))
    assert calls == ["int4"]
