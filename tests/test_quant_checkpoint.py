"""Quantised Orbax checkpoints: `checkpoints.convert --quantize` writes QuantizedArrays that restore as they were
(lazy and eager), give the quantised model's logits, and load without re-quantising (tiny random model, CPU)."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints import convert, orbax_io
from model.config import ModelConfig
from model.kv import NoCache
from model.quant import QuantizedArray
from model.transformer import build_model, model_params, random_model
from serving.engine.quantize import quantize_model

CFG = ModelConfig.tiny()


def _logits(model, tokens):
    t = len(tokens)
    return np.asarray(model(jnp.asarray([tokens]), jnp.arange(t)[None], None, NoCache(jnp.array([t])))[0][0])


@pytest.fixture(scope="module")
def float_ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("float") / "ckpt")
    params = {k: np.asarray(v) for k, v in model_params(random_model(CFG, jnp.float32, seed=2)).items()}
    orbax_io.save(path, CFG, params)
    return path, params


@pytest.mark.parametrize("method", ["int4_rtn", "w8a8_int8"])
def test_convert_quantize_round_trip(float_ckpt, tmp_path, method):
    src, params = float_ckpt
    dst = str(tmp_path / "q")
    convert.convert(src, dst, quantize=method)
    assert os.path.isfile(os.path.join(dst, orbax_io.QUANT_FILE))
    want = build_model(CFG, params, jnp.float32)
    quantize_model(want, method)  # what the converter stored (same float model, same built-in calibration)
    want_params = model_params(want)
    tokens = [5, 9, 100, 3, 77, 200, 1, 14]
    for lazy in (True, False):
        cfg, got, _ = orbax_io.restore(dst, lazy=lazy)
        assert set(got) == set(want_params)
        quantised = [k for k in got if isinstance(got[k], QuantizedArray)]
        assert len(quantised) == 7 * CFG.num_layers
        for k in quantised:
            a, b = got[k], want_params[k]
            assert (a.fmt, a.group_size, a.act_fmt, a.layout) == (b.fmt, b.group_size, b.act_fmt, b.layout)
            assert a.layout == ("nk" if method.startswith("w8a8") else "kn")  # W8A8 stored [N, K]
            for leaf in ("values", "scales", "zeros", "pre_scale", "act_scale"):
                x, y = getattr(a, leaf), getattr(b, leaf)
                assert (x is None) == (y is None), (k, leaf)
                if x is not None:
                    assert x.dtype == y.dtype
                    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        model = build_model(cfg, got, jnp.float32)
        assert quantize_model(model, method) == []  # loads without re-quantising
        np.testing.assert_allclose(_logits(model, tokens), _logits(want, tokens), rtol=1e-6, atol=1e-6)


def test_convert_quantize_bad_options(float_ckpt, tmp_path):
    src, _ = float_ckpt
    with pytest.raises(ValueError, match="--quantize must be one of"):
        convert.convert(src, str(tmp_path / "a"), quantize="nf4")
    with pytest.raises(ValueError, match="--calibration_file needs --quantize"):
        convert.convert(src, str(tmp_path / "b"), calibration_file=src)
    with pytest.raises(ValueError, match="--calibration_file is for --quantize"):  # int8 has nothing to calibrate
        convert.convert(src, str(tmp_path / "c"), quantize="int8", calibration_file=src)
    with pytest.raises(ValueError, match="--mesh is not supported yet"):
        convert.convert(src, str(tmp_path / "c"), quantize="int8", mesh="tp=1")
