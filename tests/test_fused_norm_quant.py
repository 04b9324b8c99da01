"""The decoder's W8A8 path with its input quantisers fused (MatmulOptions.fuse_act_quant): the residual add + RMSNorm
before q|k|v and gate|up and SwiGLU before the down projection each run in one pallas_kernels/act_quant_fused.py
kernel (interpreted on this CPU) and give the logits of the unfused ops (op, then act_quant's quantiser kernel) at
decode-sized rows; the kernels really run (counted), only W8A8 weights take them, and the doors' unfused ops
equal the model's exactly.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import layers, quant
from model.config import ModelConfig
from model.kv import NoCache
from model.quant_fused import fuses_input
from model.transformer import random_model
from pallas_kernels import act_quant_fused
from serving.engine.quantize import quantize_model

CFG = ModelConfig.tiny(num_layers=1)
INTERPRET = quant.MatmulOptions(act_quant_backend="interpret", w8a8_backend="interpret")


@pytest.fixture(scope="module")
def w8a8_model():
    model = random_model(CFG, jnp.bfloat16, seed=1)
    quantize_model(model, "w8a8_fp8_rtn")
    return model


def _logits(model, options, tokens):
    quant.set_options(model, options)
    b, t = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    return np.asarray(model(tokens, pos, None, NoCache(jnp.full((b,), t)))[0], np.float32)


def _counting(monkeypatch):
    calls = []
    for name in ("rms_norm_quantize", "swiglu_quantize"):
        real = getattr(act_quant_fused, name)
        monkeypatch.setattr(act_quant_fused, name, lambda *a, real=real, n=name, **k: calls.append(n) or real(*a, **k))
    return calls


def _unfused_swiglu(h, w, activation, options=None):
    gate, up = jnp.split(h, 2, axis=-1)
    return quant.matmul(jax.nn.silu(gate) * up, w, options=options)


def test_fused_norms_match_unfused(w8a8_model, monkeypatch):
    """The norms' kernels (residual add, RMSNorm, quantiser) give the unfused logits bit for bit; with SwiGLU's
    kernel too, close: it rounds act(gate) * up once from f32 where XLA's bf16 ops round twice (documented in
    pallas_kernels/act_quant_fused.py), and a random 1-layer model passes that on to the logits at a few percent."""
    tokens = jax.random.randint(jax.random.key(2), (3, 2), 0, CFG.vocab_size)
    unfused = _logits(w8a8_model, dataclasses.replace(INTERPRET, fuse_act_quant=False), tokens)
    calls = _counting(monkeypatch)
    fused = _logits(w8a8_model, INTERPRET, tokens)
    assert sorted(calls) == sorted(["rms_norm_quantize", "rms_norm_quantize", "swiglu_quantize"] * CFG.num_layers)
    rel = np.linalg.norm(fused - unfused) / np.linalg.norm(unfused)
    assert np.isfinite(fused).all() and rel < 6e-2, rel
    calls.clear()
    monkeypatch.setattr(layers, "swiglu_matmul", _unfused_swiglu)
    norms_only = _logits(w8a8_model, INTERPRET, tokens)
    assert calls == ["rms_norm_quantize", "rms_norm_quantize"] * CFG.num_layers
    np.testing.assert_array_equal(norms_only, unfused)


def test_unfused_door_is_the_models_ops(w8a8_model):
    """Where the quantiser kernel does not run (XLA's quantiser, as on a CPU by default) the doors' unfused ops give
    the model's logits bit for bit; only W8A8 weights whose options fuse enter the doors."""
    tokens = jax.random.randint(jax.random.key(3), (2, 3), 0, CFG.vocab_size)
    xla = quant.MatmulOptions(act_quant_backend="xla")
    off = dataclasses.replace(xla, fuse_act_quant=False)
    np.testing.assert_array_equal(_logits(w8a8_model, xla, tokens), _logits(w8a8_model, off, tokens))
    w = w8a8_model.layers[0].attn.wqkv.get_value()
    assert fuses_input(quant.with_options(w, xla)) and not fuses_input(quant.with_options(w, off))
    assert not fuses_input(w.dequantize(jnp.bfloat16)) and not fuses_input(dataclasses.replace(w, act_fmt=""))


@pytest.mark.gpu
@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("rows", [(4, 1), (2, 160)], ids=["decode", "prefill_w8a8_kernel_rows"])
def test_fused_norms_on_gpu(w8a8_model, rows, monkeypatch):
    """The Triton kernels in the model on a GPU, with the default options (fused) against fuse_act_quant=False."""
    tokens = jax.random.randint(jax.random.key(4), rows, 0, CFG.vocab_size)
    unfused = _logits(w8a8_model, quant.MatmulOptions(fuse_act_quant=False), tokens)
    calls = _counting(monkeypatch)
    fused = _logits(w8a8_model, quant.MatmulOptions(), tokens)
    assert sorted(calls) == sorted(["rms_norm_quantize", "rms_norm_quantize", "swiglu_quantize"] * CFG.num_layers)
    rel = np.linalg.norm(fused - unfused) / np.linalg.norm(unfused)
    assert np.isfinite(fused).all() and rel < 6e-2, rel
