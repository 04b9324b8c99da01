"""The one-pass activation quantiser (pallas_kernels/act_quant.py) against its jnp reference.

`TestInterpreted` runs the Pallas kernel in the interpreter on CPU at shapes that break the power-of-two tiles
(K = 100, 513, 14336; M not a multiple of the row block), with all-zero rows, SmoothQuant's pre-scale and a static
scale: codes and scales must equal the reference exactly. `TestGpu` runs it through Triton on a GPU: scales
exact, codes exact except at rounding boundaries (XLA may rewrite the reference's divide there; see
`_assert_codes_equal_but_at_boundaries`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import act_quant as aq


def _has_gpu() -> bool:
    return jax.devices()[0].platform == "gpu"


def _x(m, k, dtype, seed):
    kx, kr = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32) * jnp.exp(2 * jax.random.normal(kr, (m, 1)))
    return x.at[min(1, m - 1)].set(0.0).astype(dtype)  # one all-zero row: scale 1, codes 0, nothing NaN


CASES = [
    pytest.param("int8", 3, 100, jnp.bfloat16, False, False, id="int8_m3_k100"),
    pytest.param("fp8", 33, 513, jnp.bfloat16, False, False, id="fp8_m33_k513"),
    pytest.param("int8", 5, 1024, jnp.float16, True, False, id="int8_f16_pre_scale"),
    pytest.param("fp8", 7, 96, jnp.float32, False, True, id="fp8_f32_static"),
    pytest.param("int8", 9, 384, jnp.bfloat16, True, True, id="int8_pre_and_static"),
    pytest.param("fp8", 2, 14336, jnp.bfloat16, False, False, id="fp8_llama_down_k"),  # 7 chunks, no masks
    pytest.param("int8", 8, 4096, jnp.bfloat16, True, False, id="int8_whole_row_blocks"),  # M % block_m == 0
]


class ActQuantBase:
    backend: str

    @pytest.mark.parametrize("fmt,m,k,dtype,pre,static", CASES)
    def test_matches_reference(self, fmt, m, k, dtype, pre, static):
        x = _x(m, k, dtype, seed=m * k)
        pre_scale = jnp.linspace(0.5, 2.0, k) if pre else None
        act_scale = jnp.float32(0.02) if static else None
        q, s = aq.quantize_activations(x, fmt, act_scale, pre_scale, backend=self.backend)
        qr, sr = aq.reference(x, fmt, act_scale, pre_scale)
        assert q.dtype == aq.DTYPES[fmt] and q.shape == (m, k) and s.shape == (m, 1) and s.dtype == jnp.float32
        q32, qr32 = np.asarray(q, np.float32), np.asarray(qr, np.float32)
        assert np.isfinite(q32).all() and np.isfinite(np.asarray(s)).all()
        if not static:
            assert float(s[min(1, m - 1), 0]) == 1.0 and not q32[min(1, m - 1)].any()  # the all-zero row
        np.testing.assert_array_equal(np.asarray(s), np.asarray(sr))
        np.testing.assert_array_equal(q32, qr32)

    @pytest.mark.parametrize("fmt,m,k,dtype,pre,static", CASES)
    def test_fake_quantize_is_codes_times_scales(self, fmt, m, k, dtype, pre, static):
        """The one-pass quantise-dequantise: codes * scale in x's dtype, the same numbers as quantising with this
        backend and dequantising in jnp (the all-zero row stays zero)."""
        x = _x(m, k, dtype, seed=m * k + 1)
        pre_scale = jnp.linspace(0.5, 2.0, k) if pre else None
        act_scale = jnp.float32(0.02) if static else None
        got = aq.fake_quantize(x, fmt, act_scale, pre_scale, backend=self.backend)
        q, s = aq.quantize_activations(x, fmt, act_scale, pre_scale, backend=self.backend)
        want = (np.asarray(q, np.float32) * np.asarray(s)).astype(dtype)
        assert got.dtype == dtype and got.shape == (m, k)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
        if not static:
            assert not np.asarray(got, np.float32)[min(1, m - 1)].any()

    def test_leading_axes_and_ties(self):
        # scale 1 (row max 127): x.5 ties round to even as jnp.round does, and 127.4 stays inside the clip.
        row = jnp.asarray([0.5, 1.5, 2.5, -0.5, -2.5, 3.5, 126.5, -127.0, 127.0, 0.49999997], jnp.float32)
        x = jnp.stack([row, row * 0.0, -row]).reshape(3, 1, 10)
        q, s = aq.quantize_activations(x, "int8", backend=self.backend)
        assert q.shape == (3, 1, 10) and s.shape == (3, 1, 1)
        np.testing.assert_array_equal(np.asarray(q[0, 0]), [0, 2, 2, 0, -2, 4, 126, -127, 127, 0])
        np.testing.assert_array_equal(np.asarray(q), np.asarray(aq.reference(x, "int8")[0]))


class TestInterpreted(ActQuantBase):
    backend = "interpret"


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="needs a GPU (Triton)")
class TestGpu(ActQuantBase):
    backend = "triton"

    @pytest.mark.parametrize("fmt", ["int8", "fp8"])
    @pytest.mark.parametrize("k", [4096, 14336])
    def test_llama_prefill(self, fmt, k):
        x = _x(4096, k, jnp.bfloat16, seed=k)
        q, s = aq.quantize_activations(x, fmt, backend="triton")
        qr, sr = aq.reference(x, fmt)
        np.testing.assert_array_equal(np.asarray(s), np.asarray(sr))
        _assert_codes_equal_but_at_boundaries(x, s, q, qr, fmt)


def _assert_codes_equal_but_at_boundaries(x, s, q, qr, fmt, rel: float = 2.0**-18):
    """Kernel codes q equal the reference's qr except where the exact quotient v = x / s (float64) lies within
    `rel` (relative) of a rounding boundary, and there q must be one of the two neighbouring codes. On the GPU
    XLA may rewrite the reference's x / scale (into a multiply by a reciprocal, for one), which moves v by a few
    ulps: the kernel is right to the rule up to that, and anything else fails here."""
    v = np.asarray(x, np.float64) / np.asarray(s, np.float64)
    if fmt == "int8":
        enc = lambda a: np.clip(np.round(a), -127, 127)  # noqa: E731
    else:
        enc = lambda a: np.clip(a, -448, 448).astype(jnp.float8_e4m3fn).astype(np.float64)  # noqa: E731
    lo, hi = enc(v * (1 - rel)), enc(v * (1 + rel))
    q64, qr64 = np.asarray(q, np.float64), np.asarray(qr, np.float64)
    boundary = lo != hi
    assert np.all((q64 == lo) | (q64 == hi)), "kernel codes off the rule (not at a rounding boundary)"
    assert np.all((qr64 == lo) | (qr64 == hi)), "reference codes off the rule"
    differ = q64 != qr64
    assert not np.any(differ & ~boundary)
    assert differ.mean() < 1e-2, f"{differ.sum()} codes differ"  # ties are common: x and amax are bf16


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_lowers_to_triton_on_cpu(fmt, monkeypatch):
    """The Pallas -> Triton lowering (masked 2-D loads and stores, the row max, floor-based rounding, the e4m3
    cast and its byte view) runs without a GPU, for an H200 target."""
    from jax._src.pallas.triton import gpu_info, pallas_call_registration  # noqa: PLC0415

    h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: h200)
    args = (
        jax.ShapeDtypeStruct((333, 14336), jnp.bfloat16),
        jax.ShapeDtypeStruct((), jnp.float32),
        jax.ShapeDtypeStruct((14336,), jnp.float32),
    )
    for act, pre in ((None, None), (args[1], args[2])):
        for dequantize in (False, True):
            fn = jax.jit(lambda x, a, p, d=dequantize: aq._act_quant_call(x, fmt, a, p, aq.ActQuantConfig(), False, d))  # pylint: disable=protected-access
            text = fn.trace(args[0], act, pre).lower(lowering_platforms=("cuda",)).as_text()
            assert "__gpu$xla.gpu.triton" in text and "grid_x = 333" in text


@pytest.mark.parametrize(
    "x,fmt,kwargs,match",
    [
        (jnp.zeros((2, 8)), "int4", {}, "fmt"),
        (jnp.zeros((2, 8), jnp.int32), "int8", {}, "x must be"),
        (jnp.zeros((2, 8)), "int8", {"pre_scale": jnp.ones(4)}, "pre_scale"),
        (jnp.zeros((2, 8)), "int8", {"act_scale": jnp.ones(2)}, "act_scale"),
        (jnp.zeros((2, 8)), "int8", {"backend": "mosaic_gpu"}, "mosaic_gpu"),
    ],
)
def test_bad_inputs_raise(x, fmt, kwargs, match):
    for entry in (aq.quantize_activations, aq.fake_quantize):
        with pytest.raises(ValueError, match=match):
            entry(x, fmt, **{"backend": "interpret", **kwargs})


def test_fake_quantize_xla_matches_the_model_rule():
    """The "xla" backend is model/quant.py's own rule (pre-scale rounded to x's dtype, quantise, dequantise)."""
    from model import quant  # noqa: PLC0415

    x = _x(6, 96, jnp.bfloat16, seed=5)
    pre = jnp.linspace(0.5, 2.0, 96)
    w = quant.QuantizedArray(jnp.zeros((96, 8), jnp.int8), jnp.ones(8), fmt="int8", pre_scale=pre, act_fmt="int8")
    for backend in ("xla", "interpret"):
        got = aq.fake_quantize(x, "int8", None, pre, backend=backend)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(quant._prepare_input(x, w), np.float32))


def test_config_validates():
    with pytest.raises(ValueError, match="max_block_elems"):
        aq.ActQuantConfig(max_block_elems=1000)
    assert aq.ActQuantConfig().block_m(4096) == 4 and aq.ActQuantConfig().block_m(14336) == 1
