"""HF safetensors loading of MoE checkpoints (Mixtral and Qwen2-MoE parameter names) into the canonical names of
model/transformer.py, checked against the HF layout's own math: one MoE MLP computed in numpy straight from the
stored [out, in] tensors (softmax router, top-k, HF's weight normalisation, SwiGLU experts, Qwen's sigmoid-gated
shared expert) must equal the loaded model's MoEMLP on the same input."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from checkpoints import hf
from model.moe import MoEMLP
from model.transformer import build_model

D, F, E, FS, V, LAYERS = 16, 12, 4, 8, 64, 2


def _hf_dir(tmp_path, arch: str):
    rng = np.random.default_rng(0)
    r = lambda *shape: (0.3 * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
    mixtral = arch == "MixtralForCausalLM"
    config = dict(
        architectures=[arch],
        vocab_size=V,
        hidden_size=D,
        intermediate_size=F,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    if mixtral:
        config.update(num_local_experts=E)
    else:
        config.update(num_experts=E, moe_intermediate_size=F, shared_expert_intermediate_size=FS, norm_topk_prob=False)
    t = {"model.embed_tokens.weight": r(V, D), "model.norm.weight": 1 + r(D), "lm_head.weight": r(V, D)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": 1 + r(D), p + "post_attention_layernorm.weight": 1 + r(D)})
        t.update({p + f"self_attn.{n}_proj.weight": r(s, D) for n, s in (("q", 16), ("k", 8), ("v", 8))})
        t[p + "self_attn.o_proj.weight"] = r(D, 16)
        if not mixtral:
            t.update({p + f"self_attn.{n}_proj.bias": r(s) for n, s in (("q", 16), ("k", 8), ("v", 8))})
        moe = p + ("block_sparse_moe." if mixtral else "mlp.")
        t[moe + "gate.weight"] = r(E, D)
        names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        for e in range(E):
            t[f"{moe}experts.{e}.{names[0]}.weight"] = r(F, D)
            t[f"{moe}experts.{e}.{names[1]}.weight"] = r(F, D)
            t[f"{moe}experts.{e}.{names[2]}.weight"] = r(D, F)
        if not mixtral:
            t.update({moe + "shared_expert.gate_proj.weight": r(FS, D), moe + "shared_expert.up_proj.weight": r(FS, D)})
            t.update({moe + "shared_expert.down_proj.weight": r(D, FS), moe + "shared_expert_gate.weight": r(1, D)})
    save_file(t, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path), t


def _hf_moe(x, t, p, mixtral: bool):
    """HF MixtralSparseMoeBlock / Qwen2MoeSparseMoeBlock in numpy (float64), from the stored tensors."""
    silu = lambda a: a / (1 + np.exp(-a))  # noqa: E731
    moe = p + ("block_sparse_moe." if mixtral else "mlp.")
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    logits = x @ t[moe + "gate.weight"].T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1)[:, :2]
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        w = probs[n, top[n]]
        w = w / w.sum() if mixtral else w
        for weight, e in zip(w, top[n]):
            g, u = x[n] @ t[f"{moe}experts.{e}.{names[0]}.weight"].T, x[n] @ t[f"{moe}experts.{e}.{names[1]}.weight"].T
            out[n] += weight * ((silu(g) * u) @ t[f"{moe}experts.{e}.{names[2]}.weight"].T)
    if not mixtral:
        s = moe + "shared_expert."
        h = silu(x @ t[s + "gate_proj.weight"].T) * (x @ t[s + "up_proj.weight"].T)
        gate = 1 / (1 + np.exp(-(x @ t[moe + "shared_expert_gate.weight"].T)))
        out += gate * (h @ t[s + "down_proj.weight"].T)
    return out


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "Qwen2MoeForCausalLM"])
def test_moe_checkpoint_loads_and_matches_hf_math(tmp_path, arch):
    path, tensors = _hf_dir(tmp_path, arch)
    config, params = hf.load_hf(path)
    mixtral = arch == "MixtralForCausalLM"
    assert config.is_moe and config.num_experts == E and config.num_experts_per_tok == 2
    assert config.norm_topk_prob == mixtral and config.shared_expert_intermediate_size == (0 if mixtral else FS)
    assert params["layers.1.w_gate_up"].shape == (E, D, 2 * F) and params["layers.1.w_experts_down"].shape == (E, F, D)
    model = build_model(config, params)
    x = np.random.default_rng(1).standard_normal((7, D)).astype(np.float32)
    for i, layer in enumerate(model.layers):
        assert isinstance(layer.mlp, MoEMLP)
        got, counts = layer.mlp(jnp.asarray(x))
        want = _hf_moe(
            x.astype(np.float64), {k: v.astype(np.float64) for k, v in tensors.items()}, f"model.layers.{i}.", mixtral
        )
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)
        assert int(np.asarray(counts).sum()) == 7 * 2


def test_moe_checkpoint_missing_expert_is_refused(tmp_path):
    path, tensors = _hf_dir(tmp_path, "MixtralForCausalLM")
    del tensors["model.layers.0.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="expert 3 up"):
        hf.load_hf(path)
