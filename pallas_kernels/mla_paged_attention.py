"""MLA paged decode attention: absorbed queries against a paged latent cache (DeepSeek-V2/V3).

Multi-head latent attention caches one row per token, shared by every query head:

    latent_pages [num_pages, page_size, R + Dr]    row = [ c_kv (R = kv_lora_rank) | k_rope (Dr = rope dim) ]

At decode the key and value up-projections are absorbed into the query and the output
(q_latent = q_nope @ W_UK per head, out = attn @ W_UV outside this kernel), so every head attends over the
latent rows directly: logits = q_latent . c_kv + q_rope . k_rope, output = softmax(logits) @ c_kv. All query
heads share the one latent "KV head", so a gathered page serves every head of the program: MLA's decode is
the GQA kernel with a group of Hq and K = V.

Data flow (Triton / interpret backends):

    q_latent [B, Hq, R], q_rope [B, Hq, Dr] --pad heads--> [B, Hp, R], [B, Hp, Dr]  (Hp = head blocks x bh)
    grid (B, Hp / bh, num_splits): program (b, j, s) takes heads j*bh .. j*bh+bh-1 of sequence b and walks
        the pages of split s, `pages_per_block` pages per step; each step gathers the latent tile
        [N, R] and the rope tile [N, Dr] from the same rows once (the latent tile is both K and V):
            logits [bh, N] = q_latent [bh, R] c^T + q_rope [bh, Dr] k_rope^T   (base 2, online softmax)
            acc    [bh, R] += p [bh, N] c [N, R]
    num_splits == 1: normalised [B, Hp, R] in q's dtype; > 1: unnormalised partials + running max / sum,
        merged exactly by `paged_attention.merge_splits`.

Slots at positions >= length are loaded masked (as zeros), so stale or NaN data never reaches the output.
Only float pages (bf16/f16/f32) are served; the Pallas kernel needs R and Dr powers of 2 >= 16 (DeepSeek:
512 and 64). The ragged (prefill + decode) variant lives in pallas_kernels/mla_ragged_attention.py.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.backend import out_struct, resolve_backend
from pallas_kernels.paged_attention import (
    LOG2E,
    MASK_VALUE,
    _is_pow2,
    _next_pow2,
    check_triton_params,
    choose_num_splits,
    merge_splits,
)

FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class MlaDecodeConfig:
    """Tile sizes for the MLA decode kernel (a static argument). Not yet tuned on a GPU: the defaults
    follow the Triton MLA decode kernel vLLM and SGLang ship (16 heads and 32 latent rows a step, 2 stages).

    Attributes:
        block_heads: query heads per program (power of 2 >= 16; fewer heads are padded up to 16).
        block_tokens: latent rows per inner-loop step; a step gathers max(1, block_tokens // page_size) pages.
        num_splits: split-K factor over the page list; None picks one from batch, head blocks and SM count.
        num_warps: Triton warps per program.
        num_stages: Triton software-pipelining depth of the page loop.
    """

    block_heads: int = 16
    block_tokens: int = 32
    num_splits: int | None = None
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        check_block("block_heads", self.block_heads)
        check_block("block_tokens", self.block_tokens)
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"num_splits must be >= 1 or None, got {self.num_splits}")
        check_triton_params(self.num_warps, self.num_stages)

    def pages_per_block(self, page_size: int) -> int:
        return max(1, self.block_tokens // page_size)


def check_block(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not _is_pow2(value) or value < 16:
        raise ValueError(f"{name} must be a power of 2 >= 16, got {value!r}")


def heads_per_program(block_heads: int, num_heads: int) -> int:
    """Heads one program takes: block_heads, or fewer (>= 16, the tensor-core minimum) for few heads."""
    return max(16, min(block_heads, _next_pow2(num_heads)))


# ---------------------------------------------------------------------------------------------------------
# Kernel pieces shared with the ragged variant.
# ---------------------------------------------------------------------------------------------------------
def load_latent_block(pages_ref, pages, first_token, hi, page_size, rank):
    """Gathers `pages` [n] as latent [N, R] and rope [N, Dr] tiles (N = n * page_size), zero at tokens >= hi.

    pages_ref is the pool flattened to token rows, [num_pages * page_size, R + Dr]; row = page * ps + offset.
    """
    n = pages.shape[0]
    rope_dim = pages_ref.shape[-1] - rank
    offset = jnp.arange(page_size)[None, :]
    rows = (pages[:, None] * page_size + offset).reshape(n * page_size)  # [N] token rows
    token = (first_token + jnp.arange(n)[:, None] * page_size + offset).reshape(n * page_size)  # [N]
    valid = token < hi
    tiles = []
    for col0, width in ((0, rank), (rank, rope_dim)):
        cols = col0 + jnp.arange(width)[None, :]
        mask = jnp.broadcast_to(valid[:, None], (n * page_size, width))
        tiles.append(pltriton.load(pages_ref.at[rows[:, None], cols], mask=mask, other=0.0))
    return tiles[0], tiles[1], valid  # [N, R], [N, Dr], [N]


def latent_step(q_lat, q_rope, c, k_rope, mask, carry, *, scale_log2):
    """One online-softmax step in base 2. q_lat [M, R], q_rope [M, Dr], c [N, R], k_rope [N, Dr], mask [M, N]."""
    acc, m_prev, l_prev = carry  # [M, R] f32, [M] f32, [M] f32
    # Triton's default for float32 operands is TF32; float32 pages ask for full IEEE products.
    precision = jax.lax.Precision.HIGHEST if c.dtype == jnp.float32 else None
    nt = (((1,), (1,)), ((), ()))
    logits = jax.lax.dot_general(q_lat, c, nt, precision=precision, preferred_element_type=jnp.float32)
    logits += jax.lax.dot_general(q_rope, k_rope, nt, precision=precision, preferred_element_type=jnp.float32)
    logits = jnp.where(mask, logits * scale_log2, MASK_VALUE)  # [M, N]
    m_new = jnp.maximum(m_prev, logits.max(axis=-1))
    alpha = jnp.exp2(m_prev - m_new)
    p = jnp.exp2(logits - m_new[:, None])  # [M, N]
    l_new = l_prev * alpha + p.sum(axis=-1)
    pv = jax.lax.dot_general(
        p.astype(c.dtype), c, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )  # [M, R]
    return acc * alpha[:, None] + pv, m_new, l_new


def init_carry(rows: int, rank: int):
    return (
        jnp.zeros((rows, rank), jnp.float32),
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )


# ---------------------------------------------------------------------------------------------------------
# Kernel body.
# ---------------------------------------------------------------------------------------------------------
def _decode_kernel(
    lengths_ref,  # [B] int32, whole array
    block_tables_ref,  # [num_splits * pages_per_split] int32, row b
    q_lat_ref,  # [bh, R] compute dtype, heads of block j
    q_rope_ref,  # [bh, Dr] compute dtype
    pages_ref,  # [num_pages * page_size, R + Dr] the whole latent pool
    o_ref,  # [bh, R]: q dtype (one split) or f32 unnormalised accumulator (split-K)
    m_ref,  # [bh] f32 running max of base-2 logits (None without split-K)
    l_ref,  # [bh] f32 running softmax denominator (None without split-K)
    *,
    scale_log2: float,
    page_size: int,
    pages_per_block: int,
    pages_per_split: int,
):
    b, split = pl.program_id(0), pl.program_id(2)
    length = lengths_ref[b]
    q_lat, q_rope = q_lat_ref[...], q_rope_ref[...]  # [bh, R], [bh, Dr]
    rows, rank = q_lat.shape
    first_page = split * pages_per_split
    end_page = jnp.minimum(first_page + pages_per_split, pl.cdiv(length, page_size))
    num_steps = pl.cdiv(jnp.maximum(end_page - first_page, 0), pages_per_block)

    def body(i, carry):
        page0 = first_page + i * pages_per_block
        pages = block_tables_ref[pl.ds(page0, pages_per_block)]  # [pages_per_block]
        c, k_rope, valid = load_latent_block(pages_ref, pages, page0 * page_size, length, page_size, rank)
        mask = jnp.broadcast_to(valid[None, :], (rows, valid.shape[0]))
        return latent_step(q_lat, q_rope, c, k_rope, mask, carry, scale_log2=scale_log2)

    acc, m, l = jax.lax.fori_loop(0, num_steps, body, init_carry(rows, rank))
    if m_ref is None:
        o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)
    else:
        o_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l


# ---------------------------------------------------------------------------------------------------------
# pallas_call builder.
# ---------------------------------------------------------------------------------------------------------
def _build_decode_call(q_lat, q_rope, pages, block_tables, lengths, *, bh, num_splits, sm_scale, config, interpret):
    """q_lat [B, Hp, R], q_rope [B, Hp, Dr] (page dtype); block_tables [B, num_splits * pages_per_split]."""
    batch, padded_heads, rank = q_lat.shape
    rope_dim = q_rope.shape[-1]
    num_pages, page_size, width = pages.shape
    pages_per_split = block_tables.shape[1] // num_splits
    kernel = functools.partial(
        _decode_kernel,
        scale_log2=sm_scale * LOG2E,
        page_size=page_size,
        pages_per_block=config.pages_per_block(page_size),
        pages_per_split=pages_per_split,
    )
    slots = num_pages * page_size
    in_specs = [
        pl.BlockSpec((batch,), lambda b, j, s: (0,)),
        pl.BlockSpec((None, block_tables.shape[1]), lambda b, j, s: (b, 0)),
        pl.BlockSpec((None, bh, rank), lambda b, j, s: (b, j, 0)),
        pl.BlockSpec((None, bh, rope_dim), lambda b, j, s: (b, j, 0)),
        pl.BlockSpec((slots, width), lambda b, j, s: (0, 0)),
    ]
    out = functools.partial(out_struct, inputs=(q_lat, pages, block_tables, lengths))
    if num_splits == 1:
        out_shape = [out(q_lat.shape, q_lat.dtype), None, None]
        out_specs = [pl.BlockSpec((None, bh, rank), lambda b, j, s: (b, j, 0)), None, None]
    else:
        part = (num_splits, batch, padded_heads)
        out_shape = [out(part + (rank,), jnp.float32), out(part, jnp.float32), out(part, jnp.float32)]
        row_spec = pl.BlockSpec((None, None, bh), lambda b, j, s: (s, b, j))
        out_specs = [pl.BlockSpec((None, None, bh, rank), lambda b, j, s: (s, b, j, 0)), row_spec, row_spec]
    return pl.pallas_call(
        kernel,
        grid=(batch, padded_heads // bh, num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        name=f"mla_decode_ps{page_size}_h{bh}_bt{config.block_tokens}_s{num_splits}",
    )(lengths, block_tables, q_lat, q_rope, pages.reshape(slots, width))


def pad_heads(x, padded_heads: int, axis: int = 1):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, padded_heads - x.shape[axis])
    return jnp.pad(x, pad)


def _decode_pallas(q_latent, q_rope, pages, block_tables, lengths, *, sm_scale, config, interpret):
    batch, num_heads, _ = q_latent.shape
    page_size = pages.shape[1]
    bh = heads_per_program(config.block_heads, num_heads)
    padded_heads = -(-num_heads // bh) * bh
    pages_per_block = config.pages_per_block(page_size)
    num_blocks = -(-block_tables.shape[1] // pages_per_block)
    num_splits = choose_num_splits(config, batch, padded_heads // bh, num_blocks)
    pages_per_split = -(-num_blocks // num_splits) * pages_per_block
    pad_pages = num_splits * pages_per_split - block_tables.shape[1]
    block_tables = jnp.pad(block_tables, ((0, 0), (0, pad_pages)))  # padding is never read unmasked
    q_lat = pad_heads(q_latent.astype(pages.dtype), padded_heads)
    q_rp = pad_heads(q_rope.astype(pages.dtype), padded_heads)
    o, m, l = _build_decode_call(
        q_lat,
        q_rp,
        pages,
        block_tables,
        lengths,
        bh=bh,
        num_splits=num_splits,
        sm_scale=sm_scale,
        config=config,
        interpret=interpret,
    )
    if num_splits > 1:
        o = merge_splits(o, m, l)
    return o[:, :num_heads].astype(q_latent.dtype)


# ---------------------------------------------------------------------------------------------------------
# Validation, public entry point and reference.
# ---------------------------------------------------------------------------------------------------------
def validate_latent(name, q_latent, q_rope, pages, sm_scale):
    """Checks shared by the decode and ragged entry points; raises ValueError."""
    if q_latent.ndim != 3 or q_rope.ndim != 3 or q_latent.shape[:2] != q_rope.shape[:2]:
        raise ValueError(f"{name}: q_latent [N, H, R] and q_rope [N, H, Dr] disagree: {q_latent.shape}, {q_rope.shape}")
    for arg, x in (("q_latent", q_latent), ("q_rope", q_rope), ("latent_pages", pages)):
        if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
            raise ValueError(f"{name}: {arg} dtype must be bf16/f16/f32, got {x.dtype}")
    if pages.ndim != 3:
        raise ValueError(f"{name}: latent_pages must be [num_pages, page_size, R + Dr], got {pages.shape}")
    rank, rope_dim = q_latent.shape[-1], q_rope.shape[-1]
    if pages.shape[-1] != rank + rope_dim:
        raise ValueError(f"{name}: latent_pages row width {pages.shape[-1]} != R {rank} + Dr {rope_dim}")
    if not _is_pow2(pages.shape[1]):
        raise ValueError(f"{name}: page_size must be a power of 2, got {pages.shape[1]}")
    if sm_scale is None or isinstance(sm_scale, bool) or not float(sm_scale) > 0:
        raise ValueError(
            f"{name}: sm_scale must be a positive float (MLA's scale is not 1/sqrt(R + Dr)), got {sm_scale}"
        )


def check_pallas_dims(name, rank: int, rope_dim: int) -> None:
    for dim_name, dim in (("kv_lora_rank", rank), ("rope dim", rope_dim)):
        if not _is_pow2(dim) or dim < 16:
            raise ValueError(f"{name}: the Pallas kernel needs a power-of-2 {dim_name} >= 16, got {dim}")


def _validate(q_latent, q_rope, pages, block_tables, lengths, sm_scale):
    name = "mla_paged_attention"
    validate_latent(name, q_latent, q_rope, pages, sm_scale)
    batch = q_latent.shape[0]
    if block_tables.ndim != 2 or block_tables.shape[0] != batch or block_tables.dtype != jnp.int32:
        raise ValueError(
            f"{name}: block_tables must be int32 [B={batch}, max_blocks], got {block_tables.shape} {block_tables.dtype}"
        )
    if lengths.shape != (batch,) or lengths.dtype != jnp.int32:
        raise ValueError(f"{name}: lengths must be int32 [{batch}], got {lengths.shape} {lengths.dtype}")


@functools.partial(jax.jit, static_argnames=("sm_scale", "backend", "config"))
def mla_paged_attention(
    q_latent,
    q_rope,
    latent_pages,
    block_tables,
    lengths,
    *,
    sm_scale: float,
    backend=None,
    config: MlaDecodeConfig = MlaDecodeConfig(),
):
    """Absorbed MLA decode attention of one query token per sequence over a paged latent cache.

    Args:
        q_latent: [B, H, R] queries absorbed into the latent space (q_nope @ W_UK per head).
        q_rope: [B, H, Dr] rotary part of the queries.
        latent_pages: [num_pages, page_size, R + Dr] rows [c_kv | k_rope] (bf16/f16/f32).
        block_tables: [B, max_blocks] int32 page ids of each sequence, in order.
        lengths: [B] int32 KV lengths (the new token's row already written); 0 gives a zero output.
        sm_scale: logit scale (DeepSeek: mscale^2 / sqrt(qk_nope_dim + qk_rope_dim)); required.
        backend: None, "triton", "interpret" or "xla" (see pallas_kernels.backend).
        config: tile sizes (static).

    Returns:
        [B, H, R] attention-weighted latents in q_latent's dtype (apply W_UV per head outside).
    """
    _validate(q_latent, q_rope, latent_pages, block_tables, lengths, sm_scale)
    sm_scale = float(sm_scale)
    resolved = resolve_backend(backend, "mla_paged_attention")
    if resolved == "xla":
        args = (q_latent, q_rope, latent_pages, block_tables, lengths)
        return reference(*args, sm_scale=sm_scale).astype(q_latent.dtype)
    if resolved == "mosaic_gpu":
        raise ValueError("mla_paged_attention: no mosaic_gpu kernel yet; use backend='triton'")
    check_pallas_dims("mla_paged_attention", q_latent.shape[-1], q_rope.shape[-1])
    return _decode_pallas(
        q_latent,
        q_rope,
        latent_pages,
        block_tables,
        lengths,
        sm_scale=sm_scale,
        config=config,
        interpret=resolved == "interpret",
    )


def latent_scores(q_latent, q_rope, c, k_rope):
    """float32 logits [..., H, L] of q_latent [..., H, R] / q_rope [..., H, Dr] against rows [..., L, R|Dr]."""
    hi = jax.lax.Precision.HIGHEST
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    return jnp.einsum("...hr,...lr->...hl", f32(q_latent), c, precision=hi) + jnp.einsum(
        "...hd,...ld->...hl", f32(q_rope), k_rope, precision=hi
    )


def reference(q_latent, q_rope, latent_pages, block_tables, lengths, *, sm_scale, backend=None):
    """Plain-jnp float32 MLA decode gathering whole page lists; same contract as `mla_paged_attention`."""
    del backend
    batch, _, rank = q_latent.shape
    rows = latent_pages.astype(jnp.float32)[block_tables].reshape(batch, -1, latent_pages.shape[-1])  # [B, L, C]
    valid = jnp.arange(rows.shape[1])[None, :] < lengths[:, None]  # [B, L]
    rows = jnp.where(valid[..., None], rows, 0.0)  # unused slots may hold NaN
    c, k_rope = rows[..., :rank], rows[..., rank:]
    logits = latent_scores(q_latent, q_rope, c, k_rope) * sm_scale  # [B, H, L]
    logits = jnp.where(valid[:, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    p = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))
    denom = p.sum(axis=-1, keepdims=True)
    o = jnp.einsum("bhl,blr->bhr", p, c, precision=jax.lax.Precision.HIGHEST)
    return jnp.where(denom > 0, o / jnp.where(denom > 0, denom, 1.0), 0.0)
