"""Hopper FlashAttention backward through Pallas Mosaic GPU (wgmma + TMA + warp specialisation).

Data flow of `backward`: XLA prepares delta = rowsum(o * do) - dlse and lse2 = lse * log2e
(flash_attention_common.backward_inputs), then

  default (`MgpuBwdConfig()`): two kernels, a dk/dv kernel (one CTA per 128 keys of one kv head, walking the
      query blocks of its GQA group) and a dq kernel (one CTA per 128 query rows of one query head, walking the
      key blocks), each with two compute warpgroups and one TMA warpgroup feeding an SMEM ring.

The kernel bodies, their block ranges and masks are in flash_attention_mgpu_bwd_kernels.py; this module holds the
config, the pallas_call builders (SMEM scratch, barriers, grids) and the validated entry point.

`MgpuBwdConfig(fused=True)`: one kernel; after dK/dV, both warpgroups put dS^T in SMEM, meet on a barrier, and
warpgroup w computes dQ[:, w*64 : w*64 + 64] = dS @ K[:, w*64 : w*64 + 64] over all 128 keys, then
TMA-reduce-adds it (fp32) into a zeroed dq buffer. Five matmuls instead of seven, but it measured slower on
an H200 (benchmarks/results/flash_notes.md): the per-step barrier keeps the warpgroups in lockstep.

D must be 128 (the fused path splits dQ's columns in two halves; D = 256 would not fit the registers).
`backward(..., interpret=True)` runs the unfused kernels in the Mosaic GPU interpreter on a CPU.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.experimental.pallas as pl
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.backend import out_struct
from pallas_kernels.flash_attention_common import backward_inputs
from pallas_kernels.flash_attention_mgpu_bwd_kernels import (
    BF16_TILES,
    BLOCK,
    COMPUTE_WGS,
    KV_PER_CTA,
    LOG2E,
    Dims,
    dkv_kernel,
    dq_kernel,
    stage_smem,
)


@dataclasses.dataclass(frozen=True)
class MgpuBwdConfig:
    """Tiles of the Mosaic GPU backward.

    Attributes:
        fused: one kernel for dq, dk, dv (dq TMA-reduce-added in fp32) instead of a dk/dv kernel plus a dq kernel.
        max_concurrent_steps: depth of the dk/dv kernel's Q/dO ring (fused: 2 or 3, else 2 to 4).
        dq_block_kv: keys per step of the dq kernel (64 or 128).
        dq_steps: depth of the dq kernel's K/V ring.
    """

    fused: bool = False
    # H200, B4 S4096 H32 D128, two runs (benchmarks/results/flash_bwd_2026-12-01.json, kernels_2026-12-01_flash.json):
    # 2 slots averaged 424 / 441 TFLOP/s (causal / full), 3 slots 412 / 434.
    max_concurrent_steps: int = 2
    dq_block_kv: int = 64
    dq_steps: int = 3

    def __post_init__(self):
        if not 2 <= self.max_concurrent_steps <= (3 if self.fused else 4):
            raise ValueError(f"max_concurrent_steps out of range: {self}")
        if self.dq_block_kv not in (64, 128) or not 2 <= self.dq_steps <= (4 if self.dq_block_kv == 64 else 2):
            raise ValueError(f"dq_block_kv must be 64 (2-4 steps) or 128 (2 steps): {self}")


def supports(q_dtype, head_dim: int, st) -> bool:
    """Whether this kernel handles a call whose forward ran on Mosaic GPU (`st`: KernelStatic).

    bf16 only: the kernels are dtype-generic, but fp16 gradients have not been checked on a GPU yet.
    """
    return (
        jnp.dtype(q_dtype) == jnp.dtype(jnp.bfloat16)
        and head_dim == 128
        and st.sliding_window is None
        and not st.has_segments
        and st.logits_soft_cap is None
        and st.static_q_offset is not None
    )


def tile_multiples() -> tuple[int, int]:
    """(query, key) lengths must be padded to multiples of these for `backward`."""
    return KV_PER_CTA, KV_PER_CTA


def backward(q, k, v, o, lse, do, dlse, st, cfg: MgpuBwdConfig | None = None, interpret: bool = False):
    """(dq, dk, dv) for padded q/do/o [B, Tq_pad, Hq, D], k/v [B, Tk_pad, Hkv, D], lse/dlse [B, Hq, Tq_pad].

    lse is the forward's natural-log logsumexp; dlse its cotangent. Tq_pad and Tk_pad must be multiples of
    128 (`tile_multiples`); the caller slices the padding off. `interpret` runs the unfused kernels in the
    Mosaic GPU interpreter (CPU tests). It lacks pl.run_state, wgmma with A in registers and TMA reductions,
    so there each product stages A through SMEM into a fresh accumulator (`_mma_add`) and the fused variant
    is refused; masks, block ranges, GQA loops and the barrier protocol are the GPU kernels' own.
    """
    batch, tq_pad, hq, head_dim = q.shape
    tk_pad, hkv = k.shape[1], k.shape[2]
    cfg = cfg or MgpuBwdConfig()
    if interpret and cfg.fused:
        raise ValueError("the fused variant needs TMA reduce-adds, which the Mosaic GPU interpreter lacks")
    if head_dim != 128 or tq_pad % KV_PER_CTA or tk_pad % KV_PER_CTA or hq % hkv:
        raise ValueError(
            f"mosaic_gpu backward needs D = 128, Tq and Tk multiples of {KV_PER_CTA} and "
            f"Hq % Hkv == 0; got q {q.shape}, k {k.shape}"
        )
    delta, lse, do = backward_inputs(o, lse, do, dlse, q.dtype)  # delta [B, Hq, Tq]
    lse2 = lse * LOG2E
    dims = Dims(
        head_dim=head_dim,
        group=hq // hkv,
        steps=cfg.max_concurrent_steps,
        num_q_blocks=-(-st.q_len // BLOCK),
        q_off=st.static_q_offset if st.causal else 0,
        causal=st.causal,
        kv_len=st.kv_len,
        dtype=q.dtype,
        with_dq=cfg.fused,
        interpret=interpret,
    )
    if not cfg.fused:
        dk, dv = _dkv_call(q, k, v, do, lse2, delta, None, st.sm_scale, dims)
        dq_dims = dataclasses.replace(dims, steps=min(cfg.dq_steps, tk_pad // cfg.dq_block_kv))
        return _dq_call(q, k, v, do, lse2, delta, st.sm_scale, cfg.dq_block_kv, dq_dims), dk, dv
    dq_acc = jax.new_ref(jnp.zeros(q.shape, jnp.float32))  # [B, Tq_pad, Hq, D], TMA-reduced into
    dk, dv = _dkv_call(q, k, v, do, lse2, delta, dq_acc, st.sm_scale, dims)
    return (jax.freeze(dq_acc) * st.sm_scale).astype(q.dtype), dk, dv


def _dkv_call(q, k, v, do, lse2, delta, dq_acc, sm_scale, dims: Dims):
    """dk, dv [B, Tk_pad, Hkv, D] (and, fused, dq_acc += dS @ K); one CTA per 128 keys of one kv head."""
    batch, _, _, head_dim = q.shape
    tk_pad, hkv = k.shape[1], k.shape[2]
    s = dims.steps

    def entry(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs):
        dq_ref, dk_ref, dv_ref = refs if dims.with_dq else (None, *refs)
        dq_scratch = (
            (
                plgpu.SMEM((2, KV_PER_CTA, BLOCK), q.dtype, transforms=BF16_TILES),  # dS^T, double-buffered
                plgpu.SMEM(
                    (COMPUTE_WGS, BLOCK, head_dim // COMPUTE_WGS),
                    jnp.float32,  # dQ halves
                    transforms=(plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128)),
                ),
            )
            if dims.with_dq
            else (None, None)
        )
        pl.run_scoped(
            lambda *scoped: dkv_kernel(
                q_ref,
                k_ref,
                v_ref,
                do_ref,
                lse_ref,
                delta_ref,
                dq_ref,
                dk_ref,
                dv_ref,
                scoped,
                sm_scale=sm_scale,
                d=dims,
            ),
            (
                plgpu.SMEM((KV_PER_CTA, head_dim), q.dtype, transforms=BF16_TILES),  # K, then dK
                plgpu.SMEM((KV_PER_CTA, head_dim), q.dtype, transforms=BF16_TILES),  # V, then dV
                plgpu.SMEM((s, BLOCK, head_dim), q.dtype, transforms=BF16_TILES),  # Q ring
                plgpu.SMEM((s, BLOCK, head_dim), q.dtype, transforms=BF16_TILES),  # dO ring
                plgpu.SMEM((s, BLOCK), jnp.float32),  # lse2 ring
                plgpu.SMEM((s, BLOCK), jnp.float32),  # delta ring
                *dq_scratch,
                stage_smem(dims, BLOCK),
            ),
            (
                plgpu.Barrier(num_arrivals=2),  # K and V loaded
                plgpu.Barrier(num_arrivals=4, num_barriers=s),  # slot ready: Q, dO, lse2, delta
                plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=s),  # slot consumed
                plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=2),  # fused: dS^T of both warpgroups in SMEM
                plgpu.Barrier(num_arrivals=COMPUTE_WGS),
            ),  # fused: both done reading K (before dK overwrites it)
            collective_axes="wg",
        )

    kv_out = out_struct(k.shape, k.dtype, (q, k, v, do))
    return plgpu.kernel(
        entry,
        out_type=(kv_out, kv_out),
        grid=(tk_pad // KV_PER_CTA, hkv, batch),  # key tiles fastest: co-resident CTAs share Q/dO (and dq_acc)
        grid_names=("kv_seq", "heads", "batch"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if dims.interpret else None,
    )(q, k, v, do, lse2, delta, *(() if dq_acc is None else (dq_acc,)))


def _dq_call(q, k, v, do, lse2, delta, sm_scale, block_kv: int, d: Dims):
    """dq [B, Tq_pad, Hq, D]; one CTA per 128 query rows of one query head, 64 rows per compute warpgroup."""
    batch, tq_pad, hq, head_dim = q.shape
    num_q_tiles = tq_pad // KV_PER_CTA

    def entry(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref):
        pl.run_scoped(
            lambda *scoped: dq_kernel(
                q_ref,
                k_ref,
                v_ref,
                do_ref,
                lse_ref,
                delta_ref,
                dq_ref,
                scoped,
                sm_scale=sm_scale,
                block_kv=block_kv,
                num_q_tiles=num_q_tiles,
                d=d,
            ),
            (
                plgpu.SMEM((COMPUTE_WGS, BLOCK, head_dim), q.dtype, transforms=BF16_TILES),  # Q, then dQ
                plgpu.SMEM((COMPUTE_WGS, BLOCK, head_dim), q.dtype, transforms=BF16_TILES),  # dO
                plgpu.SMEM((COMPUTE_WGS, BLOCK), jnp.float32),  # lse2
                plgpu.SMEM((COMPUTE_WGS, BLOCK), jnp.float32),  # delta
                plgpu.SMEM((d.steps, block_kv, head_dim), q.dtype, transforms=BF16_TILES),  # K ring
                plgpu.SMEM((d.steps, block_kv, head_dim), q.dtype, transforms=BF16_TILES),  # V ring
                stage_smem(d, block_kv),
            ),
            (
                plgpu.Barrier(num_arrivals=4, num_barriers=COMPUTE_WGS),  # Q, dO, lse2, delta of each warpgroup
                plgpu.Barrier(num_arrivals=2, num_barriers=d.steps),  # K and V block ready
                plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=d.steps),
            ),  # slot consumed
            collective_axes="wg",
        )

    return plgpu.kernel(
        entry,
        out_type=out_struct(q.shape, q.dtype, (q, k, v, do)),
        grid=(num_q_tiles, hq, batch),  # query tiles fastest: co-resident CTAs share K/V
        grid_names=("q_seq", "heads", "batch"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if d.interpret else None,
    )(q, k, v, do, lse2, delta)
