"""Exact FlashAttention (forward and backward) as Pallas kernels.

Data flow of the forward pass, one program per (query block, batch, query head):

    q block [bq, D] stays in registers/SMEM
    for kv block in [lo, hi):              # blocks above the diagonal / outside the window are never visited
        s = q @ k_blk.T                     # [bq, bk] fp32, scaled into the log2 domain (exp2 is one MUFU op)
        mask only on boundary blocks        # [lo, full_lo) and [full_hi, hi); the middle loop is mask-free
        m_new = max(m, rowmax(s)); alpha = exp2(m - m_new); p = exp2(s - m_new)
        l = alpha * l + rowsum(p); acc = alpha * acc + p @ v_blk
    o = acc / l; lse = (m + log2 l) * ln2   # one normalisation at the end; lse saved for the backward

The backward recomputes p = exp2(s - lse) tile by tile (nothing [Tq, Tk]-sized is stored): one kernel
accumulates dq over kv blocks, another accumulates dk and dv over query blocks (and over the query heads
that share the kv head, so GQA needs no reduction afterwards).

Non-divisible lengths are padded up to the block size in the wrapper (zero rows), padded keys are masked in
the kernels and padded query rows are sliced off; this keeps every block in bounds for both the Triton
lowering and the interpreter. A query row that sees no key at all (possible with segment ids) returns zeros
and lse = -inf.

Modules: this one owns the public entry point, the Triton/interpret forward kernel, the custom VJP and
`reference()`; flash_attention_bwd.py holds the dq and dk/dv kernels, flash_attention_mgpu.py the Hopper
(Mosaic GPU) forward, flash_attention_mgpu_bwd.py the Hopper backward, flash_attention_common.py the tile
sizes, masks and block ranges they share.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import backend as backend_lib
from pallas_kernels import flash_attention_bwd, flash_attention_mgpu, flash_attention_mgpu_bwd
from pallas_kernels.flash_attention_common import (
    LN2,
    BlockSizes,
    KernelStatic,
    apply_mask,
    backward_inputs,
    dot,
    kv_block_range,
    scaled_logits,
    three_loops,
    visible,
)

__all__ = ["BlockSizes", "flash_attention", "reference"]
_SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


# ---------------------------------------------------------------------------------------------------------
# Forward kernel.
# ---------------------------------------------------------------------------------------------------------


def _fwd_kernel(
    qoff_ref,
    q_ref,
    k_ref,
    v_ref,
    qseg_ref,
    kseg_ref,
    o_ref,
    lse_ref,
    *,
    st: KernelStatic,
    bq: int,
    bk: int,
    num_q_blocks: int,
):
    # qoff_ref: [1] int32            q_ref: [bq, D]          k_ref, v_ref: [Tk_pad, D]
    # qseg_ref: [bq] int32 | None    kseg_ref: [Tk_pad] int32 | None
    # o_ref: [bq, D]                 lse_ref: [bq] fp32 (natural log)
    qi = pl.program_id(0)
    if st.causal:  # heaviest query blocks first so the tail of the grid is short
        qi = num_q_blocks - 1 - qi
    q_off = qoff_ref[0]
    q = q_ref[...]
    head_dim = q.shape[-1]
    q_first = q_off + qi * bq
    q_last = q_off + jnp.minimum(qi * bq + bq, st.q_len) - 1
    qpos = q_first + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    qseg = qseg_ref[...][:, None] if st.has_segments else None
    check_kv_len = st.kv_len % bk != 0

    def body(kb, carry, masked):
        acc, m, l = carry  # [bq, D] f32, [bq] f32, [bq] f32
        kv_slice = pl.ds(kb * bk, bk)
        s = scaled_logits(dot(q, k_ref[kv_slice, :], trans_b=True), st)  # [bq, bk]
        if masked:
            kpos = kb * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
            kseg = kseg_ref[kv_slice][None, :] if st.has_segments else None
            s = apply_mask(s, visible(qpos, kpos, qseg, kseg, st, check_kv_len))
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        if masked:  # a row with nothing visible yet keeps m = -inf; subtract 0 instead of -inf
            m_new_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        else:
            m_new_safe = m_new
        alpha = jnp.exp2(m - m_new_safe)
        p = jnp.exp2(s - m_new_safe[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        v = v_ref[kv_slice, :]
        acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v)
        return acc, m_new, l

    carry = (
        jnp.zeros((bq, head_dim), jnp.float32),
        jnp.full((bq,), -jnp.inf, jnp.float32),
        jnp.zeros((bq,), jnp.float32),
    )
    bounds = kv_block_range(q_first, q_last, k_ref.shape[0] // bk, bk, st)
    acc, m, l = three_loops(bounds, body, carry)
    empty = l == 0.0
    o_ref[...] = (acc / jnp.where(empty, 1.0, l)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, -jnp.inf, (m + jnp.log2(jnp.where(empty, 1.0, l))) * LN2)


def _fwd_call(q, k, v, q_off, q_seg, k_seg, st: KernelStatic):
    """Builds and runs the forward pallas_call on padded inputs.

    q: [B, Tq_pad, Hq, D]; k, v: [B, Tk_pad, Hkv, D]; q_off: [1] int32; q_seg: [B, Tq_pad] | None;
    k_seg: [B, Tk_pad] | None. Returns o [B, Tq_pad, Hq, D] and lse [B, Hq, Tq_pad] fp32.
    """
    batch, tq_pad, hq, head_dim = q.shape
    tk_pad, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    bq, bk = st.blocks.block_q, st.blocks.block_k
    nq = tq_pad // bq
    kernel = functools.partial(_fwd_kernel, st=st, bq=bq, bk=bk, num_q_blocks=nq)
    if st.causal:
        q_block = lambda i, b, h: (b, nq - 1 - i, h, 0)  # noqa: E731
        lse_block = lambda i, b, h: (b, h, nq - 1 - i)  # noqa: E731
        seg_block = lambda i, b, h: (b, nq - 1 - i)  # noqa: E731
    else:
        q_block = lambda i, b, h: (b, i, h, 0)  # noqa: E731
        lse_block = lambda i, b, h: (b, h, i)  # noqa: E731
        seg_block = lambda i, b, h: (b, i)  # noqa: E731
    kv_spec = pl.BlockSpec((None, tk_pad, None, head_dim), lambda i, b, h: (b, 0, h // group, 0))
    in_specs = [
        pl.BlockSpec((1,), lambda i, b, h: (0,)),
        pl.BlockSpec((None, bq, None, head_dim), q_block),
        kv_spec,
        kv_spec,
        None if q_seg is None else pl.BlockSpec((None, bq), seg_block),
        None if k_seg is None else pl.BlockSpec((None, tk_pad), lambda i, b, h: (b, 0)),
    ]
    out_specs = [pl.BlockSpec((None, bq, None, head_dim), q_block), pl.BlockSpec((None, None, bq), lse_block)]
    out_shape = [
        backend_lib.out_struct(q.shape, q.dtype, (q, k, v)),
        backend_lib.out_struct((batch, hq, tq_pad), jnp.float32, (q, k, v)),
    ]
    return pl.pallas_call(
        kernel,
        grid=(nq, batch, hq),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=st.blocks.num_warps, num_stages=st.blocks.num_stages),
        interpret=st.interpret,
        name="flash_attention_fwd",
    )(q_off, q, k, v, q_seg, k_seg)


# ---------------------------------------------------------------------------------------------------------
# Differentiable core on padded inputs.
# ---------------------------------------------------------------------------------------------------------


def _forward(q, k, v, q_off, q_seg, k_seg, st: KernelStatic, fwd_impl: str):
    if fwd_impl == "mosaic_gpu":
        return flash_attention_mgpu.forward(q, k, v, st)
    return _fwd_call(q, k, v, q_off, q_seg, k_seg, st)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _flash_core(q, k, v, q_off, q_seg, k_seg, st: KernelStatic, fwd_impl: str):
    return _forward(q, k, v, q_off, q_seg, k_seg, st, fwd_impl)


def _flash_core_fwd(q, k, v, q_off, q_seg, k_seg, st: KernelStatic, fwd_impl: str):
    o, lse = _forward(q, k, v, q_off, q_seg, k_seg, st, fwd_impl)
    return (o, lse), (q, k, v, q_off, q_seg, k_seg, o, lse)


def _use_mgpu_backward(q, k, st: KernelStatic, fwd_impl: str) -> bool:
    """The Mosaic GPU backward runs after a Mosaic GPU forward when it handles the call."""
    q_multiple, k_multiple = flash_attention_mgpu_bwd.tile_multiples()
    return (
        fwd_impl == "mosaic_gpu"
        and flash_attention_mgpu_bwd.supports(q.dtype, q.shape[-1], st)
        and q.shape[1] % q_multiple == 0
        and k.shape[1] % k_multiple == 0
    )


def _flash_core_bwd(st: KernelStatic, fwd_impl: str, res, cotangents):
    q, k, v, q_off, q_seg, k_seg, o, lse = res
    do, dlse = cotangents  # [B, Tq_pad, Hq, D], [B, Hq, Tq_pad]
    if _use_mgpu_backward(q, k, st, fwd_impl):
        dq, dk, dv = flash_attention_mgpu_bwd.backward(q, k, v, o, lse, do, dlse, st)
        return dq, dk, dv, None, None, None
    # Otherwise the Triton-style kernels (interpreted when st.interpret).
    delta, lse, do = backward_inputs(o, lse, do, dlse, q.dtype)
    dq = flash_attention_bwd.dq_call(q, k, v, do, lse, delta, q_off, q_seg, k_seg, st)
    dk, dv = flash_attention_bwd.dkv_call(q, k, v, do, lse, delta, q_off, q_seg, k_seg, st)
    return dq, dk, dv, None, None, None


_flash_core.defvjp(_flash_core_fwd, _flash_core_bwd)


# ---------------------------------------------------------------------------------------------------------
# Public entry point.
# ---------------------------------------------------------------------------------------------------------


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _fit_blocks(blocks: BlockSizes, q_len: int, kv_len: int) -> BlockSizes:
    """Shrinks tiles for short sequences (a 1-token query needs a 16-row tile, not 128)."""
    fit_q = lambda b: min(b, max(16, _next_pow2(q_len)))  # noqa: E731
    fit_k = lambda b: min(b, max(16, _next_pow2(kv_len)))  # noqa: E731
    return dataclasses.replace(
        blocks,
        block_q=fit_q(blocks.block_q),
        block_k=fit_k(blocks.block_k),
        block_q_dq=fit_q(blocks.block_q_dq),
        block_k_dq=fit_k(blocks.block_k_dq),
        block_q_dkv=fit_q(blocks.block_q_dkv),
        block_k_dkv=fit_k(blocks.block_k_dkv),
    )


def _pad_axis(x, axis: int, size: int):
    if x is None or x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


@functools.partial(
    jax.jit,
    static_argnames=(
        "causal",
        "sm_scale",
        "sliding_window",
        "logits_soft_cap",
        "return_lse",
        "backend",
        "block_sizes",
        "static_q_offset",
    ),
)
def _flash_attention_pallas(
    q,
    k,
    v,
    q_offset,
    q_seg,
    k_seg,
    *,
    causal,
    sm_scale,
    sliding_window,
    logits_soft_cap,
    return_lse,
    backend,
    block_sizes,
    static_q_offset,
):
    _, q_len, _, head_dim = q.shape
    kv_len = k.shape[1]
    blocks = _fit_blocks(block_sizes, q_len, kv_len)
    st = KernelStatic(
        causal=causal,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        q_len=q_len,
        kv_len=kv_len,
        has_segments=q_seg is not None,
        blocks=blocks,
        interpret=backend == "interpret",
        static_q_offset=static_q_offset if causal else 0,
    )  # q_offset is irrelevant without causal
    use_mgpu = backend == "mosaic_gpu" and flash_attention_mgpu.supports(q.dtype, head_dim, st)
    # Pad lengths to a multiple of every tile that will walk them (all powers of two, so the max suffices).
    q_multiple = max(blocks.block_q, blocks.block_q_dq, blocks.block_q_dkv)
    k_multiple = max(blocks.block_k, blocks.block_k_dq, blocks.block_k_dkv)
    if use_mgpu:
        mgpu_q, mgpu_k = flash_attention_mgpu.tile_multiples(head_dim)
        bwd_q, bwd_k = flash_attention_mgpu_bwd.tile_multiples()
        q_multiple, k_multiple = max(q_multiple, mgpu_q, bwd_q), max(k_multiple, mgpu_k, bwd_k)
    tq_pad = -(-q_len // q_multiple) * q_multiple
    tk_pad = -(-kv_len // k_multiple) * k_multiple
    d_pad = max(16, _next_pow2(head_dim))  # zero columns change no dot product; Triton wants powers of two
    q_p = _pad_axis(_pad_axis(q, 1, tq_pad), 3, d_pad)  # [B, Tq_pad, Hq, D_pad]
    k_p = _pad_axis(_pad_axis(k, 1, tk_pad), 3, d_pad)  # [B, Tk_pad, Hkv, D_pad]
    v_p = _pad_axis(_pad_axis(v, 1, tk_pad), 3, d_pad)
    q_off = jnp.asarray(q_offset, jnp.int32).reshape(1)
    o, lse = _flash_core(
        q_p,
        k_p,
        v_p,
        q_off,
        _pad_axis(q_seg, 1, tq_pad),
        _pad_axis(k_seg, 1, tk_pad),
        st,
        "mosaic_gpu" if use_mgpu else "triton",
    )
    o = o[:, :q_len, :, :head_dim]  # [B, Tq, Hq, D]
    if return_lse:
        return o, lse[:, :, :q_len]  # [B, Hq, Tq] fp32, natural log
    return o


def _check_segments(segment_ids, batch: int, q_len: int, kv_len: int):
    """Returns (q_seg [B, Tq], kv_seg [B, Tk]) int32 or (None, None); raises ValueError on bad shapes."""
    if segment_ids is None:
        return None, None
    if isinstance(segment_ids, (tuple, list)):
        if len(segment_ids) != 2:
            raise ValueError("segment_ids must be one [B, T] array or a (q_seg, kv_seg) pair")
        q_seg, kv_seg = segment_ids
    else:
        if q_len != kv_len:
            raise ValueError(
                f"a single segment_ids array needs Tq == Tk (got {q_len} and {kv_len}); "
                "pass a (q_seg, kv_seg) pair instead"
            )
        q_seg = kv_seg = segment_ids
    for name, seg, length in (("q", q_seg, q_len), ("kv", kv_seg, kv_len)):
        if seg.shape != (batch, length) or not jnp.issubdtype(seg.dtype, jnp.integer):
            raise ValueError(
                f"{name} segment ids must be integer [B={batch}, T={length}], got {seg.dtype}{list(seg.shape)}"
            )
    return q_seg.astype(jnp.int32), kv_seg.astype(jnp.int32)


def _validate(q, k, v, causal, sm_scale, q_offset, sliding_window, logits_soft_cap):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [B, T, H, D]; got shapes {q.shape}, {k.shape}, {v.shape}")
    batch, _, hq, head_dim = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {k.shape} and {v.shape}")
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k/v {k.shape} do not match q {q.shape} in batch or head_dim")
    if k.shape[2] < 1 or hq % k.shape[2]:
        raise ValueError(f"Hq={hq} must be a positive multiple of Hkv={k.shape[2]}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in [jnp.dtype(d) for d in _SUPPORTED_DTYPES]:
        raise ValueError(f"q, k, v must share one dtype of bf16/f16/f32, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not 1 <= head_dim <= 256:
        raise ValueError(f"head_dim must be in [1, 256], got {head_dim}")
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool, got {causal!r}")
    if sm_scale is not None and not (isinstance(sm_scale, (int, float)) and sm_scale > 0):
        raise ValueError(f"sm_scale must be a positive float, got {sm_scale!r}")
    if sliding_window is not None:
        if not isinstance(sliding_window, int) or sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive int, got {sliding_window!r}")
        if not causal:
            raise ValueError("sliding_window (keys in (p - window, p]) requires causal=True")
    if logits_soft_cap is not None and not (isinstance(logits_soft_cap, (int, float)) and logits_soft_cap > 0):
        raise ValueError(f"logits_soft_cap must be a positive float, got {logits_soft_cap!r}")
    if isinstance(q_offset, int):
        if q_offset < 0:
            raise ValueError(f"q_offset must be >= 0, got {q_offset}")
    elif jnp.ndim(q_offset) != 0 or not jnp.issubdtype(jnp.result_type(q_offset), jnp.integer):
        raise ValueError(f"q_offset must be an int or an integer scalar array, got {q_offset!r}")


def flash_attention(
    q,
    k,
    v,
    *,
    causal=True,
    sm_scale=None,
    q_offset=0,
    segment_ids=None,
    sliding_window=None,
    logits_soft_cap=None,
    return_lse=False,
    backend=None,
    block_sizes: BlockSizes | None = None,
):
    """Exact softmax attention, tiled so nothing [Tq, Tk]-sized is ever stored; differentiable.

    Args:
        q: [B, Tq, Hq, D] bf16/f16/f32 queries.
        k, v: [B, Tk, Hkv, D] keys and values, same dtype; Hq must be a multiple of Hkv (GQA/MQA).
        causal: query i (at key position q_offset + i) sees keys j <= q_offset + i.
        sm_scale: logit scale, default 1/sqrt(D).
        q_offset: int or int32 scalar array; where the query chunk sits in the key sequence (chunked prefill:
            q_offset = Tk - Tq puts the queries at the end of a longer KV).
        segment_ids: [B, T] int (Tq == Tk) or a (q_seg [B, Tq], kv_seg [B, Tk]) pair; a query sees only keys of
            its own segment (packed variable-length sequences). A row that sees no key returns zeros.
        sliding_window: with causal, the query at p sees keys in (p - window, p].
        logits_soft_cap: logits become cap * tanh(logits / cap) (after sm_scale), as in Gemma 2.
        return_lse: also return the natural-log logsumexp of each row, [B, Hq, Tq] fp32 (-inf for empty rows).
        backend: None (fastest here), "mosaic_gpu", "triton", "interpret" or "xla" (see backend.py).
            "mosaic_gpu" runs the Hopper forward for bf16/f16 with D a multiple of 64, no segments, window or
            soft cap and a Python-int q_offset, and the Triton forward otherwise; after a Mosaic GPU forward
            in bf16 with D = 128 the backward is the Mosaic GPU kernels (flash_attention_mgpu_bwd.py),
            else the Triton kernels.
        block_sizes: tile sizes for the Triton/interpret kernels; default BlockSizes.for_head_dim(D).

    Returns:
        o: [B, Tq, Hq, D] in q's dtype, or (o, lse) when return_lse.

    Raises:
        ValueError: on inconsistent shapes/dtypes, bad options, or a backend this device cannot run.
    """
    backend_name = backend_lib.resolve_backend(backend, "flash_attention")
    _validate(q, k, v, causal, sm_scale, q_offset, sliding_window, logits_soft_cap)
    q_seg, k_seg = _check_segments(segment_ids, q.shape[0], q.shape[1], k.shape[1])
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise ValueError(f"block_sizes must be a BlockSizes, got {type(block_sizes).__name__}")
    sm_scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    cap = None if logits_soft_cap is None else float(logits_soft_cap)
    options = dict(
        causal=causal,
        sm_scale=sm_scale,
        q_offset=q_offset,
        sliding_window=sliding_window,
        logits_soft_cap=cap,
        return_lse=return_lse,
    )
    if backend_name == "xla" or q.shape[1] == 0 or k.shape[1] == 0:
        seg = None if q_seg is None else (q_seg, k_seg)
        return reference(q, k, v, segment_ids=seg, **options)
    # The Mosaic GPU forward specialises on a Python-int q_offset; a traced one takes the Triton kernel.
    static_q_offset = q_offset if backend_name == "mosaic_gpu" and isinstance(q_offset, int) else None
    return _flash_attention_pallas(
        q,
        k,
        v,
        q_offset,
        q_seg,
        k_seg,
        backend=backend_name,
        static_q_offset=static_q_offset,
        block_sizes=block_sizes or BlockSizes.for_head_dim(q.shape[-1]),
        **{key: val for key, val in options.items() if key != "q_offset"},
    )


# ---------------------------------------------------------------------------------------------------------
# Reference.
# ---------------------------------------------------------------------------------------------------------


@functools.partial(
    jax.jit,
    static_argnames=("causal", "sm_scale", "sliding_window", "logits_soft_cap", "return_lse", "backend", "block_sizes"),
)
def reference(
    q,
    k,
    v,
    *,
    causal=True,
    sm_scale=None,
    q_offset=0,
    segment_ids=None,
    sliding_window=None,
    logits_soft_cap=None,
    return_lse=False,
    backend=None,
    block_sizes=None,
):
    """Plain-jnp attention with flash_attention's signature, in float32 at HIGHEST precision.

    `backend` and `block_sizes` are accepted and ignored so the two functions are interchangeable.
    """
    del backend, block_sizes
    batch, q_len, hq, head_dim = q.shape
    kv_len, hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    q32 = q.astype(jnp.float32).reshape(batch, q_len, hkv, hq // hkv, head_dim)  # [B, Tq, Hkv, G, D]
    s = jnp.einsum("bqhgd,bkhd->bhgqk", q32, k.astype(jnp.float32), precision=lax.Precision.HIGHEST) * scale
    if logits_soft_cap is not None:
        s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
    qpos = jnp.asarray(q_offset, jnp.int32) + jnp.arange(q_len)[:, None]  # [Tq, 1]
    kpos = jnp.arange(kv_len)[None, :]  # [1, Tk]
    mask = jnp.ones((1, q_len, kv_len), bool)  # [B or 1, Tq, Tk]
    if causal:
        mask = mask & (kpos <= qpos)
    if sliding_window is not None:
        mask = mask & (kpos > qpos - sliding_window)
    if segment_ids is not None:
        q_seg, k_seg = segment_ids if isinstance(segment_ids, (tuple, list)) else (segment_ids, segment_ids)
        mask = mask & (q_seg[:, :, None] == k_seg[:, None, :])
    s = jnp.where(mask[:, None, None], s, -jnp.inf)  # [B, Hkv, G, Tq, Tk]
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = (
        jnp.einsum(
            "bhgqk,bkhd->bqhgd", p / jnp.where(l == 0, 1.0, l), v.astype(jnp.float32), precision=lax.Precision.HIGHEST
        )
        .reshape(q.shape)
        .astype(q.dtype)
    )
    if not return_lse:
        return o
    lse = jnp.where(l[..., 0] == 0, -jnp.inf, m[..., 0] + jnp.log(jnp.where(l[..., 0] == 0, 1.0, l[..., 0])))
    return o, lse.reshape(batch, hq, q_len)
