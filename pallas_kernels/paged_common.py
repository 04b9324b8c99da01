"""Pieces shared by the paged attention kernels (paged_attention.py, ragged_paged_attention.py): validation of the
paged KV operands and the static options, page dequantisation, and attention sinks.

Attention sinks (gpt-oss): a learned logit per query head that joins every row's softmax denominator but carries
no value, so a head can put weight "nowhere":

    p_j = exp(s_j) / (sum_i exp(s_i) + exp(sink_h)),   out = sum_j p_j v_j

The sink is in the scaled-score domain (added after sm_scale and any soft-capping). The kernels fold it in once,
after their page loop (`add_sink`), as a key with a zero value vector; split-K partials get it in their merge.
"""

from __future__ import annotations

import jax.numpy as jnp

FLOAT_PAGE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
QUANT_PAGE_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))


def check_triton_params(num_warps: int, num_stages: int) -> None:
    """Shared validation of the Triton launch parameters of the paged kernels' configs."""
    if num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps must be a power of 2 <= 16, got {num_warps}")
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")


def validate_pages(name, q_heads, head_dim, k_pages, v_pages, k_scales, v_scales):
    """Shared checks of the paged KV operands; returns nothing, raises ValueError."""
    if k_pages.ndim != 4 or v_pages.ndim != 4:
        raise ValueError(
            f"{name}: k_pages/v_pages must be [Hkv, num_pages, page_size, D], got {k_pages.shape} and {v_pages.shape}"
        )
    if k_pages.shape != v_pages.shape or k_pages.dtype != v_pages.dtype:
        raise ValueError(
            f"{name}: k_pages {k_pages.shape} {k_pages.dtype} and v_pages {v_pages.shape} {v_pages.dtype} differ"
        )
    num_kv_heads, _, page_size, page_dim = k_pages.shape
    if page_dim != head_dim:
        raise ValueError(f"{name}: q head_dim {head_dim} != page head_dim {page_dim}")
    if num_kv_heads == 0 or q_heads % num_kv_heads:
        raise ValueError(f"{name}: Hq={q_heads} is not a multiple of Hkv={num_kv_heads}")
    if page_size <= 0 or page_size & (page_size - 1):
        raise ValueError(f"{name}: page_size must be a power of 2, got {page_size}")
    dtype = jnp.dtype(k_pages.dtype)
    if dtype in FLOAT_PAGE_DTYPES:
        if k_scales is not None or v_scales is not None:
            raise ValueError(f"{name}: scales given for float pages of dtype {dtype}")
    elif dtype in QUANT_PAGE_DTYPES:
        if k_scales is None or v_scales is None:
            raise ValueError(f"{name}: {dtype} pages need both k_scales and v_scales")
        for s_name, s in (("k_scales", k_scales), ("v_scales", v_scales)):
            if s.shape != k_pages.shape[:3] or s.dtype != jnp.float32:
                raise ValueError(f"{name}: {s_name} must be float32 {k_pages.shape[:3]}, got {s.shape} {s.dtype}")
    else:
        raise ValueError(f"{name}: unsupported page dtype {dtype}")


def validate_ragged(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs, k_scales, v_scales):
    """Operand checks of ragged_paged_attention; raises ValueError."""
    name = "ragged_paged_attention"
    if q.ndim != 3:
        raise ValueError(f"{name}: q must be [T, Hq, D], got {q.shape}")
    if q.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise ValueError(f"{name}: q dtype must be bf16/f16/f32, got {q.dtype}")
    validate_pages(name, q.shape[1], q.shape[2], k_pages, v_pages, k_scales, v_scales)
    validate_ragged_rows(name, block_tables, kv_lens, cu_q_lens, num_seqs)


def validate_ragged_rows(name: str, block_tables, kv_lens, cu_q_lens, num_seqs) -> None:
    """The row operands every ragged kernel takes (block tables, KV lengths, query offsets, live rows); raises
    ValueError naming `name`."""
    if block_tables.ndim != 2 or block_tables.dtype != jnp.int32:
        raise ValueError(
            f"{name}: block_tables must be int32 [S, max_blocks], got {block_tables.shape} {block_tables.dtype}"
        )
    num_slots = block_tables.shape[0]
    if kv_lens.shape != (num_slots,) or kv_lens.dtype != jnp.int32:
        raise ValueError(f"{name}: kv_lens must be int32 [{num_slots}], got {kv_lens.shape} {kv_lens.dtype}")
    if cu_q_lens.shape != (num_slots + 1,) or cu_q_lens.dtype != jnp.int32:
        raise ValueError(f"{name}: cu_q_lens must be int32 [{num_slots + 1}], got {cu_q_lens.shape} {cu_q_lens.dtype}")
    if jnp.shape(num_seqs) not in ((), (1,)) or jnp.result_type(num_seqs) != jnp.int32:
        raise ValueError(
            f"{name}: num_seqs must be an int32 scalar, got {jnp.shape(num_seqs)} {jnp.result_type(num_seqs)}"
        )


def softcap_scores(scores, cap):
    """Gemma 2's attention soft-capping of scaled scores: cap * tanh(scores / cap); the identity for None."""
    return scores if cap is None else cap * jnp.tanh(scores / cap)


def validate_softcap(name: str, cap) -> None:
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0):
        raise ValueError(f"{name}: logit_softcap must be None or a positive number, got {cap!r}")


def validate_window(name: str, window) -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"{name}: window must be None or a positive int, got {window!r}")


def validate_sinks(name: str, sinks, q_heads: int) -> None:
    """sinks: None, or one float logit per query head, [Hq]."""
    if sinks is None:
        return
    if jnp.shape(sinks) != (q_heads,) or not jnp.issubdtype(jnp.result_type(sinks), jnp.floating):
        raise ValueError(
            f"{name}: sinks must be a float array [Hq={q_heads}], got {jnp.shape(sinks)} {jnp.result_type(sinks)}"
        )


def dequantize_pages(pages, scales):
    """[Hkv, P, ps, D] pages (+ [Hkv, P, ps] scales or None) -> float32 values."""
    pages = pages.astype(jnp.float32)
    return pages if scales is None else pages * scales[..., None]


def add_sink(acc, m, l, sink2):
    """Folds a sink into an online-softmax state (base 2): acc [M, D], running max m [M] and sum l [M], sink
    logits sink2 [M] (already times log2(e)); the sink is one more key whose value vector is zero."""
    m_new = jnp.maximum(m, sink2)
    alpha = jnp.exp2(m - m_new)
    return acc * alpha[:, None], m_new, l * alpha + jnp.exp2(sink2 - m_new)


def softmax_with_sinks(logits, sinks):
    """Reference softmax over the last axis of float32 logits [..., L] (-inf where masked) with sink logits
    `sinks` broadcastable to logits[..., 0] (one per head); a row with every key masked comes out zero."""
    sink = jnp.broadcast_to(jnp.asarray(sinks, jnp.float32)[..., None], logits.shape[:-1] + (1,))
    m = jnp.maximum(jnp.max(logits, axis=-1, keepdims=True), sink)
    p = jnp.exp(logits - m)
    return p / (p.sum(axis=-1, keepdims=True) + jnp.exp(sink - m))
