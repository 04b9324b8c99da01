"""The `quantized_stream_layout` option: int8 / fp8 weights also stored in the Hopper streaming kernel's layout.

The engine refuses the option where no Mosaic GPU kernel can read the copy. The engine tests below pretend this
CPU can (the model's matmul still asks the device itself, so it keeps the [K, N] path) and the outputs must equal
a plain int8 engine's exactly; the layout itself must hold the same weight (its own dequantise), and update_weights must
rebuild it (else the compiled steps would read stale weights on a GPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.config import ModelConfig
from model.quant import QuantizedArray
from model.transformer import model_params, random_model
from pallas_kernels.stream_matmul_mgpu import dequantize
from serving.config import EngineConfig
from serving.engine import engine as engine_mod
from serving.engine.llm import LLM

CFG = ModelConfig.tiny()
OPTS = dict(max_model_len=128, max_num_seqs=2, max_num_batched_tokens=64, num_kv_blocks=24, warmup=False)
PROMPT = [5, 17, 29, 41, 3, 8]


def _llm(**options) -> LLM:
    return LLM.from_model(random_model(CFG, jnp.float32, seed=3), None, **(OPTS | options))


def _quantized(llm: LLM) -> list[QuantizedArray]:
    is_q = lambda x: isinstance(x, QuantizedArray)  # noqa: E731
    return [w for w in jax.tree.leaves(llm.engine.runner.params, is_leaf=is_q) if is_q(w)]


def _same_weight(w: QuantizedArray) -> bool:
    """The stream copy holds w's logical weight (up to its padding)."""
    k, n = w.shape
    return np.allclose(np.asarray(dequantize(w.stream))[:k, :n], np.asarray(w.dequantize()), rtol=0, atol=1e-6)


def _generate(llm: LLM) -> list[int]:
    return list(llm.generate([PROMPT], max_tokens=8, temperature=0.0)[0].token_ids)


def test_option_checks():
    assert EngineConfig.from_kwargs(quantization="int8", quantized_stream_layout=True).quantization.stream_layout
    with pytest.raises(ValueError, match="quantized_stream_layout"):
        EngineConfig.from_kwargs(quantization="int4_rtn", quantized_stream_layout=True)
    with pytest.raises(ValueError, match="quantized_stream_layout"):
        EngineConfig.from_kwargs(quantized_stream_layout=True)  # no quantisation
    with pytest.raises(ValueError, match="quantized_stream_layout"):
        EngineConfig.from_kwargs(quantization="fp8", quantized_stream_layout=True, tensor_parallel_size=2)


def test_refused_where_no_mosaic_gpu_kernel_runs(monkeypatch):
    monkeypatch.setattr(engine_mod, "device_supports", lambda backend: False)
    with pytest.raises(ValueError, match="quantized_stream_layout"):
        _llm(quantization="int8", quantized_stream_layout=True).generate([PROMPT], max_tokens=1)  # builds the engine


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_engine_holds_both_layouts_and_update_rebuilds(method, monkeypatch):
    monkeypatch.setattr(engine_mod, "device_supports", lambda backend: True)
    plain, streamed = _llm(quantization=method), _llm(quantization=method, quantized_stream_layout=True)
    ws = _quantized(streamed)
    assert len(ws) == 4 * CFG.num_layers and all(w.stream is not None for w in ws)  # q|k|v, wo, gate|up, down
    assert all(w.stream is None for w in _quantized(plain))
    assert all(_same_weight(w) for w in ws)
    assert _generate(streamed) == _generate(plain)
    new = model_params(random_model(CFG, jnp.float32, seed=9))
    before = np.asarray(ws[0].stream.wt)
    streamed.update_weights(new)
    ws = _quantized(streamed)
    assert all(w.stream is not None and _same_weight(w) for w in ws)
    assert not np.array_equal(np.asarray(ws[0].stream.wt), before)  # rebuilt from the new weights
    plain.update_weights(new)
    assert _generate(streamed) == _generate(plain)
