"""RoPE + the paged KV write in one kernel (pallas_kernels/rope_kv_write.py) against its jnp reference, and the
model's fused attention path (model/kv.py PagedMeta.rope_attend) against the unfused one.

One shared base runs the kernel in the Pallas interpreter on CPU and through Triton on a GPU, at token counts that
no tile divides (1, 3, 13, 100), SmolLM2's 9 / 3 heads, Llama's 32 / 8, positions up to 131k, float and int8
pages (with an all-zero head: the scale's floor), and block_tokens 1, 3 and 8. Outputs are compared whole, so a
slot written that should not be (or a page slot not written) fails too.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model import kv as kvmod
from model.config import ModelConfig
from model.layers import rope_inv_freq
from model.transformer import Attention
from pallas_kernels import rope_kv_write as R
from tests.test_quantized_matmul import fake_hopper  # noqa: F401 (fixture)

# (T, Hq, Hkv, hd, pages, page_size, page dtype, block_tokens)
CASES = [
    pytest.param(1, 4, 2, 16, 3, 4, jnp.bfloat16, None, id="decode_one_token"),
    pytest.param(3, 9, 3, 64, 4, 8, jnp.bfloat16, None, id="smollm2_heads_t3"),
    pytest.param(13, 4, 4, 32, 5, 4, jnp.float32, 3, id="mha_f32_t13_bt3"),
    pytest.param(13, 8, 2, 128, 4, 16, jnp.float16, 8, id="f16_t13_bt8"),
    pytest.param(100, 32, 8, 128, 8, 16, jnp.bfloat16, None, id="llama_heads_t100"),
    pytest.param(7, 9, 3, 64, 3, 8, jnp.int8, None, id="int8_smollm2"),
    pytest.param(13, 32, 8, 128, 4, 16, jnp.int8, 3, id="int8_llama_bt3"),
]


def _inputs(t, hq, hkv, hd, n_pages, ps, dtype, seed):
    rng = np.random.default_rng(seed)
    qkv = rng.standard_normal((t, (hq + 2 * hkv) * hd)).astype(np.float32)
    qkv[0, (hq + hkv) * hd : (hq + hkv + 1) * hd] = 0.0  # token 0's first V head all zero: int8 scale floor
    qkv = jnp.asarray(qkv, jnp.bfloat16)
    positions = rng.integers(0, 131072, t).astype(np.int32)
    positions[0] = 0
    slots = jnp.asarray(rng.permutation(n_pages * ps)[:t], jnp.int32)
    inv_freq = rope_inv_freq(hd, 500000.0, None)
    shape = (hkv, n_pages, ps, hd)
    if jnp.dtype(dtype) == jnp.int8:
        pages = [jnp.asarray(rng.integers(-127, 128, shape), jnp.int8) for _ in range(2)]
        pages += [jnp.asarray(rng.uniform(0.5, 2.0, shape[:3]), jnp.float32) for _ in range(2)]
    else:
        pages = [jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(2)]
    return qkv, jnp.asarray(positions), slots, inv_freq, pages


class RopeKVWriteBase:
    backend: str

    @pytest.mark.parametrize("t,hq,hkv,hd,n_pages,ps,dtype,bt", CASES)
    def test_matches_reference(self, t, hq, hkv, hd, n_pages, ps, dtype, bt):
        qkv, positions, slots, inv_freq, pages = _inputs(t, hq, hkv, hd, n_pages, ps, dtype, seed=t * hq + hd)
        want = R.reference(qkv, positions, slots, inv_freq, *pages, num_q_heads=hq)
        got = R.rope_kv_write(
            qkv,
            positions,
            slots,
            inv_freq,
            *[jnp.copy(p) for p in pages],  # the kernel updates the pools in place
            num_q_heads=hq,
            config=R.RopeKVConfig(block_tokens=bt),
            backend=self.backend,
        )
        assert len(got) == len(want) == 1 + len(pages)
        assert got[0].shape == (t, hq, hd) and got[0].dtype == qkv.dtype
        for g, w, name in zip(got, want, ("q", "k_pages", "v_pages", "k_scales", "v_scales")):
            assert g.shape == w.shape and g.dtype == w.dtype, name
            g32, w32 = np.asarray(g, np.float32), np.asarray(w, np.float32)
            self.assert_close(g32, w32, name, jnp.dtype(g.dtype))
        if jnp.dtype(dtype) == jnp.int8:  # the all-zero head: codes 0, scale 1e-12
            slot0 = int(slots[0])
            assert float(np.asarray(got[4]).reshape(hkv, -1)[0, slot0]) == np.float32(R.MIN_SCALE)
            assert not np.asarray(got[2]).reshape(hkv, -1, hd)[0, slot0].any()

    def assert_close(self, got, want, name, dtype):
        """Equal but for last-bit differences: x1 c - x2 s cancels near zero, where a fused multiply-add in one and
        not the other moves the rounded value by one ulp of its dtype (an int8 code then by one level), and XLA may
        divide max|x| by 127 as a multiply by 1 / 127 (a scale's last bit)."""
        if name.endswith("scales"):
            np.testing.assert_allclose(got, want, rtol=2**-22, atol=0, err_msg=name)
            return
        assert (got != want).mean() < 1e-3, name
        if dtype == jnp.int8:
            assert np.abs(got - want).max() <= 1, name
        else:
            np.testing.assert_allclose(got, want, rtol=2.0 ** -jnp.finfo(dtype).nmant, atol=0, err_msg=name)

    def test_padding_tokens_write_only_the_null_slot(self):
        """The engine pads a step with tokens whose slot is 0 (the null page): every other slot is as the reference
        writes it, whatever order the padding lands in."""
        qkv, positions, slots, inv_freq, pages = _inputs(12, 4, 2, 32, 4, 4, jnp.bfloat16, seed=5)
        slots = slots.at[8:].set(0)
        want = R.reference(qkv[:8], positions[:8], slots[:8], inv_freq, *pages, num_q_heads=4)
        got = R.rope_kv_write(
            qkv, positions, slots, inv_freq, *[jnp.copy(p) for p in pages], num_q_heads=4, backend=self.backend
        )
        np.testing.assert_array_equal(np.asarray(got[0][:8], np.float32), np.asarray(want[0], np.float32))
        for g, w in zip(got[1:], want[1:]):
            g, w = np.asarray(g, np.float32).reshape(2, -1, 32), np.asarray(w, np.float32).reshape(2, -1, 32)
            np.testing.assert_array_equal(g[:, 1:], w[:, 1:])


def test_an_eager_call_leaves_the_callers_pools_as_they_were():
    qkv, positions, slots, inv_freq, pages = _inputs(3, 4, 2, 16, 3, 4, jnp.bfloat16, seed=3)
    before = [np.asarray(p, np.float32) for p in pages]
    out = R.rope_kv_write(qkv, positions, slots, inv_freq, *pages, num_q_heads=4, backend="interpret")
    for p, b, o in zip(pages, before, out[1:]):
        np.testing.assert_array_equal(np.asarray(p, np.float32), b)  # still readable, unchanged
        assert not np.array_equal(np.asarray(o, np.float32), b)  # the returned pools hold the writes


class TestInterpret(RopeKVWriteBase):
    backend = "interpret"


@pytest.mark.gpu
@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs a GPU")
class TestGpu(RopeKVWriteBase):
    """Through Triton, whose sin / cos may also differ from XLA's in the last bit (the same tolerance)."""

    backend = "triton"


def test_lowers_to_triton_on_cpu(fake_hopper):  # noqa: F811
    for dtype, bt in ((jnp.bfloat16, None), (jnp.bfloat16, 8), (jnp.int8, 3)):
        qkv, positions, slots, inv_freq, pages = _inputs(100, 32, 8, 128, 8, 16, dtype, seed=0)

        def f(*a, bt=bt):
            return R._kernel_jit(*a, hq=32, config=R.RopeKVConfig(block_tokens=bt), interpret=False)

        args = (qkv, positions, slots, inv_freq, *pages)
        assert "triton" in jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda a: a.update(qkv=a["qkv"][:, :-1]), "width"),
        (lambda a: a.update(qkv=a["qkv"][None]), r"\[T"),
        (lambda a: a.update(slots=a["slots"][:-1]), "slots"),
        (lambda a: a.update(positions=a["positions"].astype(jnp.float32)), "integers"),
        (lambda a: a.update(inv_freq=a["inv_freq"][:-1]), "inv_freq"),
        (lambda a: a.update(v_pages=a["v_pages"][:, :-1]), "equal"),
        (lambda a: a.update(k_pages=a["k_pages"].astype(jnp.int8), v_pages=a["v_pages"].astype(jnp.int8)), "scales"),
        (
            lambda a: a.update(
                k_pages=a["k_pages"].astype(jnp.float8_e4m3fn), v_pages=a["v_pages"].astype(jnp.float8_e4m3fn)
            ),
            "dtype",
        ),
    ],
)
def test_bad_inputs_raise(mutate, match):
    qkv, positions, slots, inv_freq, (k, v) = _inputs(3, 4, 2, 16, 3, 4, jnp.bfloat16, seed=1)
    args = dict(qkv=qkv, positions=positions, slots=slots, inv_freq=inv_freq, k_pages=k, v_pages=v)
    mutate(args)
    with pytest.raises(ValueError, match=match):
        R.rope_kv_write(**args, num_q_heads=4, backend="interpret")


def test_kernel_needs_power_of_two_half_head():
    qkv, positions, slots, _, _ = _inputs(3, 2, 1, 24, 2, 4, jnp.bfloat16, seed=2)
    pages = [jnp.zeros((1, 2, 4, 24), jnp.bfloat16)] * 2
    with pytest.raises(ValueError, match="power of two"):
        R.rope_kv_write(qkv, positions, slots, rope_inv_freq(24, 1e4, None), *pages, num_q_heads=2, backend="interpret")
    out = R.rope_kv_write(qkv, positions, slots, rope_inv_freq(24, 1e4, None), *pages, num_q_heads=2, backend="xla")
    assert out[0].shape == (3, 2, 24)  # the reference takes any even hd


@pytest.mark.parametrize("kv_dtype", [jnp.float32, jnp.int8, jnp.float8_e4m3fn])
@pytest.mark.parametrize("decode_only", [False, True])
def test_attention_fused_equals_unfused(monkeypatch, kv_dtype, decode_only):
    """The model's attention layer through PagedMeta with the fused kernel (interpret) and without it: the same
    output and the same pools, for a mixed step (two sequences, 5 + 3 tokens after 4 cached each) and a decode
    step. fp8 pages are not fused (`fuses_rope` False) and take the unfused path in both runs."""
    cfg = ModelConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        max_position_embeddings=64,
    )
    attn = Attention(cfg, jnp.float32, nnx.Rngs(0))
    q_lens = [1, 1] if decode_only else [5, 3]
    t, ps = sum(q_lens), 4
    block_tables = jnp.asarray([[1, 2, 3], [4, 5, 6]], jnp.int32)
    positions = np.concatenate([np.arange(4, 4 + n) for n in q_lens]).astype(np.int32)
    rows = np.repeat(np.arange(2), q_lens)
    slots = np.asarray(block_tables)[rows, positions // ps] * ps + positions % ps
    meta = kvmod.PagedMeta(
        jnp.asarray(slots, jnp.int32),
        block_tables,
        jnp.asarray([4 + n for n in q_lens], jnp.int32),
        jnp.asarray(np.cumsum([0, *q_lens]), jnp.int32),
        jnp.int32(2),
        decode_only,
        "interpret",
    )
    x = jax.random.normal(jax.random.key(1), (1, t, 64), jnp.float32)
    cache = kvmod.init_paged_cache(1, 8, ps, 2, 32, kv_dtype)[0]
    cache = tuple(c + 0.5 if c.dtype == jnp.float32 else c for c in cache)  # earlier tokens' K / V (scales 1.5)
    inv_freq = rope_inv_freq(32, 1e4, None)
    assert meta.fuses_rope(cache, 2) == (jnp.dtype(kv_dtype) != jnp.float8_e4m3fn)
    runs = []
    assert not dataclasses.replace(meta, fuse_rope=False).fuses_rope(cache, 2)
    for fused in (True, False):
        m = dataclasses.replace(meta, fuse_rope=fused)
        runs.append(attn(x, jnp.asarray(positions)[None], inv_freq, tuple(jnp.copy(c) for c in cache), m))
    (out_f, cache_f), (out_u, cache_u) = runs
    np.testing.assert_allclose(np.asarray(out_f), np.asarray(out_u), rtol=1e-5, atol=1e-6)
    for a, b in zip(cache_f, cache_u):  # float32 K / scales: equal up to a fused multiply-add's last bit
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if jnp.dtype(kv_dtype) == jnp.int8 and a.ndim == 4:
            assert np.abs(a - b).max() <= 1 and (a != b).mean() < 1e-2
        else:
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_fuses_rope_only_where_the_kernel_applies():
    meta = kvmod.PagedMeta(*(jnp.zeros((2,), jnp.int32),) * 5, backend="interpret")
    pages = (jnp.zeros((2, 4, 4, 32), jnp.bfloat16),) * 2
    assert meta.fuses_rope(pages, 2)
    assert not meta.fuses_rope(pages, 1)  # KV heads repeated for tensor parallelism
    assert not meta.fuses_rope((jnp.zeros((2, 4, 4, 24), jnp.bfloat16),) * 2, 2)  # hd / 2 = 12
    assert not kvmod.PagedMeta(*(jnp.zeros((2,), jnp.int32),) * 5, backend="xla").fuses_rope(pages, 2)
