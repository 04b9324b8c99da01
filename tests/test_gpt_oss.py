"""gpt-oss pieces beside tests/test_hf_models.py (which runs its tiny HF fixture's logits and greedy continuations
through the engine): MXFP4 expert storage dequantised at load against a numpy reference written out per value, the
loader on an MXFP4 copy of the fixture, gpt-oss's routing and clamped SwiGLU against HF's formulas, and the
harmony template's date helper.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from checkpoints import gpt_oss_hf, hf
from model.moe import Activation, route

FIXTURE = os.path.join(os.path.dirname(__file__), "data", "hf_tiny", "gpt_oss")
HAS_GPU = any(d.platform == "gpu" for d in jax.devices())
E2M1 = {0: 0.0, 1: 0.5, 2: 1.0, 3: 1.5, 4: 2.0, 5: 3.0, 6: 4.0, 7: 6.0}


def _mxfp4_by_hand(blocks, scales):
    """Value by value: byte j of block g holds elements 2j (low nibble) and 2j + 1 (high), sign bit 3."""
    *lead, groups, nbytes = blocks.shape
    out = np.zeros((*lead, groups * nbytes * 2), np.float64)
    for idx in np.ndindex(*lead, groups):
        scale = 2.0 ** (int(scales[idx]) - 127)
        for j in range(nbytes):
            byte = int(blocks[idx][j])
            for half, code in enumerate((byte & 15, byte >> 4)):
                value = E2M1[code & 7] * (-1.0 if code & 8 else 1.0)
                out[(*idx[:-1], idx[-1] * nbytes * 2 + 2 * j + half)] = value * scale
    return out


def test_dequantize_mxfp4_matches_by_hand():
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 5, 2, 16), dtype=np.uint8)
    scales = rng.integers(115, 135, (3, 5, 2), dtype=np.uint8)
    got = gpt_oss_hf.dequantize_mxfp4(blocks, scales)
    assert got.shape == (3, 5, 64) and got.dtype == np.float32
    np.testing.assert_array_equal(got, _mxfp4_by_hand(blocks, scales))
    assert np.all(got.astype(jnp.bfloat16).astype(np.float32) == got), "MXFP4 values are exact in bfloat16"


@pytest.mark.parametrize("scales_shape", [(3, 5, 3), (3, 5)])
def test_dequantize_mxfp4_refuses_mismatched_scales(scales_shape):
    with pytest.raises(ValueError, match="MXFP4"):
        gpt_oss_hf.dequantize_mxfp4(np.zeros((3, 5, 2, 16), np.uint8), np.zeros(scales_shape, np.uint8))


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    """The tiny fixture with its expert weights replaced by random MXFP4 blocks / scales ([E, out, in / 32, 16])."""
    path = str(tmp_path_factory.mktemp("gpt_oss_mxfp4"))
    shutil.copy(os.path.join(FIXTURE, "config.json"), path)
    rng = np.random.default_rng(1)
    tensors, packed = {}, {}
    with safe_open(os.path.join(FIXTURE, "model.safetensors"), framework="numpy") as f:
        for name in f.keys():
            x = f.get_tensor(name).astype(np.float32)
            if name.endswith(("gate_up_proj", "down_proj")):  # [E, in, out] -> [E, out, in / 32, 16]
                e, k, n = x.shape
                packed[name] = rng.integers(0, 256, (e, n, k // 32, 16), dtype=np.uint8)
                tensors[name + "_blocks"] = packed[name]
                tensors[name + "_scales"] = rng.integers(120, 130, (e, n, k // 32), dtype=np.uint8)
            else:
                tensors[name] = x
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return path, tensors


def test_mxfp4_experts_load_dequantised(mxfp4_checkpoint):
    path, tensors = mxfp4_checkpoint
    config, params = hf.load_hf(path, dtype=np.float32)
    _, plain = hf.load_hf(FIXTURE, dtype=np.float32)
    assert set(params) == set(plain)
    f = config.moe_intermediate_size
    for i in range(config.num_layers):
        for proj, name in (("gate_up_proj", "w_gate_up"), ("down_proj", "w_experts_down")):
            base = f"model.layers.{i}.mlp.experts.{proj}"
            want = np.swapaxes(_mxfp4_by_hand(tensors[base + "_blocks"], tensors[base + "_scales"]), -1, -2)
            if proj == "gate_up_proj":  # interleaved gate / up columns -> [gate | up]
                want = np.concatenate([want[..., 0::2], want[..., 1::2]], axis=-1)
                assert want.shape[-1] == 2 * f
            np.testing.assert_array_equal(params[f"layers.{i}.{name}"], want)
        np.testing.assert_array_equal(params[f"layers.{i}.b_gate_up"], plain[f"layers.{i}.b_gate_up"])


def test_gate_up_columns_are_deinterleaved():
    with safe_open(os.path.join(FIXTURE, "model.safetensors"), framework="numpy") as f:
        stored = f.get_tensor("model.layers.0.mlp.experts.gate_up_proj").astype(np.float32)  # [E, D, 2F]
        bias = f.get_tensor("model.layers.0.mlp.experts.gate_up_proj_bias").astype(np.float32)
    _, params = hf.load_hf(FIXTURE, dtype=np.float32)
    f_ = stored.shape[-1] // 2
    np.testing.assert_array_equal(params["layers.0.w_gate_up"][..., :f_], stored[..., 0::2])
    np.testing.assert_array_equal(params["layers.0.w_gate_up"][..., f_:], stored[..., 1::2])
    np.testing.assert_array_equal(params["layers.0.b_gate_up"][..., f_:], bias[..., 1::2])


def test_missing_expert_tensor_is_refused(tmp_path):
    shutil.copy(os.path.join(FIXTURE, "config.json"), tmp_path)
    with safe_open(os.path.join(FIXTURE, "model.safetensors"), framework="numpy") as f:
        kept = {n: f.get_tensor(n).astype(np.float32) for n in f.keys() if n != "model.layers.1.mlp.experts.down_proj"}
    save_file(kept, os.path.join(tmp_path, "model.safetensors"))
    with pytest.raises(ValueError, match=r"layers\.1\.w_experts_down"):
        hf.load_hf(str(tmp_path))


def test_topk_softmax_routing_is_hfs():
    """HF GptOssTopKRouter: top-k of the (biased) logits, then a softmax over those k values."""
    logits = np.random.default_rng(2).standard_normal((7, 5)).astype(np.float32)
    weights, experts = route(jnp.asarray(logits), 2, True, "topk_softmax")
    order = np.argsort(-logits, axis=-1)[:, :2]
    top = np.take_along_axis(logits, order, axis=-1)
    want = np.exp(top - top.max(-1, keepdims=True))
    np.testing.assert_array_equal(np.asarray(experts), order)
    np.testing.assert_allclose(np.asarray(weights), want / want.sum(-1, keepdims=True), rtol=1e-6)


def test_clamped_swiglu_is_hfs():
    """HF GptOssExperts._apply_gate on values either side of the limit."""
    gate = np.asarray([-9.0, -1.0, 0.0, 0.5, 1.4, 2.0, 9.0], np.float32)
    up = np.asarray([-9.0, 2.0, -0.3, 0.1, 1.6, -2.5, 3.0], np.float32)
    limit, alpha = 1.5, 1.702
    g, u = np.minimum(gate, limit), np.clip(up, -limit, limit)
    want = (u + 1) * g / (1 + np.exp(-g * alpha))
    got = Activation(limit, alpha)(jnp.asarray(gate), jnp.asarray(up))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-7)
    plain = Activation()(jnp.asarray(gate), jnp.asarray(up))
    np.testing.assert_allclose(np.asarray(plain), gate / (1 + np.exp(-gate)) * up, rtol=1e-6, atol=1e-7)


def test_config_refuses_half_a_clamp():
    from model.config import ModelConfig

    with pytest.raises(ValueError, match="swiglu_limit"):
        ModelConfig.tiny_moe(swiglu_limit=7.0)
    with pytest.raises(ValueError, match="moe_routing"):
        ModelConfig.tiny_moe(moe_routing="sigmoid")


def test_harmony_style_template_gets_the_date():
    """gpt-oss's harmony template dates its system message with transformers' strftime_now."""
    from checkpoints.tokenizer import Tokenizer

    template = '{{ "Current date: " + strftime_now("%Y") }}{% for m in messages %}|{{ m.content }}{% endfor %}'
    tok = Tokenizer(hf=None, bos_token_id=None, eos_token_ids=(), add_bos=False, chat_template=template)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.startswith("Current date: 20") and text.endswith("|hi") and len(text) == len("Current date: 2026|hi")


def test_random_gpt_oss_shaped_model_runs():
    """random_model (benchmarks' random weights) builds every gpt-oss slot; the preset has gpt-oss-20b's shape."""
    from model.config import ModelConfig, RopeScaling
    from model.transformer import model_params, random_model
    from serving.engine.llm import _score

    yarn = RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=32, attention_factor=1.1)
    options = dict(attention_bias=True, attention_sinks=True, attention_out_bias=True, moe_routing="topk_softmax")
    options |= dict(moe_bias=True, swiglu_limit=7.0, swiglu_alpha=1.702, sliding_window=4, sliding_window_pattern=2)
    cfg = ModelConfig.tiny_moe(shared_expert_intermediate_size=0, rope_scaling=yarn, **options)
    model = random_model(cfg)
    assert {"layers.1.sinks", "layers.1.bo", "layers.1.b_router", "layers.1.b_gate_up"} <= set(model_params(model))
    logits = _score(model, jnp.arange(3, 12, dtype=jnp.int32)[None])
    assert logits.shape == (1, 9, cfg.vocab_size) and bool(jnp.isfinite(logits).all())
    big = ModelConfig.preset("gpt_oss_20b")
    assert big.layer_windows[:2] == (128, None) and 20e9 < big.num_params() < 22e9


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
def test_gpu_engine_greedy_matches_hf():
    """The fixture through the engine's default GPU kernels (Triton paged / ragged attention with sinks, the
    fused RoPE + KV write), float32 at "highest" matmul precision: HF's greedy continuations, token for token."""
    from serving.engine.llm import LLM

    with open(os.path.join(FIXTURE, "oracle.json")) as f:
        oracle = json.load(f)
    config, params = hf.load_hf(FIXTURE, dtype=np.float32)
    options = dict(dtype="float32", max_num_seqs=2, max_num_batched_tokens=8, num_kv_blocks=13, block_size=4)
    options |= dict(max_model_len=48, decode_steps=1, warmup=False, compilation_cache_dir="")
    with jax.default_matmul_precision("highest"):
        llm = LLM.from_params(config, params, enable_prefix_caching=True, **options)
        steps = len(oracle["greedy"][0])
        outs = llm.generate(oracle["prompts"], max_tokens=steps, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in outs] == oracle["greedy"]
