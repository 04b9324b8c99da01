"""The fused RMSNorm / SwiGLU + activation quantiser (pallas_kernels/act_quant_fused.py) against the unfused jnp ops.

The interpreter on a CPU and Triton on a GPU, at shapes that break the tiles (K = 100 masked, 14336 in 7 chunks,
M not a multiple of the row block), with a residual, a pre-scale and a static scale. The prologue's f32 arithmetic
may round a bf16 value differently from XLA's (a sum of squares in another order, sigmoid's last bit), so codes may
differ by one step where that happens: scales within 1e-2 relative, codes equal for >= 99% and within one step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import act_quant_fused as F
from tests.test_quantized_matmul import fake_hopper  # noqa: F401 (fixture)

HAS_GPU = jax.devices()[0].platform == "gpu"


def _x(shape, dtype, seed):
    return (jax.random.normal(jax.random.key(seed), shape, jnp.float32) * 2).astype(dtype)


def _close_codes(got, want, fmt):
    g, w = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(g).all()
    if fmt == "int8":
        assert np.abs(g - w).max() <= 1 and (g == w).mean() >= 0.99
    else:  # e4m3: one step is at most 1/8 of the value (1/16 relative below 2^-6 ... plus subnormals)
        assert np.all(np.abs(g - w) <= np.abs(w) / 8 + 2.0**-9) and (g == w).mean() >= 0.99


def _close_scales(got, want):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-2)


RMS_CASES = [
    pytest.param("int8", (3, 100), jnp.bfloat16, True, False, False, id="int8_k100_residual"),
    pytest.param("fp8", (2, 5, 512), jnp.bfloat16, False, True, False, id="fp8_3d_pre_scale"),
    pytest.param("int8", (9, 384), jnp.float32, True, False, True, id="int8_f32_static"),
    pytest.param("fp8", (4, 14336), jnp.bfloat16, True, False, False, id="fp8_k14336"),
]


class FusedTestBase:
    backend = "interpret"

    @pytest.mark.parametrize("fmt,shape,dtype,residual,pre,static", RMS_CASES)
    def test_rms_norm_quantize(self, fmt, shape, dtype, residual, pre, static):
        k = shape[-1]
        x, r = _x(shape, dtype, 0), (_x(shape, dtype, 1) if residual else None)
        w = jax.random.uniform(jax.random.key(2), (k,), jnp.float32, 0.5, 1.5).astype(dtype)
        kw = dict(
            residual=r,
            offset=0.0,
            pre_scale=jax.random.uniform(jax.random.key(3), (k,), jnp.float32, 0.5, 2) if pre else None,
            act_scale=jnp.float32(0.05) if static else None,
        )
        got = F.rms_norm_quantize(x, w, 1e-5, fmt, backend=self.backend, **kw)
        (want_q, want_s), want_h = F.reference_rms_norm_quantize(
            x, w, 1e-5, fmt, r, 0.0, kw["act_scale"], kw["pre_scale"]
        )
        (q, s), h = got if residual else (got, None)
        assert q.shape == shape and q.dtype == F.DTYPES[fmt] and s.shape == (*shape[:-1], 1)
        _close_codes(q, want_q, fmt)
        _close_scales(s, want_s)
        if residual:
            np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(want_h, np.float32))
        values = F.rms_norm_quantize(x, w, 1e-5, fmt, backend=self.backend, dequantize=True, **kw)
        values = values[0] if residual else values
        assert values.dtype == dtype
        want_v = np.asarray(want_q, np.float32) * np.asarray(want_s)
        np.testing.assert_allclose(np.asarray(values, np.float32), want_v, rtol=0.13, atol=float(np.max(want_s)))

    @pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
    @pytest.mark.parametrize("fmt,m,f", [("int8", 5, 100), ("fp8", 3, 2048), ("int8", 2, 14336)])
    def test_swiglu_quantize(self, fmt, m, f, activation):
        h = _x((m, 2 * f), jnp.bfloat16, 4)
        q, s = F.swiglu_quantize(h, fmt, activation, backend=self.backend)
        want_q, want_s = F.reference_swiglu_quantize(h, fmt, activation)
        assert q.shape == (m, f) and s.shape == (m, 1)
        _close_codes(q, want_q, fmt)
        _close_scales(s, want_s)


class TestInterpret(FusedTestBase):
    pass


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
class TestTriton(FusedTestBase):
    backend = "triton"


def test_xla_backend_and_bad_inputs():
    h = _x((2, 64), jnp.bfloat16, 5)
    q, s = F.swiglu_quantize(h, "int8", backend="xla")
    wq, ws = F.reference_swiglu_quantize(h, "int8")
    np.testing.assert_array_equal(q, wq) and np.testing.assert_array_equal(s, ws)
    with pytest.raises(ValueError, match="2F"):
        F.swiglu_quantize(_x((2, 63), jnp.bfloat16, 5), "int8", backend="interpret")
    with pytest.raises(ValueError, match="activation"):
        F.swiglu_quantize(h, "int8", "relu", backend="interpret")
    with pytest.raises(ValueError, match="fmt"):
        F.swiglu_quantize(h, "int4", backend="interpret")
    with pytest.raises(ValueError, match="weight must be"):
        F.rms_norm_quantize(h, jnp.ones((63,)), 1e-5, "fp8", backend="interpret")
    with pytest.raises(ValueError, match="residual"):
        F.rms_norm_quantize(h, jnp.ones((64,)), 1e-5, "fp8", residual=h[:1], backend="interpret")


def test_lowers_to_triton_on_cpu(fake_hopper):  # noqa: F811
    """Both prologues (residual, pre-scale, static scale, dequantised output) lower through Pallas' Triton rules."""
    cfg = F.ActQuantConfig()
    for k, res, pre, static, deq in ((100, True, False, False, False), (4096, False, True, True, True)):
        x = jnp.ones((3, k), jnp.bfloat16)
        args = (x, x if res else None, jnp.ones((k,)), jnp.ones((k,)) if pre else None, 0.1 if static else None)
        for mode in ("rms", "swiglu"):
            xin = x if mode == "rms" else jnp.ones((3, 2 * k), jnp.bfloat16)
            kw = dict(mode=mode, fmt="fp8", k=k, eps=1e-5, offset=0.0, activation="silu", dequantize=deq)
            res_in = args[1] if mode == "rms" else None
            lowered = F._call.trace(xin, res_in, *args[2:], **kw, config=cfg, interpret=False).lower(
                lowering_platforms=("cuda",)
            )
            assert "triton" in lowered.as_text()


def _w8a8_weight(k, n, seed=7):
    from model import quant_methods as qm  # noqa: PLC0415

    w = jax.random.normal(jax.random.key(seed), (k, n), jnp.float32) * k**-0.5
    return qm.fp8_w8a8(w)  # fp8 weights per channel, fp8 activations per token


@pytest.mark.parametrize("rows", [3, 256])
def test_model_doors_fuse_the_quantiser_for_w8a8(rows, monkeypatch):
    """model/quant_fused.py: a W8A8 weight's swiglu_matmul / rms_norm_matmul run the fused kernels (interpreted here;
    below w8a8_min_rows the codes' values feed the weight's bf16 paths, from it the codes feed the W8A8 kernel) and
    agree with the unfused ops through model.quant.matmul; a bf16 weight takes the unfused ops exactly."""
    from model import quant, quant_fused  # noqa: PLC0415

    calls = []
    for name in ("swiglu_quantize", "rms_norm_quantize"):
        real = getattr(F, name)
        monkeypatch.setattr(F, name, lambda *a, real=real, name=name, **kw: calls.append(name) or real(*a, **kw))
    opts = quant.MatmulOptions(act_quant_backend="interpret", w8a8_backend="interpret")
    w = _w8a8_weight(256, 256)
    h = _x((rows, 512), jnp.bfloat16, 8)
    gate, up = jnp.split(h, 2, axis=-1)
    want = quant.matmul(jax.nn.silu(gate) * up, w, options=opts)
    got = quant_fused.swiglu_matmul(h, w, "silu", options=opts)
    assert got.shape == want.shape and float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 2e-2
    x, r, g = _x((rows, 256), jnp.bfloat16, 9), _x((rows, 256), jnp.bfloat16, 10), jnp.full((256,), 0.9)
    got, hsum = quant_fused.rms_norm_matmul(x, g, 1e-5, w, residual=r, options=opts)
    (ref_q, ref_s), ref_h = F.reference_rms_norm_quantize(x, g, 1e-5, "fp8", r)
    want = quant.matmul((ref_q.astype(jnp.float32) * ref_s).astype(jnp.bfloat16), w, options=opts)
    np.testing.assert_array_equal(np.asarray(hsum, np.float32), np.asarray(ref_h, np.float32))
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 2e-2
    assert calls == ["swiglu_quantize", "rms_norm_quantize"]
    wb = jnp.asarray(np.asarray(w.dequantize()), jnp.bfloat16)  # a plain weight: the unfused ops, bit for bit
    np.testing.assert_array_equal(
        np.asarray(quant_fused.swiglu_matmul(h, wb, "silu"), np.float32),
        np.asarray(quant.matmul(jax.nn.silu(gate) * up, wb), np.float32),
    )
    assert calls == ["swiglu_quantize", "rms_norm_quantize"]
