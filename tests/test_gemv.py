"""Tests of the weight-streaming GEMV (pallas_kernels/gemv.py) against its plain-jnp reference.

One shared base runs in Pallas interpret mode on CPU and through Triton on a GPU. Shapes break the tiles on purpose
(K and N not multiples of the tile, a last K chunk with fewer tiles, M = 1..4); the interpreter starts every output
as NaN, so an unwritten column fails the finiteness check. The bit-trick conversions are checked exhaustively
against the dtype casts they replace (every int8, e4m3 and packed-int4 byte, e4m3 subnormals included).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gemv as G
from tests.test_quantized_matmul import fake_hopper, make_weight, rel_err  # noqa: F401 (fixture)

HAS_GPU = any(d.platform == "gpu" for d in jax.devices())
SMALL = G.GemvConfig(block_n=32, block_k=16, steps=3)
SMALL_LOOP = G.GemvConfig(block_n=32, block_k=16, steps=5, depth=2)  # a loop with 2 tiles in flight
SMALL_ATOMIC = G.GemvConfig(block_n=32, block_k=16, steps=2, atomic=True)  # K chunks meet by atomic adds

# (name, fmt, K, N, group_size, asymmetric, per-tensor scale)
CASES = (
    ("bf16_k100_n33", "bf16", 100, 33, 0, False, False),
    ("bf16_k512_n256", "bf16", 512, 256, 0, False, False),
    ("int8_k100_n33", "int8", 100, 33, 0, False, False),
    ("int8_q8_0_k160_n40", "int8", 160, 40, 32, False, False),
    ("fp8_channel_k100_n33", "fp8", 100, 33, 0, False, False),
    ("fp8_tensor_k96_n80", "fp8", 96, 80, 0, False, True),
    ("int4_g32_asym_k224_n33", "int4", 224, 33, 32, True, False),
    ("int4_g64_sym_k256_n48", "int4", 256, 48, 64, False, False),
    ("int4_g128_asym_k384_n20", "int4", 384, 20, 128, True, False),
    ("int4_g32_float_zero_k160_n40", "int4", 160, 40, 32, "float", False),  # GGUF Q4_1: zero = -min / scale
)


def weight(rng, fmt, k, n, g, asym, per_tensor):
    if fmt == "int8" and g:  # GGUF Q8_0: int8 codes, one scale per group of g rows
        values = jnp.asarray(rng.integers(-127, 128, (k, n)), jnp.int8)
        return values, jnp.asarray(rng.uniform(0.1, 1, (k // g, n)), jnp.float32), None
    if asym == "float":
        values, scales, _ = make_weight(rng, fmt, k, n, g, False, per_tensor)
        return values, scales, jnp.asarray(rng.uniform(-3, 18, (k // g, n)), jnp.float32)
    return make_weight(rng, fmt, k, n, g, asym, per_tensor)


class GemvTestBase:
    backend = "interpret"
    config = SMALL

    @pytest.mark.parametrize("m", [1, 2, 4])
    @pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
    def test_matches_reference(self, case, m):
        _, fmt, k, n, g, asym, per_tensor = case
        rng = np.random.default_rng(abs(hash((case[0], m))) % 2**32)
        w = weight(rng, fmt, k, n, g, asym, per_tensor)
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        got = G.gemv(x, *w, fmt=fmt, group_size=g, config=self.config, backend=self.backend)
        want = G.reference(x, *w, fmt=fmt, group_size=g)
        assert got.shape == (m, n) and got.dtype == x.dtype
        assert rel_err(got, want) < 4e-3  # f32 sums in another order, one bf16 rounding

    def test_fp8_subnormals_and_extremes(self):
        """Every finite e4m3 code (subnormals, +-448) as a weight row: the conversion must be exact."""
        codes = jnp.arange(256, dtype=jnp.uint8)
        finite = codes[~jnp.isnan(jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn).astype(jnp.float32))]
        values = jax.lax.bitcast_convert_type(jnp.tile(finite[:, None], (1, 48)), jnp.float8_e4m3fn)  # [254, 48]
        k = values.shape[0]
        x = jnp.zeros((1, k), jnp.float32).at[0, jnp.arange(0, k, 7)].set(1.0)  # sums a few codes, exactly
        scales = jnp.full((48,), 0.5, jnp.float32)
        got = G.gemv(x, values, scales, fmt="fp8", config=self.config, backend=self.backend)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(G.reference(x, values, scales, fmt="fp8")))


class TestInterpret(GemvTestBase):
    pass


class TestInterpretLoop(GemvTestBase):
    config = SMALL_LOOP


class TestInterpretAtomic(GemvTestBase):
    config = SMALL_ATOMIC


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
class TestTriton(GemvTestBase):
    backend = "triton"
    config = G.GemvConfig()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a GPU")
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_triton_small_tiles_and_plain_casts(case):
    """The small-tile geometry (uneven last chunk) and the plain-cast conversions on the GPU."""
    _, fmt, k, n, g, asym, per_tensor = case
    rng = np.random.default_rng(5)
    w = weight(rng, fmt, k, n, g, asym, per_tensor)
    x = jnp.asarray(rng.standard_normal((3, k)), jnp.bfloat16)
    want = G.reference(x, *w, fmt=fmt, group_size=g)
    for config in (SMALL, SMALL_LOOP, SMALL_ATOMIC, dataclasses.replace(G.GemvConfig(), bit_convert=False)):
        assert rel_err(G.gemv(x, *w, fmt=fmt, group_size=g, config=config, backend="triton"), want) < 4e-3


def test_conversions_are_exact():
    b = jnp.arange(256, dtype=jnp.uint8)
    i8 = jax.lax.bitcast_convert_type(b, jnp.int8)
    np.testing.assert_array_equal(G.convert(i8, "int8"), i8.astype(jnp.float32))
    e4m3 = jax.lax.bitcast_convert_type(b, jnp.float8_e4m3fn).astype(jnp.float32)
    finite = ~jnp.isnan(e4m3)
    np.testing.assert_array_equal((G.convert(b, "fp8") * G.FP8_OUT_SCALE)[finite], e4m3[finite])
    bf = jnp.asarray(np.random.default_rng(0).standard_normal(4096) * 1e3, jnp.bfloat16)
    np.testing.assert_array_equal(G.convert(bf, "bf16"), bf.astype(jnp.float32))
    lo, hi = G.convert_int4(b)
    np.testing.assert_array_equal(lo, (b & 0xF).astype(jnp.float32))
    np.testing.assert_array_equal(hi, 16 * (b >> 4).astype(jnp.float32))


def test_lowers_to_triton_on_cpu(fake_hopper):  # noqa: F811
    """Every format (partial tiles included) lowers through Pallas' Triton rules."""
    for _, fmt, k, n, g, asym, per_tensor in CASES:
        w = weight(np.random.default_rng(0), fmt, k, n, g, asym, per_tensor)
        x = jax.ShapeDtypeStruct((2, k), jnp.bfloat16)
        for config in (G.GemvConfig(), SMALL, SMALL_LOOP, SMALL_ATOMIC):

            def f(x, v, s, z, config=config, fmt=fmt, g=g):
                return G._kernel_jit(x, v, s, z, fmt=fmt, group_size=g, config=config, interpret=False)

            assert "triton" in jax.jit(f).trace(x, *w).lower(lowering_platforms=("cuda",)).as_text()


def test_bad_inputs_raise():
    x = jnp.ones((2, 64), jnp.bfloat16)
    w8 = jnp.ones((64, 16), jnp.int8)
    with pytest.raises(ValueError, match="1 to 4"):
        G.gemv(jnp.ones((5, 64), jnp.bfloat16), w8, jnp.ones(16), fmt="int8", backend="interpret")
    with pytest.raises(ValueError, match="last axis"):
        G.gemv(x, jnp.ones((32, 16), jnp.int8), jnp.ones(16), fmt="int8", backend="interpret")
    with pytest.raises(ValueError, match="stores values as int8"):
        G.gemv(x, w8.astype(jnp.int32), jnp.ones(16), fmt="int8", backend="interpret")
    with pytest.raises(ValueError, match="scales"):
        G.gemv(x, w8, jnp.ones(15), fmt="int8", backend="interpret")
    with pytest.raises(ValueError, match="group_size"):
        G.gemv(x, jnp.ones((32, 16), jnp.uint8), jnp.ones((1, 16)), fmt="int4", group_size=48)
    with pytest.raises(ValueError, match="unknown fmt"):
        G.gemv(x, w8, fmt="int2", backend="interpret")
    with pytest.raises(ValueError, match="zero points"):
        G.gemv(x, w8, jnp.ones((2, 16)), jnp.ones((2, 16)), fmt="int8", group_size=32, backend="interpret")
    with pytest.raises(ValueError, match="block_n"):
        G.GemvConfig(block_n=48)


def test_xla_backend_is_the_reference():
    rng = np.random.default_rng(3)
    w = weight(rng, "int4", 128, 24, 32, True, False)
    x = jnp.asarray(rng.standard_normal((2, 128)), jnp.float32)
    np.testing.assert_array_equal(
        G.gemv(x, *w, fmt="int4", group_size=32, backend="xla"), G.reference(x, *w, fmt="int4", group_size=32)
    )


@pytest.mark.parametrize("case", CASES[::2], ids=[c[0] for c in CASES[::2]])
def test_model_door_takes_the_gemv_for_one_row(case, monkeypatch):
    """model.quant.matmul sends a one-row x through the GEMV (the interpreter here) for every [K, N] format, with the
    LM head's float32 output too, and equals the plain-jnp path; two rows take the old path."""
    from model import quant

    _, fmt, k, n, g, asym, per_tensor = case
    calls = []
    real = G.gemv
    monkeypatch.setattr(G, "gemv", lambda *a, **kw: calls.append(kw["fmt"]) or real(*a, **kw))
    values, scales, zeros = weight(np.random.default_rng(2), fmt, k, n, g, asym, per_tensor)
    w = values if fmt == "bf16" else quant.QuantizedArray(values, scales, zeros, fmt=fmt, group_size=g)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((1, 1, k)), jnp.bfloat16)
    want = G.reference(x, values, scales, zeros, fmt=fmt, group_size=g, out_dtype=jnp.float32)
    opts = quant.MatmulOptions(gemv_backend="interpret")  # the other paths stay on XLA on a CPU
    for out_dtype in (None, jnp.float32):
        got = quant.matmul(x, w, out_dtype=out_dtype, options=opts)
        assert got.shape == (1, 1, n) and got.dtype == (out_dtype or x.dtype)
        assert rel_err(got, want) < 4e-3
    assert calls == [fmt, fmt]
    quant.matmul(jnp.concatenate([x, x], axis=1), w, options=opts)
    assert len(calls) == 2
    quant.matmul(x, w, options=quant.MatmulOptions(gemv_max_rows=(), gemv_backend="interpret"))
    assert len(calls) == 2  # the option turns the GEMV off


@pytest.mark.parametrize("method", ["int8", "int4_rtn"])
def test_engine_decodes_one_row_steps_through_the_gemv(method, monkeypatch):
    """A whole engine (tiny model, float32, weights quantised at load) with the GEMV serving its one-row decode steps
    (the interpreter here) greedy-decodes the tokens of the same engine without it."""
    from model import quant
    from model.config import ModelConfig
    from model.transformer import random_model
    from serving.engine.llm import LLM
    from serving.engine.quantize import quantize_model

    cfg = ModelConfig.tiny()
    opts = dict(max_model_len=64, max_num_seqs=1, max_num_batched_tokens=32, num_kv_blocks=16, warmup=False)

    def tokens(options=None):
        model = random_model(cfg, jnp.float32, seed=3)
        quantize_model(model, method)
        quant.set_options(model, options)  # the weights carry the paths their steps take
        llm = LLM.from_model(model, None, **opts)
        return llm.generate([[5, 17, 29, 41, 3, 8]], max_tokens=6, temperature=0.0, ignore_eos=True)[0].token_ids

    want = tokens()
    calls = []
    real = G.gemv
    monkeypatch.setattr(G, "gemv", lambda *a, **kw: calls.append(kw["fmt"]) or real(*a, **kw))
    assert tokens(quant.MatmulOptions(gemv_backend="interpret")) == want
    assert calls and set(calls) == {method[:4]}  # traced once per projection and one-row step shape
