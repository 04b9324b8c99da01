"""Tests of the quantisation methods: error ordering on a layer with outlier inputs, safe scales, int4 packing."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from model import quant
from model import quant_methods as qm


def outlier_layer(seed=0, t=512, k=256, n=96):
    """Correlated inputs with a few channels ~30x larger than the rest (as in LLM activations), random weight.

    GPTQ's compensation works through correlations between input channels (with white inputs it is RTN).
    """
    rng = np.random.default_rng(seed)
    mix = np.eye(k) + 1.2 * rng.standard_normal((k, k)) / np.sqrt(k)
    x = (rng.standard_normal((t, k)) @ mix).astype(np.float32)
    x[:, rng.choice(k, 6, replace=False)] *= 30.0
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(w)


def output_error(x, w, q):
    return float(jnp.linalg.norm(x @ w - quant.reference_matmul(x, q)) / jnp.linalg.norm(x @ w))


@pytest.mark.parametrize("asymmetric", [False, True])
def test_awq_and_gptq_beat_rtn_on_outlier_inputs(asymmetric):
    x, w = outlier_layer()
    kw = dict(fmt="int4", group_size=64, asymmetric=asymmetric)
    e_rtn = output_error(x, w, qm.rtn(w, **kw))
    e_awq = output_error(x, w, qm.awq(w, x, **kw))
    e_gptq = output_error(x, w, qm.gptq(w, x, **kw))
    e_gptq_act = output_error(x, w, qm.gptq(w, x, act_order=True, **kw))
    assert e_awq < 0.9 * e_rtn, (e_awq, e_rtn)
    assert e_gptq < 0.9 * e_rtn, (e_gptq, e_rtn)
    assert e_gptq_act < 0.9 * e_gptq, (e_gptq_act, e_gptq)  # outlier inputs first: their errors get compensated


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_gptq_per_channel_beats_rtn(fmt):
    x, w = outlier_layer(1)
    q = qm.gptq(w, x, fmt=fmt)
    assert q.fmt == fmt and q.values.dtype == {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}[fmt]
    assert output_error(x, w, q) < 0.9 * output_error(x, w, qm.rtn(w, fmt))


def test_fp8_w8a8_calibrated_weights_beat_rtn_weights():
    x, w = outlier_layer(9)
    err = {m: output_error(x, w, qm.fp8_w8a8(w, x, weights=m)) for m in ("rtn", "search", "gptq")}
    assert err["gptq"] < 0.9 * err["rtn"] and err["search"] < err["rtn"], err
    with pytest.raises(ValueError, match="weights"):
        qm.fp8_w8a8(w, x, weights="mse")
    with pytest.raises(ValueError, match="x_tk"):
        qm.fp8_w8a8(w, weights="gptq")


def test_smoothquant_beats_plain_w8a8_on_outliers():
    x, w = outlier_layer(2)
    plain = qm.rtn(w, "int8")
    plain = quant.QuantizedArray(plain.values, plain.scales, fmt="int8", act_fmt="int8")
    smooth = qm.smoothquant(w, x, alpha=0.5)
    assert output_error(x, w, smooth) < output_error(x, w, plain)
    with pytest.raises(ValueError, match="alpha"):
        qm.smoothquant(w, x, alpha=1.5)


@pytest.mark.parametrize("static", [False, True])
def test_fp8_w8a8_scales_and_error(static):
    x, w = outlier_layer(3)
    q = qm.fp8_w8a8(w, x, static=static)
    assert (q.act_scale is not None) == static
    assert output_error(x, w, q) < 0.1


@pytest.mark.parametrize(
    "fmt,kw",
    [
        ("int8", {}),
        ("fp8", {}),
        ("fp8", {"per_tensor": True}),
        ("int4", {"group_size": 32}),
        ("int4", {"group_size": 32, "asymmetric": True}),
    ],
)
def test_rtn_scales_never_zero_or_nan_and_reconstruct(fmt, kw):
    rng = np.random.default_rng(4)
    w = rng.standard_normal((128, 48)).astype(np.float32)
    w[:, 3] = 0.0  # an all-zero column
    w[:32, 5] = 0.0  # an all-zero group
    w[:, 7] = 1e-30  # a denormal-small column
    q = qm.rtn(jnp.asarray(w), fmt, **kw)
    scales = np.asarray(q.scales)
    assert np.isfinite(scales).all() and (scales > 0).all()
    back = np.asarray(q.dequantize())
    assert np.isfinite(back).all()
    np.testing.assert_array_equal(back[:, 3], 0.0)
    rel = np.linalg.norm(back - w) / np.linalg.norm(w)
    assert rel < {"int8": 0.01, "fp8": 0.05, "int4": 0.2}[fmt], rel


def test_gptq_and_awq_scales_safe_with_dead_inputs():
    x, w = outlier_layer(5, k=128)
    x = x.at[:, :10].set(0.0)  # channels never active
    for q in (qm.gptq(w, x, group_size=32), qm.awq(w, x, group_size=32)):
        assert np.isfinite(np.asarray(q.dequantize())).all()
        assert (np.asarray(q.scales) > 0).all()


def test_int4_pack_round_trip():
    codes = jnp.asarray(np.random.default_rng(6).integers(0, 16, (64, 10)), jnp.uint8)
    packed = qm.pack_int4(codes)
    assert packed.shape == (32, 10) and packed.dtype == jnp.uint8
    np.testing.assert_array_equal(qm.unpack_int4(packed), codes)
    # the layout model/quant.py documents: row 2i low nibble, row 2i+1 high nibble
    np.testing.assert_array_equal(np.asarray(packed[0] & 0xF), np.asarray(codes[0]))
    np.testing.assert_array_equal(np.asarray(packed[0] >> 4), np.asarray(codes[1]))
    q = quant.QuantizedArray(packed, jnp.ones((2, 10)), fmt="int4", group_size=32)
    np.testing.assert_array_equal(q.dequantize(), np.asarray(codes, np.float32) - 8.0)


def test_bad_group_size_raises():
    with pytest.raises(ValueError, match="group_size"):
        qm.rtn(jnp.ones((100, 4)), "int4", group_size=64)
    with pytest.raises(ValueError, match="fmt"):
        qm.gptq(jnp.ones((64, 4)), jnp.ones((8, 64)), fmt="bf16")


def test_door_applies_pre_scale_and_activation_quantisation():
    x, w = outlier_layer(7, t=16, k=128, n=32)
    for q in (qm.awq(w, x, group_size=32), qm.smoothquant(w, x), qm.fp8_w8a8(w, x, static=True)):
        np.testing.assert_allclose(quant.matmul(x, q), quant.reference_matmul(x, q), rtol=2e-4, atol=2e-4)


def test_fp8_calibrated_scales_beat_amax_and_stay_safe():
    """The searched per-channel e4m3 scales give a smaller activation-weighted error than amax / 448 (never a
    larger one: amax / 448 is a candidate), and an all-zero column keeps a finite positive scale."""
    x, w = outlier_layer(8)
    w = w.at[:, 4].set(0.0)
    amax, searched = qm.rtn(w, "fp8"), qm.fp8_calibrated(w, x)
    h = jnp.mean(x * x, axis=0)[:, None]

    def weighted(q):
        return jnp.sum(h * (w - q.dequantize()) ** 2, axis=0)

    assert (np.asarray(weighted(searched)) <= np.asarray(weighted(amax)) * (1 + 1e-6)).all()
    assert output_error(x, w, searched) < 0.9 * output_error(x, w, amax)
    scales = np.asarray(searched.scales)
    assert np.isfinite(scales).all() and (scales > 0).all()
    np.testing.assert_array_equal(np.asarray(searched.dequantize())[:, 4], 0.0)


def test_int4_float_zero_points_reproduce_a_q4_1_grid():
    """A weight already on a 4-bit grid per group of 32 (w = m + d * q, as a GGUF Q4_1 checkpoint dequantises)
    comes back exactly with float zero points at group 32; integer zero points (0 forced into the range) do not."""
    rng = np.random.default_rng(10)
    k, n = 128, 24
    q = rng.integers(0, 16, (k, n))
    q[0::32], q[1::32] = 0, 15  # every group spans the full code range, as llama.cpp's min / max does
    d = np.repeat(rng.uniform(0.01, 0.05, (k // 32, n)), 32, axis=0)
    m = np.repeat(rng.uniform(-0.3, 0.1, (k // 32, n)), 32, axis=0)
    w = jnp.asarray(m + d * q, jnp.float32)
    exact = qm.rtn(w, "int4", group_size=32, asymmetric=True, zero_point="float").dequantize()
    np.testing.assert_allclose(exact, w, atol=1e-6)
    integer = qm.rtn(w, "int4", group_size=32, asymmetric=True).dequantize()
    assert float(jnp.max(jnp.abs(integer - w))) > 1e-3
    with pytest.raises(ValueError, match="zero_point"):
        qm.rtn(w, "int4", group_size=32, asymmetric=True, zero_point="fp")


@pytest.mark.parametrize("zero_point", ["int", "float"])
def test_int4_clip_search_never_worse_per_group_and_helps_heavy_tails(zero_point):
    x, w = outlier_layer(11)
    w = w * jnp.asarray(np.random.default_rng(11).standard_t(3, w.shape), jnp.float32)  # heavy-tailed weights
    g = 64
    plain = qm.int4_group_params(w, g, True, zero_point)
    clipped = qm.int4_clip_search(w, x, g, True, zero_point)
    h = jnp.einsum("tgi,tgj->gij", x.reshape(-1, 4, g), x.reshape(-1, 4, g)) / x.shape[0]

    def group_error(params):
        e = (w - qm._int4_array(w, *params, g).dequantize()).reshape(4, g, -1)
        return np.asarray(jnp.einsum("gin,gij,gjn->gn", e, h, e))

    assert (group_error(clipped) <= group_error(plain) * (1 + 1e-5) + 1e-9).all()
    kw = dict(fmt="int4", group_size=g, asymmetric=True, zero_point=zero_point)
    e_rtn = output_error(x, w, qm.rtn(w, **kw))
    assert output_error(x, w, qm._int4_array(w, *clipped, g)) < 0.95 * e_rtn
    assert output_error(x, w, qm.awq(w, x, **kw)) < output_error(x, w, qm.awq(w, x, clip=False, **kw))
    e_gptq = output_error(x, w, qm.gptq(w, x, act_order=True, **kw))
    assert e_gptq < output_error(x, w, qm.gptq(w, x, act_order=True, clip=False, **kw)) and e_gptq < 0.9 * e_rtn


def test_sequential_calibration_starts_from_float_inputs_and_then_sees_quantised_ones(monkeypatch):
    """benchmarks/quant_quality.py's `<method>_seq`: every projection quantised; the first layer's (nothing quantised
    before it) equal the float-input method's, a later layer's differ (their inputs come from quantised layers); an
    input-free method (RTN) is unchanged by the order."""
    from benchmarks import quant_quality as qq
    from model import transformer
    from model.config import ModelConfig

    cfg = ModelConfig.tiny()
    monkeypatch.setitem(qq.GROUP, "group_size", 16)  # tiny K = 64 / 96
    params = transformer.model_params(transformer.random_model(cfg, jnp.float32, seed=3))
    calib = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 32)).astype(np.int32)
    model = transformer.build_model(cfg, params, jnp.float32)
    plain = {m: qq.quantised_params(params, qq.calibration_inputs(model, calib, cfg.num_layers), m)
             for m in ("int4_gptq", "int4_rtn")}  # fmt: skip
    seq = {m: qq.sequential_params(cfg, params, calib, m) for m in ("int4_gptq", "int4_rtn")}

    def values(p, name):
        return np.asarray(p[name].values)

    names = [n for n in params if n.startswith("layers.") and n.rsplit(".", 1)[1] in ("wq", "w_down")]
    assert names and all(isinstance(seq["int4_gptq"][n], quant.QuantizedArray) for n in names)
    for n in ("layers.0.wq", "layers.0.w_down"):
        np.testing.assert_array_equal(values(seq["int4_gptq"], n), values(plain["int4_gptq"], n))
    assert not np.array_equal(
        values(seq["int4_gptq"], "layers.1.w_down"), values(plain["int4_gptq"], "layers.1.w_down")
    )
    for n in names:
        np.testing.assert_array_equal(values(seq["int4_rtn"], n), values(plain["int4_rtn"], n))


def test_calibration_sources(tmp_path):
    """calibration_file: a .txt, a JSONL with a "text" field per line, or a directory of them; anything else is
    refused by name. The default (model/calibration/) mixes prose and code, and every document reaches the budget."""
    from model import quantize_model as qz

    class Chars:  # one token per character: the tests read the sequences back as text
        def encode(self, text):
            return [ord(c) % 256 for c in text]

    (tmp_path / "a.txt").write_text("alpha " * 50)
    (tmp_path / "b.jsonl").write_text('{"text": "' + "beta " * 60 + '"}\n\n{"text": "gamma"}\n')
    (tmp_path / "notes.md").write_text("ignored in a directory")
    assert qz.calibration_texts(str(tmp_path / "b.jsonl")) == ["beta " * 60, "gamma"]
    assert qz.calibration_texts(str(tmp_path)) == ["alpha " * 50, "beta " * 60, "gamma"]
    rows = qz.calibration_tokens(Chars(), 256, str(tmp_path), max_tokens=1000)
    texts = ["".join(map(chr, r)) for r in rows]
    assert rows.shape == (2, 256) and texts[0].startswith("alpha") and texts[1].startswith("beta")
    for bad, match in (
        ("notes.md", "expected a .txt file"),
        ("missing.txt", "does not exist"),
    ):
        with pytest.raises(ValueError, match=match):
            qz.calibration_texts(str(tmp_path / bad))
    (tmp_path / "c.jsonl").write_text('{"text": 3}\n')
    with pytest.raises(ValueError, match=r"c.jsonl:1: expected an object with a string \"text\""):
        qz.calibration_texts(str(tmp_path / "c.jsonl"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="holds no text"):
        qz.calibration_texts(str(empty))
    default = qz.calibration_texts()
    assert len(default) == 3 and any("def " in d for d in default) and sum(map(len, default)) > 40_000
    rows = qz.calibration_tokens(Chars(), 256, None)
    assert rows.shape == (qz.CALIBRATION_TOKENS // 256, 256)
    docs = ["".join(chr(t) for t in Chars().encode(d)) for d in default]
    sources = ["".join(map(chr, r)) for r in rows]
    assert {next(i for i, d in enumerate(docs) if s in d) for s in sources} == {0, 1, 2}  # prose and code
