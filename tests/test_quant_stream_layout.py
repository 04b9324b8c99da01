"""The `quantized_stream_layout` option: int8 / fp8 / int4 weights also stored in the Hopper streaming kernel's layout.

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

from model import quant
from model.config import ModelConfig
from model.quant import QuantizedArray
from model.transformer import model_params, random_model
from pallas_kernels import stream_matmul_mgpu as stream_mod
from pallas_kernels.stream_matmul_mgpu import dequantize
from serving.config import EngineConfig
from serving.engine import engine as engine_mod
from serving.engine.llm import LLM
from serving.engine.quantize import add_stream_layout, quantize_model

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
    for method in ("int4_rtn", "int4_awq", "int4_gptq"):
        assert EngineConfig.from_kwargs(quantization=method, quantized_stream_layout=True).quantization.stream_layout
    # W8A8: activations quantised per call, while the streaming kernel takes bf16 x
    for method in ("w8a8_fp8", "w8a8_fp8_rtn", "w8a8_int8"):
        with pytest.raises(ValueError, match="quantized_stream_layout"):
            EngineConfig.from_kwargs(quantization=method, quantized_stream_layout=True)
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


def test_int4_engine_decodes_through_the_interpreted_kernel(monkeypatch):
    """int4 (group 64 and, for down's K = 96, 32; float zero points) with the stream layout: every projection of a
    bf16 engine runs the streaming kernel (the Mosaic GPU interpreter here) and greedy tokens equal a plain int4
    engine's, which dequantises in XLA."""
    monkeypatch.setattr(engine_mod, "device_supports", lambda backend: True)
    calls = []
    real = stream_mod.stream_matmul
    monkeypatch.setattr(stream_mod, "stream_matmul", lambda x, w, **kw: calls.append(w.fmt) or real(x, w, **kw))

    def llm(stream: bool):
        model = random_model(CFG, jnp.bfloat16, seed=3)
        quantize_model(model, "int4_rtn")
        if stream:
            add_stream_layout(model)
        quant.set_options(model, quant.MatmulOptions(stream_backend="interpret", kernel_max_rows=()))
        return LLM.from_model(model, None, **OPTS)

    plain, streamed = llm(False), llm(True)
    ws = _quantized(streamed)
    assert {w.group_size for w in ws} == {32, 64} and all(w.zeros is not None and _same_weight(w) for w in ws)
    tokens = _generate(plain)
    assert not calls
    assert _generate(streamed) == tokens
    assert calls and set(calls) == {"int4"}  # traced once per projection and step shape


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1"])
def test_gguf_kept_q4_is_the_same_int4_format(type_name):
    """GGUF Q4_0 / Q4_1 weights kept quantised (checkpoints/gguf_quant.py) are "int4" group 32, symmetric / with
    float zero points: the stream layout takes them and holds the same weight (quantize_model keeps them as they are,
    so the option streams them too)."""
    from checkpoints import gguf_quant  # noqa: PLC0415

    k, n = 96, 40
    rng = np.random.default_rng(5)
    nb = k // gguf_quant.BLOCK
    d = rng.uniform(0.01, 0.1, (n, nb, 1)).astype(np.float16).view(np.uint8)
    head = [d] if type_name == "Q4_0" else [d, rng.uniform(-0.5, 0.5, (n, nb, 1)).astype(np.float16).view(np.uint8)]
    qs = rng.integers(0, 256, (n, nb, 16), dtype=np.uint8)
    w = gguf_quant.to_quantized(np.concatenate([*head, qs], axis=-1).reshape(-1), type_name, (k, n))
    assert w.fmt == "int4" and w.group_size == 32 and (w.zeros is None) == (type_name == "Q4_0")
    assert _same_weight(quant.with_stream_layout(w))
