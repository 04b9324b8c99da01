"""W8A8 weights stored [N, K] (QuantizedArray.layout "nk"), the layout Hopper's 8-bit wgmma reads: every reader.

quantize_model stores w8a8_fp8 / w8a8_int8 projections so, so that the prefill kernel never transposes a weight
per call and decode's streaming kernel reads the same buffer. The readers: the logical shape and `dequantize`, the
XLA fallback of `matmul`, fusing and splitting q|k|v and gate|up (model/fused.py), Orbax save / restore
(tests/test_quant_checkpoint.py checks the round trip), the engine's re-quantising weight update, and the
zero-copy StreamWeight view decode takes on a Hopper GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import fused, quant
from model import quant_methods as qm
from model.config import ModelConfig
from model.quant import QuantizedArray
from model.transformer import model_params, random_model
from pallas_kernels import stream_matmul_mgpu as sm
from serving.engine import quantize as quantize_lib
from serving.engine.llm import LLM

CFG = ModelConfig.tiny()


def _w8a8(k, n, method, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    w = jax.random.normal(kw, (k, n), jnp.float32) * k**-0.5
    x = jax.random.normal(kx, (64, k), jnp.float32)
    return quantize_lib.quantize_weight(method, w, x), w


@pytest.mark.parametrize("method", ["w8a8_int8", "w8a8_fp8", "w8a8_fp8_rtn"])
def test_quantize_weight_stores_nk(method):
    q, _ = _w8a8(96, 40, method)
    kn = quant.to_layout(q, "kn")
    assert q.layout == "nk" and q.values.shape == (40, 96) and q.shape == (96, 40) == kn.shape
    np.testing.assert_array_equal(np.asarray(q.dequantize()), np.asarray(kn.dequantize()))
    x = jax.random.normal(jax.random.key(1), (3, 5, 96), jnp.float32).astype(jnp.bfloat16)
    # The XLA path (this CPU): the same numbers from either layout, decode- and prefill-sized.
    for rows in (x[:, :1], x):
        np.testing.assert_array_equal(np.asarray(quant.matmul(rows, q)), np.asarray(quant.matmul(rows, kn)))
    assert quant.to_layout(kn, "nk").values.shape == (40, 96)


def test_layout_is_checked():
    with pytest.raises(ValueError, match="layout"):
        QuantizedArray(jnp.zeros((8, 4), jnp.int8), jnp.ones(4), fmt="int8", layout="t")
    with pytest.raises(ValueError, match="layout 'nk'"):
        QuantizedArray(jnp.zeros((8, 4), jnp.uint8), jnp.ones((1, 4)), fmt="int4", group_size=16, layout="nk")


def test_fuse_and_split_nk_parts():
    parts = fused.group_parts(CFG, "wqkv")
    k = CFG.hidden_size
    w = jax.random.normal(jax.random.key(2), (k, sum(p.width for p in parts)), jnp.float32)
    whole = quant.to_layout(qm.smoothquant(w, jax.random.normal(jax.random.key(3), (32, k))), "nk")
    pieces = fused.split(whole, parts)
    assert all(p.layout == "nk" and p.shape == (k, part.width) for p, part in zip(pieces, parts))
    again = fused.fuse(pieces, parts)
    assert again.layout == "nk" and again.values.shape == whole.values.shape
    np.testing.assert_array_equal(np.asarray(again.values), np.asarray(whole.values))
    np.testing.assert_array_equal(np.asarray(pieces[1].dequantize()), np.asarray(whole.dequantize())[:, 64:96])


def test_engine_update_keeps_nk():
    opts = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, num_kv_blocks=16, warmup=False)
    llm = LLM.from_model(random_model(CFG, jnp.float32, seed=3), None, quantization="w8a8_int8", **opts)
    is_q = lambda x: isinstance(x, QuantizedArray)  # noqa: E731
    qs = [w for w in jax.tree.leaves(llm.engine.runner.params, is_leaf=is_q) if is_q(w)]
    assert len(qs) == 4 * CFG.num_layers and all(w.layout == "nk" for w in qs)
    first = llm.generate([[5, 17, 29]], max_tokens=4, temperature=0.0)[0].token_ids
    new = model_params(random_model(CFG, jnp.float32, seed=9))
    llm.update_weights(new)
    qs = [w for w in jax.tree.leaves(llm.engine.runner.params, is_leaf=is_q) if is_q(w)]
    assert all(w.layout == "nk" for w in qs)
    got = llm.params["layers.0.wo"]
    assert got.layout == "nk"
    err = np.abs(np.asarray(got.dequantize()) - np.asarray(new["layers.0.wo"])).max()
    assert err < 0.02 * np.abs(np.asarray(new["layers.0.wo"])).max()  # re-quantised from the new weight
    assert len(llm.generate([[5, 17, 29]], max_tokens=4, temperature=0.0)[0].token_ids) == len(first)  # runs on


def test_decode_reads_the_nk_buffer_without_a_copy(monkeypatch):
    """On Hopper a W8A8 weight's decode-sized calls take the streaming kernel over its own [N, K] values."""
    q, _ = _w8a8(256, 256, "w8a8_int8")
    seen = []
    real = sm.stream_matmul

    def interpreted(x, stream, backend=None):
        seen.append(stream)
        return real(x, stream, backend="interpret")

    monkeypatch.setattr(quant, "_stream_ok", lambda *_: True)
    monkeypatch.setattr(sm, "stream_matmul", interpreted)
    x = jax.random.normal(jax.random.key(4), (3, 256), jnp.float32).astype(jnp.bfloat16)
    got = quant.matmul(x, q)
    assert len(seen) == 1 and seen[0].wt is q.values  # the stored buffer itself
    want = quant.reference_matmul(x, q)
    assert float(jnp.linalg.norm((got - want).astype(jnp.float32)) / jnp.linalg.norm(want.astype(jnp.float32))) < 1e-2
    odd, _ = _w8a8(96, 40, "w8a8_int8")  # needs padding: no view, the XLA path
    assert quant._nk_stream(odd) is None  # pylint: disable=protected-access


@pytest.mark.parametrize("method", ["w8a8_int8", "w8a8_fp8_rtn"])
def test_decode_fake_quantises_x_in_one_pass(method, monkeypatch):
    """Below w8a8_min_rows, where the act_quant kernel runs (here its interpreter), x is pre-scaled, quantised and
    dequantised by its one-pass fake_quantize: the same numbers as the jnp passes this CPU takes by default."""
    from pallas_kernels import act_quant  # noqa: PLC0415

    q, _ = _w8a8(256, 64, method)
    x = jax.random.normal(jax.random.key(6), (2, 5, 256), jnp.float32).astype(jnp.bfloat16)
    want = quant.matmul(x, q)
    calls = []
    real = act_quant.fake_quantize
    monkeypatch.setattr(act_quant, "fake_quantize", lambda *a, **kw: calls.append(kw["backend"]) or real(*a, **kw))
    assert quant.matmul(x, q) is not None and calls == []  # no kernel backend on this CPU: the jnp passes
    got = quant.matmul(x, q, options=quant.MatmulOptions(act_quant_backend="interpret"))
    assert calls == ["interpret"] and got.shape == (2, 5, 64)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
