"""Paged decode attention: one new query token per sequence against a paged KV cache.

Data flow (Triton / interpret backends):

    q [B, Hq, D] --reshape/pad--> q [B, Hkv, Gp, D]      (Gp = G = Hq/Hkv rounded up to a power of 2, >= 16)
    grid (B, Hkv, num_splits): program (b, h, s) walks the pages of sequence b that fall in split s,
        `pages_per_block` pages at a time, gathering each page of KV head h once for all G query heads
        of its group (q tile [Gp, D] x K tile [block_tokens, D]^T on the tensor cores), online softmax.
    num_splits == 1: the kernel normalises and writes [B, Hkv, Gp, D] in q's dtype.
    num_splits  > 1: each split writes its unnormalised accumulator plus running max / sum (base-2 logits),
        and `_merge_splits` combines them exactly (log-sum-exp merge) in a small XLA reduction.

Quantised pages (int8 / float8_e4m3fn) carry one float32 scale per token per head; the kernel feeds the
raw values to the tensor cores (int8 and e4m3 convert exactly to bf16/f16) and applies the scales to the
logits columns (K) and to the probabilities (V), which is exactly dequantise-then-attend.
Tokens at positions >= length are loaded masked (as zeros), so stale or NaN data in unused page slots
never reaches the output.

Attention sinks (`sinks` [Hq], gpt-oss; pallas_kernels/paged_common.py): one more logit per query head in each
softmax denominator, folded in after the page loop, or into the split-K merge.

Sliding window (`window`, static): the query at position length - 1 sees keys in [length - window, length).
The page loop starts at the block holding key length - window, so pages wholly before the window are never
read (the engine may already have given them back: their table entries can point anywhere); keys before the
window inside the first block are loaded masked, like those past the length.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.backend import out_struct, resolve_backend
from pallas_kernels.paged_common import (
    FLOAT_PAGE_DTYPES,
    add_sink,
    check_triton_params,
    dequantize_pages,
    softcap_scores,
    softmax_with_sinks,
    validate_pages,
    validate_sinks,
    validate_softcap,
    validate_window,
)

LOG2E = math.log2(math.e)
# Finite so that exp2(mask - max) is exactly 0 and never NaN, even for rows with no valid key yet.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class PagedAttentionConfig:
    """Tile sizes for the decode kernel (a static argument). Defaults: the best of an H200 sweep.

    Attributes:
        block_tokens: KV tokens per inner-loop step; a step gathers max(1, block_tokens // page_size) pages.
        num_splits: split-K factor over the page list; None picks one from batch size and SM count.
        num_warps: Triton warps per program.
        num_stages: Triton software-pipelining depth of the page loop.
    """

    block_tokens: int = 64
    num_splits: int | None = None
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self):
        if not _is_pow2(self.block_tokens) or self.block_tokens < 16:
            raise ValueError(f"block_tokens must be a power of 2 >= 16, got {self.block_tokens}")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"num_splits must be >= 1 or None, got {self.num_splits}")
        check_triton_params(self.num_warps, self.num_stages)

    def pages_per_block(self, page_size: int) -> int:
        return max(1, self.block_tokens // page_size)


def _num_sms() -> int:
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def choose_num_splits(config: PagedAttentionConfig, batch: int, num_kv_heads: int, num_blocks: int) -> int:
    """Split-K factor: enough programs to fill the GPU about twice, each still a few blocks long.

    Measured on an H200 (benchmarks/kernels_paged.py, block_tokens 64, 4 stages): B=64 Hkv=8 ctx 4096 ran
    best unsplit (274 us vs 290 us with 2 splits); B=8 ctx 8192 best with 8 splits (82 us; 16: 89, 32: 96).
    """
    if config.num_splits is not None:
        return max(1, min(config.num_splits, num_blocks))
    programs = batch * num_kv_heads
    want = max(1, -(-2 * _num_sms() // programs))
    most = max(1, num_blocks // 4)  # keep >= 4 page blocks per split so the loop can pipeline
    return _next_pow2(min(want, most)) if min(want, most) > 1 else 1


# ---------------------------------------------------------------------------------------------------------
# Kernel body.
# ---------------------------------------------------------------------------------------------------------
def load_kv_block(pages_ref, scales_ref, pages, first_token, length, page_size, lo=None):
    """Gathers `pages` [n] of one KV head as a [n * page_size, D] tile, zero outside [lo, length); plus scales.

    pages_ref is one head's pages flattened to token rows, [num_pages * page_size, D]; row = page * ps + offset.
    All-array indices (rows [N, 1] x cols [1, D]) keep the gather expressible in interpret mode too.
    """
    n = pages.shape[0]
    head_dim = pages_ref.shape[-1]
    offset = jnp.arange(page_size)[None, :]
    rows = (pages[:, None] * page_size + offset).reshape(n * page_size)  # [N] token rows
    token = (first_token + jnp.arange(n)[:, None] * page_size + offset).reshape(n * page_size)  # [N]
    valid = token < length if lo is None else (token < length) & (token >= lo)
    cols = jnp.arange(head_dim)[None, :]
    mask = jnp.broadcast_to(valid[:, None], (n * page_size, head_dim))
    zero = 0 if jnp.issubdtype(pages_ref.dtype, jnp.integer) else 0.0
    tile = pltriton.load(pages_ref.at[rows[:, None], cols], mask=mask, other=zero)  # [N, D]
    scales = None
    if scales_ref is not None:
        scales = pltriton.load(scales_ref.at[rows], mask=valid, other=0.0)  # [N]
    return tile, scales, valid


def attend_block(q, k, v, k_scale, v_scale, mask, carry, *, scale_log2, compute_dtype, softcap=None):
    """One online-softmax step in base 2. q [M, D], k/v [N, D], scales [N] or None, mask [M, N] bool.
    softcap: scores s (already scaled) become softcap * tanh(s / softcap) (Gemma 2), or None."""
    acc, m_prev, l_prev = carry  # [M, D] f32, [M] f32, [M] f32
    k = k.astype(compute_dtype)
    # Triton's default for float32 operands is TF32; float32 pages ask for full IEEE products.
    precision = jax.lax.Precision.HIGHEST if jnp.dtype(compute_dtype) == jnp.float32 else None
    logits = jax.lax.dot_general(
        q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )  # [M, N]
    if k_scale is not None:
        logits = logits * k_scale[None, :]
    if softcap is not None:
        logits = softcap * LOG2E * jnp.tanh(logits * (scale_log2 / LOG2E / softcap))
    logits = jnp.where(mask, logits if softcap is not None else logits * scale_log2, MASK_VALUE)
    m_new = jnp.maximum(m_prev, logits.max(axis=-1))
    alpha = jnp.exp2(m_prev - m_new)
    p = jnp.exp2(logits - m_new[:, None])  # [M, N]
    l_new = l_prev * alpha + p.sum(axis=-1)
    if v_scale is not None:
        p = p * v_scale[None, :]
    pv = jax.lax.dot_general(
        p.astype(compute_dtype),
        v.astype(compute_dtype),
        (((1,), (0,)), ((), ())),
        precision=precision,
        preferred_element_type=jnp.float32,
    )  # [M, D]
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_new


def _decode_kernel(
    lengths_ref,  # [B] int32, whole array
    block_tables_ref,  # [num_splits * pages_per_split] int32, row b
    q_ref,  # [Gp, D] compute dtype
    k_pages_ref,  # [num_pages * page_size, D], KV head h
    v_pages_ref,  # [num_pages * page_size, D], KV head h
    k_scales_ref,  # [num_pages * page_size] f32, KV head h (None for float pages)
    v_scales_ref,  # [num_pages * page_size] f32, KV head h (None for float pages)
    sinks_ref,  # [Gp] f32 base-2 sink logits of the group's query heads (None without sinks)
    o_ref,  # [Gp, D]: q dtype (one split) or f32 unnormalised accumulator (split-K)
    m_ref,  # [Gp] f32 running max of base-2 logits (None without split-K)
    l_ref,  # [Gp] f32 running softmax denominator (None without split-K)
    *,
    scale_log2: float,
    page_size: int,
    pages_per_block: int,
    pages_per_split: int,
    compute_dtype,
    window: int | None,
    softcap: float | None,
):
    b, split = pl.program_id(0), pl.program_id(2)
    block_tokens = pages_per_block * page_size
    length = lengths_ref[b]
    q = q_ref[...]  # [Gp, D]
    rows, head_dim = q.shape

    first_page = split * pages_per_split
    lo = None if window is None else jnp.maximum(length - window, 0)  # first key inside the window
    if window is not None:  # skip whole blocks before the window, keeping block starts aligned within the split
        skip = jnp.maximum(lo // page_size - first_page, 0) // pages_per_block * pages_per_block
        first_page = first_page + skip
    end_page = jnp.minimum(split * pages_per_split + pages_per_split, pl.cdiv(length, page_size))
    num_steps = pl.cdiv(jnp.maximum(end_page - first_page, 0), pages_per_block)

    def body(i, carry):
        page0 = first_page + i * pages_per_block
        pages = block_tables_ref[pl.ds(page0, pages_per_block)]  # [pages_per_block]
        first_token = page0 * page_size
        k, ks, valid = load_kv_block(k_pages_ref, k_scales_ref, pages, first_token, length, page_size, lo)
        v, vs, _ = load_kv_block(v_pages_ref, v_scales_ref, pages, first_token, length, page_size, lo)
        mask = jnp.broadcast_to(valid[None, :], (rows, block_tokens))
        kw = dict(scale_log2=scale_log2, compute_dtype=compute_dtype, softcap=softcap)
        return attend_block(q, k, v, ks, vs, mask, carry, **kw)

    carry = (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    acc, m, l = jax.lax.fori_loop(0, num_steps, body, carry)
    if m_ref is None:
        if sinks_ref is not None:
            acc, m, l = add_sink(acc, m, l, sinks_ref[...])
        l_safe = jnp.where(l > 0, l, 1.0)
        o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
    else:
        o_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l


# ---------------------------------------------------------------------------------------------------------
# pallas_call builder.
# ---------------------------------------------------------------------------------------------------------
def _build_decode_call(
    q4,
    k_pages,
    v_pages,
    k_scales,
    v_scales,
    block_tables,
    lengths,
    sinks,
    *,
    sm_scale,
    config,
    num_splits,
    interpret,
    out_dtype,
    window,
    softcap,
):
    """q4 [B, Hkv, Gp, D] (compute dtype); block_tables [B, num_splits * pages_per_split] (padded); sinks
    [Hkv, Gp] f32 base-2 or None (folded in by the kernel when unsplit, else by the caller's merge)."""
    batch, num_kv_heads, rows, head_dim = q4.shape
    _, num_pages, page_size, _ = k_pages.shape
    pages_per_block = config.pages_per_block(page_size)
    pages_per_split = block_tables.shape[1] // num_splits
    kernel = functools.partial(
        _decode_kernel,
        scale_log2=sm_scale * LOG2E,
        page_size=page_size,
        pages_per_block=pages_per_block,
        pages_per_split=pages_per_split,
        compute_dtype=q4.dtype,
        window=window,
        softcap=softcap,
    )
    slots = num_pages * page_size
    page_spec = pl.BlockSpec((None, slots, head_dim), lambda b, h, s: (h, 0, 0))
    scale_spec = pl.BlockSpec((None, slots), lambda b, h, s: (h, 0))
    in_specs = [
        pl.BlockSpec((batch,), lambda b, h, s: (0,)),
        pl.BlockSpec((None, block_tables.shape[1]), lambda b, h, s: (b, 0)),
        pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0)),
        page_spec,
        page_spec,
        None if k_scales is None else scale_spec,
        None if v_scales is None else scale_spec,
        None if sinks is None or num_splits > 1 else pl.BlockSpec((None, rows), lambda b, h, s: (h, 0)),
    ]
    out = functools.partial(out_struct, inputs=(q4, k_pages, v_pages, block_tables, lengths))
    if num_splits == 1:
        out_shape = [out(q4.shape, out_dtype), None, None]
        out_specs = [pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0)), None, None]
    else:
        part = (num_splits, batch, num_kv_heads, rows)
        out_shape = [
            out(part + (head_dim,), jnp.float32),
            out(part, jnp.float32),
            out(part, jnp.float32),
        ]
        row_spec = pl.BlockSpec((None, None, None, rows), lambda b, h, s: (s, b, h, 0))
        out_specs = [
            pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, s: (s, b, h, 0, 0)),
            row_spec,
            row_spec,
        ]
    return pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        name=f"paged_decode_ps{page_size}_bt{config.block_tokens}_s{num_splits}",
    )(
        lengths,
        block_tables,
        q4,
        *flatten_pages(k_pages, v_pages, k_scales, v_scales),
        None if num_splits > 1 else sinks,
    )


def flatten_pages(k_pages, v_pages, k_scales, v_scales):
    """[Hkv, P, ps, D] pages and [Hkv, P, ps] scales -> token-row views [Hkv, P*ps, D] / [Hkv, P*ps] (free)."""
    hkv, num_pages, page_size, head_dim = k_pages.shape
    slots = num_pages * page_size
    flat = [k_pages.reshape(hkv, slots, head_dim), v_pages.reshape(hkv, slots, head_dim)]
    flat += [None if s is None else s.reshape(hkv, slots) for s in (k_scales, v_scales)]
    return flat


def merge_splits(acc, m, l, sink2=None):
    """Exact merge of split-K partials. acc [S, ..., D] f32, m/l [S, ...] base-2 max / sums -> [..., D];
    sink2 [...] (optional): base-2 sink logits, one more term of each denominator."""
    m_all = m.max(axis=0) if sink2 is None else jnp.maximum(m.max(axis=0), sink2)  # [...]
    w = jnp.exp2(m - m_all[None])  # [S, ...]
    l_all = (w * l).sum(axis=0) + (0.0 if sink2 is None else jnp.exp2(sink2 - m_all))
    o = (w[..., None] * acc).sum(axis=0)
    return jnp.where(l_all[..., None] > 0, o / jnp.where(l_all > 0, l_all, 1.0)[..., None], 0.0)


def compute_dtype_for(q_dtype, page_dtype):
    """Dtype the tensor cores see: the page dtype for float pages, else q's 16-bit dtype (bf16 default)."""
    if jnp.dtype(page_dtype) in FLOAT_PAGE_DTYPES:
        return jnp.dtype(page_dtype)
    return jnp.dtype(q_dtype) if jnp.dtype(q_dtype) in (jnp.bfloat16, jnp.float16) else jnp.dtype(jnp.bfloat16)


def _paged_pallas(
    q,
    k_pages,
    v_pages,
    block_tables,
    lengths,
    k_scales,
    v_scales,
    sinks,
    *,
    sm_scale,
    config,
    interpret,
    window,
    softcap,
):
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    rows = max(16, _next_pow2(group))
    pages_per_block = config.pages_per_block(page_size)
    num_blocks = -(-block_tables.shape[1] // pages_per_block)
    num_splits = choose_num_splits(config, batch, num_kv_heads, num_blocks)
    pages_per_split = -(-num_blocks // num_splits) * pages_per_block
    pad_pages = num_splits * pages_per_split - block_tables.shape[1]
    block_tables = jnp.pad(block_tables, ((0, 0), (0, pad_pages)))  # padding is never read unmasked
    q4 = q.reshape(batch, num_kv_heads, group, head_dim).astype(compute_dtype_for(q.dtype, k_pages.dtype))
    q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    if sinks is not None:  # [Hq] -> base-2 [Hkv, Gp]
        sinks = jnp.pad(sinks.astype(jnp.float32).reshape(num_kv_heads, group) * LOG2E, ((0, 0), (0, rows - group)))
    o, m, l = _build_decode_call(
        *(q4, k_pages, v_pages, k_scales, v_scales, block_tables, lengths, sinks),
        sm_scale=sm_scale,
        config=config,
        num_splits=num_splits,
        interpret=interpret,
        out_dtype=q.dtype,
        window=window,
        softcap=softcap,
    )
    if num_splits > 1:
        o = merge_splits(o, m, l, None if sinks is None else sinks[None])
    return o[:, :, :group, :].reshape(batch, num_q_heads, head_dim).astype(q.dtype)


# ---------------------------------------------------------------------------------------------------------
# Validation, public entry point and reference.
# ---------------------------------------------------------------------------------------------------------
def _validate(q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales):
    if q.ndim != 3:
        raise ValueError(f"paged_attention: q must be [B, Hq, D], got {q.shape}")
    if jnp.dtype(q.dtype) not in FLOAT_PAGE_DTYPES:
        raise ValueError(f"paged_attention: q dtype must be bf16/f16/f32, got {q.dtype}")
    batch, q_heads, head_dim = q.shape
    validate_pages("paged_attention", q_heads, head_dim, k_pages, v_pages, k_scales, v_scales)
    if block_tables.ndim != 2 or block_tables.shape[0] != batch or block_tables.dtype != jnp.int32:
        raise ValueError(
            f"paged_attention: block_tables must be int32 [B={batch}, max_blocks], got "
            f"{block_tables.shape} {block_tables.dtype}"
        )
    if lengths.shape != (batch,) or lengths.dtype != jnp.int32:
        raise ValueError(f"paged_attention: lengths must be int32 [{batch}], got {lengths.shape} {lengths.dtype}")


@functools.partial(jax.jit, static_argnames=("sm_scale", "backend", "config", "window", "logit_softcap"))
def paged_attention(
    q,
    k_pages,
    v_pages,
    block_tables,
    lengths,
    *,
    sm_scale=None,
    k_scales=None,
    v_scales=None,
    backend=None,
    config: PagedAttentionConfig = PagedAttentionConfig(),
    window: int | None = None,
    logit_softcap: float | None = None,
    sinks=None,
):
    """Decode attention of one query token per sequence over a paged KV cache.

    Args:
        q: [B, Hq, D] queries (bf16/f16/f32).
        k_pages, v_pages: [Hkv, num_pages, page_size, D] pages (bf16/f16/f32, or int8/float8_e4m3fn with scales).
        block_tables: [B, max_blocks] int32 page ids of each sequence, in order.
        lengths: [B] int32 KV lengths (the new token's KV already written); 0 gives a zero output.
        sm_scale: logit scale, default 1/sqrt(D).
        k_scales, v_scales: [Hkv, num_pages, page_size] float32 per-token scales, for quantised pages only.
        backend: None, "triton", "interpret" or "xla" (see pallas_kernels.backend).
        config: tile sizes (static).
        window: sliding window (static): the query sees the last `window` keys only; None: all of them.
        logit_softcap: scaled scores s -> cap * tanh(s / cap) before the softmax (static; Gemma 2), or None.
        sinks: [Hq] float attention-sink logits (gpt-oss; paged_common.py), or None.

    Returns:
        [B, Hq, D] in q's dtype.
    """
    _validate(q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales)
    validate_window("paged_attention", window)
    validate_softcap("paged_attention", logit_softcap)
    validate_sinks("paged_attention", sinks, q.shape[1])
    sm_scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    resolved = resolve_backend(backend, "paged_attention")
    if resolved == "xla":
        kw = dict(sm_scale=sm_scale, k_scales=k_scales, v_scales=v_scales, window=window, logit_softcap=logit_softcap)
        from pallas_kernels.paged_attention_xla import decode_attention  # which imports this module

        return decode_attention(q, k_pages, v_pages, block_tables, lengths, **kw, sinks=sinks).astype(q.dtype)
    if resolved == "mosaic_gpu":
        raise ValueError("paged_attention: no mosaic_gpu kernel yet; use backend='triton'")
    if not _is_pow2(q.shape[-1]) or q.shape[-1] < 16:
        raise ValueError(f"paged_attention: the Pallas kernel needs a power-of-2 head_dim >= 16, got {q.shape[-1]}")
    return _paged_pallas(
        *(q, k_pages, v_pages, block_tables, lengths, k_scales, v_scales, sinks),
        sm_scale=sm_scale,
        config=config,
        interpret=resolved == "interpret",
        window=window,
        softcap=logit_softcap,
    )


def reference(
    q,
    k_pages,
    v_pages,
    block_tables,
    lengths,
    *,
    sm_scale=None,
    k_scales=None,
    v_scales=None,
    backend=None,
    window=None,
    logit_softcap=None,
    sinks=None,
):
    """Plain-jnp float32 decode attention gathering whole page lists; same contract as `paged_attention`."""
    del backend
    batch, q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    k = dequantize_pages(k_pages, k_scales)[:, block_tables]  # [Hkv, B, max_blocks, ps, D]
    v = dequantize_pages(v_pages, v_scales)[:, block_tables]
    k = k.reshape(num_kv_heads, batch, -1, head_dim)  # [Hkv, B, L, D]
    v = v.reshape(num_kv_heads, batch, -1, head_dim)
    valid = jnp.arange(k.shape[2])[None, :] < lengths[:, None]  # [B, L]
    if window is not None:
        valid &= jnp.arange(k.shape[2])[None, :] >= lengths[:, None] - window
    k = jnp.where(valid[None, :, :, None], k, 0.0)  # unused slots may hold NaN
    v = jnp.where(valid[None, :, :, None], v, 0.0)
    qg = q.astype(jnp.float32).reshape(batch, num_kv_heads, q_heads // num_kv_heads, head_dim)
    logits = jnp.einsum("bhgd,hbld->bhgl", qg, k, precision=jax.lax.Precision.HIGHEST) * sm_scale
    logits = softcap_scores(logits, logit_softcap)
    logits = jnp.where(valid[:, None, None, :], logits, -jnp.inf)
    if sinks is not None:
        p = softmax_with_sinks(logits, sinks.reshape(num_kv_heads, -1))
        o = jnp.einsum("bhgl,hbld->bhgd", p, v, precision=jax.lax.Precision.HIGHEST)
        return o.reshape(batch, q_heads, head_dim)
    m = jnp.max(logits, axis=-1, keepdims=True)
    p = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))
    denom = p.sum(axis=-1, keepdims=True)
    o = jnp.einsum("bhgl,hbld->bhgd", p, v, precision=jax.lax.Precision.HIGHEST)
    o = jnp.where(denom > 0, o / jnp.where(denom > 0, denom, 1.0), 0.0)
    return o.reshape(batch, q_heads, head_dim)
