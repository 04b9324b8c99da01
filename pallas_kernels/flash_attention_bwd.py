"""FlashAttention backward kernels (Triton lowering or interpreter): dq, then dk/dv, from the saved lse.

Nothing [Tq, Tk]-sized is stored: each kernel recomputes its score tiles, p = exp2(s - lse), and uses
ds = p * (dp - delta) with delta = rowsum(o * do) - dlse. The dq kernel walks kv blocks for one query block; the
dk/dv kernel walks query blocks, and the query heads sharing its kv head, so GQA needs no reduction afterwards.
Both reuse the forward's block ranges, so blocks above the diagonal or outside the window are skipped here too.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.backend import out_struct
from pallas_kernels.flash_attention_common import (
    LOG2E,
    KernelStatic,
    apply_mask,
    dot,
    kv_block_range,
    q_block_range,
    scaled_logits,
    soft_cap_grad,
    three_loops,
    visible,
)


def _dq_kernel(
    qoff_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    qseg_ref,
    kseg_ref,
    dq_ref,
    *,
    st: KernelStatic,
    bq: int,
    bk: int,
):
    # qoff_ref: [1] int32    q_ref, do_ref: [bq, D]    k_ref, v_ref: [Tk_pad, D]
    # lse_ref, delta_ref: [bq] f32 (lse is +inf for rows that see nothing, so their p is 0)
    # qseg_ref: [bq] | None  kseg_ref: [Tk_pad] | None    dq_ref: [bq, D]
    qi = pl.program_id(0)
    q_off = qoff_ref[0]
    q, do = q_ref[...], do_ref[...]
    lse2 = lse_ref[...] * LOG2E
    delta = delta_ref[...]
    q_first = q_off + qi * bq
    q_last = q_off + jnp.minimum(qi * bq + bq, st.q_len) - 1
    qpos = q_first + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    qseg = qseg_ref[...][:, None] if st.has_segments else None
    check_kv_len = st.kv_len % bk != 0

    def body(kb, dq, masked):  # dq: [bq, D] f32
        kv_slice = pl.ds(kb * bk, bk)
        k = k_ref[kv_slice, :]
        s = scaled_logits(dot(q, k, trans_b=True), st)  # [bq, bk]
        cap_grad = None if st.logits_soft_cap is None else soft_cap_grad(s, st)
        if masked:
            kpos = kb * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
            kseg = kseg_ref[kv_slice][None, :] if st.has_segments else None
            s = apply_mask(s, visible(qpos, kpos, qseg, kseg, st, check_kv_len))
        p = jnp.exp2(s - lse2[:, None])
        dp = dot(do, v_ref[kv_slice, :], trans_b=True)  # [bq, bk]
        ds = p * (dp - delta[:, None])
        if cap_grad is not None:
            ds = ds * cap_grad
        return dq + dot(ds.astype(k.dtype), k)

    bounds = kv_block_range(q_first, q_last, k_ref.shape[0] // bk, bk, st)
    dq = three_loops(bounds, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * st.sm_scale).astype(dq_ref.dtype)


def _dkv_kernel(
    qoff_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    qseg_ref,
    kseg_ref,
    dk_ref,
    dv_ref,
    *,
    st: KernelStatic,
    bq: int,
    bk: int,
    group: int,
):
    # qoff_ref: [1] int32    q_ref, do_ref: [Tq_pad, G, D] (the G query heads sharing this kv head)
    # k_ref, v_ref: [bk, D]  lse_ref, delta_ref: [G, Tq_pad] f32
    # qseg_ref: [Tq_pad] | None   kseg_ref: [bk] | None   dk_ref, dv_ref: [bk, D]
    # Works on transposed tiles ([bk, bq]) so every product is a plain or B-transposed dot.
    kb = pl.program_id(0)
    q_off = qoff_ref[0]
    k, v = k_ref[...], v_ref[...]
    k_first = kb * bk
    k_last = jnp.minimum(k_first + bk, st.kv_len) - 1
    kpos = k_first + lax.broadcasted_iota(jnp.int32, (bk, bq), 0)
    kseg = kseg_ref[...][:, None] if st.has_segments else None
    bounds = q_block_range(k_first, k_last, q_off, q_ref.shape[0] // bq, bq, st)

    def body(qb, carry, masked, g):
        dk, dv = carry  # [bk, D] f32 each
        q_slice = pl.ds(qb * bq, bq)
        q, do = q_ref[q_slice, g, :], do_ref[q_slice, g, :]
        s_t = scaled_logits(dot(k, q, trans_b=True), st)  # [bk, bq]
        cap_grad = None if st.logits_soft_cap is None else soft_cap_grad(s_t, st)
        if masked:
            qpos = q_off + qb * bq + lax.broadcasted_iota(jnp.int32, (bk, bq), 1)
            qseg = qseg_ref[q_slice][None, :] if st.has_segments else None
            s_t = apply_mask(s_t, visible(qpos, kpos, qseg, kseg, st, False))
        p_t = jnp.exp2(s_t - lse_ref[g, q_slice][None, :] * LOG2E)
        dv = dv + dot(p_t.astype(do.dtype), do)
        dp_t = dot(v, do, trans_b=True)  # [bk, bq]
        ds_t = p_t * (dp_t - delta_ref[g, q_slice][None, :])
        if cap_grad is not None:
            ds_t = ds_t * cap_grad
        return dk + dot(ds_t.astype(q.dtype), q), dv

    def head(g, carry):
        return three_loops(bounds, functools.partial(body, g=g), carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, group, head, (zeros, zeros))
    dk_ref[...] = (dk * st.sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _bwd_params(st: KernelStatic):
    return pltriton.CompilerParams(num_warps=st.blocks.num_warps_bwd, num_stages=st.blocks.num_stages_bwd)


def dq_call(q, k, v, do, lse, delta, q_off, q_seg, k_seg, st: KernelStatic):
    """dq [B, Tq_pad, Hq, D] from padded q/do [B, Tq_pad, Hq, D], k/v [B, Tk_pad, Hkv, D], lse/delta [B, Hq, Tq_pad]."""
    batch, tq_pad, hq, head_dim = q.shape
    tk_pad, group = k.shape[1], hq // k.shape[2]
    bq, bk = st.blocks.block_q_dq, st.blocks.block_k_dq
    q_spec = pl.BlockSpec((None, bq, None, head_dim), lambda i, b, h: (b, i, h, 0))
    kv_spec = pl.BlockSpec((None, tk_pad, None, head_dim), lambda i, b, h: (b, 0, h // group, 0))
    row_spec = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))
    in_specs = [
        pl.BlockSpec((1,), lambda i, b, h: (0,)),
        q_spec,
        kv_spec,
        kv_spec,
        q_spec,
        row_spec,
        row_spec,
        None if q_seg is None else pl.BlockSpec((None, bq), lambda i, b, h: (b, i)),
        None if k_seg is None else pl.BlockSpec((None, tk_pad), lambda i, b, h: (b, 0)),
    ]
    return pl.pallas_call(
        functools.partial(_dq_kernel, st=st, bq=bq, bk=bk),
        grid=(tq_pad // bq, batch, hq),
        in_specs=in_specs,
        out_specs=q_spec,
        out_shape=out_struct(q.shape, q.dtype, (q, k, v, do)),
        compiler_params=_bwd_params(st),
        interpret=st.interpret,
        name="flash_attention_dq",
    )(q_off, q, k, v, do, lse, delta, q_seg, k_seg)


def dkv_call(q, k, v, do, lse, delta, q_off, q_seg, k_seg, st: KernelStatic):
    """(dk, dv) [B, Tk_pad, Hkv, D]; one program per (kv block, batch, kv head) loops over its G query heads."""
    batch, tq_pad, hq, head_dim = q.shape
    tk_pad, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    bq, bk = st.blocks.block_q_dkv, st.blocks.block_k_dkv
    q_spec = pl.BlockSpec((None, tq_pad, group, head_dim), lambda j, b, h: (b, 0, h, 0))
    kv_spec = pl.BlockSpec((None, bk, None, head_dim), lambda j, b, h: (b, j, h, 0))
    row_spec = pl.BlockSpec((None, group, tq_pad), lambda j, b, h: (b, h, 0))
    in_specs = [
        pl.BlockSpec((1,), lambda j, b, h: (0,)),
        q_spec,
        kv_spec,
        kv_spec,
        q_spec,
        row_spec,
        row_spec,
        None if q_seg is None else pl.BlockSpec((None, tq_pad), lambda j, b, h: (b, 0)),
        None if k_seg is None else pl.BlockSpec((None, bk), lambda j, b, h: (b, j)),
    ]
    return pl.pallas_call(
        functools.partial(_dkv_kernel, st=st, bq=bq, bk=bk, group=group),
        grid=(tk_pad // bk, batch, hkv),
        in_specs=in_specs,
        out_specs=[kv_spec, kv_spec],
        out_shape=[out_struct(k.shape, k.dtype, (q, k, v, do)), out_struct(v.shape, v.dtype, (q, k, v, do))],
        compiler_params=_bwd_params(st),
        interpret=st.interpret,
        name="flash_attention_dkv",
    )(q_off, q, k, v, do, lse, delta, q_seg, k_seg)
