"""The Hopper (Mosaic GPU) FlashAttention forward, run in the Mosaic GPU interpreter on CPU and on an H200.

On CPU the kernel runs under `plgpu.force_gpu_interpret_mode()`: the interpreter simulates the three
warpgroups, the TMA copies, the K/V ring barriers and the ping-pong schedule barrier, and checks that every
barrier phase is observed. One construct differs from the GPU build: p @ v is a plain dot instead of a
register-operand wgmma inside `pl.run_state` (the interpreter has neither; see the module docstring), and the
pipelined loop (`MgpuConfig.pipelined`, built on both) runs as the plain loop; the GPU tests cover it.

Every case compares o and lse with `reference()` (float32, HIGHEST) on fresh random inputs and checks that
nothing is NaN or inf. Shapes are small (2-3 s each in the interpreter).
"""

from __future__ import annotations

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import flash_attention as fa
from pallas_kernels import flash_attention_mgpu as mgpu
from pallas_kernels.flash_attention_common import BlockSizes, KernelStatic


def _has_hopper() -> bool:
    device = jax.devices()[0]
    return device.platform == "gpu" and float(getattr(device, "compute_capability", "0")) >= 9.0


def _inputs(batch, q_len, kv_len, hq, hkv, head_dim, seed):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(kq, (batch, q_len, hq, head_dim), jnp.bfloat16),
        jax.random.normal(kk, (batch, kv_len, hkv, head_dim), jnp.bfloat16),
        jax.random.normal(kv, (batch, kv_len, hkv, head_dim), jnp.bfloat16),
    )


def _mosaic_interpreted(q, k, v, *, causal, q_offset):
    """The public entry point's padding + the Mosaic GPU forward, with the kernel run by the interpreter.

    `flash_attention(backend="mosaic_gpu")` refuses to run on a CPU (backend.py), so this calls the jitted
    body behind it; the forced interpret mode is part of jit's cache key.
    """
    head_dim = q.shape[-1]
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()):
        return fa._flash_attention_pallas(  # pylint: disable=protected-access
            q,
            k,
            v,
            q_offset,
            None,
            None,
            causal=causal,
            sm_scale=head_dim**-0.5,
            sliding_window=None,
            logits_soft_cap=None,
            return_lse=True,
            backend="mosaic_gpu",
            block_sizes=BlockSizes.for_head_dim(head_dim),
            static_q_offset=q_offset if causal else 0,
        )


def _check(o, lse, q, k, v, *, causal, q_offset, lse_tol):
    ref_o, ref_lse = fa.reference(q, k, v, causal=causal, q_offset=q_offset, return_lse=True)
    o, lse = np.asarray(o, np.float32), np.asarray(lse)
    assert o.shape == ref_o.shape and lse.shape == ref_lse.shape
    assert np.isfinite(o).all() and np.isfinite(lse).all()
    np.testing.assert_allclose(o, np.asarray(ref_o, np.float32), atol=2e-2, rtol=0)
    np.testing.assert_allclose(lse, np.asarray(ref_lse), atol=lse_tol, rtol=0)


# (batch, q_len, kv_len, hq, hkv, head_dim, causal, q_offset): padded by the entry point to 128-row / 128-key
# tiles, so every case also has padded query rows and a masked key tail.
CASES = [
    pytest.param(1, 200, 200, 2, 2, 64, True, 0, id="causal_T200"),
    pytest.param(1, 192, 192, 2, 2, 64, False, 0, id="full_T192"),
    pytest.param(2, 130, 130, 4, 2, 64, True, 0, id="causal_gqa2_B2"),
    pytest.param(1, 72, 328, 2, 1, 64, True, 256, id="causal_chunk_at_end_gqa2"),
    pytest.param(1, 100, 260, 2, 2, 128, False, 0, id="full_cross_D128"),
]


@pytest.mark.parametrize("batch,q_len,kv_len,hq,hkv,head_dim,causal,q_offset", CASES)
def test_interpreted_entry_point_matches_reference(batch, q_len, kv_len, hq, hkv, head_dim, causal, q_offset):
    q, k, v = _inputs(batch, q_len, kv_len, hq, hkv, head_dim, seed=q_len + kv_len)
    o, lse = _mosaic_interpreted(q, k, v, causal=causal, q_offset=q_offset)
    _check(o, lse, q, k, v, causal=causal, q_offset=q_offset, lse_tol=1e-4)


def _forward_direct(q, k, v, cfg, causal, interpret):
    """mgpu.forward on already tile-aligned inputs (no entry point): lets a test pick the tiles and ring."""
    _, q_len, _, head_dim = q.shape
    st = KernelStatic(
        causal=causal,
        sm_scale=head_dim**-0.5,
        sliding_window=None,
        logits_soft_cap=None,
        q_len=q_len,
        kv_len=k.shape[1],
        has_segments=False,
        blocks=BlockSizes(),
        interpret=False,
        static_q_offset=0,
    )
    return jax.jit(lambda q, k, v: mgpu.forward(q, k, v, st, cfg=cfg, interpret=interpret))(q, k, v)


# 64-key blocks: in a causal CTA the first warpgroup finishes one step before the second (the drain path),
# and a 3-slot ring wraps around more than once.
RING_CASES = [
    pytest.param(mgpu.MgpuConfig(block_q=64, block_kv=64, max_concurrent_steps=3), True, id="causal_bkv64_ring3"),
    pytest.param(mgpu.MgpuConfig(block_q=64, block_kv=64, max_concurrent_steps=2), False, id="full_bkv64_ring2"),
    pytest.param(
        mgpu.MgpuConfig(block_q=128, block_kv=64, max_concurrent_steps=3, q_tiles_fastest=True, split_refill=False),
        True,
        id="causal_bq128_qfast_joint_refill",
    ),
]


@pytest.mark.parametrize("cfg,causal", RING_CASES)
def test_interpreted_ring_and_drain(cfg, causal):
    seq = 512 if cfg.block_q == 128 else 384
    q, k, v = _inputs(1, seq, seq, 2, 2, 64, seed=7)
    o, lse = _forward_direct(q, k, v, cfg, causal, plgpu.InterpretGPUParams())
    _check(o, lse, q, k, v, causal=causal, q_offset=0, lse_tol=1e-4)


def test_rejects_misaligned_lengths_and_bad_configs():
    q, k, v = _inputs(1, 200, 200, 2, 2, 64, seed=0)
    with pytest.raises(ValueError, match="do not fit tiles"):
        _forward_direct(q, k, v, mgpu.MgpuConfig(), True, plgpu.InterpretGPUParams())
    with pytest.raises(ValueError, match="compute_registers"):
        mgpu.MgpuConfig(compute_registers=200)
    with pytest.raises(ValueError, match="multiples of 64"):
        mgpu.MgpuConfig(block_kv=96)


@pytest.mark.gpu
@pytest.mark.skipif(not _has_hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize(
    "cfg,causal",
    RING_CASES
    + [
        pytest.param(mgpu.MgpuConfig(), True, id="plain_causal"),
        pytest.param(mgpu.MgpuConfig(), False, id="plain_full"),
        pytest.param(mgpu.MgpuConfig(pipelined=True, split_refill=True), True, id="pipelined_causal"),
        pytest.param(mgpu.MgpuConfig(pipelined=True, split_refill=True), False, id="pipelined_full"),
    ],
)
def test_gpu_forward_matches_reference(cfg, causal):
    q, k, v = _inputs(2, 1024, 1024, 4, 2, 128, seed=11)
    o, lse = _forward_direct(q, k, v, cfg, causal, None)
    _check(o, lse, q, k, v, causal=causal, q_offset=0, lse_tol=5e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not _has_hopper(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("batch,q_len,kv_len,hq,hkv,head_dim,causal,q_offset", CASES)
def test_gpu_entry_point_matches_reference(batch, q_len, kv_len, hq, hkv, head_dim, causal, q_offset):
    q, k, v = _inputs(batch, q_len, kv_len, hq, hkv, head_dim, seed=q_len + kv_len)
    o, lse = fa.flash_attention(q, k, v, causal=causal, q_offset=q_offset, return_lse=True, backend="mosaic_gpu")
    _check(o, lse, q, k, v, causal=causal, q_offset=q_offset, lse_tol=5e-3)
