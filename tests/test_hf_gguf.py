"""Qwen2 / Qwen3 GGUF files: the tiny Qwen3 checkpoint of tests/data/hf_tiny written as llama.cpp's converter
writes it (architecture "qwen3", Q / K rows in HF's order: Qwen uses NeoX RoPE, so they are not permuted, unlike
"llama" files) loads to the same parameters as the safetensors, hence to transformers' logits; the same file
under "qwen2" (without the q/k norms) loads without them."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints import hf
from checkpoints.gguf import load_gguf
from model.transformer import build_model

DATA = os.path.join(os.path.dirname(__file__), "data", "hf_tiny", "qwen3")
_LAYER = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
_GLOBAL["lm_head.weight"] = "output.weight"


def write_gguf(path: str, arch: str, skip_qk_norm: bool = False) -> None:
    import gguf
    from safetensors.numpy import load_file

    with open(os.path.join(DATA, "config.json")) as f:
        cfg = json.load(f)
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    for name, value in load_file(os.path.join(DATA, "model.safetensors")).items():
        if name in _GLOBAL:
            gguf_name = _GLOBAL[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            if skip_qk_norm and "_norm" in rest and "self_attn" in rest:
                continue
            gguf_name = f"blk.{layer}.{_LAYER[rest]}"
        w.add_tensor(gguf_name, np.asarray(value, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def hf_params():
    return hf.load_hf(DATA, dtype=np.float32)


def test_qwen3_gguf_loads_the_safetensors_params(tmp_path, hf_params):
    path = str(tmp_path / "qwen3.gguf")
    write_gguf(path, "qwen3")
    config, params, _ = load_gguf(path)
    want_cfg, want = hf_params
    assert config.has_qk_norm and config.head_dim == want_cfg.head_dim == 16
    for field in ("num_layers", "num_heads", "num_kv_heads", "rope_theta", "tie_word_embeddings"):
        assert getattr(config, field) == getattr(want_cfg, field), field
    assert config.rms_norm_eps == pytest.approx(want_cfg.rms_norm_eps, rel=1e-6)  # GGUF keeps a float32
    assert sorted(params) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(np.asarray(params[name]), want[name], err_msg=name)
    from serving.engine.llm import _score

    with open(os.path.join(DATA, "oracle.json")) as f:
        prompt = json.load(f)["prompts"][0]
    logits = _score(build_model(config, params, jnp.float32), jnp.asarray([prompt], jnp.int32))[0]
    assert np.abs(np.asarray(logits) - np.load(os.path.join(DATA, "logits.npy"))).max() < 1e-4


def test_qwen2_gguf_is_not_permuted(tmp_path, hf_params):
    path = str(tmp_path / "qwen2.gguf")
    write_gguf(path, "qwen2", skip_qk_norm=True)
    config, params, _ = load_gguf(path)
    assert not config.has_qk_norm and "layers.0.q_norm" not in params
    np.testing.assert_array_equal(np.asarray(params["layers.1.wq"]), hf_params[1]["layers.1.wq"])
    np.testing.assert_array_equal(np.asarray(params["layers.0.wk"]), hf_params[1]["layers.0.wk"])
