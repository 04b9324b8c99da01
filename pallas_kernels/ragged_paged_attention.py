"""Ragged paged attention: one launch over a mixed batch of prefill chunks and decode rows.

Data flow (Triton / interpret backends):

    q [T, Hq, D] --> q [Hkv, T_pad * Gp, D]      row r of KV head h = (token r // Gp, query head h*G + r % Gp)
    metadata pass (XLA, on device): a work list of query tiles, entry w -> (kind, sequence, first flat
        token). Sequences with more than `small` query tokens get cdiv(q_len, bq) prefill tiles of bq
        tokens; the others (decode, speculative verify) get one small tile each, so a decode row does not
        pay for a prefill-sized tile. config.schedule orders the list (see `tile_metadata`).
    grid (Hkv, W), W = T // bq + S (a static bound on the tile count; programs past it exit at once).
        program (h, w): the rows of tile w for KV head h (its tokens x the Gp heads of group h); walks
        the sequence's pages up to the tile's last causal position; each KV page is gathered once for all
        rows; causal mask per row; masked store of the rows that belong to the sequence.
    o [Hkv, T_pad * Gp, D] --> [T, Hq, D], rows at or past cu_q_lens[num_seqs] zeroed.

        flat tokens:  | seq 0 (5 tok) | s1 (1) | seq 2 (17 tok)                    | s3 (1) | pad pad |
        prefill tiles (bq=8), sequence order:  p0 = seq 0 [0, 5)   p1, p2, p3 = seq 2 [6, 14) [14, 22) [22, 23)
        small tiles (q_len <= 4):              s0 = s1 [5, 6)      s1 = s3 [23, 24)
        work list, interleave: p0 s0 p1 p2 s1 p3      prefill_first: p0 p1 p2 p3 s0 s1
        query j of seq s sits at position kv_lens[s] - q_len[s] + j and sees keys 0..that position
        (with a sliding `window`: keys (position - window, position]; the page loop of a tile then starts at
        the block holding its first row's earliest key, so pages wholly before every row's window are skipped).

Prefill tiles are compute-bound on pages that mostly sit in L2; decode tiles are bound by HBM bandwidth.
Both kinds share one compiled kernel, whose registers and shared memory are sized by the prefill branch,
so a decode tile here streams KV at about half the rate of the dedicated decode kernel
(pallas_kernels/paged_attention.py); benchmarks/results/paged_notes.md (run 3) has the measurements and
the variants tried. Shapes (T, S, max_blocks) are static buckets; the data decides the work. Attention sinks
(`sinks` [Hq], gpt-oss) come in as a per-row vector beside q's rows and join each row's denominator after the loop.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import paged_attention_xla
from pallas_kernels.backend import out_struct, resolve_backend
from pallas_kernels.paged_attention import (
    LOG2E,
    MASK_VALUE,
    _is_pow2,
    _next_pow2,
    attend_block,
    compute_dtype_for,
    flatten_pages,
    load_kv_block,
)
from pallas_kernels.paged_common import (
    add_sink,
    check_triton_params,
    dequantize_pages,
    softcap_scores,
    softmax_with_sinks,
    validate_ragged,
    validate_sinks,
    validate_softcap,
    validate_window,
)

SCHEDULES = ("interleave", "prefill_first")


@dataclasses.dataclass(frozen=True)
class RaggedConfig:
    """Tile sizes for the ragged kernel (a static argument). Defaults: the best of an H200 sweep on the
    mixed batch of benchmarks/kernels_paged.py (4 x 512-token chunks + 60 decode rows, ctx 2048, G=4).

    Attributes:
        block_q_rows: query rows per prefill tile (tokens x padded group heads); tokens = rows // Gp.
        small_q_rows: query rows per small tile, used for sequences whose whole query fits in one
            (decode and speculative-verify rows), so they do not pay for a prefill-sized tile; 0 disables.
        block_tokens: KV tokens per inner-loop step; a step gathers max(1, block_tokens // page_size) pages.
        small_block_tokens: the same for small tiles (None: block_tokens). On the H200 mix, 128 made the
            one launch 426 us instead of 446 us but a decode-only batch 464 us instead of 309 us, so the
            default keeps one step size.
        num_warps: Triton warps per program.
        num_stages: Triton software-pipelining depth of the page loop.
        schedule: order of the work list, "interleave" (small tiles spread evenly among the prefill tiles)
            or "prefill_first" (small tiles after all prefill tiles); see `tile_metadata`.
    """

    block_q_rows: int = 128
    small_q_rows: int = 16
    block_tokens: int = 64
    small_block_tokens: int | None = None
    num_warps: int = 4
    num_stages: int = 2
    schedule: str = "prefill_first"

    def __post_init__(self):
        if not _is_pow2(self.block_q_rows) or self.block_q_rows < 16:
            raise ValueError(f"block_q_rows must be a power of 2 >= 16, got {self.block_q_rows}")
        if self.small_q_rows and (not _is_pow2(self.small_q_rows) or self.small_q_rows < 16):
            raise ValueError(f"small_q_rows must be 0 or a power of 2 >= 16, got {self.small_q_rows}")
        if not _is_pow2(self.block_tokens) or self.block_tokens < 16:
            raise ValueError(f"block_tokens must be a power of 2 >= 16, got {self.block_tokens}")
        if self.small_block_tokens is not None and (
            not _is_pow2(self.small_block_tokens) or self.small_block_tokens < 16
        ):
            raise ValueError(f"small_block_tokens must be None or a power of 2 >= 16, got {self.small_block_tokens}")
        check_triton_params(self.num_warps, self.num_stages)
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")

    def pages_per_block(self, page_size: int) -> tuple[int, int]:
        """(pages per step of a prefill tile, pages per step of a small tile)."""
        return (
            max(1, self.block_tokens // page_size),
            max(1, (self.small_block_tokens or self.block_tokens) // page_size),
        )

    def tokens_per_tile(self, group_rows: int) -> tuple[int, int]:
        """(tokens per prefill tile, tokens per small tile; 0 when small tiles are off)."""
        big = max(1, self.block_q_rows // group_rows)
        small = max(1, self.small_q_rows // group_rows) if self.small_q_rows else 0
        return big, (small if small < big else 0)


# ---------------------------------------------------------------------------------------------------------
# Metadata pass: per-program work list, on device.
# ---------------------------------------------------------------------------------------------------------
NO_TILE, PREFILL_TILE, SMALL_TILE = 0, 1, 2


def tile_metadata(
    cu_q_lens, num_seqs, *, block_q: int, small_block_q: int, max_tiles: int, schedule: str = "prefill_first"
):
    """Work list of query tiles: entry w -> (kind, sequence, first flat token).

    A live sequence with 0 < q_len <= small_block_q gets one small tile (decode, speculative verify);
    any other gets cdiv(q_len, block_q) prefill tiles. Prefill tiles keep sequence order, and so do small
    tiles; `schedule` merges the two lists:

        prefill_first:  p0 p1 p2 p3 p4 p5 s0 s1 s2      (small tiles fill the tail)
        interleave:     p0 s0 p1 p2 s1 p3 p4 s2 p5      (even spacing: tile i of n sits near (i + 1/2) / n)

    Prefill tiles first keeps the tiles of one chunk, which reuse its pages from L2, running together;
    the small tiles then fill the tail. Interleaving was meant to run bandwidth-bound decode tiles beside
    compute-bound prefill tiles all along, but measured 1.5-1.8x slower on an H200 (paged_notes.md, run 3).

    Args:
        cu_q_lens: [S+1] int32 cumulative query lengths.
        num_seqs: [] int32; sequences at or past it get no tiles.
        block_q: tokens per prefill tile.
        small_block_q: tokens per small tile (0: no small tiles).
        max_tiles: static bound W on the tile count.
        schedule: "interleave" or "prefill_first".

    Returns:
        tiles [3, W] int32: (kind, sequence, first flat token) of each entry; kind is NO_TILE past the
        live tiles, PREFILL_TILE or SMALL_TILE.
    """
    num_slots = cu_q_lens.shape[0] - 1
    live = jnp.arange(num_slots) < num_seqs
    q_lens = jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0)  # [S]
    small = (q_lens > 0) & (q_lens <= small_block_q)
    n_big = jnp.where(small, 0, (q_lens + block_q - 1) // block_q)  # [S]
    ends_big, ends_small = jnp.cumsum(n_big), jnp.cumsum(small.astype(jnp.int32))  # [S] exclusive ends
    total_big, total_small = ends_big[-1], ends_small[-1]
    i = jnp.arange(max_tiles, dtype=jnp.int32)  # tile index within its kind
    seq_big = jnp.minimum(jnp.searchsorted(ends_big, i, side="right"), num_slots - 1)
    q0_big = cu_q_lens[seq_big] + (i - (ends_big - n_big)[seq_big]) * block_q
    seq_small = jnp.minimum(jnp.searchsorted(ends_small, i, side="right"), num_slots - 1)
    if schedule == "prefill_first":
        at_big, at_small = i, total_big + i
    else:  # merge on keys (2i+1) * n_other: small tile j goes before prefill tile i iff (2j+1)/ns < (2i+1)/nb
        key_big, key_small = (2 * i + 1) * total_small, (2 * i + 1) * total_big  # < (2W)^2: int32 for W < 23k
        key_small = jnp.where(i < total_small, key_small, jnp.iinfo(jnp.int32).max)
        key_big = jnp.where(i < total_big, key_big, jnp.iinfo(jnp.int32).max)
        at_big = i + jnp.searchsorted(key_small, key_big, side="left").astype(jnp.int32)
        at_small = i + jnp.searchsorted(key_big, key_small, side="right").astype(jnp.int32)
    at_big = jnp.where(i < total_big, at_big, max_tiles)  # out of range: dropped by the scatter
    at_small = jnp.where(i < total_small, at_small, max_tiles)
    tiles = jnp.zeros((3, max_tiles), jnp.int32)
    for at, kind, seq, q0 in (
        (at_big, PREFILL_TILE, seq_big, q0_big),
        (at_small, SMALL_TILE, seq_small, cu_q_lens[seq_small]),
    ):
        tiles = tiles.at[:, at].set(jnp.stack([jnp.full_like(seq, kind), seq, q0]).astype(jnp.int32), mode="drop")
    return tiles


# ---------------------------------------------------------------------------------------------------------
# Kernel body.
# ---------------------------------------------------------------------------------------------------------
def _attend_tile(
    seq,
    q0,
    cu_q_lens_ref,
    kv_lens_ref,
    block_tables_ref,
    q_ref,
    k_pages_ref,
    v_pages_ref,
    k_scales_ref,
    v_scales_ref,
    sinks_ref,
    o_ref,
    *,
    block_q,
    group_rows,
    scale_log2,
    page_size,
    pages_per_block,
    compute_dtype,
    window,
    softcap,
):
    """Causal attention of tokens q0 .. q0+block_q-1 of sequence `seq` (rows past its end are not stored)."""
    q_begin, q_end = cu_q_lens_ref[seq], cu_q_lens_ref[seq + 1]
    first_pos = kv_lens_ref[seq] - (q_end - q_begin)  # position of the sequence's first query token
    rows = block_q * group_rows
    tok = q0 + jnp.arange(rows) // group_rows  # [M] flat token of each row
    pos = first_pos + tok - q_begin  # [M] causal position of each row
    kv_hi = first_pos + jnp.minimum(q0 + block_q, q_end) - q_begin  # keys the tile's last row sees
    block_tokens = pages_per_block * page_size
    q = q_ref[pl.ds(q0 * group_rows, rows), :]  # [M, D]
    # Earliest key any row of the tile sees: the first row's window start (0 without a window).
    kv_lo = None if window is None else jnp.maximum(first_pos + q0 - q_begin - window + 1, 0)

    def body(i, carry):
        page0 = i * pages_per_block
        pages = block_tables_ref[seq, pl.ds(page0, pages_per_block)]  # [pages_per_block]
        first_token = page0 * page_size
        k, ks, valid = load_kv_block(k_pages_ref, k_scales_ref, pages, first_token, kv_hi, page_size, kv_lo)
        v, vs, _ = load_kv_block(v_pages_ref, v_scales_ref, pages, first_token, kv_hi, page_size, kv_lo)
        key = first_token + jnp.arange(block_tokens)  # [N]
        mask = valid[None, :] & (key[None, :] <= pos[:, None])  # [M, N]
        if window is not None:
            mask &= key[None, :] > pos[:, None] - window
        kw = dict(scale_log2=scale_log2, compute_dtype=compute_dtype, softcap=softcap)
        return attend_block(q, k, v, ks, vs, mask, carry, **kw)

    carry = (
        jnp.zeros((rows, q.shape[1]), jnp.float32),
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    first_block = 0 if window is None else kv_lo // block_tokens
    acc, m, l = jax.lax.fori_loop(first_block, pl.cdiv(kv_hi, block_tokens), body, carry)
    if sinks_ref is not None:
        acc, m, l = add_sink(acc, m, l, sinks_ref[pl.ds(q0 * group_rows, rows)])
    out = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)
    store_mask = jnp.broadcast_to((tok < q_end)[:, None], out.shape)
    pltriton.store(o_ref.at[pl.ds(q0 * group_rows, rows), :], out, mask=store_mask)


def _ragged_kernel(
    tiles_ref,  # [3, W] int32: kind, sequence, first flat token of each entry
    cu_q_lens_ref,  # [S+1] int32
    kv_lens_ref,  # [S] int32
    block_tables_ref,  # [S, max_blocks_padded] int32
    q_ref,  # [T_pad * Gp, D] compute dtype, KV head h
    k_pages_ref,  # [num_pages * page_size, D], KV head h
    v_pages_ref,  # [num_pages * page_size, D], KV head h
    k_scales_ref,  # [num_pages * page_size] f32 (None for float pages)
    v_scales_ref,  # [num_pages * page_size] f32 (None for float pages)
    sinks_ref,  # [T_pad * Gp] f32 base-2 sink logit of each row's query head (None without sinks)
    o_ref,  # [T_pad * Gp, D] q dtype, KV head h
    *,
    block_q: int,
    small_block_q: int,
    pages_per_block: tuple[int, int],
    **static,
):
    w = pl.program_id(1)
    kind, seq, q0 = tiles_ref[0, w], tiles_ref[1, w], tiles_ref[2, w]
    refs = (
        cu_q_lens_ref,
        kv_lens_ref,
        block_tables_ref,
        q_ref,
        k_pages_ref,
        v_pages_ref,
        k_scales_ref,
        v_scales_ref,
        sinks_ref,
        o_ref,
    )
    big_pages, small_pages = pages_per_block
    pl.when(kind == PREFILL_TILE)(
        lambda: _attend_tile(seq, q0, *refs, block_q=block_q, pages_per_block=big_pages, **static)
    )
    if small_block_q:  # one branch per tile size: a decode row does not pay for a prefill-sized tile
        pl.when(kind == SMALL_TILE)(
            lambda: _attend_tile(seq, q0, *refs, block_q=small_block_q, pages_per_block=small_pages, **static)
        )


# ---------------------------------------------------------------------------------------------------------
# pallas_call builder.
# ---------------------------------------------------------------------------------------------------------
def _ragged_pallas(
    q,
    k_pages,
    v_pages,
    block_tables,
    kv_lens,
    cu_q_lens,
    num_seqs,
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
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    group_rows = _next_pow2(group)
    block_q, small_block_q = config.tokens_per_tile(group_rows)
    rows = block_q * group_rows
    num_slots = kv_lens.shape[0]
    max_tiles = num_tokens // block_q + num_slots  # prefill tiles <= T / bq + S_prefill, small <= S_small
    padded_tokens = num_tokens + block_q  # a tile may start near T and span bq rows
    pages_per_block = config.pages_per_block(page_size)
    pad_pages = -block_tables.shape[1] % max(pages_per_block)  # both are powers of 2
    block_tables = jnp.pad(block_tables, ((0, 0), (0, pad_pages)))  # padding is never read unmasked

    q4 = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(compute_dtype_for(q.dtype, k_pages.dtype))
    q4 = jnp.pad(q4, ((0, padded_tokens - num_tokens), (0, 0), (0, group_rows - group), (0, 0)))
    q_rows = q4.transpose(1, 0, 2, 3).reshape(num_kv_heads, padded_tokens * group_rows, head_dim)
    if sinks is not None:  # [Hq] -> base 2, one per row of q_rows: [Hkv, T_pad * Gp]
        sinks = jnp.pad(
            sinks.astype(jnp.float32).reshape(num_kv_heads, group) * LOG2E, ((0, 0), (0, group_rows - group))
        )
        sinks = jnp.tile(sinks, (1, padded_tokens))
    tiles = tile_metadata(
        cu_q_lens, num_seqs, block_q=block_q, small_block_q=small_block_q, max_tiles=max_tiles, schedule=config.schedule
    )

    kernel = functools.partial(
        _ragged_kernel,
        block_q=block_q,
        small_block_q=small_block_q,
        scale_log2=sm_scale * LOG2E,
        page_size=page_size,
        pages_per_block=pages_per_block,
        group_rows=group_rows,
        compute_dtype=q_rows.dtype,
        window=window,
        softcap=softcap,
    )
    # Grid (Hkv, W): heads vary fastest, so entries launch in work-list order and the heads of one entry,
    # which read the same block tables, run side by side.
    whole = lambda shape: pl.BlockSpec(shape, lambda h, w: (0,) * len(shape))  # noqa: E731
    slots = num_pages * page_size
    row_spec = pl.BlockSpec((None, padded_tokens * group_rows, head_dim), lambda h, w: (h, 0, 0))
    page_spec = pl.BlockSpec((None, slots, head_dim), lambda h, w: (h, 0, 0))
    scale_spec = pl.BlockSpec((None, slots), lambda h, w: (h, 0))
    in_specs = [
        whole((3, max_tiles)),
        whole(cu_q_lens.shape),
        whole(kv_lens.shape),
        whole(block_tables.shape),
        row_spec,
        page_spec,
        page_spec,
        None if k_scales is None else scale_spec,
        None if v_scales is None else scale_spec,
        None if sinks is None else pl.BlockSpec((None, padded_tokens * group_rows), lambda h, w: (h, 0)),
    ]
    o_rows = pl.pallas_call(
        kernel,
        grid=(num_kv_heads, max_tiles),
        in_specs=in_specs,
        out_specs=row_spec,
        out_shape=out_struct(q_rows.shape, q.dtype, (q_rows, k_pages, v_pages, block_tables, kv_lens)),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        name=f"ragged_paged_ps{page_size}_m{rows}_bt{config.block_tokens}_{pages_per_block[1]}_{config.schedule}",
    )(tiles, cu_q_lens, kv_lens, block_tables, q_rows, *flatten_pages(k_pages, v_pages, k_scales, v_scales), sinks)

    o = o_rows.reshape(num_kv_heads, padded_tokens, group_rows, head_dim)[:, :num_tokens, :group]
    o = o.transpose(1, 0, 2, 3).reshape(num_tokens, num_q_heads, head_dim)
    live = jnp.arange(num_tokens) < cu_q_lens[num_seqs]  # rows no tile wrote hold garbage
    return jnp.where(live[:, None, None], o, jnp.zeros((), o.dtype))


# ---------------------------------------------------------------------------------------------------------
# Validation, public entry point and reference.
# ---------------------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("sm_scale", "backend", "config", "window", "logit_softcap"))
def ragged_paged_attention(
    q,
    k_pages,
    v_pages,
    block_tables,
    kv_lens,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale=None,
    k_scales=None,
    v_scales=None,
    backend=None,
    config: RaggedConfig = RaggedConfig(),
    window: int | None = None,
    logit_softcap: float | None = None,
    sinks=None,
):
    """Causal attention of a flat, ragged batch of query tokens over a paged KV cache.

    Args:
        q: [T, Hq, D] query tokens of all sequences, back to back (bf16/f16/f32).
        k_pages, v_pages: [Hkv, num_pages, page_size, D] (bf16/f16/f32, or int8/float8_e4m3fn with scales).
        block_tables: [S, max_blocks] int32 page ids of each sequence slot.
        kv_lens: [S] int32 KV length of each sequence including this step's tokens (already in the pages).
        cu_q_lens: [S+1] int32 cumulative query lengths; sequence s owns tokens cu_q_lens[s]:cu_q_lens[s+1].
        num_seqs: int32 scalar; slots at or past it are padding.
        sm_scale: logit scale, default 1/sqrt(D).
        k_scales, v_scales: [Hkv, num_pages, page_size] float32 per-token scales, for quantised pages only.
        backend: None, "triton", "interpret" or "xla" (see pallas_kernels.backend).
        config: tile sizes (static).
        window: sliding window (static): the query at position p sees keys (p - window, p]; None: 0..p.
        logit_softcap: scaled scores s -> cap * tanh(s / cap) before the softmax (static; Gemma 2), or None.
        sinks: [Hq] float attention-sink logits (gpt-oss; paged_common.py), or None.

    Returns:
        [T, Hq, D] in q's dtype; rows at or past cu_q_lens[num_seqs] are zero.
    """
    validate_ragged(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs, k_scales, v_scales)
    validate_window("ragged_paged_attention", window)
    validate_softcap("ragged_paged_attention", logit_softcap)
    validate_sinks("ragged_paged_attention", sinks, q.shape[1])
    num_seqs = jnp.reshape(num_seqs, ())
    sm_scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    resolved = resolve_backend(backend, "ragged_paged_attention")
    if resolved == "xla":
        kw = dict(sm_scale=sm_scale, k_scales=k_scales, v_scales=v_scales, window=window, logit_softcap=logit_softcap)
        args = (q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs)
        return paged_attention_xla.ragged_attention(*args, **kw, sinks=sinks).astype(q.dtype)
    if resolved == "mosaic_gpu":
        raise ValueError("ragged_paged_attention: no mosaic_gpu kernel yet; use backend='triton'")
    if not _is_pow2(q.shape[-1]) or q.shape[-1] < 16:
        raise ValueError(
            f"ragged_paged_attention: the Pallas kernel needs a power-of-2 head_dim >= 16, got {q.shape[-1]}"
        )
    return _ragged_pallas(
        *(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs, k_scales, v_scales, sinks),
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
    kv_lens,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale=None,
    k_scales=None,
    v_scales=None,
    backend=None,
    token_chunk: int = 64,
    window=None,
    logit_softcap=None,
    sinks=None,
):
    """Plain-jnp float32 ragged attention; gathers each token's page list, `token_chunk` tokens at a time."""
    del backend
    num_tokens, q_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[0]
    group = q_heads // num_kv_heads
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    num_seqs = jnp.reshape(num_seqs, ())
    k_all = dequantize_pages(k_pages, k_scales)  # [Hkv, P, ps, D]
    v_all = dequantize_pages(v_pages, v_scales)
    t = jnp.arange(num_tokens)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens, t, side="right") - 1, 0, block_tables.shape[0] - 1)  # [T]
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = kv_lens[seq] - q_len + (t - cu_q_lens[seq])  # [T]
    live = t < cu_q_lens[num_seqs]

    def one_chunk(args):
        q_c, seq_c, pos_c = args  # [C, Hq, D], [C], [C]
        k = k_all[:, block_tables[seq_c]].reshape(num_kv_heads, len(seq_c), -1, head_dim)  # [Hkv, C, L, D]
        v = v_all[:, block_tables[seq_c]].reshape(num_kv_heads, len(seq_c), -1, head_dim)
        key = jnp.arange(k.shape[2])[None, :]
        valid = key <= pos_c[:, None]  # [C, L]
        if window is not None:
            valid &= key > pos_c[:, None] - window
        k = jnp.where(valid[None, :, :, None], k, 0.0)  # unused slots may hold NaN
        v = jnp.where(valid[None, :, :, None], v, 0.0)
        qg = q_c.astype(jnp.float32).reshape(len(seq_c), num_kv_heads, group, head_dim)
        logits = jnp.einsum("chgd,hcld->chgl", qg, k, precision=jax.lax.Precision.HIGHEST) * sm_scale
        logits = softcap_scores(logits, logit_softcap)
        logits = jnp.where(valid[:, None, None, :], logits, -jnp.inf)
        p = (
            jax.nn.softmax(logits, axis=-1)
            if sinks is None
            else softmax_with_sinks(logits, sinks.reshape(num_kv_heads, group))
        )
        return jnp.einsum("chgl,hcld->chgd", p, v, precision=jax.lax.Precision.HIGHEST)

    chunk = min(token_chunk, num_tokens)
    pad = -num_tokens % chunk
    split = lambda x: jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)).reshape(-1, chunk, *x.shape[1:])  # noqa: E731
    o = jax.lax.map(one_chunk, (split(q), split(seq), split(jnp.maximum(pos, 0))))
    o = o.reshape(-1, q_heads, head_dim)[:num_tokens]
    return jnp.where(live[:, None, None], o, 0.0)
