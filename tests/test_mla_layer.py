"""Tests of the MLA attention layer (model/mla.py) against a plain jnp DeepSeek attention.

The reference below is written the way transformers' DeepseekV3Attention computes it: keys and values expanded
per head from the latent (kv_b_proj), the rotary part rotated on even/odd pairs, softmax over qk_head_dim-wide
dot products. The layer computes the absorbed form over its latent cache, so agreement checks the absorption,
the cache rows and the paged kernels' plumbing (prefill chunks, decode steps, page boundaries).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model.kv import ContiguousMeta, NoCache, PagedMeta
from model.mla import MlaAttention, MlaConfig, YarnScaling, init_mla_paged_cache, yarn_mscale

HI = jax.lax.Precision.HIGHEST
YARN = YarnScaling(factor=40.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=0.707)
CFG = MlaConfig(
    hidden_size=48,
    num_heads=3,
    q_lora_rank=24,
    kv_lora_rank=32,
    qk_nope_head_dim=8,
    qk_rope_head_dim=16,
    v_head_dim=12,
    rope_theta=10000.0,
    yarn=YARN,
)


def rms(x, w, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * w


def rope_pairs(x, pos, inv_freq, factor):
    """Interleaved RoPE as transformers' apply_rotary_pos_emb_interleave: pairs (x0, x1) rotated together."""
    ang = pos[..., None].astype(jnp.float32) * inv_freq  # [B, T, Dr/2]
    cos, sin = (jnp.cos(ang) * factor)[:, :, None], (jnp.sin(ang) * factor)[:, :, None]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def reference(layer: MlaAttention, x, positions):
    """DeepSeek attention of x [B, T, D] (causal over T) with expanded per-head keys and values, float32."""
    cfg = layer.cfg
    b, t, _ = x.shape
    h, dn, dr, dv, r = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    a = jnp.einsum("btd,de->bte", x, layer.w_a[...], precision=HI)
    q_a, kv = a[..., : cfg.q_a_width], a[..., cfg.q_a_width :]
    if cfg.q_lora_rank is not None:
        q = jnp.einsum(
            "btl,le->bte", rms(q_a, layer.q_a_norm.weight[...], cfg.rms_norm_eps), layer.w_q_b[...], precision=HI
        )
    else:
        q = q_a
    q = q.reshape(b, t, h, dn + dr)
    inv_freq, factor = cfg.rope()
    q_rot = rope_pairs(q[..., dn:], positions, inv_freq, factor)
    k_rot = rope_pairs(kv[..., r:][:, :, None], positions, inv_freq, factor)  # [B, T, 1, Dr]
    kv_up = jnp.einsum(
        "btr,re->bte", rms(kv[..., :r], layer.kv_a_norm.weight[...], cfg.rms_norm_eps), layer.w_kv_b[...], precision=HI
    )
    kv_up = kv_up.reshape(b, t, h, dn + dv)
    k = jnp.concatenate([kv_up[..., :dn], jnp.broadcast_to(k_rot, (b, t, h, dr))], -1)
    qf = jnp.concatenate([q[..., :dn], q_rot], -1)
    s = jnp.einsum("bthd,bshd->bhts", qf, k, precision=HI) * cfg.sm_scale
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
    o = jnp.einsum("bhts,bshv->bthv", jax.nn.softmax(s, -1), kv_up[..., dn:], precision=HI)
    return jnp.einsum("bte,ed->btd", o.reshape(b, t, h * dv), layer.w_o[...], precision=HI)


def make_layer(cfg=CFG, seed=0):
    layer = MlaAttention(cfg, jnp.float32, nnx.Rngs(seed))
    rng = np.random.default_rng(seed)  # non-trivial norm weights, so a skipped norm shows
    layer.kv_a_norm.weight[...] = jnp.asarray(1 + 0.3 * rng.standard_normal(cfg.kv_lora_rank), jnp.float32)
    if cfg.q_lora_rank is not None:
        layer.q_a_norm.weight[...] = jnp.asarray(1 + 0.3 * rng.standard_normal(cfg.q_lora_rank), jnp.float32)
    return layer


def jitted(layer):
    """The layer as one jitted function of (x, positions, cache, meta): a compile per shape, not per op."""
    graphdef, state = nnx.split(layer)
    call = jax.jit(lambda state, *args: nnx.merge(graphdef, state)(*args))
    return lambda *args: call(state, *args)


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all()
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("q_lora,interleave", [(24, True), (None, False)])
def test_scoring_matches_reference(q_lora, interleave):
    import dataclasses

    cfg = dataclasses.replace(CFG, q_lora_rank=q_lora, rope_interleave=interleave)
    layer = make_layer(cfg)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 13, cfg.hidden_size)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(13), (2, 13))
    out, _ = jitted(layer)(x, pos, None, NoCache(valid_len=jnp.asarray([13, 13])))
    if interleave:
        assert rel_err(out, reference(layer, x, pos)) < 1e-5
    else:  # plain rotate-half: permuting the rope dims of the reference's input is the same as not interleaving
        assert rel_err(out, reference_rotate_half(layer, x, pos)) < 1e-5


def reference_rotate_half(layer, x, pos):
    """Reference for rope_interleave=False: feed the reference weights whose rope columns are re-interleaved."""
    cfg = layer.cfg
    dn, dr, h = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.num_heads
    inter = np.empty(dr, int)
    inter[0::2], inter[1::2] = np.arange(dr // 2), np.arange(dr // 2, dr)  # rotate-half order -> pairs
    perm_q = np.concatenate([hh * (dn + dr) + np.concatenate([np.arange(dn), dn + inter]) for hh in range(h)])
    perm_a = np.concatenate([np.arange(cfg.q_a_width + cfg.kv_lora_rank), cfg.q_a_width + cfg.kv_lora_rank + inter])
    twin = make_layer(cfg)
    nnx.update(twin, nnx.state(layer))
    twin.w_a[...] = layer.w_a[...][:, perm_a]
    if cfg.q_lora_rank is not None:
        twin.w_q_b[...] = layer.w_q_b[...][:, perm_q]
    else:
        twin.w_a[...] = twin.w_a[...][:, np.concatenate([perm_q, np.arange(cfg.q_a_width, perm_a.size)])]
    return reference(twin, x, pos)


def test_contiguous_decode_matches_reference():
    layer = make_layer()
    x = jnp.asarray(np.random.default_rng(2).standard_normal((1, 7, CFG.hidden_size)), jnp.float32)
    pos = jnp.arange(7)[None]
    cache = jnp.zeros((1, 16, CFG.latent_width))
    run = jitted(layer)
    out0, cache = run(x[:, :4], pos[:, :4], cache, ContiguousMeta())
    outs = [out0]
    for i in range(4, 7):
        o, cache = run(x[:, i : i + 1], pos[:, i : i + 1], cache, ContiguousMeta())
        outs.append(o)
    assert rel_err(jnp.concatenate(outs, 1), reference(layer, x, pos)) < 1e-5


def _paged_meta(slots, tables, kv_lens, cu, decode_only, backend):
    return PagedMeta(
        slot_mapping=jnp.asarray(slots, jnp.int32),
        block_tables=jnp.asarray(tables, jnp.int32),
        kv_lens=jnp.asarray(kv_lens, jnp.int32),
        cu_q_lens=jnp.asarray(cu, jnp.int32),
        num_seqs=jnp.int32(len(kv_lens)),
        decode_only=decode_only,
        backend=backend,
    )


@pytest.mark.parametrize("backend,page_size", [("xla", 4), ("interpret", 8)])
def test_paged_prefill_chunks_and_decode_match_reference(backend, page_size):
    """Two sequences: prefill in two chunks (3 + 10 and 1 + 4 tokens), then decode steps past page boundaries."""
    import dataclasses

    cfg = dataclasses.replace(CFG, kv_lora_rank=32, qk_rope_head_dim=16)
    layer = make_layer(cfg, seed=3)
    lens = [13 + 4, 5 + 4]
    xs = [
        jnp.asarray(np.random.default_rng(10 + s).standard_normal((1, n, cfg.hidden_size)), jnp.float32)
        for s, n in enumerate(lens)
    ]
    (pages,) = init_mla_paged_cache(1, 12, page_size, cfg, jnp.float32)[0]
    pages = jnp.full_like(pages, jnp.nan)  # unwritten slots must never be read
    tables = np.array([[7, 2, 9, 0, 5], [4, 11, 1, 3, 6]])[:, : math.ceil(max(lens) / page_size)]
    slot = lambda s, p: tables[s, p // page_size] * page_size + p % page_size  # noqa: E731
    outs = [[], []]
    done = [0, 0]
    steps = [(3, 1), (10, 4)] + [(1, 1)] * 4
    cache, run = (pages,), jitted(layer)
    for q_lens in steps:
        tokens = [np.arange(done[s], done[s] + q_lens[s]) for s in range(2)]
        x = jnp.concatenate([xs[s][:, tokens[s]] for s in range(2)], axis=1)
        pos = jnp.asarray(np.concatenate(tokens))[None]
        slots = [slot(s, int(p)) for s in range(2) for p in tokens[s]]
        kv = [done[s] + q_lens[s] for s in range(2)]
        meta = _paged_meta(slots, tables, kv, [0, q_lens[0], sum(q_lens)], q_lens == (1, 1), backend)
        out, cache = run(x, pos, cache, meta)
        outs[0].append(out[:, : q_lens[0]])
        outs[1].append(out[:, q_lens[0] :])
        done = kv
    for s in range(2):
        ref = reference(layer, xs[s], jnp.arange(lens[s])[None])
        assert rel_err(jnp.concatenate(outs[s], 1), ref) < 1e-5


def test_yarn_frequencies_and_scale():
    plain, _ = MlaConfig(**{**CFG.__dict__, "yarn": None}).rope()
    inv, factor = CFG.rope()
    np.testing.assert_allclose(inv[0], plain[0], rtol=1e-6)  # the fastest dim (many turns in the old context) kept
    np.testing.assert_allclose(inv[-1], plain[-1] / YARN.factor, rtol=1e-6)  # slowest dim interpolated
    assert np.all(np.asarray(inv) <= np.asarray(plain) * (1 + 1e-6)) and np.all(
        np.diff(np.asarray(inv / plain)) <= 1e-7
    )
    assert factor == pytest.approx(yarn_mscale(40.0, 1.0) / yarn_mscale(40.0, 0.707))
    assert CFG.sm_scale == pytest.approx(yarn_mscale(40.0, 0.707) ** 2 / math.sqrt(24))
    one, f1 = MlaConfig(**{**CFG.__dict__, "yarn": YarnScaling(factor=1.0, original_max_position_embeddings=64)}).rope()
    np.testing.assert_allclose(one, plain, rtol=1e-6)
    assert f1 == 1.0


@pytest.mark.parametrize(
    "kwargs",
    [dict(num_heads=0), dict(qk_rope_head_dim=7), dict(q_lora_rank=0), dict(kv_lora_rank=0)],
)
def test_config_validation(kwargs):
    with pytest.raises(ValueError):
        MlaConfig(**{**CFG.__dict__, **kwargs})


def test_latent_cache_rejects_quantised_dtype():
    with pytest.raises(ValueError, match="dtype"):
        init_mla_paged_cache(1, 4, 4, CFG, jnp.int8)
