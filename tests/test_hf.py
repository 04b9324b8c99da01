"""HF safetensors loader: tiny random checkpoints written with HF's tensor names, single-file and sharded."""

import json
import os

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from checkpoints import hf
from checkpoints.gguf import expected_shapes
from model.config import ModelConfig, RopeScaling

TINY_HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
}


def hf_tensors(hf_config: dict, seed: int = 0, bf16_names: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """Random tensors with HF names and HF's [out, in] layout for `hf_config`."""
    rng = np.random.default_rng(seed)
    d, f, v = hf_config["hidden_size"], hf_config["intermediate_size"], hf_config["vocab_size"]
    hd = hf_config.get("head_dim") or d // hf_config["num_attention_heads"]
    q, kv = hf_config["num_attention_heads"] * hd, hf_config["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not hf_config.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (v, d)
    bias = hf_config["architectures"][0] == "Qwen2ForCausalLM"
    for i in range(hf_config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (q, d),
                p + "self_attn.k_proj.weight": (kv, d),
                p + "self_attn.v_proj.weight": (kv, d),
                p + "self_attn.o_proj.weight": (d, q),
                p + "mlp.gate_proj.weight": (f, d),
                p + "mlp.up_proj.weight": (f, d),
                p + "mlp.down_proj.weight": (d, f),
                p + "input_layernorm.weight": (d,),
                p + "post_attention_layernorm.weight": (d,),
            }
        )
        if bias:
            shapes.update(
                {
                    p + "self_attn.q_proj.bias": (q,),
                    p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.bias": (kv,),
                }
            )
    tensors = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    for n in bf16_names:
        tensors[n] = tensors[n].astype(ml_dtypes.bfloat16)
    return tensors


def write_hf_checkpoint(directory: str, hf_config: dict, tensors: dict[str, np.ndarray], num_shards: int = 1):
    """Writes config.json plus model.safetensors, or `num_shards` shards and model.safetensors.index.json."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf_config, f)
    if num_shards == 1:
        save_file(tensors, os.path.join(directory, "model.safetensors"))
        return
    names = sorted(tensors)
    weight_map = {}
    for s in range(num_shards):
        fn = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        part = names[s::num_shards]
        save_file({n: tensors[n] for n in part}, os.path.join(directory, fn))
        weight_map.update({n: fn for n in part})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def write_tiny_hf(directory: str, num_shards: int = 1, **overrides) -> dict[str, np.ndarray]:
    """Writes the tiny Llama checkpoint (q_proj of layer 0 in bf16) and returns its HF tensors."""
    hf_config = {**TINY_HF_CONFIG, **overrides}
    tensors = hf_tensors(hf_config, bf16_names=("model.layers.0.self_attn.q_proj.weight",))
    write_hf_checkpoint(directory, hf_config, tensors, num_shards)
    return tensors


def check_canonical(params: dict[str, np.ndarray], tensors: dict[str, np.ndarray], config: ModelConfig):
    """Every canonical tensor equals its HF source, transposed for linear layers; nothing extra."""
    assert set(params) == set(expected_shapes(config))
    for hf_name, src in tensors.items():
        mapped = hf.canonical_name(hf_name)
        if mapped is None or mapped[0] not in params:  # Ignored buffers; lm_head of a tied model.
            continue
        name, transpose = mapped
        want = src.T if transpose else src
        assert params[name].dtype == src.dtype, name
        assert params[name].shape == want.shape, name
        np.testing.assert_array_equal(params[name], want, err_msg=name)


@pytest.mark.parametrize("num_shards", [1, 3])
def test_llama_single_and_sharded(tmp_path, num_shards):
    tensors = write_tiny_hf(str(tmp_path), num_shards)
    config, params = hf.load_hf(str(tmp_path))
    assert config == ModelConfig(
        name=tmp_path.name,
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_ids=(2,),
    )
    assert params["layers.0.wq"].dtype == ml_dtypes.bfloat16
    assert params["layers.0.wq"].shape == (32, 32) and params["layers.0.wk"].shape == (32, 16)
    assert params["lm_head"].shape == (32, 96) and params["embed"].shape == (96, 32)
    check_canonical(params, tensors, config)


def test_dtype_cast_and_progress(tmp_path):
    write_tiny_hf(str(tmp_path))
    seen = []
    _, params = hf.load_hf(str(tmp_path), dtype=np.float32, progress=lambda i, n, name: seen.append((i, n)))
    assert all(a.dtype == np.float32 for a in params.values())
    assert seen[-1] == (len(params), len(params)) and len(seen) == len(params)


def test_qwen2_bias_tied_and_eos_list(tmp_path):
    hf_config = {
        **TINY_HF_CONFIG,
        "architectures": ["Qwen2ForCausalLM"],
        "tie_word_embeddings": True,
        "eos_token_id": [2, 5],
        "sliding_window": 64,
        "use_sliding_window": False,
    }
    del hf_config["head_dim"]  # Falls back to hidden / heads = 8.
    tensors = hf_tensors(hf_config)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()  # Tied, but stored anyway.
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)  # Ignored buffer.
    write_hf_checkpoint(str(tmp_path), hf_config, tensors, num_shards=2)
    config, params = hf.load_hf(str(tmp_path))
    assert config.attention_bias and config.tie_word_embeddings and config.eos_token_ids == (2, 5)
    assert config.head_dim == 8 and "lm_head" not in params
    assert params["layers.1.bk"].shape == (16,)
    check_canonical(params, tensors, config)


@pytest.mark.parametrize("layout", ["transformers4", "transformers5"])
def test_llama3_rope_scaling(layout):
    rope = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    hf_config = dict(TINY_HF_CONFIG)
    if layout == "transformers4":
        hf_config.update(rope_theta=500000.0, rope_scaling=rope)
    else:
        del hf_config["rope_theta"]
        hf_config["rope_parameters"] = {**rope, "rope_theta": 500000.0}
    config = hf.config_from_hf(hf_config)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == RopeScaling(factor=32.0)


def test_default_rope_parameters_and_mistral():
    hf_config = {
        **TINY_HF_CONFIG,
        "architectures": ["MistralForCausalLM"],
        "sliding_window": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
    }
    del hf_config["rope_theta"]
    config = hf.config_from_hf(hf_config)
    assert config.rope_theta == 1e6 and config.rope_scaling is None and not config.attention_bias


@pytest.mark.parametrize(
    "change, message",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn RoPE scaling needs"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "unsupported RoPE scaling"),
    ],
)
def test_config_errors(change, message):
    with pytest.raises(ValueError, match=message):
        hf.config_from_hf({**TINY_HF_CONFIG, **change})


def test_missing_directory_and_weights(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        hf.load_hf(str(tmp_path / "nope"))
    os.makedirs(tmp_path / "empty")
    with open(tmp_path / "empty" / "config.json", "w") as f:
        json.dump(TINY_HF_CONFIG, f)
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        hf.load_hf(str(tmp_path / "empty"))


def test_missing_shard_file(tmp_path):
    write_tiny_hf(str(tmp_path), num_shards=2)
    os.remove(tmp_path / "model-00002-of-00002.safetensors")
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors"):
        hf.load_hf(str(tmp_path))


def test_missing_tensor_is_named(tmp_path):
    tensors = hf_tensors(TINY_HF_CONFIG)
    del tensors["model.layers.1.mlp.up_proj.weight"], tensors["lm_head.weight"]
    write_hf_checkpoint(str(tmp_path), TINY_HF_CONFIG, tensors)
    with pytest.raises(ValueError, match=r"\['layers.1.w_up', 'lm_head'\]"):
        hf.load_hf(str(tmp_path))


def test_unexpected_and_misshapen_tensors(tmp_path):
    tensors = hf_tensors(TINY_HF_CONFIG)
    tensors["model.layers.0.self_attn.q_norm.weight"] = np.ones(8, np.float32)  # A Qwen3-style extra.
    write_hf_checkpoint(str(tmp_path / "extra"), TINY_HF_CONFIG, tensors)
    with pytest.raises(ValueError, match="q_norm"):
        hf.load_hf(str(tmp_path / "extra"))
    tensors = hf_tensors(TINY_HF_CONFIG)
    tensors["model.layers.0.mlp.down_proj.weight"] = tensors["model.layers.0.mlp.down_proj.weight"].T.copy()
    write_hf_checkpoint(str(tmp_path / "shape"), TINY_HF_CONFIG, tensors)
    with pytest.raises(ValueError, match="down_proj"):
        hf.load_hf(str(tmp_path / "shape"))


def test_tokenizer_absent_is_none(tmp_path):
    write_tiny_hf(str(tmp_path))
    assert hf.load_hf_tokenizer(str(tmp_path)) is None
    assert hf.is_hf_dir(str(tmp_path)) and not hf.is_hf_dir(str(tmp_path.parent))
