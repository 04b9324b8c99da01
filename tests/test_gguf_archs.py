"""GGUF qwen3moe, gemma2 and phi3 against their HF checkpoints: the tiny fixtures of tests/data/hf_tiny written as
llama.cpp's converter writes them (tools/hf_to_gguf.py: stacked experts, Gemma's 1 + w norms, Phi-3's fused qkv /
gate_up and longrope factor tensors) load to the parameters and config of the safetensors, hence to transformers'
float32 logits within 1e-4; a Q8_0 file keeps its codes (quantized=True), Phi-3's fused rows split by whole blocks,
and stays close to the float logits."""

from __future__ import annotations

import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints import hf
from checkpoints.gguf import load_gguf
from model.quant import QuantizedArray
from model.transformer import build_model
from serving.engine.llm import _score
from tools.hf_to_gguf import convert

DATA = os.path.join(os.path.dirname(__file__), "data", "hf_tiny")
FIXTURES = {"qwen3_moe": "qwen3moe", "gemma2": "gemma2", "phi3": "phi3"}


def _prompt(name: str) -> list[int]:
    with open(os.path.join(DATA, name, "oracle.json")) as f:
        return json.load(f)["prompts"][0]


def _logits(config, params, name: str) -> np.ndarray:
    return np.asarray(_score(build_model(config, params, jnp.float32), jnp.asarray([_prompt(name)], jnp.int32))[0])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    out = {}
    for name, arch in FIXTURES.items():
        for kind in ("F32", "Q8_0"):
            path = str(tmp_path_factory.mktemp("gguf") / f"{name}.{kind}.gguf")
            assert convert(os.path.join(DATA, name), path, kind, byte_vocab=True) == arch
            out[name, kind] = path
    return out


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_gguf_loads_the_hf_model(files, name):
    config, params, meta = load_gguf(files[name, "F32"])
    want_cfg, want = hf.load_hf(os.path.join(DATA, name), dtype=np.float32)
    assert meta.architecture == FIXTURES[name]
    differ = {
        f.name: (getattr(config, f.name), getattr(want_cfg, f.name))
        for f in dataclasses.fields(config)
        if f.name not in ("name", "rms_norm_eps", "rope_scaling", "query_pre_attn_scalar")
        and getattr(config, f.name) != getattr(want_cfg, f.name)
    }
    assert not differ, differ
    assert config.rms_norm_eps == pytest.approx(want_cfg.rms_norm_eps, rel=1e-6)  # GGUF keeps float32 values
    assert (config.query_pre_attn_scalar or 0) == pytest.approx(want_cfg.query_pre_attn_scalar or 0, rel=1e-6)
    if want_cfg.rope_scaling is not None:
        got, ref = config.rope_scaling, want_cfg.rope_scaling
        assert (got.rope_type, got.original_max_position_embeddings) == (ref.rope_type, 64)
        np.testing.assert_allclose(got.short_factor, ref.short_factor, rtol=1e-6)
        np.testing.assert_allclose(got.long_factor, ref.long_factor, rtol=1e-6)
        assert got.attention_factor == pytest.approx(ref.attention_factor, rel=1e-6)
    assert sorted(params) == sorted(want)
    for key in want:  # Gemma's norms went through 1 + w and back in float32
        np.testing.assert_allclose(np.asarray(params[key]), want[key], rtol=0, atol=1e-6, err_msg=key)
    got = _logits(config, params, name)
    err = np.abs(got - np.load(os.path.join(DATA, name, "logits.npy"))).max()
    assert err < 1e-4, f"{name}: max abs logit error {err}"


def test_llm_serves_the_file_and_keeps_its_codes(files):
    """Through the public API: LLM(path) on the qwen3moe file gives HF's logits; quantization="gguf" on its Q8_0
    file keeps the attention codes (int8, group 32; experts float) and gives the dequantised file's logits."""
    from serving.engine.llm import LLM

    opts = dict(dtype="float32", attention_backend="xla", max_num_seqs=1, num_kv_blocks=8, block_size=16)
    prompt = _prompt("qwen3_moe")
    exact = LLM(files["qwen3_moe", "F32"], max_model_len=64, **opts).score(prompt)
    assert np.abs(exact - np.load(os.path.join(DATA, "qwen3_moe", "logits.npy"))).max() < 1e-4
    kept = LLM(files["qwen3_moe", "Q8_0"], quantization="gguf", max_model_len=64, **opts)
    w = kept.model.layers[0].attn.wqkv.get_value()
    assert isinstance(w, QuantizedArray) and w.fmt == "int8" and w.group_size == 32
    assert not isinstance(kept.model.layers[0].mlp.w_gate_up.get_value(), QuantizedArray)
    plain = LLM(files["qwen3_moe", "Q8_0"], max_model_len=64, **opts)
    assert not isinstance(plain.model.layers[0].attn.wqkv.get_value(), QuantizedArray)
    np.testing.assert_allclose(kept.score(prompt), plain.score(prompt), rtol=1e-5, atol=1e-5)


def test_config_from_llama_cpp_keys(files):
    moe, _, _ = load_gguf(files["qwen3_moe", "F32"], lazy=True)
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (4, 2, 32)
    assert moe.norm_topk_prob and moe.has_qk_norm and moe.shared_expert_intermediate_size == 0
    gemma2, _, _ = load_gguf(files["gemma2", "F32"], lazy=True)
    assert gemma2.arch == "gemma2" and gemma2.layer_windows == (8, None) and gemma2.tie_word_embeddings
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == (8.0, 20.0)
    phi3, _, _ = load_gguf(files["phi3", "F32"], lazy=True)
    assert phi3.long_rope and phi3.layer_windows == (16, 16) and phi3.head_dim == 16


def test_gemma2_attention_scale_follows_llama_cpp_without_the_key(tmp_path):
    """Without `attention.scale` a gemma2 file gets llama.cpp's scale: 1/sqrt(head_dim) (1/sqrt(D / heads) for
    the 46-layer 27B), so the tiny checkpoint (query_pre_attn_scalar 24, head_dim 16) is then another model."""
    import gguf

    src = os.path.join(DATA, "gemma2")
    path = str(tmp_path / "gemma2.gguf")
    convert(src, path)
    reader = gguf.GGUFReader(path)
    assert reader.fields["gemma2.attention.scale"].contents() == pytest.approx(24**-0.5, rel=1e-6)
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg["query_pre_attn_scalar"] = cfg["head_dim"]  # what llama.cpp assumes: the converter then writes no key
    alt = tmp_path / "alt"
    alt.mkdir()
    (alt / "config.json").write_text(json.dumps(cfg))
    os.symlink(os.path.join(src, "model.safetensors"), alt / "model.safetensors")
    convert(str(alt), str(tmp_path / "alt.gguf"))
    assert "gemma2.attention.scale" not in gguf.GGUFReader(str(tmp_path / "alt.gguf")).fields
    config, _, _ = load_gguf(str(tmp_path / "alt.gguf"), lazy=True)
    assert config.query_pre_attn_scalar == 16.0


@pytest.mark.parametrize("layers,scalar", [(42, 256.0), (46, 144.0)])  # 42: head_dim; 46 (27B): D / heads
def test_gemma2_scale_by_size_as_llama_cpp(tmp_path, layers, scalar):
    import gguf

    from checkpoints.gguf import config_from_metadata, read_metadata

    path = str(tmp_path / "gemma2.gguf")
    w = gguf.GGUFWriter(path, "gemma2")
    w.add_block_count(layers)
    w.add_embedding_length(4608)
    w.add_feed_forward_length(36864)
    w.add_head_count(32)
    w.add_head_count_kv(16)
    w.add_key_length(256 if layers == 42 else 128)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))  # metadata only: no weights are read
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = gguf.GGUFReader(path)
    config = config_from_metadata(reader, read_metadata(reader), ())
    assert config.query_pre_attn_scalar == scalar
    assert (config.attn_logit_softcap, config.final_logit_softcap, config.sliding_window) == (50.0, 30.0, 4096)


@pytest.mark.parametrize("name", ["phi3", "qwen3_moe"])
def test_q8_0_file_keeps_codes_and_stays_close(files, name):
    config, qparams, _ = load_gguf(files[name, "Q8_0"], lazy=True, quantized=True)
    _, fparams, _ = load_gguf(files[name, "Q8_0"], lazy=True)
    for leaf in ("wq", "wk", "wv", "wo") + (("w_gate", "w_up", "w_down") if name == "phi3" else ()):
        q = qparams[f"layers.1.{leaf}"]
        assert isinstance(q, QuantizedArray) and q.fmt == "int8" and q.group_size == 32, leaf
        np.testing.assert_array_equal(np.asarray(q.dequantize(jnp.float32)), fparams[f"layers.1.{leaf}"], leaf)
    if name == "qwen3_moe":  # experts and router stay float (the grouped expert matmul takes no QuantizedArray)
        assert not isinstance(qparams["layers.0.w_gate_up"], QuantizedArray)
        assert qparams["layers.0.w_gate_up"].shape == (4, 64, 64)
    kept, plain = _logits(config, qparams, name), _logits(config, fparams, name)
    np.testing.assert_allclose(kept, plain, rtol=1e-5, atol=1e-5)  # the same codes and scales, not requantised
    want = np.load(os.path.join(DATA, name, "logits.npy"))
    rel = np.linalg.norm(kept - want) / np.linalg.norm(want)
    # Q8_0 rounds each weight by up to half a step of its 32-block's max / 127 (~0.5% rms at unit-scale
    # weights); over two layers, the embedding and the head that is ~2% of the logits' norm.
    assert 1e-3 < rel < 3e-2, f"{name}: Q8_0 logits {rel:.4f} off HF's (norm-relative)"


def test_llama_file_loads_the_hf_model(tmp_path):
    """llama files hold Q / K rows permuted for llama.cpp's interleaved RoPE, and Llama 3's RoPE scaling only as
    the `rope_freqs` divisors; the loader undoes the one and recovers the other, to HF's logits."""
    path = str(tmp_path / "llama.gguf")
    assert convert(os.path.join(DATA, "llama32"), path) == "llama"
    config, params, _ = load_gguf(path, lazy=True)
    want_cfg, want = hf.lazy_hf(os.path.join(DATA, "llama32"), dtype=np.float32)
    assert config.rope_scaling == want_cfg.rope_scaling  # factor 32, original context 64, low / high 1 / 4
    for key in ("layers.0.wq", "layers.1.wk", "layers.1.wv"):
        np.testing.assert_array_equal(params[key], want[key], err_msg=key)
    err = np.abs(_logits(config, params, "llama32") - np.load(os.path.join(DATA, "llama32", "logits.npy"))).max()
    assert err < 1e-4, f"llama32: max abs logit error {err}"


@pytest.mark.parametrize("head_dim,factor", [(64, 32.0), (128, 8.0)])  # Llama 3.2 1B / 3B, Llama 3.1 8B / 70B
def test_llama3_scaling_recovered_at_real_shapes(head_dim, factor):
    from checkpoints.gguf_arch import llama3_factors, llama3_from_factors
    from model.config import RopeScaling
    from tools.hf_to_gguf import llama3_rope_factors

    params = dict(rope_theta=500000.0, factor=factor, original_max_position_embeddings=8192)
    stored = llama3_rope_factors(params, head_dim)  # float32, as llama.cpp's converter computes them
    want = RopeScaling(factor=factor, original_max_position_embeddings=8192)
    np.testing.assert_allclose(llama3_factors(want, head_dim, 500000.0), stored, rtol=1e-6)
    assert llama3_from_factors(stored.astype(np.float64), head_dim, 500000.0) == want


def test_bad_files_are_refused(tmp_path):
    import gguf

    path = str(tmp_path / "phi3.gguf")
    w = gguf.GGUFWriter(path, "phi3")
    for add, v in ((w.add_block_count, 1), (w.add_embedding_length, 64), (w.add_feed_forward_length, 96)):
        add(v)
    w.add_head_count(4)
    w.add_rope_dimension_count(12)  # partial rotary (Phi-4-mini style)
    w.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="partial rotary"):
        load_gguf(path)
    path = str(tmp_path / "moe.gguf")
    w = gguf.GGUFWriter(path, "qwen3moe")
    for add, v in ((w.add_block_count, 1), (w.add_embedding_length, 64), (w.add_feed_forward_length, 96)):
        add(v)
    w.add_head_count(4)
    w.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="expert_count"):
        load_gguf(path)
    path = str(tmp_path / "llama.gguf")
    w = gguf.GGUFWriter(path, "llama")
    for add, v in ((w.add_block_count, 1), (w.add_embedding_length, 64), (w.add_feed_forward_length, 96)):
        add(v)
    w.add_head_count(4)
    w.add_tensor("rope_freqs.weight", np.asarray([1, 3, 1, 2, 5, 1, 1, 4], np.float32))  # not llama3-shaped
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="llama3"):
        load_gguf(path)


def test_every_registered_gguf_architecture_loads():
    """The README's formats column (checkpoints/architectures.py) names only GGUF architectures the loader knows,
    and each of those new here has its tiny file above."""
    from checkpoints.architectures import ARCHITECTURES
    from checkpoints.gguf import SUPPORTED_ARCHITECTURES

    named = {a.gguf for a in ARCHITECTURES.values() if a.gguf}
    assert named <= set(SUPPORTED_ARCHITECTURES), named - set(SUPPORTED_ARCHITECTURES)
    assert set(FIXTURES.values()) <= named
