"""GGUF Q8_0 / Q4_0 / Q4_1 weights kept quantised (checkpoints/gguf_quant.py): exact against the gguf package's own
dequantisation on fresh random tensors, and the default SmolLM2 file (Q4_1) loaded quantised gives the logits of
the dequantised model within bf16 tolerance."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from checkpoints.gguf import unpermute_rope_rows
from checkpoints.gguf_quant import decode_blocks, to_quantized
from model.quant import QuantizedArray, matmul


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("shape", [(5, 96), (12, 32)])
def test_blocks_map_exactly(type_name, shape):
    rng = np.random.default_rng(hash((type_name, shape)) % 2**32)
    w_out_in = (rng.standard_normal(shape) * rng.uniform(0.01, 3.0, (shape[0], 1))).astype(np.float32)
    w_out_in[0, :32] = 0.7  # a constant block (Q4_1: d = 0)
    ggml_type = GGMLQuantizationType[type_name]
    raw = quants.quantize(w_out_in, ggml_type)
    want = quants.dequantize(raw, ggml_type).astype(np.float32)  # [out, in]
    q = to_quantized(raw, type_name, (shape[1], shape[0]))
    assert isinstance(q, QuantizedArray) and q.shape == (shape[1], shape[0]) and q.group_size == 32
    assert q.fmt == ("int8" if type_name == "Q8_0" else "int4")
    assert (q.zeros is not None) == (type_name == "Q4_1")
    got = np.asarray(q.dequantize(jnp.float32)).T
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    x = rng.standard_normal((3, shape[1])).astype(np.float32)
    np.testing.assert_allclose(np.asarray(matmul(jnp.asarray(x), q)), x @ want.T, rtol=1e-4, atol=1e-4)


def test_row_permutation_moves_codes_and_scales():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    raw = quants.quantize(w, GGMLQuantizationType.Q4_1)
    permute = lambda a: unpermute_rope_rows(a, 2)  # noqa: E731
    q = to_quantized(raw, "Q4_1", (64, 8), permute)
    want = unpermute_rope_rows(quants.dequantize(raw, GGMLQuantizationType.Q4_1), 2)
    np.testing.assert_allclose(np.asarray(q.dequantize()).T, want, rtol=1e-6, atol=1e-6)
    assert decode_blocks(raw, "Q4_1", (64, 8))["codes"].max() <= 15


def test_default_smollm2_q4_1_kept_quantised_matches_dequantised():
    from checkpoints.gguf import load_gguf
    from checkpoints.loader import resolve_model_path
    from model.kv import NoCache
    from model.transformer import build_model

    try:
        path = resolve_model_path("default")
    except (RuntimeError, OSError) as e:
        pytest.skip(f"default model not available: {e}")
    cfg, qparams, _ = load_gguf(path, lazy=True, quantized=True)
    _, fparams, _ = load_gguf(path, lazy=True)
    names = [n for n in qparams if n.rsplit(".", 1)[-1] in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")]
    assert len(names) == 7 * cfg.num_layers
    sample = qparams[names[0]]
    assert isinstance(sample, QuantizedArray) and sample.fmt == "int4" and sample.zeros is not None
    tokens = np.random.default_rng(0).integers(10, cfg.vocab_size, 24)
    logits = {}
    for key, params in (("q", qparams), ("f", fparams)):
        model = build_model(cfg, params, jnp.float32)
        if key == "q":
            assert isinstance(model.layers[0].attn.wqkv.get_value(), QuantizedArray)
        t = len(tokens)
        logits[key] = np.asarray(model(jnp.asarray([tokens]), jnp.arange(t)[None], None, NoCache(jnp.array([t])))[0])
        del model
    scale = np.abs(logits["f"]).max()
    np.testing.assert_allclose(logits["q"], logits["f"], atol=scale * 2**-8)  # bf16 tolerance (8 mantissa bits)
    assert (logits["q"].argmax(-1) == logits["f"].argmax(-1)).all()


def test_llm_option_keeps_the_gguf_codes():
    """LLM(quantization="gguf") loads the default Q4_1 file with its codes kept (int4 group 32, float zero points: no
    dequantisation at load) and greedy-decodes the tokens of the dequantised model (float32 on CPU)."""
    from checkpoints.loader import resolve_model_path
    from serving.engine.llm import LLM

    try:
        resolve_model_path("default")
    except (RuntimeError, OSError) as e:
        pytest.skip(f"default model not available: {e}")
    opts = dict(
        dtype="float32", attention_backend="xla", max_num_seqs=2, num_kv_blocks=32, block_size=16, max_model_len=256
    )
    kept, plain = LLM(quantization="gguf", **opts), LLM(**opts)
    w = kept.model.layers[0].mlp.w_down.get_value()
    assert isinstance(w, QuantizedArray) and w.fmt == "int4" and w.group_size == 32 and w.zeros is not None
    assert not isinstance(plain.model.layers[0].mlp.w_down.get_value(), QuantizedArray)
    prompt = "The capital of France is"
    got, want = (llm.generate([prompt], max_tokens=8, temperature=0.0)[0] for llm in (kept, plain))
    assert got.token_ids == want.token_ids


def test_keep_gguf_option_refused_where_it_cannot_apply(tmp_path):
    from checkpoints.loader import load_checkpoint
    from model.config import ModelConfig
    from model.transformer import model_params, random_model
    from serving.config import EngineConfig
    from serving.engine.llm import LLM

    with pytest.raises(ValueError, match="calibration_file"):
        EngineConfig.from_kwargs(quantization="gguf", calibration_file="calib.txt")
    with pytest.raises(ValueError, match="needs a .gguf file"):
        load_checkpoint(str(tmp_path), quantized=True)
    cfg = ModelConfig.preset("tiny")
    with pytest.raises(ValueError, match="quantization='gguf'"):
        LLM.from_params(cfg, model_params(random_model(cfg, jnp.float32)), quantization="gguf")
