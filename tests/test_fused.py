"""model/fused.py: the fused q|k|v and gate|up layouts (per tensor-parallel shard), their inverse, quantised parts,
and that one fused matmul gives each part's output exactly as its own matmul did (the unfused model)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import fused
from model.config import ModelConfig
from model.kv import NoCache
from model.quant import QuantizedArray
from model.quant_methods import rtn, smoothquant
from model.transformer import _param_slots, _storage_slots, build_model, model_params, random_model

HD = 4
PARTS = (fused.Part("wq", 8 * HD, 8), fused.Part("wk", 2 * HD, 2), fused.Part("wv", 2 * HD, 2))


def _parts(seed=0, k=6):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((k, p.width)).astype(np.float32) for p in PARTS]


@pytest.mark.parametrize("shards", [1, 2, 4, 8])
def test_layout_per_shard_and_inverse(shards):
    """Shard j of the fused columns is q_j | k_j | v_j: its block of q heads and the KV heads those read (both KV
    heads at 1 shard, one each at 2, the one KV head repeated at 4 and 8); split() inverts fuse()."""
    q, k, v = _parts()
    w = fused.fuse([q, k, v], PARTS, shards)
    per = w.shape[1] // shards
    assert w.shape[1] == fused.fused_width(PARTS, shards) == shards * (8 // shards + 2 * (2 // min(2, shards))) * HD
    qw, kvw = 8 * HD // shards, 2 * HD // min(2, shards)  # q columns and k (= v) columns per shard
    for j in range(shards):
        block = w[:, j * per : (j + 1) * per]
        head = j * min(2, shards) // shards  # the KV block shard j holds
        np.testing.assert_array_equal(block[:, :qw], q[:, j * qw : (j + 1) * qw])
        np.testing.assert_array_equal(block[:, qw : qw + kvw], k[:, head * kvw : (head + 1) * kvw])
        np.testing.assert_array_equal(block[:, qw + kvw :], v[:, head * kvw : (head + 1) * kvw])
    for got, want in zip(fused.split(w, PARTS, shards), (q, k, v)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("shards", [1, 4])
def test_unfuse_output_gives_each_parts_matmul(shards):
    """x @ fused -> per part: q as x @ wq; k, v as x @ wk (heads repeated when the layout repeats them)."""
    q, k, v = _parts(1)
    x = np.random.default_rng(2).standard_normal((3, 6)).astype(np.float32)
    outs = fused.unfuse_output(jnp.asarray(x @ fused.fuse([q, k, v], PARTS, shards)), PARTS, shards)
    np.testing.assert_allclose(outs[0], x @ q, rtol=1e-6, atol=1e-6)
    rep = shards // 2 if shards > 2 else 1
    for got, w in zip(outs[1:], (k, v)):
        want = np.repeat((x @ w).reshape(3, 2, HD), rep, axis=1).reshape(3, -1)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_bad_shards_and_widths():
    with pytest.raises(ValueError, match="neither split nor repeat"):
        fused.fuse(_parts(), PARTS, 3)
    with pytest.raises(ValueError, match="wk: 5 output columns"):
        fused.fuse([_parts()[0], np.zeros((6, 5)), _parts()[2]], PARTS, 1)


def test_quantised_parts_concatenate_leafwise():
    """Per-channel int8 and grouped int4 parts fuse into one QuantizedArray (scales / zeros along the output axis);
    parts with different SmoothQuant pre-scales cannot share an input scaling, so they are dequantised."""
    q, k, v = (jnp.asarray(w) for w in _parts(3, k=64))
    for quant in (lambda w: rtn(w, "int8"), lambda w: rtn(w, "int4", group_size=32, asymmetric=True)):
        parts = [quant(w) for w in (q, k, v)]
        got = fused.fuse(parts, PARTS)
        assert isinstance(got, QuantizedArray) and got.shape == (64, fused.fused_width(PARTS, 1))
        want = np.concatenate([np.asarray(p.dequantize()) for p in parts], axis=1)
        np.testing.assert_array_equal(np.asarray(got.dequantize()), want)
        for a, b in zip(fused.split(got, PARTS), parts):
            np.testing.assert_array_equal(np.asarray(a.dequantize()), np.asarray(b.dequantize()))
    x = jnp.asarray(np.random.default_rng(4).standard_normal((16, 64)), jnp.float32)
    separate = [smoothquant(w, x, alpha=0.5) for w in (q, k, v)]
    got = fused.fuse(separate, PARTS)
    assert not isinstance(got, QuantizedArray)
    np.testing.assert_allclose(np.asarray(got), np.concatenate([np.asarray(p.dequantize()) for p in separate], 1))
    joint = smoothquant(jnp.concatenate([q, k, v], 1), x, alpha=0.5)  # what quantize_model does: one pre_scale
    assert all(p.pre_scale is joint.pre_scale for p in fused.split(joint, PARTS))


def test_fused_model_equals_unfused_matmuls():
    """The fused model's logits equal a forward that runs q, k, v, gate, up as separate matmuls."""
    cfg = ModelConfig.tiny(attention_bias=True)
    model = random_model(cfg, seed=3)
    params = model_params(model)
    assert set(_param_slots(model)) == set(params) and "layers.0.wqkv" in _storage_slots(model)
    tokens, pos = jnp.asarray([[5, 17, 30, 2, 9]]), jnp.arange(5)[None]
    got = model(tokens, pos, None, NoCache(jnp.array([5])))[0]

    from model import layers, transformer

    def separate(x, w, out_dtype=None):  # the fused weight split back into its parts, one matmul each
        n = w.shape[-1]
        if isinstance(w, jax.Array) and n in (cfg.q_size + 2 * cfg.kv_size, 2 * cfg.intermediate_size):
            ps = fused.group_parts(cfg, "wqkv" if n == cfg.q_size + 2 * cfg.kv_size else "gate_up")
            return jnp.concatenate([x @ p for p in fused.split(w, ps)], axis=-1).astype(out_dtype or x.dtype)
        return saved(x, w, out_dtype)

    saved = transformer.matmul
    transformer.matmul = layers.matmul = separate
    try:
        want = model(tokens, pos, None, NoCache(jnp.array([5])))[0]
    finally:
        transformer.matmul = layers.matmul = saved
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    rebuilt = build_model(cfg, {k: np.asarray(v) for k, v in params.items()})
    np.testing.assert_array_equal(np.asarray(rebuilt(tokens, pos, None, NoCache(jnp.array([5])))[0]), np.asarray(got))
