"""Pieces shared by the FlashAttention kernels: tile sizes, the static kernel spec, masks and block ranges.

Everything here is traced inside Pallas kernels (Triton lowering or the interpreter) except the two dataclasses,
which are static, hashable arguments.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as pltriton

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes and launch parameters of the Triton kernels (a static, hashable argument).

    Attributes:
        block_q / block_k: forward tiles along queries and keys.
        block_q_dq / block_k_dq: tiles of the dq kernel.
        block_q_dkv / block_k_dkv: tiles of the dk/dv kernel.
        num_warps / num_stages: forward launch parameters; *_bwd for both backward kernels.
    """

    block_q: int = 128
    block_k: int = 64
    block_q_dq: int = 64
    block_k_dq: int = 64
    block_q_dkv: int = 64
    block_k_dkv: int = 64
    num_warps: int = 8
    num_stages: int = 3
    num_warps_bwd: int = 4
    num_stages_bwd: int = 2

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"BlockSizes.{field.name} must be a positive int, got {value!r}")
            if field.name.startswith("block_") and (value < 16 or value & (value - 1)):
                raise ValueError(f"BlockSizes.{field.name} must be a power of two >= 16, got {value}")

    @classmethod
    def for_head_dim(cls, head_dim: int) -> BlockSizes:
        """Defaults that fit registers/SMEM for `head_dim` (measured on an H200, benchmarks/kernels_flash.py)."""
        if head_dim > 128:
            return cls(
                block_q=64,
                block_k=64,
                num_warps=4,
                num_stages=2,
                block_q_dq=32,
                block_k_dq=64,
                block_q_dkv=32,
                block_k_dkv=64,
            )
        return cls()


@dataclasses.dataclass(frozen=True)
class KernelStatic:
    """Everything the kernels specialise on (hashable: a custom_vjp nondiff argument and a jit static)."""

    causal: bool
    sm_scale: float
    sliding_window: int | None
    logits_soft_cap: float | None
    q_len: int  # unpadded Tq
    kv_len: int  # unpadded Tk
    has_segments: bool
    blocks: BlockSizes
    interpret: bool
    static_q_offset: int | None = None  # set only for the Mosaic GPU forward, which specialises on it


def scaled_logits(s, st: KernelStatic):
    """Raw q.k [.., ..] fp32 -> logits in the log2 domain (scaled, soft-capped)."""
    if st.logits_soft_cap is None:
        return s * (st.sm_scale * LOG2E)
    cap = st.logits_soft_cap
    return jnp.tanh(s * (st.sm_scale / cap)) * (cap * LOG2E)


def soft_cap_grad(s2, st: KernelStatic):
    """d capped / d uncapped, from the capped log2-domain logits s2: 1 - tanh^2."""
    t = s2 * (1.0 / (st.logits_soft_cap * LOG2E))
    return 1.0 - t * t


def visible(qpos, kpos, qseg, kseg, st: KernelStatic, check_kv_len: bool):
    """Broadcasting mask: may query position `qpos` see key position `kpos`?"""
    mask = None

    def both(a, b):
        return b if a is None else jnp.logical_and(a, b)

    if check_kv_len:
        mask = both(mask, kpos < st.kv_len)
    if st.causal:
        mask = both(mask, kpos <= qpos)
    if st.sliding_window is not None:
        mask = both(mask, kpos > qpos - st.sliding_window)
    if st.has_segments:
        mask = both(mask, qseg == kseg)
    return mask


def apply_mask(s, mask):
    return s if mask is None else jnp.where(mask, s, -jnp.inf)


def kv_block_range(q_first, q_last, num_kv_blocks: int, bk: int, st: KernelStatic):
    """KV blocks for the query positions [q_first, q_last]: (lo, full_lo, full_hi, hi).

    Blocks [lo, hi) hold every key some query can see; [full_lo, full_hi) need no mask at all.
    """
    if st.causal:
        hi = jnp.minimum(num_kv_blocks, q_last // bk + 1)
        full_hi = (q_first + 1) // bk
    else:
        hi = jnp.int32(num_kv_blocks)
        full_hi = jnp.int32(num_kv_blocks)
    full_hi = jnp.minimum(full_hi, st.kv_len // bk)
    if st.sliding_window is not None:
        w = st.sliding_window
        lo = jnp.maximum(q_first - w + 1, 0) // bk
        full_lo = (jnp.maximum(q_last - w + 1, 0) + bk - 1) // bk
    else:
        lo = jnp.int32(0)
        full_lo = jnp.int32(0)
    if st.has_segments:
        full_hi = full_lo  # every block needs the segment mask
    full_lo = jnp.clip(full_lo, lo, hi)
    full_hi = jnp.clip(full_hi, full_lo, hi)
    return lo, full_lo, full_hi, hi


def q_block_range(k_first, k_last, q_off, num_q_blocks: int, bq: int, st: KernelStatic):
    """Query blocks that see keys [k_first, k_last]: (lo, full_lo, full_hi, hi); inverse of kv_block_range."""
    if st.causal:  # query i (position q_off + i) sees key j iff q_off + i >= j
        lo = jnp.maximum(k_first - q_off, 0) // bq
        full_lo = (jnp.maximum(k_last - q_off, 0) + bq - 1) // bq
    else:
        lo = jnp.int32(0)
        full_lo = jnp.int32(0)
    if st.sliding_window is not None:  # and iff q_off + i <= j + w - 1
        last_q = k_last + st.sliding_window - 1 - q_off
        hi = jnp.where(last_q >= 0, jnp.minimum(num_q_blocks, last_q // bq + 1), 0)
        full_last = k_first + st.sliding_window - bq - q_off
        full_hi = jnp.where(full_last >= 0, full_last // bq + 1, 0)
    else:
        hi = jnp.int32(num_q_blocks)
        full_hi = jnp.int32(num_q_blocks)
    if st.has_segments:
        full_hi = full_lo
    full_lo = jnp.clip(full_lo, lo, hi)
    full_hi = jnp.clip(full_hi, full_lo, hi)
    return lo, full_lo, full_hi, hi


def three_loops(bounds, body, carry):
    """Runs body(i, carry, masked) over [lo, full_lo) masked, [full_lo, full_hi) unmasked, [full_hi, hi) masked."""
    lo, full_lo, full_hi, hi = bounds
    carry = lax.fori_loop(lo, full_lo, functools.partial(body, masked=True), carry)
    carry = lax.fori_loop(full_lo, full_hi, functools.partial(body, masked=False), carry)
    return lax.fori_loop(full_hi, hi, functools.partial(body, masked=True), carry)


def dot(a, b, trans_b=False):
    # fp32 inputs get IEEE products (Triton's default for fp32 is TF32, ~3e-4 relative error).
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 and b.dtype == jnp.float32 else None
    return pltriton.dot(a, b, trans_b=trans_b, precision=precision)


def backward_inputs(o, lse, do, dlse, dtype):
    """(delta [B, Hq, Tq] f32, lse with empty rows at +inf, do in `dtype`) for the backward kernels.

    d lse / d s = p, so an lse cotangent folds into delta: ds = p * (dp - (rowsum(o * do) - dlse)). A row that saw
    no key has lse = -inf; +inf makes its p = exp(s - lse) = 0 in the backward.
    """
    delta = jnp.einsum("bthd,bthd->bht", o.astype(jnp.float32), do.astype(jnp.float32)) - dlse
    return delta, jnp.where(lse == -jnp.inf, jnp.inf, lse), do.astype(dtype)
