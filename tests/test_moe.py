"""The MoE MLP (model/moe.py) and the MoE fields of ModelConfig.

The block is checked in float32 against a dense per-token reference written independently of the dispatch: a
Python loop over tokens, each sent through its own top-k experts with numpy, so a wrong sort, un-sort or weight
shows up as a wrong token. The routing statistics must count every (token, expert) assignment once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model import moe
from model.config import ModelConfig


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _per_token_reference(block: moe.MoEMLP, x_td: np.ndarray, cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """(y [T, D], tokens per expert [E]) by looping over tokens in numpy (float64)."""
    f = cfg.moe_intermediate_size
    w_router = np.asarray(block.w_router[...], np.float64)
    w_gate_up = np.asarray(block.w_gate_up[...], np.float64)
    w_down = np.asarray(block.w_down[...], np.float64)
    counts = np.zeros(cfg.num_experts, np.int64)
    ys = []
    for x in np.asarray(x_td, np.float64):
        logits = x @ w_router
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        top = np.argsort(-probs, kind="stable")[: cfg.num_experts_per_tok]
        weights = probs[top] / (probs[top].sum() if cfg.norm_topk_prob else 1.0)
        y = np.zeros_like(x)
        for e, w in zip(top, weights):
            counts[e] += 1
            h = x @ w_gate_up[e]
            y += w * ((_silu(h[:f]) * h[f:]) @ w_down[e])
        if block.has_shared:
            sg = x @ np.asarray(block.shared_w_gate[...], np.float64)
            su = x @ np.asarray(block.shared_w_up[...], np.float64)
            shared = (_silu(sg) * su) @ np.asarray(block.shared_w_down[...], np.float64)
            gate = 1.0 / (1.0 + np.exp(-(x @ np.asarray(block.shared_gate[...], np.float64))))
            y += gate * shared
        ys.append(y)
    return np.stack(ys), counts


CONFIGS = [
    pytest.param(ModelConfig.tiny_moe(), id="qwen_style_shared_expert"),
    pytest.param(
        ModelConfig.tiny_moe(
            name="tiny_mixtral",
            num_experts=4,
            moe_intermediate_size=40,
            shared_expert_intermediate_size=0,
            norm_topk_prob=True,
        ),  # fmt: skip
        id="mixtral_style_renormalised",
    ),
    pytest.param(ModelConfig.tiny_moe(num_experts=5, num_experts_per_tok=5), id="top_k_equals_E"),
]


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("lead", [(2, 7), (1,)], ids=["B2_T7", "one_token"])
def test_block_matches_per_token_reference_f32(cfg, lead):
    block = moe.MoEMLP(cfg, jnp.float32, nnx.Rngs(params=sum(lead) + cfg.num_experts))
    x = jax.random.normal(jax.random.key(1), (*lead, cfg.hidden_size), jnp.float32)
    y, tokens_per_expert = block(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    ref_y, ref_counts = _per_token_reference(block, np.asarray(x).reshape(-1, cfg.hidden_size), cfg)
    np.testing.assert_allclose(np.asarray(y).reshape(ref_y.shape), ref_y, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(tokens_per_expert), ref_counts)
    assert int(tokens_per_expert.sum()) == int(np.prod(lead)) * cfg.num_experts_per_tok


def test_jitted_block_and_skewed_routing_statistics():
    """Under jit, with a router that sends every token to experts 0 and 3: the counts say so exactly."""
    cfg = ModelConfig.tiny_moe(shared_expert_intermediate_size=0)
    block = moe.MoEMLP(cfg, jnp.float32, nnx.Rngs(params=0))
    router = np.zeros((cfg.hidden_size, cfg.num_experts), np.float32)
    router[:, 0], router[:, 3] = 5.0, 4.0
    block.w_router[...] = jnp.asarray(router)
    x = jnp.abs(jax.random.normal(jax.random.key(2), (3, 5, cfg.hidden_size), jnp.float32))  # positive: 0 then 3

    @nnx.jit
    def run(block, x):
        return block(x)

    y, counts = run(block, x)
    np.testing.assert_array_equal(np.asarray(counts), [15, 0, 0, 15, 0, 0])
    ref_y, _ = _per_token_reference(block, np.asarray(x).reshape(-1, cfg.hidden_size), cfg)
    np.testing.assert_allclose(np.asarray(y).reshape(ref_y.shape), ref_y, rtol=1e-4, atol=1e-5)


def test_statistics_skip_padding_rows():
    cfg = ModelConfig.tiny_moe()
    block = moe.MoEMLP(cfg, jnp.float32, nnx.Rngs(params=7))
    x = jax.random.normal(jax.random.key(4), (2, 6, cfg.hidden_size), jnp.float32)
    valid = jnp.asarray([[True] * 6, [True] * 2 + [False] * 4])
    y, counts = block(x, valid)
    y_all, counts_all = block(x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_all))  # padding changes no output
    _, ref_counts = _per_token_reference(block, np.asarray(x)[np.asarray(valid)], cfg)
    np.testing.assert_array_equal(np.asarray(counts), ref_counts)
    assert int(counts.sum()) == 8 * cfg.num_experts_per_tok and int(counts_all.sum()) == 12 * cfg.num_experts_per_tok


def test_bf16_block_close_to_f32():
    cfg = ModelConfig.tiny_moe()
    block32 = moe.MoEMLP(cfg, jnp.float32, nnx.Rngs(params=4))
    block16 = moe.MoEMLP(cfg, jnp.bfloat16, nnx.Rngs(params=4))
    for name in ("w_router", "w_gate_up", "w_down", "shared_gate", "shared_w_gate", "shared_w_up", "shared_w_down"):
        getattr(block16, name)[...] = getattr(block32, name)[...].astype(jnp.bfloat16)
    x = jax.random.normal(jax.random.key(3), (2, 9, cfg.hidden_size), jnp.float32)
    y32, c32 = block32(x)
    y16, c16 = block16(x.astype(jnp.bfloat16))
    assert y16.dtype == jnp.bfloat16
    rel = np.linalg.norm(np.asarray(y16, np.float32) - np.asarray(y32)) / np.linalg.norm(np.asarray(y32))
    assert rel < 3e-2, rel
    assert int(c16.sum()) == int(c32.sum()) == 18 * cfg.num_experts_per_tok


def test_expert_matmul_door():
    x = jax.random.normal(jax.random.key(0), (10, 64), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (3, 64, 32), jnp.float32)
    sizes = jnp.asarray([4, 0, 6], jnp.int32)
    out = moe.expert_matmul(x, w, sizes)
    ref = np.concatenate([np.asarray(x[:4]) @ np.asarray(w[0]), np.asarray(x[4:]) @ np.asarray(w[2])])
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)
    from model.quant import QuantizedArray

    # Quantised experts (every leaf leading with E) take the ragged_dot path (tests/test_moe_quant.py).
    codes = jnp.round(w * 10).astype(jnp.int8)
    quantized = QuantizedArray(codes, jnp.full((3, 32), 0.5, jnp.float32))
    want = moe.expert_matmul(x, codes.astype(jnp.float32) * 0.5, sizes)
    np.testing.assert_allclose(
        np.asarray(moe.expert_matmul(x, quantized, sizes)), np.asarray(want), rtol=1e-5, atol=1e-4
    )


def test_moe_config_presets_and_validation():
    mixtral, qwen = ModelConfig.mixtral_8x7b(), ModelConfig.qwen_moe()
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size) == (8, 2, 14336)
    assert mixtral.norm_topk_prob and mixtral.shared_expert_intermediate_size == 0
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size) == (60, 4, 1408)
    assert qwen.shared_expert_intermediate_size == 5632 and not qwen.norm_topk_prob
    # Published sizes: Mixtral 46.7B total / 12.9B active, Qwen1.5-MoE-A2.7B 14.3B / 2.7B.
    assert round(mixtral.num_params() / 1e9, 1) == 46.7 and round(mixtral.num_params(active=True) / 1e9, 1) == 12.9
    assert round(qwen.num_params() / 1e9, 1) == 14.3 and round(qwen.num_params(active=True) / 1e9, 1) == 2.7
    assert ModelConfig.preset("tiny_moe").is_moe and not ModelConfig.preset("tiny").is_moe
    assert ModelConfig.from_json(qwen.to_json()) == qwen
    with pytest.raises(ValueError, match="num_experts_per_tok must be in"):
        ModelConfig.tiny_moe(num_experts_per_tok=7)
    with pytest.raises(ValueError, match="moe_intermediate_size is set but num_experts is 0"):
        ModelConfig.tiny(moe_intermediate_size=8)
    with pytest.raises(ValueError, match="moe_intermediate_size must be positive"):
        ModelConfig.tiny_moe(moe_intermediate_size=0)
    with pytest.raises(ValueError, match="num_experts must be >= 0"):
        ModelConfig.tiny(num_experts=-1)
    with pytest.raises(ValueError, match="needs an MoE config"):
        moe.MoEMLP(ModelConfig.tiny(), jnp.float32, None)


@pytest.mark.gpu
@pytest.mark.skipif(not moe.backend_lib.device_supports("mosaic_gpu"), reason="needs a Hopper GPU")
def test_gpu_block_grouped_kernel_matches_ragged_dot():
    """bf16 on an H200: the block through the Mosaic GPU grouped matmul vs the same block through ragged_dot."""
    cfg = ModelConfig.tiny_moe(hidden_size=256, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2)
    fast = moe.MoEMLP(cfg, jnp.bfloat16, nnx.Rngs(params=0), backend="mosaic_gpu")
    slow = moe.MoEMLP(cfg, jnp.bfloat16, nnx.Rngs(params=0), backend="xla")
    x = jax.random.normal(jax.random.key(5), (4, 333, cfg.hidden_size), jnp.bfloat16)
    (y_fast, c_fast), (y_slow, c_slow) = fast(x), slow(x)
    np.testing.assert_array_equal(np.asarray(c_fast), np.asarray(c_slow))
    a, b = np.asarray(y_fast, np.float32), np.asarray(y_slow, np.float32)
    assert np.isfinite(a).all() and np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-2
